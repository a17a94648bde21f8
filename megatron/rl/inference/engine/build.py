"""Building megatron-core's dynamic inference engine around a (training) GPTModel.

The constructors of megatron-core's engine stack are called through
:mod:`~megatron.rl.inference.engine.construct`, which knows each supported release's signatures; an upgrade
touches that module and the entries of :mod:`megatron.rl.runtime.patches`.

The controller is subclassed so that *we* sample (per-request temperature, top-k, top-p and seed)
and report log-probs under ``softmax(logits / T)``; see :mod:`megatron.rl.inference.sampling`
for why the stock controller's numbers do not match what the RL trainer recomputes. The subclass overrides
private steps of megatron-core's controller, and the context class overrides its step padding: both are
registered changes to megatron-core (:mod:`megatron.rl.runtime.subclasses`).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Sequence

import torch

from megatron.core.inference.contexts import DynamicInferenceContext
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.utils import get_model_config

from megatron.rl.inference.engine.batched_admission import BatchedAdmission
from megatron.rl.inference.engine.construct import (
    ContextSizes, block_allocator, last_token_logits_only, make_context, make_controller, make_engine, make_wrapper,
)
from megatron.rl.inference.engine.engine_flags import EngineFlags, apply_engine_flags
from megatron.rl.inference.engine.graphs import DecodeGraphs
from megatron.rl.inference.engine.kv_reuse import ReusedCpuKvBuffer
from megatron.rl.inference.engine.rollout_engine import RolloutEngine
from megatron.rl.inference.engine.route_recorder import RouteRecorder
from megatron.rl.inference.engine.shared_prefill import SharedPromptPrefill, megatron_core_shares_prompts
from megatron.rl.inference.sampling import NoiseStream, host_sampling, sample_tokens, tempered_log_probs
from megatron.rl.runtime import decode_mirror, kv_append, packed_linear, patches, rope_cache, torch_attention, versions
from megatron.rl.runtime.decode_lengths import set_decode_lengths
from megatron.rl.runtime.torch_attention import MIN_KEY_SLOTS
from megatron.rl.routing.replay import install_router_replay

log = logging.getLogger(__name__)

__all__ = ["EngineSettings", "SampleSpec", "EngineTokenizer", "SamplingController", "build_engine",
           "unwrap_gpt_model"]


@dataclasses.dataclass
class EngineSettings:
    """Sizes of the dynamic engine's paged KV cache and batches.

    buffer_size_gb: KV-cache memory per rank (all layers, this rank's heads).
    block_size_tokens: tokens per KV block (the paging granularity).
    max_requests: most requests decoded in one step (at most ``max_tokens``).
    max_tokens: most tokens in one forward step (prefill chunks are cut to fit).
    max_sequence_length: prompt + generated tokens per request (None: the model's ``max_sequence_length``).
    seed: seeds the sampler shared by requests without their own seed (same on all ranks of a group).
    token_rounder: forward steps are padded to a multiple of this many tokens (megatron-core pads to 64 so
        CUDA graphs see few shapes; without graphs the padding is pure waste: a decode step for 3 requests
        would compute 64 token slots). Rounded up to a multiple of the TP size. None = megatron-core's 64.
    cpu_fast_steps: on CPU, run engine steps outside the CPU layer's device-rewriting torch-function mode
        (construction and request admission stay inside it); ~1.5x faster decode steps on small models.
        Set False if a step ever fails with a CUDA device error (then everything runs inside the mode).
    share_prompt_prefill: requests admitted in one step with the same prompt (a GRPO group) prefill it once
        (:mod:`megatron.rl.inference.engine.shared_prefill`; on megatron-core 0.19 its own prefix caching, which
        shares whole KV blocks of equal prompt prefixes); False = every request prefills its own prompt.
    batched_admission: the requests admitted in one step are written into the context's arrays in one batch of
        tensor writes before the forward (:mod:`megatron.rl.inference.engine.batched_admission`; the same values);
        False = megatron-core's ``add_request`` writes each request's entries as it admits it.
    keep_cpu_kv_buffer: on CPU, a stopped engine's KV buffer is kept for the next engine of the same shape
        (:mod:`megatron.rl.inference.engine.kv_reuse`: a fresh buffer page-faults every cache page it writes);
        False = freed at exit. GPU buffers are always freed.
    decode_mirror: on CPU, decode attention reads each layer's keys and values from a dense copy of the batch's
        cache that each step extends by its new tokens (:mod:`megatron.rl.runtime.decode_mirror`; the same bits,
        more memory: at most as much again as the KV cache), instead of gathering them from the paged cache in
        every layer of every step; False = gather.
    record_routes: record every processed token's MoE routes into ``InferenceResponse.routes``
        (:mod:`megatron.rl.inference.engine.route_recorder`; ``--rl-router-replay rollout``). MoE models only.

    decode_buckets: fixed shapes for decode steps: the active request count is padded up to the smallest of these
        sizes (padding rows compute and are dropped), and the decode attention's key slots to a multiple of
        ``MIN_KEY_SLOTS``, so a decode step takes one of a few shapes (what a captured graph or a compiled step
        needs). None = pad to ``token_rounder`` only (fastest without graphs). Counts above the largest size keep
        ``token_rounder``'s padding.
    decode_cuda_graphs: on a GPU, capture the decode forward in a CUDA graph per bucket and attention key length
        and replay it (:mod:`megatron.rl.inference.engine.graphs`; needs ``decode_buckets``, which it defaults to
        powers of two); a shape whose capture fails runs eagerly. Ignored on CPU. Tested on CPU by replaying the
        recorded step; not run on a GPU yet (see that module).

    packed_weights: on CPU (fp32, MKL), inference linear layers reuse MKL packs of their weights across the steps
        of one generation (:mod:`megatron.rl.runtime.packed_linear`; the packs are dropped whenever the engine
        pauses or stops, before the weights change). Default: on where they were measured faster
        (:func:`~megatron.rl.runtime.packed_linear.pays_off`).

    Defaults: :meth:`for_device`. On CPU, small blocks and a buffer sized for the batch matter most
    (the stock 256-token blocks and 16 384-token steps gather far more cache than a short request uses).
    """

    buffer_size_gb: float = 0.5
    block_size_tokens: int = 64
    max_requests: int = 256
    max_tokens: int = 4096
    max_sequence_length: int | None = None
    seed: int = 1234
    token_rounder: int | None = 8
    cpu_fast_steps: bool = True
    share_prompt_prefill: bool = True
    batched_admission: bool = True
    keep_cpu_kv_buffer: bool = True
    decode_mirror: bool = True
    record_routes: bool = False
    decode_buckets: tuple[int, ...] | None = None
    decode_cuda_graphs: bool = False
    packed_weights: bool = dataclasses.field(default_factory=packed_linear.pays_off)

    @classmethod
    def for_device(cls, device: str | torch.device) -> "EngineSettings":
        if torch.device(device).type == "cpu":
            return cls()
        # GPU: megatron-core's own block size, step size and token padding, a larger buffer and batch.
        return cls(buffer_size_gb=4.0, block_size_tokens=256, max_requests=512, max_tokens=16384, token_rounder=None)

    def for_release(self) -> "EngineSettings":
        """These settings with the features whose megatron-core entries (:mod:`megatron.rl.runtime.subclasses`)
        were not written for the installed release turned off: there the stock path runs."""
        off = {field: False for field, names in _FEATURE_ENTRIES.items()
               if getattr(self, field) and not any(patches.covers_installed(name) for name in names)
               and not versions.written_for(_MEGATRON_CORE_OWN.get(field, ()))}
        if self.decode_buckets is not None and not patches.covers_installed(_DECODE_BUCKETS_ENTRY):
            off["decode_buckets"] = None
        if off:
            log.debug("engine features not written for megatron-core %s, left off: %s",
                      versions.installed_version(), ", ".join(sorted(off)))
        return dataclasses.replace(self, **off) if off else self

    @classmethod
    def from_flags(cls, device: str | torch.device, flags: EngineFlags, tp_size: int = 1,
                   record_routes: bool = False) -> "EngineSettings":
        """:meth:`for_device`'s settings with a run's engine flags applied (:func:`apply_engine_flags`; bucket sizes
        are multiples of the model's TP size ``tp_size``); ``record_routes``: ``--rl-router-replay rollout``."""
        settings = dataclasses.replace(cls.for_device(device), record_routes=record_routes)
        return apply_engine_flags(settings, flags, torch.device(device).type, tp_size)


# EngineSettings features -> the registry entries of the megatron-core internals each is built on (one per release
# where the releases' internals differ); a feature is on where one of its entries was written for the installed one
_FEATURE_ENTRIES = {"share_prompt_prefill": ("dynamic context: shared prompt prefill",),
                    "batched_admission": ("dynamic context: batched admission",
                                          "dynamic context: batched admission (0.19)"),
                    "keep_cpu_kv_buffer": ("dynamic context: reused CPU KV buffer",
                                           "dynamic context: reused CPU KV buffer (0.19)"),
                    "decode_cuda_graphs": ("dynamic context: decode buckets",)}
# EngineSettings features megatron-core provides through its public API on some releases (nothing is changed there)
_MEGATRON_CORE_OWN = {"share_prompt_prefill": versions.MCORE_0_19}  # InferenceConfig.enable_prefix_caching
_DECODE_BUCKETS_ENTRY = "dynamic context: decode buckets"
_FAST_ADMISSION_ENTRY = "engine admission of token-id prompts"

GRAPH_DEVICES = ("cuda",)  # where EngineSettings.decode_cuda_graphs captures (CPU has no graphs to capture)
GRAPH_KEY_SLOTS = 64  # with graphs, decode attention's key slots are a multiple of this: one graph per (rows, slots)


def forget_step_memos(context: Any) -> None:
    """Drop what a decode forward memoises per step (attention plans, RoPE cos/sin, KV-append slots), so that the
    next forward computes it: inside the captured run of a graph, rather than taken from a warm-up run."""
    torch_attention.forget_step_plans()
    rope_cache.forget(context)
    kv_append.forget(context)


@dataclasses.dataclass
class SampleSpec:
    """How to sample one request: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), generator."""

    temperature: float
    top_k: int
    top_p: float
    generator: NoiseStream | None = None


class EngineTokenizer:
    """The tokenizer interface megatron-core's controller expects, over one of our tokenizers.

    Ids outside the tokenizer's vocabulary (the model's padded vocabulary rows) render as nothing
    instead of raising, so a sample that lands there never crashes detokenization.
    """

    def __init__(self, tokenizer: Any):
        self.inner = tokenizer
        self.vocab_size = int(tokenizer.vocab_size)
        self.eod = getattr(tokenizer, "eod", None)
        self.pad = getattr(tokenizer, "pad", None)
        self.bos = getattr(tokenizer, "bos", None)
        self._stop_triggers: dict[tuple[str, ...], frozenset[int] | None] = {}

    def tokenize(self, text: str) -> list[int]:
        return list(self.inner.tokenize(text))

    def detokenize(self, ids: Sequence[int], **_unused: Any) -> str:
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self.inner.detokenize(ids)

    def offsets(self, ids: Sequence[int], text: str) -> list[int]:
        return list(self.inner.offsets(ids, text))

    def stop_triggers(self, stops: Sequence[str]) -> frozenset[int] | None:
        """The inner tokenizer's :meth:`~megatron.rl.training.tokenizer.Tokenizer.stop_triggers`, memoised."""
        key = tuple(stops)
        if key not in self._stop_triggers:
            method = getattr(self.inner, "stop_triggers", None)
            self._stop_triggers[key] = method(key) if method is not None else None
        return self._stop_triggers[key]


@dataclasses.dataclass
class _StepSampling:
    """One step's sampling inputs, prepared on the host before the forward (:meth:`SamplingController._prepare_sampling`)."""

    count: int
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    generators: list
    host: tuple[list[int], bool]  # sample_tokens' sampled_rows and truncate


class SamplingController(TextGenerationController):
    """TextGenerationController whose sampling and log-probs follow our per-request :class:`SampleSpec`.

    ``specs`` maps engine request id -> SampleSpec; the owner adds an entry before adding the request
    to the engine and removes it when the request finishes. Requires a context built with
    ``materialize_only_last_token_logits=True`` (one logits row per active request).
    """

    def __init__(self, *args: Any, seed: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.specs: dict[int, SampleSpec] = {}
        device = self._sampled_tokens_cuda.device
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(seed)
        self._step_log_probs: torch.Tensor | None = None
        self.route_recorder: RouteRecorder | None = None  # set by build_engine with EngineSettings.record_routes
        self._step_sampling: _StepSampling | None = None
        self.key_multiple = 1  # decode attention's key slots are rounded up to this (EngineSettings.decode_buckets)
        self.decode_mirror = False  # decode attention over decode_mirror (EngineSettings.decode_mirror)
        self.graphs: DecodeGraphs | None = None  # EngineSettings.decode_cuda_graphs on a GPU
        self.graph_buckets: frozenset[int] = frozenset()
        self._graph_key: tuple[int, int] | None = None  # this decode step's (rows, key slots) when graphs are on

    def make_generator(self, seed: int) -> NoiseStream:
        g = torch.Generator(device=self._sampled_tokens_cuda.device)
        g.manual_seed(int(seed))
        return NoiseStream(g)

    # --- overrides of TextGenerationController's private steps (registry entry "engine sampling and log-probs")

    def _dynamic_step_context_bookkeeping(self):
        if self.route_recorder is not None:  # before update_requests moves requests between slots
            self.route_recorder.harvest(self.inference_wrapped_model.inference_context)
        return super()._dynamic_step_context_bookkeeping()

    def _dynamic_step_sample_bookkeeping(self):
        # The stock bucketing by (temperature, top_k, top_p) is not used: we sample per row.
        pass

    def _dynamic_step_context_init(self, *args: Any, **kwargs: Any):
        # Everything the step's forward and sampling need from the host is worked out here, before the forward:
        # the decode attention's key lengths and this step's sampling settings. The forward and the sampler then
        # read nothing back from the device (what a GPU needs to capture them in a graph).
        if self.route_recorder is not None:  # the routers record this step's forward
            self.route_recorder.before_forward()
        result = super()._dynamic_step_context_init(*args, **kwargs)
        context = self.inference_wrapped_model.inference_context
        active = slice(context.paused_request_count, context.total_request_count)
        request_ids = context.request_ids[active].tolist()
        self._graph_key = None
        if context.is_decode_only():
            lengths = context.active_attn_metadata["mha_metadata"].state_data["kv_seq_lengths"]
            if self.graphs is not None:  # one read per step, outside the graph: its shapes and plan key the graph
                host = set_decode_lengths(lengths, key_multiple=self.key_multiple, owner=context, split_groups=False)
                self._graph_key = (context.padded_active_request_count, host.key_slots(MIN_KEY_SLOTS))
            elif lengths.device.type == "cpu":  # our attention stand-in (no flash-attn): a read of host memory
                set_decode_lengths(lengths, key_multiple=self.key_multiple,
                                   request_ids=request_ids if self.decode_mirror else None, owner=context)
        elif decode_mirror.current() is not None:  # a prefill step: readmitted requests compute their tokens anew
            prefilled = context.request_query_lengths[active] > 1
            decode_mirror.current().forget(context.request_ids[active][prefilled].tolist())
        self._step_sampling = self._prepare_sampling(context, request_ids)
        return result

    def _dynamic_step_forward_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        context = self.inference_wrapped_model.inference_context
        rows = context.padded_active_request_count
        if self.graphs is not None and self._graph_key is not None and rows in self.graph_buckets:
            return self.graphs(self._graph_key, input_ids, position_ids)
        return super()._dynamic_step_forward_logits(input_ids, position_ids)

    def _prepare_sampling(self, context: Any, request_ids: list[int]) -> "_StepSampling":
        """The active requests' (``request_ids``) sampling settings as tensors, their generators and the host-side
        facts."""
        specs = [self.specs[i] for i in request_ids]
        device = self._sampled_tokens_cuda.device
        # A request being prefilled in chunks samples a throw-away token: keep its own generator untouched.
        chunked = context.chunked_prefill_request_id
        return _StepSampling(
            count=len(specs),
            temperature=torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=device),
            top_k=torch.tensor([s.top_k for s in specs], dtype=torch.long, device=device),
            top_p=torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device),
            generators=[None if rid == chunked else s.generator for rid, s in zip(request_ids, specs)],
            host=host_sampling(specs))

    def _dynamic_step_sample_logits(self, logits: torch.Tensor | None = None):
        if logits is None:  # 0.19 hands the forward's logits over in a buffer of the controller
            logits = self._all_logits_cuda
        context = self.inference_wrapped_model.inference_context
        assert last_token_logits_only(context), "build the context with materialize_only_last_token_logits"
        step = self._step_sampling
        last_token_logits = logits.squeeze(0)[:step.count]
        log_probs = tempered_log_probs(last_token_logits, step.temperature)
        tokens = sample_tokens(log_probs, step.temperature, step.top_k, step.top_p, step.generators,
                               self.shared_generator, *step.host)
        self._sampled_tokens_cuda[:step.count] = tokens
        self._step_log_probs = log_probs.gather(-1, tokens[:, None])[:, 0]

    def _dynamic_step_calculate_log_probs(self, logits: torch.Tensor | None = None):
        # One log-prob per active request (its newly sampled token), under softmax(logits / T).
        assert self._step_log_probs is not None
        return [[lp] for lp in self._step_log_probs.tolist()], self._step_log_probs


def power_of_two_buckets(smallest: int, largest: int) -> tuple[int, ...]:
    """``smallest, 2 * smallest, ...`` up to the first size >= ``largest`` (decode buckets; pure)."""
    if smallest < 1 or largest < 1:
        raise ValueError(f"bucket sizes must be >= 1, got smallest={smallest}, largest={largest}")
    sizes = [smallest]
    while sizes[-1] < largest:
        sizes.append(2 * sizes[-1])
    return tuple(sizes)


def bucket_size(count: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``count``, or None when every bucket is smaller (pure)."""
    fitting = [b for b in buckets if b >= count]
    return min(fitting) if fitting else None


class _DecodeBuckets:
    """Context mixin: decode steps pad their request count to the smallest of ``DECODE_BUCKETS`` that holds it.

    megatron-core 0.16.1's ``initialize_attention_state`` pads a decode step to ``round_up_tokens(active)`` (a
    multiple of ``TOKEN_ROUNDER``) and calls it on the instance only, so the override sees whether the step decodes.
    """

    DECODE_BUCKETS: tuple[int, ...] = ()
    FULL_DECODE_LOGITS = False  # decode logits for every padded row (a fixed output shape for graphs)

    def round_up_tokens(self, value, tp_size=None):
        rounded = super().round_up_tokens(value, tp_size)
        if not self.is_decode_only():
            return rounded
        bucket = bucket_size(rounded, self.DECODE_BUCKETS)
        return rounded if bucket is None else bucket

    def last_token_logits(self, logits: torch.Tensor) -> torch.Tensor:
        # Decode: every request has one query token, so its last-token row is its own row; all padded rows are kept
        # (the sampler takes the active ones) so the forward's output has the bucket's shape, not the request count's.
        # The output layer then also runs on the padded rows: MKL may round a product of another row count
        # differently in the last bits, so only graphs (which need the fixed shape) take it.
        if self.FULL_DECODE_LOGITS and self.is_decode_only():
            return logits.squeeze(0)
        return super().last_token_logits(logits)


@functools.lru_cache(maxsize=None)
def _context_class(token_rounder: int | None, share_prompt_prefill: bool = False,
                   keep_cpu_kv_buffer: bool = False, decode_buckets: tuple[int, ...] | None = None,
                   full_decode_logits: bool = False, batched_admission: bool = False
                   ) -> type[DynamicInferenceContext]:
    """DynamicInferenceContext with its class-level token padding (``TOKEN_ROUNDER``) replaced and the mixins
    of :mod:`~megatron.rl.inference.engine.shared_prefill`, :mod:`~megatron.rl.inference.engine.batched_admission`,
    :mod:`~megatron.rl.inference.engine.kv_reuse` and
    decode buckets (:class:`_DecodeBuckets`)."""
    if token_rounder is not None and token_rounder < 1:
        raise ValueError(f"EngineSettings.token_rounder must be >= 1 or None, got {token_rounder}")
    if decode_buckets is not None and (not decode_buckets or min(decode_buckets) < 1):
        raise ValueError(f"EngineSettings.decode_buckets must be positive sizes, got {decode_buckets}")
    mixins = ((SharedPromptPrefill,) if share_prompt_prefill else ()) + (
        (BatchedAdmission,) if batched_admission else ()) + (
        (ReusedCpuKvBuffer,) if keep_cpu_kv_buffer else ()) + ((_DecodeBuckets,) if decode_buckets else ())
    if token_rounder is None and not mixins:
        return DynamicInferenceContext
    attrs = {"__doc__": DynamicInferenceContext.__doc__}
    if token_rounder is not None:
        attrs["TOKEN_ROUNDER"] = token_rounder
    if decode_buckets:
        attrs["DECODE_BUCKETS"] = tuple(sorted(decode_buckets))
        attrs["FULL_DECODE_LOGITS"] = full_decode_logits
    name = "DynamicInferenceContext" + (f"Round{token_rounder}" if token_rounder else "") + "".join(
        m.__name__.strip("_") for m in mixins)
    return type(name, mixins + (DynamicInferenceContext,), attrs)


def unwrap_gpt_model(model: Any) -> torch.nn.Module:
    """Strip DDP / Float16Module style wrappers (anything with ``.module``) down to the GPTModel."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"the Megatron inference backend needs one model chunk, got {len(model)} "
                             "(virtual pipeline stages are not supported by megatron-core inference)")
        model = model[0]
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def build_engine(model: torch.nn.Module, tokenizer: EngineTokenizer, settings: EngineSettings,
                 max_sequence_length: int, pg_collection: Any = None) -> tuple[DynamicInferenceEngine,
                                                                              DynamicInferenceContext,
                                                                              SamplingController]:
    """Build context + wrapper + controller + engine around ``model``.

    model: the model chunk as trained (DDP/Float16Module wrappers are fine: megatron-core unwraps
    them); its weights are used in place, nothing is copied. Call from the thread that will step the
    engine, inside its running asyncio loop (the engine binds to the running loop).
    pg_collection: the model's own process groups when it is an inference copy with its own layout
    (:mod:`megatron.rl.layout.groups`); None = megatron-core's global ``parallel_state`` groups.
    """
    settings = settings.for_release()
    gpt = unwrap_gpt_model(model)
    config = get_model_config(gpt)
    num_local_layers = len(gpt.decoder.layers)
    padded_vocab_size = gpt.vocab_size  # the model's (padded) vocabulary: logits have this width
    if settings.decode_cuda_graphs and settings.record_routes:
        raise ValueError("EngineSettings: decode_cuda_graphs with record_routes: the routes are recorded by Python "
                         "hooks in the forward, which a replayed graph does not run")
    buckets = settings.decode_buckets
    if buckets is None and settings.decode_cuda_graphs:
        buckets = power_of_two_buckets(settings.token_rounder or 8, settings.max_requests)
    # a prompt block taken from megatron-core's prefix cache is never forwarded, so its tokens would get no routes
    own_sharing = megatron_core_shares_prompts()
    prefix_caching = settings.share_prompt_prefill and own_sharing and not settings.record_routes
    context_cls = _context_class(settings.token_rounder, settings.share_prompt_prefill and not own_sharing,
                                 settings.keep_cpu_kv_buffer,
                                 tuple(buckets) if buckets else None, settings.decode_cuda_graphs,
                                 settings.batched_admission)
    sizes = ContextSizes(num_layers=num_local_layers, max_sequence_length=max_sequence_length,
                         buffer_size_gb=settings.buffer_size_gb, block_size_tokens=settings.block_size_tokens,
                         max_tokens=settings.max_tokens, max_requests=settings.max_requests)
    context = make_context(context_cls, config, sizes, pg_collection, prefix_caching=prefix_caching)
    wrapped = make_wrapper(model, config, context, padded_vocab_size, max_sequence_length, pg_collection)
    controller = make_controller(SamplingController, wrapped, tokenizer, pg_collection, seed=settings.seed)
    if settings.record_routes:
        controller.route_recorder = route_recorder(model, config, pg_collection)
    if buckets:
        controller.key_multiple = MIN_KEY_SLOTS
    controller.decode_mirror = settings.decode_mirror
    if settings.decode_cuda_graphs and context.memory_buffer.device.type in GRAPH_DEVICES:
        forward = super(SamplingController, controller)._dynamic_step_forward_logits
        controller.graphs = DecodeGraphs(forward, reset=functools.partial(forget_step_memos, context))
        controller.graph_buckets = frozenset(buckets)
        controller.key_multiple = GRAPH_KEY_SLOTS  # fewer key lengths, fewer graphs
    engine_cls = RolloutEngine if patches.covers_installed(_FAST_ADMISSION_ENTRY) else DynamicInferenceEngine
    engine = make_engine(engine_cls, controller, context, settings.seed, pg_collection)
    log.debug("dynamic inference engine: %d KV blocks of %d tokens, max_requests=%d, max_tokens=%d",
              block_allocator(context).total_count, context.block_size_tokens, context.max_requests,
              context.max_tokens)
    return engine, context, controller


def route_recorder(model: torch.nn.Module, config: Any, pg_collection: Any = None) -> RouteRecorder:
    """A :class:`RouteRecorder` over ``model``'s routers, combining over its model-parallel group when its pipeline
    stages or sequence-parallel ranks each see part of a step's routes."""
    from megatron.core import parallel_state as ps

    if pg_collection is None:
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        tp_rank, group = ps.get_tensor_model_parallel_rank(), ps.get_model_parallel_group()
    else:
        tp, pp = pg_collection.tp.size(), pg_collection.pp.size()
        tp_rank, group = pg_collection.tp.rank(), pg_collection.mp
    sp = tp > 1 and bool(config.sequence_parallel)
    return RouteRecorder(install_router_replay(model), group if (pp > 1 or sp) else None,
                         tp_rank if sp else 0, tp if sp else 1)
