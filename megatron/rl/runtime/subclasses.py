"""The classes of ours that derive from megatron-core classes and override their internals, as registry entries.

Each lives with its feature (the engine build, its context mixins, the pretraining dataset); its entry here
says which megatron-core members it overrides, why, and for which versions, so that a megatron-core upgrade
finds them all in one place. A test checks that every listed member exists in the installed megatron-core and
that every such class in the package is listed.
"""
from __future__ import annotations

from megatron.rl.runtime.patches import declare_subclass
from megatron.rl.runtime.versions import BOTH, MCORE_0_16, MCORE_0_19

_CONTROLLER = "megatron.core.inference.text_generation_controllers.text_generation_controller:TextGenerationController"
_CONTEXT = "megatron.core.inference.contexts.dynamic_context:DynamicInferenceContext"

# (name, where: our class or the function that builds it, changes: the megatron-core members, why, versions).
# An engine feature whose entry lacks the installed release is left off there (EngineSettings.for_release).
_ENTRIES = (
    ("engine sampling and log-probs", "megatron.rl.inference.engine.build:SamplingController",
     f"{_CONTROLLER}._dynamic_step_sample_logits, "
     f"._dynamic_step_calculate_log_probs, ._dynamic_step_context_init, ._dynamic_step_context_bookkeeping, "
     f"._dynamic_step_forward_logits",
     "the trainer recomputes log-probs under softmax(logits / T) before top-k / top-p, and each request has "
     "its own temperature, top-k, top-p and seed; the stock controller samples per bucket of equal settings "
     "and reports other log-probs, so each active row is sampled and scored here. The step's context init also "
     "works out on the host, before the forward, what the forward and the sampler would otherwise read back from "
     "the device (the decode attention's cache lengths, the greedy rows, whether any row truncates), so neither "
     "synchronises and a GPU can capture the decode forward; with EngineSettings.decode_cuda_graphs the forward "
     "of a decode bucket replays a CUDA graph (engine/graphs.py; eager where capture fails). With "
     "EngineSettings.record_routes the routers record each step's forward, harvested before the context's "
     "bookkeeping moves requests between slots", BOTH),
    ("engine sampling: no bucketing by settings", "megatron.rl.inference.engine.build:SamplingController",
     f"{_CONTROLLER}._dynamic_step_sample_bookkeeping",
     "0.16.1's controller groups the active requests by equal (temperature, top-k, top-p) before sampling; ours "
     "samples each row with its own settings, so the grouping is skipped (0.19 has no such step)", MCORE_0_16),
    ("dynamic context: decode buckets", "megatron.rl.inference.engine.build:_DecodeBuckets",
     f"{_CONTEXT}.round_up_tokens, .last_token_logits",
     "a decode step's shape follows its active request count, so a captured graph or a compiled step would see "
     "a new shape almost every step; with EngineSettings.decode_buckets a decode step pads its request count to "
     "the smallest of a few sizes, and with decode CUDA graphs it keeps every padded row's logits so the "
     "forward's output has the bucket's shape (megatron-core's own padding is a multiple of TOKEN_ROUNDER)", MCORE_0_16),
    ("dynamic context: step padding", "megatron.rl.inference.engine.build:_context_class",
     f"{_CONTEXT}.TOKEN_ROUNDER",
     "megatron-core pads every forward step to a multiple of 64 tokens for CUDA graphs; without graphs a decode "
     "step of a few requests computes mostly padding (EngineSettings.token_rounder)", BOTH),
    ("dynamic context: shared prompt prefill", "megatron.rl.inference.engine.shared_prefill:SharedPromptPrefill",
     f"{_CONTEXT}.add_request, .append_key_value_cache, .update_requests, .reset (and the per-token "
     f"arrays add_request fills)",
     "a GRPO group submits its prompt group-size times and the context prefills each copy; followers enter "
     "with their last prompt token and get the leader's KV slots after each layer's append. On 0.19 nothing is "
     "overridden: EngineSettings.share_prompt_prefill turns on megatron-core's own prefix caching "
     "(InferenceConfig.enable_prefix_caching), which shares whole KV blocks by reference count", MCORE_0_16),
    ("dynamic context: batched admission", "megatron.rl.inference.engine.batched_admission:BatchedAdmission",
     f"{_CONTEXT}.add_request, .initialize_attention_state, .reset, .deallocate_all_tensors (and the per-request "
     f"and per-token arrays add_request fills)",
     "add_request writes ~20 small tensor entries per request, one request at a time; a rollout phase admits all "
     "its requests in one step, whose prefill then spent more time admitting than in the forward. Whole-prompt "
     "admissions are queued and written in one batch of writes before the step's forward (the same values)", MCORE_0_16),
    ("dynamic context: batched admission (0.19)", "megatron.rl.inference.engine.batched_admission:BatchedAdmission",
     f"{_CONTEXT}.add_request, ._compute_prefix_match, .initialize_attention_state, .reset (and the per-request "
     f"and per-token arrays add_request fills, request_in_prefill_status_tensor, the prefix-cache counters); "
     f"megatron.core.inference.contexts.kv_block_allocator:KVBlockAllocator.register_kv_block_hashes",
     "as on 0.16.1; 0.19's add_request also matches the prompt's whole blocks against its prefix cache and "
     "registers the new ones: a request with a hit is left to it, the others are queued with their blocks' hashes "
     "registered on admission", MCORE_0_19),
    ("dynamic context: reused CPU KV buffer", "megatron.rl.inference.engine.kv_reuse:ReusedCpuKvBuffer",
     f"{_CONTEXT}.allocate_all_tensors, .deallocate_all_tensors (and the memory_buffer they make)",
     "every rollout phase builds a context whose KV buffer is a fresh allocation that the kernel page-faults "
     "on first write; on CPU a stopped engine's buffer serves the next one of the same shape", MCORE_0_16),
    ("dynamic context: reused CPU KV buffer (0.19)", "megatron.rl.inference.engine.kv_reuse:ReusedCpuKvBuffer",
     f"{_CONTEXT}._allocate_memory_buffer (and the memory_buffer it makes)",
     "as on 0.16.1; 0.19 allocates the buffer in _allocate_memory_buffer and its suspend keeps it, so the kept "
     "buffer is taken after that allocation and free_context hands the buffer to the pool", MCORE_0_19),
    ("engine admission of token-id prompts", "megatron.rl.inference.engine.rollout_engine:RolloutEngine",
     "megatron.core.inference.engines.dynamic_engine:DynamicInferenceEngine.add_request (calls its _add_request)",
     "add_request's DynamicInferenceRequest deep-copies the prompt tensor (~70 us a request through Python's copy "
     "protocol and the CPU device mode); a rollout phase admits all its requests before its first step, so a "
     "token-id prompt's request is made with the same tokens and a clone(). 0.19's request keeps the prompt "
     "tensor it is given (no copy): there megatron-core's add_request runs", MCORE_0_16),
    ("scalar sampling parameters", "megatron.rl.inference.engine.session:_scalar_sampling_params",
     "megatron.core.inference.sampling_params:SamplingParams (a deep copy made shallow)",
     "every request deep-copies its SamplingParams on creation, walking ~30 objects where a shallow copy of "
     "its scalars is the same", BOTH),
    ("engine route recording", "megatron.rl.inference.engine.route_recorder:RouteRecorder",
     "megatron.core.transformer.moe.router:TopKRouter.routing (its router_replay records the engine forward's "
     "top-k)",
     "--rl-router-replay rollout needs each generated token's experts. The engine's forward runs the model as "
     "built for training, whose TopKRouter (local and Transformer Engine specs, on 0.16.1 and 0.19) hands its top-k "
     "to the router's replay slot; 0.19's InferenceTopKRouter comes only with transformer_impl="
     "'inference_optimized', which megatron-rl does not build. 0.19's own recording (moe_enable_routing_replay, "
     "the context's RoutingMetadata) is not used: it reads megatron-core's process-wide list of replay instances "
     "(every model of the process) and allocates its buffer on the current CUDA device", BOTH),
    ("pretraining dataset sources", "megatron.rl.training.data:PretrainingGPTDataset",
     "megatron.core.datasets.gpt_dataset:GPTDataset.build_low_level_dataset, ._key_config_attributes, "
     "._get_num_epochs",
     "JSONL and mock corpora as low-level datasets, their settings in the index-cache key, and a clear error "
     "instead of megatron-core's endless loop over a split without tokens", BOTH),
    ("MoE routing replay slot", "megatron.rl.routing.replay_slot:RolloutRouterReplay",
     "megatron.core.transformer.moe.router_replay:RouterReplay.__init__, .get_replay_topk, "
     ".set_target_indices; megatron.core.transformer.moe.router:TopKRouter (its router_replay, set per "
     "router)",
     "megatron-core's replay instances register in one process-wide list (every model of the process), take "
     "every row from the target and count nothing; ours is set on one model's routers, keeps the router's own "
     "choice for rows without a recorded route, and counts how often the replay changed the experts", BOTH),
)

for _name, _where, _changes, _why, _versions in _ENTRIES:
    declare_subclass(_name, where=_where, changes=_changes, why=_why, versions=_versions)
