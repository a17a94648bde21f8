"""Token-in/token-out on the in-process megatron-core engine with a BPE tokenizer: a multi-turn OpenEnv episode's
trained tokens are exactly the tokens the engine generated, although re-tokenizing their text would change
them; per-token masks cover exactly the generated tokens and the log-probs equal a teacher-forced forward."""
import asyncio

import pytest
import torch

from megatron.rl.agent.api import GroupedRolloutRequest
from megatron.rl.agent.env_config import build_agent_from_config
from megatron.rl.inference.api import GenerationArgs

pytestmark = pytest.mark.slow
pytest.importorskip("openenv.core.env_server.interfaces", reason="openenv-core is not installed")
pytest.importorskip("transformers", reason="the BPE tokenizer needs transformers")

from tests.unit_tests.rl.environments.test_openenv_env import ENV, Recording  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, tiny_gpt
    from tests.unit_tests.rl.training.data.data_test_utils import save_tiny_hf_tokenizer

    init_distributed(tp=1)
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(str(save_tiny_hf_tokenizer(tmp_path_factory.mktemp("bpe"))))
    model = tiny_gpt()  # vocabulary 384 >= the BPE's ~300
    backend = MegatronInference(model, tokenizer)
    yield model, tokenizer, backend
    backend.exit_inference_mode()


def test_multi_turn_trained_tokens_equal_the_engines(engine):
    from tests.unit_tests.rl.inference.scripts.megatron_common import teacher_forced_logprobs

    model, tokenizer, backend = engine
    rec = Recording(backend)
    agent = build_agent_from_config([{"type": "openenv", "args": {
        "environment": ENV, "action_field": "guess", "observation_field": "prompt", "max_turns": 3,
        "max_tokens": 5}}]).entries[0].agent
    out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=2, inference_interface=rec,
        generation_args=GenerationArgs(temperature=1.0, max_tokens=5, seed=3))))
    rollouts = [r for g in out.groups for r in g.rollouts]
    assert all(r.ok for r in rollouts) and all(r.metadata["num_turns"] == 3 for r in rollouts)
    responses = [resp for _, resp in rec.calls]
    by_tokens = {tuple(resp.token_ids): resp for resp in responses}
    changed_by_retokenizing = 0
    for r in rollouts:
        assert tuple(r.token_ids) in by_tokens  # the trained sequence is one the engine returned, unchanged
        turns = [resp for resp in responses
                 if resp.token_ids == r.token_ids[:len(resp.token_ids)] and len(resp.token_ids) > r.prompt_length]
        assert len(turns) == 3
        engine_generated = [t for resp in turns for t in resp.token_ids[resp.prompt_length:]]
        trained = [t for t, m in zip(r.token_ids, r.generation_mask) if m]
        assert trained == engine_generated
        # observation tokens (the hints) are never trained on, generated ones always are
        gen_positions = {i for resp in turns for i in range(resp.prompt_length, len(resp.token_ids))}
        assert [i for i, m in enumerate(r.generation_mask) if m] == sorted(gen_positions)
        # what text round-trips would have produced: the engine's tokens are not the tokenizer's canonical ones
        for resp in turns:
            gen = resp.token_ids[resp.prompt_length:]
            changed_by_retokenizing += tokenizer.tokenize(tokenizer.detokenize(gen)) != gen
        ref = teacher_forced_logprobs(model, r.token_ids, 1, 1.0)
        idx = sorted(gen_positions)
        torch.testing.assert_close(torch.tensor([r.logprobs[i] for i in idx]),
                                   torch.stack([ref[i - 1] for i in idx]).float(), atol=1e-5, rtol=0)
    assert changed_by_retokenizing > 0  # the case re-tokenization gets wrong does occur here
