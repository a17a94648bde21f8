"""RoPE in megatron-core's dynamic inference with cos/sin computed once per step instead of once per layer.

:func:`install` replaces ``DynamicInferenceContext.apply_rotary_emb_query`` / ``apply_rotary_emb_key`` with
versions that take the gathered ``cos``/``sin`` from a per-step cache on the context (the same bits; tested).
Fused RoPE, multi-latent attention and packed ``cu_seqlens`` call the originals. The cache lives on the context
and dies with it.

The cache key and why it is safe: docs/runtime.md.
"""
from __future__ import annotations

import torch

__all__ = ["install", "rotate", "forget"]

_ORIGINALS: dict[str, object] = {}


def install() -> None:
    """Replace the two context methods (idempotent). Called by the CPU layer's patch registry."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext as cls

    if _ORIGINALS:
        return
    _ORIGINALS["query"], _ORIGINALS["key"] = cls.apply_rotary_emb_query, cls.apply_rotary_emb_key
    cls.apply_rotary_emb_query = _apply_query
    cls.apply_rotary_emb_key = _apply_key


def original(name: str):
    """The method :func:`install` replaced (``"query"`` or ``"key"``): for tests and fallbacks."""
    return _ORIGINALS[name]


def _plain(config, cu_seqlens=None) -> bool:
    """Whether megatron-core would take the unfused bshd path that :func:`rotate` reproduces."""
    return not config.apply_rope_fusion and not config.multi_latent_attention and cu_seqlens is None


def _apply_query(self, query, query_emb, config, cu_seqlens_q, cp_group, mscale=1.0):
    if not _plain(config, cu_seqlens_q):
        return _ORIGINALS["query"](self, query, query_emb, config, cu_seqlens_q, cp_group, mscale)
    n = self.padded_active_token_count
    cos, sin = _step_cos_sin(self, query_emb, _positions(self, "token_to_pos_ids"), n, mscale, query.dtype,
                             config.rotary_interleaved)
    query[:n] = rotate(query[:n], cos, sin, config.rotary_interleaved)
    return query


def _apply_key(self, key, key_emb, config, cp_group, mscale=1.0):
    n = self.padded_active_token_count
    if not _plain(config) or (self.is_decode_only() and key.shape[0] != n):
        return _ORIGINALS["key"](self, key, key_emb, config, cp_group, mscale)  # (its assertion names the sizes)
    cos, sin = _step_cos_sin(self, key_emb, _positions(self, "token_to_position_in_request"), n, mscale, key.dtype,
                             config.rotary_interleaved)
    if self.is_decode_only():
        return rotate(key[:n], cos, sin, config.rotary_interleaved)
    key[:n] = rotate(key[:n], cos, sin, config.rotary_interleaved)
    return key


def _positions(context, name: str) -> torch.Tensor:
    """The step's position buffer ``name`` as the original method reads it: 0.19 from the context's device snapshot
    (``gpu_view``, refreshed in place every step), 0.16.1 from the context itself."""
    view = getattr(context, "gpu_view", None)
    return getattr(context if view is None else view, name)


def forget(context) -> None:
    """Drop ``context``'s memoised cos/sin: the next step computes them afresh (inside a graph capture, say)."""
    context.__dict__.pop("_rl_rope_cache", None)


def _step_cos_sin(context, freqs: torch.Tensor, positions: torch.Tensor, n: int, mscale: float,
                  dtype: torch.dtype, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` of ``freqs[positions[:n]]`` as ``_apply_rotary_pos_emb_bshd`` computes them, memoised;
    ``sin`` comes as :func:`rotate` takes it (its first half negated when not interleaved)."""
    cache = context.__dict__.setdefault("_rl_rope_cache", {})  # one entry per position buffer (queries, keys)
    version = positions._version
    hit = cache.get(id(positions))
    settings = (float(mscale), dtype, bool(interleaved))
    if (hit is not None and hit[0] is freqs and hit[1] is positions
            and hit[2:5] == (version, n, settings)):
        return hit[5], hit[6]
    emb = freqs[positions[:n]][:n]  # the originals' gather: [n, 1, 1, rot_dim]
    cos = (torch.cos(emb) * mscale).to(dtype)
    sin = (torch.sin(emb) * mscale).to(dtype)
    if not interleaved:
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    cache[id(positions)] = (freqs, positions, version, n, settings, cos, sin)
    return cos, sin


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``_apply_rotary_pos_emb_bshd`` (megatron-core 0.16.1 and 0.19, no MLA) given its ``cos_`` and ``sin_``, the same bits.

    Not interleaved, ``sin`` comes with its first half negated (:func:`_step_cos_sin`): megatron's
    ``rotate_half(t) * sin`` is ``cat(-t2, t1) * cat(s1, s2)``, and ``-t2 * s1`` is ``t2 * -s1`` exactly (IEEE
    products are sign-symmetric), so ``cat(t2, t1) * cat(-s1, s2)`` gives it bit for bit with one op fewer
    than the negation and once per step. The pass-through part is only concatenated when there is one.
    """
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    rot_dim = cos.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    if interleaved:
        t = (t * cos) + (_rotate_half(t, interleaved) * sin)
    else:
        half = rot_dim // 2
        t = (t * cos) + (torch.cat((t[..., half:], t[..., :half]), dim=-1) * sin)
    return torch.cat((t, t_pass), dim=-1) if t_pass.shape[-1] else t
