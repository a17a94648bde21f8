"""GRPO end to end through the real train_rl.py CLI on the environment adapters and model-based rewards.

* A locally trained tiny reward model that prefers digits is the only reward (type: model_reward around the
  digits_please prompts, rule weight 0): its score rises under GRPO.
* reasoning-gym's basic_arithmetic from the quickstart's pretrained arithmetic model (built here by the
  quickstart's own stages): held-out pass@1 rises by >= 0.08 (the spread measured: at the assertion). The task
  config matches what that model can read: two single-digit operands, '+', no parentheses or negation
  (reasoning-gym draws operands from 0..10), shown in the quickstart's prompt format through prompt_template /
  prompt_replacements; the reward is reasoning-gym's own score_answer.
"""
import statistics
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.unit_tests.rl.e2e.test_reward_rises import _records, run_tiny_grpo

pytestmark = pytest.mark.slow

REASONING_GYM_ENV = """environments:
  - type: reasoning_gym
    args:
      task: basic_arithmetic
      config: {min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1, operators: ["+"],
               allow_parentheses: false, allow_negation: false}
      prompt_template: "Q: {metadata[expression]}=? A:"
      prompt_replacements: {" ": ""}
      answer_format: number
      stop: ["\\n"]
      max_tokens: 8
      validation_size: 200
"""
RL_ITERS = 160


def test_reward_model_score_rises_under_grpo(tmp_path):
    pytest.importorskip("transformers", reason="the reward model needs transformers (pip install 'megatron-rl[hf]')")
    from tests.unit_tests.rl.agent.tiny_reward_model import build_digit_reward_model

    rm = build_digit_reward_model(tmp_path / "rm", steps=200)
    env = tmp_path / "env.yaml"
    env.write_text("imports: [digit_agents]\nenvironments:\n  - type: model_reward\n    name: rm_digits\n"
                   "    args:\n      env: {type: digits_please}\n      rule_weight: 0.0\n"
                   f"      reward_model: {{path: '{rm}', template: '{{completion}}', batch_size: 32}}\n")
    metrics = tmp_path / "metrics.jsonl"
    run_tiny_grpo(env, metrics)
    records = [r for r in _records(metrics) if "reward_mean" in r]
    scores = [r["env/rm_digits/reward/reward_model"] for r in records]
    assert len(scores) == 12 and all(r["env/rm_digits/failed_rollouts"] == 0 for r in records)
    first, last = statistics.fmean(scores[:3]), statistics.fmean(scores[-3:])
    assert last > first + 0.2, f"the reward model's score did not rise: {scores}"


def test_reasoning_gym_pass_at_1_rises_from_the_quickstart_model(tmp_path):
    pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install 'megatron-rl[envs]')")
    sys.path.insert(0, str(REPO_ROOT / "examples" / "rl"))
    import quickstart as qs

    pre = qs.pretrain(tmp_path, nproc=1, gpu=False)
    env = tmp_path / "reasoning_gym.yaml"
    env.write_text(REASONING_GYM_ENV)
    metrics = tmp_path / "metrics.jsonl"
    qs.run([sys.executable, str(REPO_ROOT / "train_rl.py"), *qs.model_flags(False),
            *qs.rl_flags(pre, tmp_path / "rl", env, metrics, tmp_path / "tb", nproc=1, iters=RL_ITERS)],
           tmp_path / "logs" / "train_rl.log")
    evals = [(r["iteration"], r["eval/pass@1"]) for r in _records(metrics) if "eval/pass@1" in r]
    # The gain moves with the seed and with the machine type (their float differences give another pretrained
    # model and another RL trajectory): seeds 1-4 gained 0.230, 0.217, 0.153, 0.165 on a 2-core Intel Xeon
    # without AMX (avx512_vnni) and 0.153, 0.097, 0.160, 0.130 on an AMD EPYC with AVX2 and no AVX-512; seed 1
    # gained 0.118 on an Intel Xeon with AMX and 0.20 on the machine this test was written on. 0.08 holds
    # below all of them, and still fails a run that learns nothing (about 0 +- 0.04).
    assert qs.final_pass_at_1(evals) - evals[0][1] >= 0.08, evals
