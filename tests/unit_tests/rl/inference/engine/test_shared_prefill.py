"""Requests with the same prompt prefill it once (megatron.rl.inference.engine.shared_prefill).

The same batch is generated with sharing on and off: sharing must actually skip prompt tokens, give the same
greedy completions, stay within the fp32 train-inference log-prob bound against a teacher-forced forward, and
keep every sampled rollout's log-probs within that bound of the unshared engine's for the same seeds. On
megatron-core 0.16.1 a follower skips all but its prompt's last token (SharedPromptPrefill); on 0.19 megatron-core's
prefix caching shares the prompt's whole KV blocks.
"""
from __future__ import annotations

import pytest
import torch

from tests.unit_tests.rl.inference.scripts.megatron_common import (init_distributed, peaked_tiny_gpt,
                                                                   teacher_forced_logprobs)

MAX_GAP = 1e-5  # the fp32 train-inference bound of test_megatron_logprob_gap.py
BLOCK = 16  # KV block tokens of the engines under test


@pytest.fixture(scope="module")
def engines():
    init_distributed(tp=1)
    from megatron.rl.inference.megatron import EngineSettings, MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    model = peaked_tiny_gpt(hidden=64, layers=2, seq=128)
    backends = {share: MegatronInference(model, ByteLevelTokenizer(), settings=EngineSettings(
        block_size_tokens=BLOCK, share_prompt_prefill=share)) for share in (True, False)}
    yield model, backends
    for backend in backends.values():
        backend.exit_inference_mode()


def _groups(temperature: float, seed0: int = 0) -> list:
    """GRPO-like: 6 prompts (1 to 37 tokens, one spanning 3 KV blocks) x 4 rollouts, plus 3 lone prompts."""
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    prompts = ["a", "Q: 12+7=? A:", "the quick brown fox jumps over the lazy", "xy", "abcdefghijklmnop",
               "hello world"]
    requests = []
    for p, prompt in enumerate(prompts):
        for i in range(4):
            requests.append(InferenceRequest(prompt=prompt, generation_args=GenerationArgs(
                temperature=temperature, max_tokens=6 + 3 * (i % 3), seed=seed0 + 10 * p + i)))
    for prompt in ("lone one", "another lone prompt", "z"):
        requests.append(InferenceRequest(prompt=prompt, generation_args=GenerationArgs(
            temperature=temperature, max_tokens=9, seed=seed0 + 99)))
    return requests


def _skipped(backend) -> int:
    from megatron.rl.inference.engine.shared_prefill import shared_prefill_tokens

    return shared_prefill_tokens(backend._session.engine)


def _follower_skip(length: int) -> int:
    """Prompt positions a follower of a ``length``-token prompt does not compute: all but the last one
    (SharedPromptPrefill); with megatron-core's prefix caching, the whole blocks, leaving it two tokens or more."""
    from megatron.rl.inference.engine.shared_prefill import megatron_core_shares_prompts

    if not megatron_core_shares_prompts():
        return length - 1
    whole = length // BLOCK * BLOCK
    return whole if length - whole >= 2 else max(0, (length - 2) // BLOCK * BLOCK)


def test_shared_prompts_skip_their_prefill_and_keep_greedy_completions(engines):
    _, backends = engines
    shared = backends[True].generate(_groups(0.0))
    skipped = _skipped(backends[True])
    plain = backends[False].generate(_groups(0.0))
    # each group's 3 followers skip what they share with their leader; the lone prompts share nothing
    lengths = [r.prompt_length for r in shared[:24:4]]
    assert lengths[2] > 2 * BLOCK  # one prompt spans three KV blocks
    assert skipped == sum(3 * _follower_skip(n) for n in lengths) > 0
    assert [r.token_ids for r in shared] == [r.token_ids for r in plain]
    for a, b in zip(shared, plain):
        assert a.finish_reason == b.finish_reason == "length", (a.error, b.error)


def test_sampled_rollouts_match_the_unshared_engine_and_the_trainer(engines):
    model, backends = engines
    shared = backends[True].generate(_groups(1.0, seed0=1000))
    plain = backends[False].generate(_groups(1.0, seed0=1000))
    gaps, magnitudes = [], []
    for a, b in zip(shared, plain):
        assert a.finish_reason in ("stop", "length"), a.error
        assert a.token_ids == b.token_ids  # same seeds, same distributions within rounding: same samples
        ref = teacher_forced_logprobs(model, a.token_ids, a.prompt_length, 1.0)
        gaps.append(float((torch.tensor(a.logprobs) - ref).abs().max()))
        assert float((torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs().max()) < MAX_GAP
        magnitudes.append(float(ref.abs().mean()))
    assert sum(magnitudes) / len(magnitudes) > 1.0, "the model is not peaked: the test would not exercise the gap"
    assert max(gaps) < MAX_GAP, f"max train-inference gap {max(gaps):.3g}"


def test_followers_admitted_beside_requests_in_flight(engines):
    """A second batch of groups joins while the first decodes: the step mixes decode rows, leaders and followers
    at other KV offsets, and followers' caches are copied from leaders of that step only."""
    import asyncio

    model, backends = engines
    backend = backends[True]
    first, second = _groups(1.0, seed0=2000), _groups(1.0, seed0=3000)
    for r in first:
        r.generation_args.max_tokens = 20

    async def both():
        early = asyncio.ensure_future(backend.agenerate(first))
        await asyncio.sleep(0.05)
        return await early, await backend.agenerate(second)

    before = _skipped(backend) if backend.active else 0
    a, b = asyncio.run(both())
    assert _skipped(backend) > before
    for r in a + b:
        assert r.finish_reason in ("stop", "length"), r.error
        ref = teacher_forced_logprobs(model, r.token_ids, r.prompt_length, 1.0)
        assert float((torch.tensor(r.logprobs) - ref).abs().max()) < MAX_GAP


def test_after_a_pause_new_requests_share_no_prompt_cached_before_it(engines):
    """megatron-core 0.19's prefix cache outlives a step: once the weights may have changed (a paused phase resumed),
    a new request with a cached prompt computes it anew, while the requests holding the old blocks keep them."""
    from megatron.rl.inference.engine.shared_prefill import forget_shared_prompts, megatron_core_shares_prompts

    if not megatron_core_shares_prompts():
        pytest.skip("0.16.1: SharedPromptPrefill shares within one step only, never across a pause")
    from megatron.core.inference.contexts import DynamicInferenceContext
    from megatron.core.inference.inference_request import DynamicInferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.utils import get_model_config

    from megatron.rl.inference.engine.construct import ContextSizes, make_context
    from megatron.rl.runtime.cuda_to_cpu import CudaToCpuMode

    model, _ = engines
    sizes = ContextSizes(num_layers=2, max_sequence_length=128, buffer_size_gb=0.01, block_size_tokens=BLOCK,
                         max_tokens=512, max_requests=8)
    with CudaToCpuMode():
        context = make_context(DynamicInferenceContext, get_model_config(model), sizes, prefix_caching=True)
    prompt = torch.arange(1, 3 * BLOCK + 4)

    def admit(rid: int) -> None:
        context.add_request(DynamicInferenceRequest(
            request_id=rid, prompt_tokens=prompt.clone(), block_size_tokens=BLOCK, enable_prefix_caching=True,
            sampling_params=SamplingParams(num_tokens_to_generate=4, termination_id=0)))

    admit(1)
    admit(2)
    assert context.prefix_cache_prefill_skipped_tokens == 3 * BLOCK  # shared before the pause
    holders = context.request_to_kv_block_ids[:2, :3].clone()
    forget_shared_prompts(context)
    admit(3)
    assert context.prefix_cache_prefill_skipped_tokens == 3 * BLOCK  # the new request computed its whole prompt
    assert torch.equal(context.request_to_kv_block_ids[:2, :3], holders)  # the holders kept their blocks
    assert not set(context.request_to_kv_block_ids[2, :3].tolist()) & set(holders.flatten().tolist())
    admit(4)
    assert context.prefix_cache_prefill_skipped_tokens == 6 * BLOCK  # and the blocks cached after it are shared
