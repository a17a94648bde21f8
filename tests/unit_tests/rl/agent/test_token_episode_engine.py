"""Token-in/token-out on the in-process megatron-core engine with a BPE tokenizer: a multi-turn episode's trained
tokens are exactly the tokens the engine generated, although re-tokenizing their text would change them;
per-token masks cover exactly the generated tokens and the log-probs equal a teacher-forced forward. Once with
TokenEpisode driven by hand (no environment library), once as an OpenEnv episode through type: openenv."""
import asyncio

import pytest
import torch

from megatron.rl.agent.api import GroupedRolloutRequest
from megatron.rl.agent.env_config import build_agent_from_config
from megatron.rl.inference.api import GenerationArgs

pytestmark = pytest.mark.slow
pytest.importorskip("transformers", reason="the BPE tokenizer needs transformers")


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


def _check_episode(model, tokenizer, token_ids, generation_mask, logprobs, prompt_length, turns) -> int:
    """Trained tokens == the engine's generated tokens turn by turn; returns how many turns' tokens differ from the
    tokenizer's own tokenization of their text (what re-tokenizing the history would have trained on)."""
    from tests.unit_tests.rl.inference.scripts.megatron_common import teacher_forced_logprobs

    assert token_ids == turns[-1].token_ids and prompt_length == turns[0].prompt_length
    generated = [i for resp in turns for i in range(resp.prompt_length, len(resp.token_ids))]
    assert [i for i, m in enumerate(generation_mask) if m] == generated
    assert [token_ids[i] for i in generated] == [t for resp in turns for t in resp.token_ids[resp.prompt_length:]]
    ref = teacher_forced_logprobs(model, token_ids, 1, 1.0)
    torch.testing.assert_close(torch.tensor([logprobs[i] for i in generated]),
                               torch.stack([ref[i - 1] for i in generated]).float(), atol=1e-5, rtol=0)
    return sum(tokenizer.tokenize(tokenizer.detokenize(r.token_ids[r.prompt_length:])) != r.token_ids[r.prompt_length:]
               for r in turns)


def test_token_episode_on_the_engine(engine):
    from megatron.rl.agent.token_episode import TokenEpisode

    model, tokenizer, backend = engine
    changed = 0
    for seed in range(3):
        episode, turns = TokenEpisode(), []
        for turn, text in enumerate(["The quick brown", "\nfox says:", "\nand then:"]):
            ga = GenerationArgs(temperature=1.0, max_tokens=5, seed=seed * 10 + turn)
            [resp] = asyncio.run(backend.agenerate([episode.next_request(text, ga)]))
            assert resp.finish_reason != "error", resp.error
            episode.add(resp)
            turns.append(resp)
        changed += _check_episode(model, tokenizer, episode.token_ids, episode.generation_mask, episode.logprobs,
                                  episode.prompt_length, turns)
    assert changed > 0  # the case re-tokenization gets wrong does occur here


def test_openenv_episode_on_the_engine(engine):
    pytest.importorskip("openenv.core.env_server.interfaces", reason="openenv-core is not installed")
    from tests.unit_tests.rl.environments.test_openenv_env import ENV, Recording

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
    changed = 0
    for r in rollouts:  # this rollout's turns: the responses whose tokens it starts with
        turns = sorted((resp for resp in responses if resp.token_ids == r.token_ids[:len(resp.token_ids)]),
                       key=lambda resp: len(resp.token_ids))
        assert len(turns) == 3
        changed += _check_episode(model, tokenizer, r.token_ids, r.generation_mask, r.logprobs, r.prompt_length,
                                  turns)
    assert changed > 0
