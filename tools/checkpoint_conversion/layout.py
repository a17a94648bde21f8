"""Tensor layouts of megatron-core's fused GPT weights, as pure functions (no process groups, no I/O).

megatron-core stores attention's Q, K and V projections in one ``linear_qkv`` matrix whose output rows are
grouped by *query group* (= KV head): for each of the ``G`` groups, the ``H/G`` query heads of the group,
then the group's key head, then its value head, each ``D`` rows (``D`` = head dim)::

    [q_0 .. q_{H/G-1} | k_0 | v_0 | q_{H/G} .. | k_1 | v_1 | ...]      (rows; H heads, G groups)

This is what lets tensor parallelism split ``linear_qkv`` row-wise into whole groups. SwiGLU's gate and up
projections are fused into ``linear_fc1`` as ``[gate; up]`` (megatron-core's GLU applies the activation to
the first half). Embedding and output matrices have ``padded_vocab`` rows; rows past the real vocabulary
are zeros.
"""
from __future__ import annotations

import torch


def _check_heads(num_heads: int, num_groups: int) -> int:
    if num_groups < 1 or num_heads % num_groups != 0:
        raise ValueError(f"num_heads={num_heads} must be a positive multiple of num_groups={num_groups}")
    return num_heads // num_groups


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """Separate projections -> megatron's grouped ``linear_qkv`` weight (or bias).

    Args:
        q: ``[H*D, ...]`` (weight ``[H*D, hidden]`` or bias ``[H*D]``), heads in order.
        k, v: ``[G*D, ...]``.
        num_heads: ``H``; num_groups: ``G`` (query groups = KV heads).
    Returns: ``[(H + 2G) * D, ...]`` laid out per group as ``[q heads of the group, k, v]``.
    """
    per_group = _check_heads(num_heads, num_groups)
    head_dim = k.shape[0] // num_groups
    if q.shape[0] != num_heads * head_dim or v.shape != k.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"inconsistent q/k/v shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)} for "
                         f"{num_heads} heads in {num_groups} groups")
    rest = q.shape[1:]
    qg = q.reshape(num_groups, per_group * head_dim, *rest)
    kg = k.reshape(num_groups, head_dim, *rest)
    vg = v.reshape(num_groups, head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape((num_heads + 2 * num_groups) * head_dim, *rest)


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: ``[(H + 2G) * D, ...]`` -> ``(q [H*D, ...], k [G*D, ...], v [G*D, ...])``."""
    per_group = _check_heads(num_heads, num_groups)
    rows = qkv.shape[0]
    if rows % (num_heads + 2 * num_groups) != 0:
        raise ValueError(f"linear_qkv has {rows} rows, not a multiple of heads + 2*groups = "
                         f"{num_heads + 2 * num_groups}")
    head_dim = rows // (num_heads + 2 * num_groups)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(num_heads * head_dim, *rest).contiguous(), k.reshape(num_groups * head_dim, *rest).contiguous(),
            v.reshape(num_groups * head_dim, *rest).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU ``gate [F, hidden]``, ``up [F, hidden]`` -> megatron ``linear_fc1`` ``[2F, hidden]`` = ``[gate; up]``."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} projections differ in shape")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`: ``[2F, hidden]`` -> ``(gate [F, hidden], up [F, hidden])``."""
    if fc1.shape[0] % 2:
        raise ValueError(f"linear_fc1 has an odd number of rows ({fc1.shape[0]}); not a SwiGLU layer")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def pad_vocab(weight: torch.Tensor, padded_vocab: int) -> torch.Tensor:
    """``[V, hidden]`` -> ``[padded_vocab, hidden]`` with zero rows appended (Megatron's padded vocabulary)."""
    vocab = weight.shape[0]
    if padded_vocab < vocab:
        raise ValueError(f"padded vocab {padded_vocab} is smaller than the vocab {vocab}")
    if padded_vocab == vocab:
        return weight
    return torch.cat([weight, weight.new_zeros(padded_vocab - vocab, *weight.shape[1:])], dim=0)


def unpad_vocab(weight: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[padded_vocab, hidden]`` -> the first ``vocab`` rows."""
    if weight.shape[0] < vocab:
        raise ValueError(f"weight has {weight.shape[0]} rows, fewer than the vocab {vocab}")
    return weight[:vocab].contiguous()
