"""Requests admitted in one batch of writes (megatron.rl.inference.engine.batched_admission) leave the context as
megatron-core's one-at-a-time ``add_request`` does, and generate the same tokens and log-probs.

``shared``: on megatron-core 0.16.1 the shared-prefill mixin; on 0.19 megatron-core's prefix caching (a request whose
whole blocks are another's is admitted by megatron-core's own code, between queued ones)."""
from __future__ import annotations

import pytest
import torch

from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, peaked_tiny_gpt
from megatron.rl.inference.engine.construct import block_allocator
from tests.conftest import needs_entry

pytestmark = needs_entry("dynamic context: batched admission", "dynamic context: batched admission (0.19)")

# The context's per-request arrays (first total_request_count rows) and per-token arrays (first active_token_count).
_REQUEST_ARRAYS = ("request_ids", "request_query_lengths", "request_output_lengths", "request_kv_length_offsets",
                   "request_kv_block_counts", "request_last_kv_block_id", "request_last_kv_block_offset",
                   "request_to_kv_block_ids")
_TOKEN_ARRAYS = ("token_to_pos_ids", "token_to_input_ids", "token_to_request_idx", "token_to_position_in_request",
                 "token_to_block_idx", "token_to_local_position_within_kv_block")


@pytest.fixture(scope="module")
def model():
    init_distributed(tp=1)
    return peaked_tiny_gpt(hidden=64, layers=2, seq=128)


def _is_0_19() -> bool:
    from megatron.rl.runtime import versions

    return versions.is_0_19()


def _context(batched: bool, shared: bool, max_tokens: int = 4096, model=None):
    from megatron.rl.inference.engine.build import _context_class
    from megatron.rl.runtime.cuda_to_cpu import CudaToCpuMode

    if _is_0_19():
        from megatron.core.utils import get_model_config

        from megatron.rl.inference.engine.construct import ContextSizes, make_context

        sizes = ContextSizes(num_layers=2, max_sequence_length=128, buffer_size_gb=0.01, block_size_tokens=16,
                             max_tokens=max_tokens, max_requests=64)
        with CudaToCpuMode():
            return make_context(_context_class(8, False, False, None, False, batched), get_model_config(model),
                                sizes, prefix_caching=shared)
    cls = _context_class(8, shared, False, None, False, batched)
    with CudaToCpuMode():  # construction allocates with CUDA literals, as in the engine
        return cls(params_dtype=torch.float32, num_layers=2, kv_channels=16, num_attention_heads=4,
                   max_sequence_length=128, buffer_size_gb=0.01, block_size_tokens=16, max_tokens=max_tokens,
                   max_requests=64, num_cuda_graphs=None, materialize_only_last_token_logits=True,
                   unified_memory_level=0)


def _requests(seed: int, shared: bool = False):
    from megatron.core.inference.inference_request import DynamicInferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = []
    for length in (1, 5, 16, 17, 37, 5, 40):  # one token, one block exactly, several blocks
        prompt = torch.randint(0, 200, (length,), generator=g)
        prompts += [prompt] * (3 if length == 5 else 1)  # a group sharing its prompt (shared prefill)
        if length == 37 and _is_0_19():  # a prompt whose two whole blocks megatron-core's prefix cache shares
            prompts.append(prompt)
    # 0.19's request hashes its whole blocks for the prefix cache when told the block size
    caching = {"block_size_tokens": 16, "enable_prefix_caching": shared} if _is_0_19() else {}
    return [DynamicInferenceRequest(request_id=100 + i, prompt_tokens=p.clone(),
                                    sampling_params=SamplingParams(temperature=0.5 + 0.1 * i, top_k=i % 3, top_p=0.0,
                                                                   num_tokens_to_generate=3 + i, termination_id=7,
                                                                   return_log_probs=bool(i % 2)), **caching)
            for i, p in enumerate(prompts)]


def _admit(context, requests, chunk_at: int | None = None) -> None:
    for i, req in enumerate(requests):
        if i == chunk_at:  # a chunk of a chunked prefill: megatron-core's own code, after what is queued
            context.add_request(req, req.remaining_prompt_length - 2)  # the chunk length (renamed in 0.19)
            return
        context.add_request(req)
        req.remaining_prompt_tokens = req.remaining_prompt_tokens.new_empty(0)  # as the engine does


def _state(context) -> dict:
    n, t = context.total_request_count, context.active_token_count
    state = {name: getattr(context, name)[:n].clone() for name in _REQUEST_ARRAYS}
    state.update({name: getattr(context, name)[:t].clone() for name in _TOKEN_ARRAYS})
    state.update({f"metadata {k}": v[:n].clone() for k, v in context.request_metadata.items()})
    state["counts"] = torch.tensor([n, t, context.num_prefill_requests, block_allocator(context).total_avail])
    state["padding"] = torch.stack([getattr(context, name)[t:context.padded_active_token_count].clone()
                                    for name in ("token_to_block_idx", "token_to_local_position_within_kv_block",
                                                 "token_to_position_in_request")])
    if hasattr(context, "shared_prefill_pairs"):
        state["pairs"] = torch.tensor(context.shared_prefill_pairs())
    if _is_0_19():
        allocator = context.kv_block_allocator
        state["request_in_prefill_status_tensor"] = context.request_in_prefill_status_tensor[:n].clone()
        state["counters"] = torch.tensor([context.lifetime_prefill_token_count, context.prefix_cache_hits,
                                          context.prefix_cache_prefill_computed_tokens,
                                          context.prefix_cache_prefill_skipped_tokens])
        if context.enable_prefix_caching:
            state["hashes"] = torch.tensor(sorted(allocator.kv_hash_to_block_id.items()))
            state["block_ref_counts"] = allocator.block_ref_counts.clone()
    return state


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("chunk_at", [None, 6])
def test_same_context_as_megatrons_add_request(model, shared, chunk_at):
    states = []
    for batched in (True, False):
        context = _context(batched, shared, model=model)
        _admit(context, _requests(0, shared), chunk_at)
        if batched and chunk_at is None:  # queued: the step's first use of the context writes them
            # (on 0.19 a prefix-cache hit, the eighth request, is megatron-core's: what was queued before it is written)
            hit = 8 if shared and _is_0_19() else 0
            assert context.request_ids[hit:context.total_request_count].eq(-1).all()
            assert context.request_ids[:hit].ge(100).all()
        context.initialize_attention_state()
        states.append(_state(context))
    ours, ref = states
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name
    assert ref["counts"][1] > 0 and ref["request_ids"].ge(100).all()
    if shared and not _is_0_19():
        assert len(ref["pairs"]) == (4 if chunk_at is None else 2)  # groups of three: two followers each
    if shared and _is_0_19() and chunk_at is None:
        assert ref["counters"][1] == 1 and ref["counters"][3] == 32  # the repeated prompt's two blocks were shared


def test_a_full_context_raises_megatrons_error_and_keeps_its_state(model):
    from megatron.core.inference.contexts.dynamic_context import TokenOverflowError

    states = []
    for batched in (True, False):
        context = _context(batched, False, max_tokens=64, model=model)
        requests = _requests(1)
        with pytest.raises(TokenOverflowError):
            _admit(context, requests)
        context.initialize_attention_state()
        states.append(_state(context))
    for name in states[1]:
        assert torch.equal(states[0][name], states[1][name]), name


def test_generation_is_bit_identical(model):
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest
    from megatron.rl.inference.megatron import EngineSettings, MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    prompts = ["a", "Q: 12+7=? A:", "the quick brown fox jumps over the lazy", "xy", "hello world"]
    requests = [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=t, max_tokens=5 + i % 4,
                                                                          seed=10 * j + i))
                for j, p in enumerate(prompts) for i in range(4) for t in (0.0, 1.0)]
    out = {}
    for batched in (True, False):
        # max_tokens 64: the 39-token prompt's group does not fit in one step with the others (chunked prefill)
        backend = MegatronInference(model, ByteLevelTokenizer(), settings=EngineSettings(
            block_size_tokens=16, max_tokens=64, max_requests=64, batched_admission=batched))
        try:
            out[batched] = backend.generate(requests)
        finally:
            backend.exit_inference_mode()
    for a, b in zip(out[True], out[False]):
        assert a.finish_reason == b.finish_reason == "length", (a.error, b.error)
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
