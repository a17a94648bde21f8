"""Building megatron-core's dynamic inference engine around a (training) GPTModel.

This is the ONLY module that calls the constructors of ``DynamicInferenceContext``,
``GPTInferenceWrapper``, ``TextGenerationController`` and ``DynamicInferenceEngine``: their
signatures are those of megatron-core 0.16.1 and change in 0.17+ (``DynamicInferenceContext(model_config,
inference_config)``, ``DynamicInferenceEngine(controller, context)``, no ``pp_group`` on the controller).
An upgrade touches :func:`build_engine` and the entries of :mod:`megatron.rl.runtime.patches`.

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
from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import InferenceWrapperConfig
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.utils import get_model_config

from megatron.rl.inference.engine.kv_reuse import ReusedCpuKvBuffer
from megatron.rl.inference.engine.route_recorder import RouteRecorder
from megatron.rl.inference.sampling import NoiseStream, sample_tokens, tempered_log_probs
from megatron.rl.inference.engine.shared_prefill import SharedPromptPrefill

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
        (:mod:`megatron.rl.inference.engine.shared_prefill`); False = every request prefills its own prompt.
    keep_cpu_kv_buffer: on CPU, a stopped engine's KV buffer is kept for the next engine of the same shape
        (:mod:`megatron.rl.inference.engine.kv_reuse`: a fresh buffer page-faults every cache page it writes);
        False = freed at exit. GPU buffers are always freed.
    record_routes: record every processed token's MoE routes into ``InferenceResponse.routes``
        (:mod:`megatron.rl.inference.engine.route_recorder`; ``--rl-router-replay rollout``). MoE models only.

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
    keep_cpu_kv_buffer: bool = True
    record_routes: bool = False

    @classmethod
    def for_device(cls, device: str | torch.device) -> "EngineSettings":
        if torch.device(device).type == "cpu":
            return cls()
        # GPU: megatron-core's own block size, step size and token padding, a larger buffer and batch.
        return cls(buffer_size_gb=4.0, block_size_tokens=256, max_requests=512, max_tokens=16384, token_rounder=None)


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

    def make_generator(self, seed: int) -> NoiseStream:
        g = torch.Generator(device=self._sampled_tokens_cuda.device)
        g.manual_seed(int(seed))
        return NoiseStream(g)

    # --- overrides of TextGenerationController's private steps (registry entry "engine sampling and log-probs")

    def _dynamic_step_context_init(self, *args: Any, **kwargs: Any):
        if self.route_recorder is not None:  # the routers record this step's forward
            self.route_recorder.before_forward()
        return super()._dynamic_step_context_init(*args, **kwargs)

    def _dynamic_step_context_bookkeeping(self):
        if self.route_recorder is not None:  # before update_requests moves requests between slots
            self.route_recorder.harvest(self.inference_wrapped_model.inference_context)
        return super()._dynamic_step_context_bookkeeping()

    def _dynamic_step_sample_bookkeeping(self):
        # The stock bucketing by (temperature, top_k, top_p) is not used: we sample per row.
        pass

    def _dynamic_step_sample_logits(self, logits: torch.Tensor):
        context = self.inference_wrapped_model.inference_context
        assert context.materialize_only_last_token_logits, "build the context with materialize_only_last_token_logits"
        active = slice(context.paused_request_count, context.total_request_count)
        count = context.total_request_count - context.paused_request_count
        last_token_logits = logits.squeeze(0)[:count]
        request_ids = context.request_ids[active].tolist()
        specs = [self.specs[i] for i in request_ids]
        device = last_token_logits.device
        temperature = torch.tensor([s.temperature for s in specs], dtype=torch.float32, device=device)
        top_k = torch.tensor([s.top_k for s in specs], dtype=torch.long, device=device)
        top_p = torch.tensor([s.top_p for s in specs], dtype=torch.float32, device=device)
        # A request being prefilled in chunks samples a throw-away token: keep its own generator untouched.
        chunked = context.chunked_prefill_request_id
        generators = [None if rid == chunked else s.generator for rid, s in zip(request_ids, specs)]
        log_probs = tempered_log_probs(last_token_logits, temperature)
        tokens = sample_tokens(log_probs, temperature, top_k, top_p, generators, self.shared_generator)
        self._sampled_tokens_cuda[:count] = tokens
        self._step_log_probs = log_probs.gather(-1, tokens[:, None])[:, 0]

    def _dynamic_step_calculate_log_probs(self, logits: torch.Tensor):
        # One log-prob per active request (its newly sampled token), under softmax(logits / T).
        assert self._step_log_probs is not None
        return [[lp] for lp in self._step_log_probs.tolist()], None


@functools.lru_cache(maxsize=None)
def _context_class(token_rounder: int | None, share_prompt_prefill: bool = False,
                   keep_cpu_kv_buffer: bool = False) -> type[DynamicInferenceContext]:
    """DynamicInferenceContext with its class-level token padding (``TOKEN_ROUNDER``) replaced and the mixins
    of :mod:`~megatron.rl.inference.engine.shared_prefill` and :mod:`~megatron.rl.inference.engine.kv_reuse`."""
    if token_rounder is not None and token_rounder < 1:
        raise ValueError(f"EngineSettings.token_rounder must be >= 1 or None, got {token_rounder}")
    mixins = ((SharedPromptPrefill,) if share_prompt_prefill else ()) + (
        (ReusedCpuKvBuffer,) if keep_cpu_kv_buffer else ())
    if token_rounder is None and not mixins:
        return DynamicInferenceContext
    attrs = {"__doc__": DynamicInferenceContext.__doc__}
    if token_rounder is not None:
        attrs["TOKEN_ROUNDER"] = token_rounder
    name = "DynamicInferenceContext" + (f"Round{token_rounder}" if token_rounder else "") + "".join(
        m.__name__ for m in mixins)
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
    """Build context + wrapper + controller + engine around ``model`` (megatron-core 0.16.1 signatures).

    model: the model chunk as trained (DDP/Float16Module wrappers are fine: megatron-core unwraps
    them); its weights are used in place, nothing is copied. Call from the thread that will step the
    engine, inside its running asyncio loop (the engine binds to the running loop).
    pg_collection: the model's own process groups when it is an inference copy with its own layout
    (:mod:`megatron.rl.layout.groups`); None = megatron-core's global ``parallel_state`` groups.
    """
    gpt = unwrap_gpt_model(model)
    config = get_model_config(gpt)
    num_local_layers = len(gpt.decoder.layers)
    padded_vocab_size = gpt.vocab_size  # the model's (padded) vocabulary: logits have this width
    context = _context_class(settings.token_rounder, settings.share_prompt_prefill, settings.keep_cpu_kv_buffer)(
        params_dtype=config.params_dtype,
        num_layers=num_local_layers,
        kv_channels=config.kv_channels,
        num_attention_heads=config.num_query_groups or config.num_attention_heads,
        max_sequence_length=max_sequence_length,
        buffer_size_gb=settings.buffer_size_gb,
        block_size_tokens=settings.block_size_tokens,
        max_tokens=settings.max_tokens,
        max_requests=settings.max_requests,
        num_cuda_graphs=None,
        materialize_only_last_token_logits=True,
        unified_memory_level=0,
        pg_collection=pg_collection,
    )
    wrapper_config = InferenceWrapperConfig(
        hidden_size=config.hidden_size,
        params_dtype=config.params_dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=padded_vocab_size,
        inference_max_requests=context.max_requests,
        inference_max_seq_length=max_sequence_length,
        fp32_residual_connection=config.fp32_residual_connection,
    )
    wrapped = GPTInferenceWrapper(model, wrapper_config, context, pg_collection=pg_collection)
    controller = SamplingController(wrapped, tokenizer, seed=settings.seed,
                                    pp_group=None if pg_collection is None else pg_collection.pp)
    if settings.record_routes:
        controller.route_recorder = route_recorder(model, config, pg_collection)
    engine = DynamicInferenceEngine(controller, context, random_seed=settings.seed, pg_collection=pg_collection)
    log.debug("dynamic inference engine: %d KV blocks of %d tokens, max_requests=%d, max_tokens=%d",
              context.block_allocator.total_count, context.block_size_tokens, context.max_requests,
              context.max_tokens)
    return engine, context, controller


def route_recorder(model: torch.nn.Module, config: Any, pg_collection: Any = None) -> RouteRecorder:
    """A :class:`RouteRecorder` over ``model``'s routers, combining over its model-parallel group when its pipeline
    stages or sequence-parallel ranks each see part of a step's routes."""
    from megatron.core import parallel_state as ps

    from megatron.rl.routing.replay import install_router_replay

    if pg_collection is None:
        tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
        tp_rank, group = ps.get_tensor_model_parallel_rank(), ps.get_model_parallel_group()
    else:
        tp, pp = pg_collection.tp.size(), pg_collection.pp.size()
        tp_rank, group = pg_collection.tp.rank(), pg_collection.mp
    sp = tp > 1 and bool(config.sequence_parallel)
    return RouteRecorder(install_router_replay(model), group if (pp > 1 or sp) else None,
                         tp_rank if sp else 0, tp if sp else 1)
