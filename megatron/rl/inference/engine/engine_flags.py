"""The in-process engine's Megatron flags: CUDA graphs of the decode step, and the engine's request and KV limits.

Megatron-LM's ``--cuda-graph-impl local``, ``--inference-dynamic-batching-num-cuda-graphs``,
``--inference-dynamic-batching-max-requests`` and ``--inference-dynamic-batching-buffer-size-gb`` become the
engine's :class:`~megatron.rl.inference.engine.build.EngineSettings` (:func:`apply_engine_flags`), for
``train_rl.py`` and the checkpoint server alike. Training runs eagerly (``--rl-training-cuda-graphs`` is
refused). Must not: import megatron-core, so parsing the flags stays light.

What each flag does: docs/inference.md.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from megatron.rl.base.errors import ConfigError
from megatron.rl.base.flags import flag
from megatron.rl.inference.api import backend_class

log = logging.getLogger(__name__)

__all__ = ["EngineFlags", "validate_engine_flags", "apply_engine_flags", "even_buckets", "GRAPH_IMPLS",
           "BUCKET_MULTIPLE"]

GRAPH_IMPLS = ("none", "local", "transformer_engine")  # Megatron-LM's choices; "transformer_engine" is refused
BUCKET_MULTIPLE = 8  # decode bucket sizes are multiples of this (megatron-core's graph sizes are too)
NO_TRAINING_GRAPHS = ("--cuda-graph-impl local (CUDA graphs of the in-process engine's decode step; the training "
                      "step runs eagerly in megatron-rl)")


@dataclasses.dataclass(frozen=True)
class EngineFlags:
    """The in-process engine's flags (``--inference-backend megatron``); unset values keep the engine's defaults
    (:meth:`EngineSettings.for_device`)."""

    _flag_group = "in-process inference engine (--inference-backend megatron)"
    _removed_flags = {"--rl-training-cuda-graphs": NO_TRAINING_GRAPHS}

    cuda_graph_impl: str = flag(
        "none", choices=GRAPH_IMPLS,
        help="local = on a GPU, capture the decode step's forward in CUDA graphs (one per batch bucket and attention "
             "key length) and replay them; a shape whose capture fails runs eagerly, training stays eager. Not run "
             "on a GPU yet. none (default) = no graphs. transformer_engine is not supported.")
    num_cuda_graphs: int | None = flag(
        None, name="--inference-dynamic-batching-num-cuda-graphs",
        help="With --cuda-graph-impl local: this many decode batch sizes (buckets), evenly spaced up to the request "
             "limit in multiples of 8. Default: powers of two from 8.")
    max_requests: int | None = flag(
        None, name="--inference-dynamic-batching-max-requests",
        help="Requests the engine runs at once (default 256 on CPU, 512 on GPU).")
    buffer_size_gb: float | None = flag(
        None, name="--inference-dynamic-batching-buffer-size-gb",
        help="KV-cache memory of the engine, GB (default 0.5 on CPU, 4 on GPU).")

    @property
    def cuda_graphs(self) -> bool:
        return self.cuda_graph_impl == "local"


def validate_engine_flags(f: EngineFlags, inference_backend: str, router_replay: str = "off") -> None:
    """ConfigError for values that cannot work, naming the flag; a warning for flags that will be ignored."""
    if f.cuda_graph_impl == "transformer_engine":
        raise ConfigError("--cuda-graph-impl transformer_engine: not supported; megatron-rl captures the in-process "
                          "engine's decode step itself: use --cuda-graph-impl local.")
    backend = backend_class(inference_backend)
    if f.cuda_graphs and not backend.captures_decode_graphs:
        raise ConfigError(f"--cuda-graph-impl local captures the in-process engine's decode step, but "
                          f"--inference-backend={inference_backend}; use --inference-backend megatron, or drop the "
                          f"flag (a server backend runs its own graphs).")
    if f.cuda_graphs and router_replay == "rollout":
        raise ConfigError("--cuda-graph-impl local with --rl-router-replay rollout: the engine records each decode "
                          "step's MoE routes from Python hooks in the forward, which a replayed graph does not run; "
                          "drop one of the two.")
    if f.num_cuda_graphs is not None and f.num_cuda_graphs < 1:
        raise ConfigError(f"--inference-dynamic-batching-num-cuda-graphs={f.num_cuda_graphs}: must be >= 1.")
    if f.max_requests is not None and f.max_requests < 1:
        raise ConfigError(f"--inference-dynamic-batching-max-requests={f.max_requests}: must be >= 1.")
    if f.buffer_size_gb is not None and not (math.isfinite(f.buffer_size_gb) and f.buffer_size_gb > 0):
        raise ConfigError(f"--inference-dynamic-batching-buffer-size-gb={f.buffer_size_gb}: must be a positive "
                          f"number of GB.")
    if f.num_cuda_graphs is not None and not f.cuda_graphs:
        log.warning("--inference-dynamic-batching-num-cuda-graphs=%d is ignored without --cuda-graph-impl local",
                    f.num_cuda_graphs)
    ignored = [name for name, value in (("--inference-dynamic-batching-max-requests", f.max_requests),
                                        ("--inference-dynamic-batching-buffer-size-gb", f.buffer_size_gb))
               if value is not None]
    if ignored and not backend.in_process_engine:
        log.warning("%s: ignored with --inference-backend=%s (they size the in-process engine)",
                    " and ".join(ignored), inference_backend)


def even_buckets(count: int, largest: int, multiple: int = BUCKET_MULTIPLE) -> tuple[int, ...]:
    """``count`` decode bucket sizes, ascending: multiples of a step (``largest / count`` rounded up to
    ``multiple``) below ``largest``, then ``largest`` rounded down to ``multiple`` (at least ``multiple``). Pure."""
    if count < 1 or largest < 1 or multiple < 1:
        raise ValueError(f"even_buckets needs positive sizes, got count={count}, largest={largest}, "
                         f"multiple={multiple}")
    top = max(multiple, largest // multiple * multiple)
    if count == 1:
        return (top,)
    step = max(multiple, multiple * math.ceil(int(largest / count) / multiple))
    return (*range(step, top, step), top)


def apply_engine_flags(settings: Any, f: EngineFlags, device_type: str, tp_size: int = 1) -> Any:
    """``settings`` (an ``EngineSettings``) with the flags of ``f`` applied, for an engine on ``device_type`` whose
    model has TP size ``tp_size`` (bucket sizes are multiples of it too)."""
    changes: dict[str, Any] = {}
    if f.max_requests is not None:
        changes["max_requests"] = f.max_requests
    if f.buffer_size_gb is not None:
        changes["buffer_size_gb"] = f.buffer_size_gb
    if f.cuda_graphs:
        changes["decode_cuda_graphs"] = True
        if f.num_cuda_graphs is not None:
            largest = changes.get("max_requests", settings.max_requests)
            changes["decode_buckets"] = even_buckets(f.num_cuda_graphs, largest, math.lcm(BUCKET_MULTIPLE, tp_size))
        if device_type != "cuda":
            log.warning("--cuda-graph-impl local: this run's engine is on %s, which has no CUDA graphs; decode steps "
                        "run eagerly at the decode buckets' shapes", device_type)
    return dataclasses.replace(settings, **changes)
