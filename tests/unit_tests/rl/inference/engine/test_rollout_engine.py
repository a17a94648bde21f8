"""RolloutEngine admits a token-id prompt as megatron-core's add_request does: the same request, tokens and copy.

On megatron-core 0.19 its own add_request makes no copy of the prompt, so the stock engine runs there."""
from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
import torch

from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, peaked_tiny_gpt
from tests.conftest import needs_entry


@pytest.fixture(scope="module")
def model():
    init_distributed(tp=1)
    return peaked_tiny_gpt(hidden=64, layers=2, seq=128)


@needs_entry("engine admission of token-id prompts")
def test_token_id_admission_matches_megatron_cores(model):
    from megatron.core.inference.engines import DynamicInferenceEngine

    from megatron.rl.inference.engine.build import EngineSettings, EngineTokenizer, build_engine
    from megatron.rl.inference.engine.rollout_engine import RolloutEngine
    from megatron.rl.inference.engine.session import _scalar_sampling_params
    from megatron.rl.runtime.cuda_to_cpu import CudaToCpuMode
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    async def admit():
        with CudaToCpuMode():
            engine, context, _ = build_engine(model, EngineTokenizer(ByteLevelTokenizer()),
                                              EngineSettings(block_size_tokens=16, max_requests=8), 128)
            assert isinstance(engine, RolloutEngine)
            prompt = [5, 17, 3, 250, 9]
            made = {}
            for rid, add in ((1, engine.add_request), (2, lambda *a: DynamicInferenceEngine.add_request(engine, *a)),
                             (3, engine.add_request)):
                params = _scalar_sampling_params()(temperature=1.0, top_k=0, top_p=0.0, return_log_probs=True,
                                                   skip_prompt_log_probs=True, num_tokens_to_generate=4 + rid,
                                                   termination_id=7)
                add(rid, prompt if rid != 3 else prompt * 30, params)  # 3: longer than the context allows
                made[rid] = engine.requests[rid].record.requests[0]
            return engine, made

    engine, made = asyncio.run(admit())
    ours, theirs = made[1], made[2]
    assert torch.equal(ours.prompt_tokens, theirs.prompt_tokens) and ours.prompt_tokens.dtype == torch.int64
    assert torch.equal(ours.remaining_prompt_tokens, theirs.remaining_prompt_tokens)
    assert ours.remaining_prompt_tokens.data_ptr() != ours.prompt_tokens.data_ptr()  # a copy, as the deep copy
    assert ours.prompt is theirs.prompt is None and ours.status == theirs.status
    assert ours.sampling_params.num_tokens_to_generate == 5 and theirs.sampling_params.num_tokens_to_generate == 6
    assert ours.sampling_params is not made[2].sampling_params
    assert list(engine.waiting_request_ids) == [1, 2] and list(engine.failed_request_ids) == [3]  # checks still run


def test_megatron_core_0_19_admits_a_token_id_prompt_without_copying_it(model):
    """Where RolloutEngine is not used (0.19), megatron-core's own admission is already the cheap one: the request
    holds the prompt tensor made from the list, with no second copy."""
    from megatron.rl.runtime import versions

    if not versions.is_0_19():
        pytest.skip("megatron-core 0.16.1 deep-copies the prompt: RolloutEngine admits it there")
    from megatron.core.inference.engines import DynamicInferenceEngine

    from megatron.rl.inference.engine.build import EngineSettings, EngineTokenizer, build_engine
    from megatron.rl.inference.engine.rollout_engine import RolloutEngine
    from megatron.rl.inference.engine.session import _scalar_sampling_params
    from megatron.rl.runtime.cuda_to_cpu import CudaToCpuMode
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    async def admit():
        with CudaToCpuMode():
            engine, _, _ = build_engine(model, EngineTokenizer(ByteLevelTokenizer()),
                                        EngineSettings(block_size_tokens=16, max_requests=8), 128)
            params = _scalar_sampling_params()(temperature=1.0, top_k=0, top_p=0.0, return_log_probs=True,
                                               skip_prompt_log_probs=True, num_tokens_to_generate=4,
                                               termination_id=7)
            engine.add_request(1, [5, 17, 3, 250, 9], params)
            return engine, engine.requests[1].record.requests[0]

    # on its own thread, as the engine session builds it: 0.19's engine sets the inference-mode flag of its thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        engine, request = pool.submit(asyncio.run, admit()).result()
    assert type(engine) is DynamicInferenceEngine and not isinstance(engine, RolloutEngine)
    assert request.prompt_tokens.tolist() == [5, 17, 3, 250, 9]
    assert request.remaining_prompt_tokens.data_ptr() == request.prompt_tokens.data_ptr()  # one tensor, no copy
