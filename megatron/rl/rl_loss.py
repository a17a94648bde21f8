"""megatron-core forward steps for RL: scoring (old / reference log-probs) and the GRPO/PPO training loss.

Both consume micro-batches of :class:`~megatron.rl.packing.batch.PackedBatch` rows. Attention
never crosses sequences: with the local layer spec a block-diagonal causal ``attention_mask`` is passed
(RoPE at each sequence's own positions, optionally attention per sequence: :mod:`megatron.rl.packing.packed_forward`); with
TransformerEngine the rows are flattened to THD with ``PackedSeqParams``.

Gradient scale. megatron-core's schedule (with ``calculate_per_token_loss=False``, our default) divides
each micro-batch loss by ``num_microbatches`` and DDP averages gradients over data-parallel ranks. Our
per-micro-batch losses already use *global* normalisers (they sum to the step's loss, see
:mod:`megatron.rl.algorithms.aggregation`), so the training loss is multiplied by
``num_microbatches * dp_size`` to cancel both: the gradient is exactly that of the global loss.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from megatron.rl.algorithms import LossNormalizers, aggregate_loss, compute_token_loss
from megatron.rl.algorithms.entropy import entropy_from_partials, entropy_partials
from megatron.rl.algorithms.logprobs import logprob_temperature
from megatron.rl.algorithms.policy_loss import PolicyLossConfig
from megatron.rl.packing.packed_forward import isolate_sequences
from megatron.rl.routing.replay import replaying
from megatron.rl.packing.batch import PackedBatch

# The per-token values of a micro-batch the loss reads.
_LOSS_VALUES = ("old_logprobs", "advantages", "ref_logprobs", "inference_logprobs")
# Per-token stats reported token-weighted as [value * n, n] pairs (see megatron.rl.training.loop).
_WEIGHTED_STATS = ("clip_fraction_low", "clip_fraction_high", "ratio_mean", "kl_mean", "entropy_mean",
                   "is_weight_mean", "is_truncated_fraction", "is_masked_fraction")


# --------------------------------------------------------------------------- log-probs over vocab shards
# With tensor parallelism each rank holds ``V / TP`` columns of the logits. Log-probs go through megatron-core's
# ``vocab_parallel_cross_entropy`` (which all-reduces max and sum over the TP group and is differentiable);
# entropy through :mod:`megatron.rl.algorithms.entropy`'s partial sums, all-reduced with megatron's
# autograd-aware region ops. With TP = 1 both reduce to the plain full-vocabulary formulas
# (:func:`megatron.rl.algorithms.logprobs.token_logprobs`, :func:`~megatron.rl.algorithms.entropy_from_logits`).
# The inference backends report log-probs under ``softmax(logits / T)`` (T = 1 for greedy); the trainer scores
# the same distribution, so both take ``temperature``.


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels | context) under softmax(logits / T).

    Args:
        logits: [..., V / TP] this rank's vocab shard (any leading shape, e.g. [b, s]).
        labels: [...] global token ids (int64).
    Returns: float32 [...], differentiable w.r.t. ``logits``.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / logprob_temperature(temperature)
    return -vocab_parallel_cross_entropy(scaled, labels)


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, [..., V / TP] -> float32 [...], differentiable."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    scaled = logits.float() / logprob_temperature(temperature)
    row_max = scaled.detach().max(dim=-1).values  # the shift cancels exactly, so no gradient is needed
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if tp > 1:
        torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    sum_exp, sum_exp_shifted = entropy_partials(scaled, row_max)
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        sum_exp_shifted = reduce_from_tensor_model_parallel_region(sum_exp_shifted)
    return entropy_from_partials(sum_exp, sum_exp_shifted)


def model_forward(model, mb: PackedBatch, device: torch.device, use_thd: bool,
                  packed_attention: str = "auto") -> torch.Tensor:
    """Run the model on packed rows; returns logits [rows, S, V/TP] on the last stage, hidden states elsewhere.

    Every sequence of a row gets RoPE at its own positions (0 .. L-1), as if it ran alone: megatron-core does
    that itself for THD; the [rows, S] path needs :func:`~megatron.rl.packing.packed_forward.isolate_sequences`, which
    also computes the attention as ``packed_attention`` says (``--rl-packed-attention``: one masked product per
    row, per sequence length bit-identical to one sequence per row, or per group of similar lengths; "auto"
    picks the cheaper of masked and grouped per micro-batch). A micro-batch carrying ``routes`` (MoE routing
    replay) routes its tokens by them (:func:`~megatron.rl.routing.replay.replaying`).
    """
    tokens, positions = mb.tokens.to(device), mb.position_ids.to(device)
    with replaying(model, mb.token_values.get("routes"), use_thd):  # MoE: the rollouts' routes (--rl-router-replay)
        if use_thd:
            return model(tokens.reshape(1, -1), positions.reshape(1, -1), None,
                         packed_seq_params=mb.packed_seq_params())
        with isolate_sequences(model, positions, mb.sequence_spans(), packed_attention) as needs_mask:
            return model(tokens, positions, mb.attention_mask().to(device) if needs_mask else None)


def _logits(output: torch.Tensor, mb: PackedBatch) -> torch.Tensor:
    return output.reshape(mb.num_rows, mb.seq_length, -1)


def _store(target: torch.Tensor, logprobs: torch.Tensor) -> None:
    """Write masked log-probs into a micro-batch's value view (it lands in the rank's full batch)."""
    target.copy_(logprobs.reshape(target.shape).to(target.dtype).to(target.device))


def scoring_forward_step(value_name: str, temperature: float, device: torch.device, use_thd: bool,
                         packed_attention: str = "auto") -> Callable:
    """Forward-only step writing per-token log-probs into ``mb.values[value_name]`` (last stage only).

    The micro-batches are views into the rank's full :class:`PackedBatch`, so the values land there.
    """

    def loss_func(mb: PackedBatch, output: torch.Tensor):
        with torch.no_grad():
            lp = vocab_parallel_logprobs(_logits(output, mb), mb.labels.to(device), temperature)
            _store(mb.values[value_name], lp * mb.loss_mask.to(device))
        return torch.zeros((), device=device), {}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model_forward(model, mb, device, use_thd, packed_attention), functools.partial(loss_func, mb)

    return forward_step


def compute_rl_loss(logits: torch.Tensor, mb: PackedBatch, loss_cfg: PolicyLossConfig, aggregation: str,
                    normalizers: LossNormalizers, temperature: float, old_logprobs_from_forward: bool = False,
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the step loss and its report.

    logits: [rows, S, V/TP]. ``mb.values`` holds ``advantages`` and ``old_logprobs`` (and
    ``ref_logprobs`` / ``inference_logprobs`` when used), all [rows, S] label-aligned.
    ``old_logprobs_from_forward``: the old-policy log-probs are this forward's own, detached (the step
    runs on the policy that sampled); they are written into ``mb.values["old_logprobs"]`` exactly as
    :func:`scoring_forward_step` would, and the loss uses them from there.
    Returns (loss scalar: sums over micro-batches and DP ranks to the global loss, report dict of
    ``[weighted sum, weight]`` pairs).
    """
    device = logits.device
    labels = mb.labels.to(device)
    mask = mb.loss_mask.to(device).reshape(-1)
    logprobs = vocab_parallel_logprobs(logits, labels, temperature).reshape(-1)
    if old_logprobs_from_forward:
        _store(mb.values["old_logprobs"], logprobs.detach() * mask)
    # only what the loss reads (a batch also carries per-token values the iteration's metrics read on the host)
    values = {k: mb.values[k].to(device).reshape(-1) for k in _LOSS_VALUES if k in mb.values}
    entropy = None
    if loss_cfg.needs_entropy:  # without a bonus it is only reported: no graph
        with torch.set_grad_enabled(torch.is_grad_enabled() and loss_cfg.entropy_weight != 0):
            entropy = vocab_parallel_entropy(logits, temperature).reshape(-1)
    seq_ids = mb.seq_ids.to(device).reshape(-1)
    token_loss, stats = compute_token_loss(
        loss_cfg, logprobs, values["old_logprobs"], values["advantages"], mask,
        ref_logprobs=values.get("ref_logprobs"), inference_logprobs=values.get("inference_logprobs"),
        entropy=entropy, seq_ids=seq_ids)
    loss = aggregate_loss(token_loss, mask, aggregation, normalizers, seq_ids=seq_ids)
    n = mask.sum().detach().double()
    # [loss * N_global, n_local] summed over micro-batches and ranks gives [loss_total * N, N].
    report = {"rl loss": torch.stack([loss.detach().double() * float(normalizers.num_tokens), n])}
    for key in _WEIGHTED_STATS:
        if key in stats:
            report[key] = torch.stack([stats[key].double() * n, n])
    if "num_rejected" in stats:  # sequence rejection: the share of sequences dropped
        report["is_rejected_fraction"] = torch.stack([stats["num_rejected"].double(),
                                                      stats["num_sequences"].double()])
    return loss, report


def training_forward_step(loss_cfg: PolicyLossConfig, aggregation: str, normalizers: LossNormalizers,
                          temperature: float, grad_scale: float, device: torch.device, use_thd: bool,
                          old_logprobs_from_forward: bool = False, packed_attention: str = "auto") -> Callable:
    """Forward step whose loss back-propagates the GRPO/PPO objective (see the module doc for ``grad_scale``;
    :func:`compute_rl_loss` for ``old_logprobs_from_forward``, :func:`model_forward` for
    ``packed_attention``)."""

    def loss_func(mb: PackedBatch, output: torch.Tensor):
        loss, report = compute_rl_loss(_logits(output, mb), mb, loss_cfg, aggregation, normalizers, temperature,
                                       old_logprobs_from_forward)
        return loss * grad_scale, torch.tensor(1, dtype=torch.int), report

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model_forward(model, mb, device, use_thd, packed_attention), functools.partial(loss_func, mb)

    return forward_step
