"""The CPU compatibility layer for megatron-core: the registered patches a machine without a GPU needs.

megatron-core assumes CUDA in a handful of places: device placement, streams and events, memory statistics,
the RNG tracker, fused kernels of transformer-engine / apex, flash-attn. On a CPU-only torch build we paper
over them at run time without editing site-packages. Every patch is a function registered with
``@cpu_patch(name, why)`` in the one registry (:mod:`megatron.rl.runtime.patches`, kind ``"cpu"``; the paged
attention fallback, :mod:`megatron.rl.runtime.cuda_fallbacks`, serves both kinds); :func:`install` applies
each exactly once (idempotent) and refuses to run against a megatron-core version the patches were not
written and tested for. ``PATCHES`` / ``INSTALLED``: the registry's CPU patches / those applied.

None of this is ever installed when CUDA is usable: see ``megatron.rl.runtime.setup_runtime``.
"""
from __future__ import annotations

import collections
import logging
import os
from typing import Any

import torch
import torch.cuda.random as cuda_random
from torch.overrides import _get_current_function_mode_stack

from megatron.rl.base.errors import UserError
# cuda_fallbacks registers the paged-attention patch, which install() applies as a CPU patch too
from megatron.rl.runtime import (  # noqa: F401
    cuda_fallbacks, decode_layer, kv_append, no_grad_linear, patches, rope_cache, versions)
from megatron.rl.runtime.cuda_to_cpu import CudaToCpuMode

log = logging.getLogger(__name__)

# megatron-core versions whose CUDA assumptions these patches were checked against.
SUPPORTED_MCORE_VERSIONS = versions.SUPPORTED
ALLOW_UNTESTED_ENV = "MEGATRON_RL_ALLOW_UNTESTED_MCORE"


class UnsupportedMegatronCoreVersion(UserError, RuntimeError):
    pass


_cpu_mode: CudaToCpuMode | None = None
_installed: list[str] = []  # the CPU patches install() applied, in order


def cpu_patch(name: str, why: str, changes: str | None = None, written_for: tuple[str, ...] = versions.BOTH):
    """Register a CPU patch function (``changes``: the names it replaces; default ``name``; ``written_for``: the
    megatron-core releases it applies to, :func:`install` skips it on others). Registration order is
    application order."""
    return patches.register(name, when="cpu", changes=changes or name, why=why, versions=written_for)


def __getattr__(name: str) -> Any:
    if name == "PATCHES":  # name -> Patch, the registry's CPU patches in application order
        return {p.name: p for p in patches.entries("cpu")}
    if name == "INSTALLED":  # the CPU patches install() applied in this process, in order
        return list(_installed)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_mcore_version(version: str | None = None) -> str:
    """Raise unless megatron-core is a version these patches were tested against."""
    if version is None:
        version = versions.installed_version()
    if not versions.release(version) and os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise UnsupportedMegatronCoreVersion(
            f"megatron-core {version} is installed, but megatron-rl's CPU runtime layer was written for "
            f"{', '.join(SUPPORTED_MCORE_VERSIONS)} (its CUDA workarounds patch internals that change between "
            f"releases). Install a supported one: pip install megatron-core=={versions.MCORE_0_16[-1]} "
            f"(Python 3.10-3.11) or megatron-core=={versions.MCORE_0_19[-1]} (Python 3.12+), "
            f"or set {ALLOW_UNTESTED_ENV}=1 to try anyway.")
    return version


# --------------------------------------------------------------------------- torch.cuda stubs


class _SyncStream:
    """Stand-in for torch.cuda.Stream and torch.cuda.Event: CPU work is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _SyncStream()

    def record(self, *args, **kwargs):
        pass

    def synchronize(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, *args):
        return 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _noop_factory():
    """A fresh no-op per stubbed name: torch._dynamo's trace rules reject one function object bound
    to several torch.cuda names ("Duplicate torch object ... with different rules")."""

    def noop(*args, **kwargs):
        return None

    return noop


@cpu_patch("torch.cuda.current_device",
           "megatron allocates with device=torch.cuda.current_device(); returning 'cpu' puts those tensors on CPU",
           changes="torch.cuda.current_device, .set_device, .device_count")
def _patch_current_device():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.set_device = _noop_factory()
    torch.cuda.device_count = lambda: 0


@cpu_patch("torch.cuda.synchronize", "timers, DDP and inference synchronise the device; CPU work is synchronous",
           changes="torch.cuda.synchronize, .empty_cache, .is_current_stream_capturing")
def _patch_synchronize():
    torch.cuda.synchronize = _noop_factory()
    torch.cuda.empty_cache = _noop_factory()
    torch.cuda.is_current_stream_capturing = lambda: False


@cpu_patch("torch.cuda.Stream/Event/stream/current_stream",
           "DDP grad-reduce overlap and inference create streams and events; synchronous stand-ins",
           changes="torch.cuda.Stream, .Event, .stream, .current_stream, .default_stream")
def _patch_streams():
    torch.cuda.Stream = _SyncStream
    torch.cuda.Event = _SyncStream
    torch.cuda.stream = lambda stream=None: _SyncStream()
    torch.cuda.current_stream = lambda *a, **k: _SyncStream()
    torch.cuda.default_stream = lambda *a, **k: _SyncStream()


@cpu_patch("torch.cuda.nvtx", "range push/pop markers for profilers; no-ops (without CUDA they raise 'NVTX "
           "functions not installed')", changes="torch.cuda.nvtx.range_push, .range_pop")
def _patch_nvtx():
    torch.cuda.nvtx.range_push = _noop_factory()
    torch.cuda.nvtx.range_pop = _noop_factory()


def _rebind_nvtx(module) -> None:
    # `from torch.cuda.nvtx import range_pop, range_push` at import time bound the real functions.
    module.range_push = torch.cuda.nvtx.range_push
    module.range_pop = torch.cuda.nvtx.range_pop


@cpu_patch("torch.cuda.nvtx in the dynamic engine", "the engine imported the markers by name: its copies become "
           "the no-ops too", changes="megatron.core.inference.engines.dynamic_engine:range_push, .range_pop",
           written_for=versions.MCORE_0_16)
def _patch_engine_nvtx():
    from megatron.core.inference.engines import dynamic_engine

    _rebind_nvtx(dynamic_engine)


@cpu_patch("torch.cuda.nvtx in the text generation controller", "the controller imported the markers by name: its "
           "copies become the no-ops too",
           changes="megatron.core.inference.text_generation_controllers.text_generation_controller:range_push, "
                   ".range_pop", written_for=versions.MCORE_0_19)
def _patch_controller_nvtx():
    from megatron.core.inference.text_generation_controllers import text_generation_controller

    _rebind_nvtx(text_generation_controller)


@cpu_patch("torch.cuda.memory_*/mem_get_info",
           "the dynamic inference context sizes its KV buffer from device memory statistics; report the host's",
           changes="torch.cuda.mem_get_info, .memory_allocated, .max_memory_allocated, .memory_reserved, "
           ".max_memory_reserved, .reset_peak_memory_stats, .memory_stats")
def _patch_memory_stats():
    import psutil

    def mem_get_info(*args, **kwargs):
        vm = psutil.virtual_memory()
        return vm.available, vm.total

    torch.cuda.mem_get_info = mem_get_info
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
    torch.cuda.reset_peak_memory_stats = _noop_factory()
    torch.cuda.memory_stats = lambda *a, **k: collections.defaultdict(int)


@cpu_patch("torch.cuda RNG -> CPU generator",
           "CudaRNGStatesTracker saves/restores the 'CUDA' RNG around TP regions; on CPU that is the CPU generator, "
           "which its fork() then swaps in and out correctly",
           changes="torch.cuda.get_rng_state, .set_rng_state, .manual_seed, .manual_seed_all; "
           "megatron.core.tensor_parallel.random:_set_cuda_rng_state")
def _patch_rng():

    import megatron.core.tensor_parallel.random as mpu_random

    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    torch.cuda.manual_seed_all = _noop_factory()  # torch.manual_seed() calls it; the CPU generator is already seeded
    cuda_random.get_rng_state = torch.cuda.get_rng_state
    cuda_random.set_rng_state = torch.cuda.set_rng_state
    mpu_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


class _DropCpuRngWarning(logging.Filter):
    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


@cpu_patch("silence 'CPU RNG state changed within GPU RNG context'",
           "expected here: the 'GPU' RNG is the CPU generator, so megatron's sanity warning fires on every fork",
           changes="a logging filter on megatron.core.tensor_parallel.random")
def _patch_rng_warning():
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_DropCpuRngWarning())


@cpu_patch("WrappedTorchNorm with sequence parallel",
           "the torch-norm fallback (no apex/TE) asserts sequence_parallel is off; allow it and tag the norm weights "
           "sequence_parallel so finalize_model_grads all-reduces their grads across TP ranks",
           changes="megatron.core.transformer.torch_norm:WrappedTorchNorm.__new__")
def _patch_torch_norm():
    from megatron.core.transformer import torch_norm

    norm_classes = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}

    def new(cls, config, hidden_size, eps=1e-5, **_unused):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma / memory-efficient layer norm need transformer-engine or apex")
        if config.normalization not in norm_classes:
            raise ValueError(f"normalization {config.normalization!r} is not supported by the torch fallback")
        module = norm_classes[config.normalization](normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            for p in module.parameters():
                p.sequence_parallel = True
        return module

    torch_norm.WrappedTorchNorm.__new__ = new


@cpu_patch("DistributedOptimizer with torch Adam",
           "without apex/TE the distributed optimizer falls back to torch Adam, whose per-param 'step' breaks "
           "checkpoint loading: empty state on a fresh optimizer (assert len(steps)==1), KeyError 'step' in the "
           "fully_reshardable loader, in-place copies into views of leaves without no_grad, and one shared 'step' "
           "tensor after load that Adam increments once per param (silent divergence)",
           changes="megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict, "
           "._set_main_param_and_optimizer_states, .load_state_dict, "
           ".load_parameter_state_from_dp_reshardable")
def _patch_distributed_optimizer():
    from megatron.core.optimizer import distrib_optimizer as do

    if do.HAVE_APEX_OR_TE:
        return
    cls = do.DistributedOptimizer
    orig_sharded_state_dict = cls.sharded_state_dict
    orig_load_state_dict = cls.load_state_dict

    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        if is_loading:
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    state = self.optimizer.state[p]
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(p.data)
                        state["exp_avg_sq"] = torch.zeros_like(p.data)
        return orig_sharded_state_dict(self, model_sharded_state_dict or {}, is_loading, *args, **kwargs)

    @torch.no_grad()
    def set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][order]
        targets = {"param": main_param, **self.optimizer.state[main_param]}
        for key, dst in targets.items():
            if key in tensors:
                dst.copy_(tensors[key])

    def load_state_dict(self, state_dict):
        result = orig_load_state_dict(self, state_dict)
        steps = {g["step"] for g in state_dict.get("optimizer", {}).get("param_groups", []) if "step" in g}
        if len(steps) > 1:
            raise RuntimeError(f"checkpoint has inconsistent optimizer steps across param groups: {sorted(steps)}")
        for state in self.optimizer.state.values():
            if steps:
                state["step"] = torch.tensor(float(next(iter(steps))))
            elif torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()  # un-share
        return result

    cls.sharded_state_dict = sharded_state_dict
    cls._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states
    cls.load_state_dict = load_state_dict
    cls.load_parameter_state_from_dp_reshardable = torch.no_grad()(cls.load_parameter_state_from_dp_reshardable)


@cpu_patch("moe_utils TE names",
           "without transformer-engine, router_gating_linear references the undefined name te_general_gemm "
           "(NameError); define the TE-only names as None so the torch paths are taken",
           changes="megatron.core.transformer.moe.moe_utils: te_general_gemm and the other fused_* names (defined"
           " as None where missing)")
def _patch_moe_te_names():
    from megatron.core.transformer.moe import moe_utils

    if moe_utils.HAVE_TE:
        return
    for name in ("te_general_gemm", "fused_topk_with_score_function", "fused_compute_score_for_moe_aux_loss",
                 "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs", "fused_unpermute",
                 "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


@cpu_patch("moe_utils.maybe_move_tensor_to_cpu",
           "the alltoall dispatcher converts split sizes to numpy only when tensor.is_cuda; on CPU they stay tensors "
           "and all_to_all_single(output_split_sizes=tensor) raises TypeError",
           changes="megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu; "
           "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu")
def _patch_moe_split_sizes():
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor):
            tensor = tensor.cpu()
            if as_numpy:
                tensor = tensor.numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


cpu_patch("dynamic inference RoPE: cos/sin once per step",
          "megatron-core's dynamic context rotates each layer's queries and keys with apply_rotary_pos_emb, which "
          "gathers the step's frequencies and takes their cos and sin again in every layer (2 x layers times per "
          "step, the same values), a noticeable share of a small model's decode step on CPU. The unfused formula "
          "then runs on cos/sin computed once per step (rope_cache.py; bit for bit the same, tested)",
          "megatron.core.inference.contexts.dynamic_context:DynamicInferenceContext.apply_rotary_emb_query, "
          ".apply_rotary_emb_key", versions.BOTH)(rope_cache.install)


cpu_patch("dynamic inference KV append: index_copy_",
          "without Triton, megatron-core appends each layer's keys and values to the paged cache with an "
          "advanced-index put over (block, slot) index tensors, slow per-element index arithmetic on CPU; "
          "index_copy_ at flat slots computed once per step writes the same values (kv_append.py, tested against "
          "the original)",
          "megatron.core.inference.contexts.dynamic_context:DynamicInferenceContext.append_key_value_cache")(
    kv_append.install)


cpu_patch("dynamic inference decode step: a plain layer's calls only",
          "in a decode step megatron-core's TransformerLayer and Attention forwards run a few hundred Python "
          "lines per layer around the dozen calls that compute (offload managers, NVTX ranges, recompute and "
          "fused-kernel branches, cross-attention identities, einops); on CPU that glue is a few percent of a "
          "small model's decode step. A plain layer's decode step makes the same calls in the same order "
          "(decode_layer.py; the same bits, tested); every other layer and step runs megatron-core's forward",
          "megatron.core.transformer.transformer_layer:TransformerLayer.forward")(decode_layer.install)


cpu_patch("local linear layers: no autograd Function without gradients",
          "megatron-core's ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding call autograd Functions "
          "(the linear, the copy to and reduce from the tensor-parallel region) on every forward, also under "
          "inference_mode, where their Python bookkeeping is a few percent of a small model's decode step; while no "
          "gradient is recorded (and without sequence parallelism) the same torch calls run directly "
          "(no_grad_linear.py; the same bits, tested against the originals), except inside an inference engine's "
          "packed-weight scope, where large fp32 weights use MKL's packed GEMM (packed_linear.py)",
          "megatron.core.tensor_parallel.layers:linear_with_grad_accumulation_and_async_allreduce, "
          ".copy_to_tensor_model_parallel_region, .reduce_from_tensor_model_parallel_region")(no_grad_linear.install)


@cpu_patch("inference.communication_utils._is_cuda",
           "pipeline-parallel inference asserts tensors are CUDA before send/recv/broadcast",
           changes="megatron.core.inference.communication_utils:_is_cuda")
def _patch_inference_comm():
    from megatron.core.inference import communication_utils

    communication_utils._is_cuda = _noop_factory()


@cpu_patch("CudaToCpuMode",
           "device='cuda', integer devices, .cuda(), .to('cuda'), torch.device('cuda'), pin_memory=True and "
           "Tensor.type() == 'torch.cuda.FloatTensor' checks, rewritten at the torch-function level",
           changes="torch functions called with CUDA devices (a TorchFunctionMode per thread)")
def _patch_device_mode():
    enter_cpu_mode()


def enter_cpu_mode() -> None:
    """Enter the device-rewriting mode in the calling thread (torch-function modes are thread-local).

    ``install()`` enters it in the installing thread; threads that run megatron-core code (e.g. an
    inference worker thread) call this once at start.
    """
    global _cpu_mode
    if cpu_mode_active():
        return
    mode = CudaToCpuMode()
    mode.__enter__()
    _cpu_mode = mode


def cpu_mode_active() -> bool:

    return any(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack())


def install() -> list[str]:
    """Apply every registered CPU patch once. Returns the names applied by this call (empty if done before)."""
    if torch.cuda.is_available() and os.environ.get("MEGATRON_RL_FORCE_CPU") != "1":
        raise RuntimeError("the CPU runtime layer must not be installed when CUDA is available")
    version = check_mcore_version()
    applied = [p.name for p in patches.entries("cpu")
               if p.name not in _installed
               and (versions.written_for(p.versions, version) or not versions.release(version))]
    for name in applied:
        patches.apply(name)
        _installed.append(name)
    if applied:
        log.debug("megatron-rl CPU runtime: applied %d patches", len(applied))
    return applied
