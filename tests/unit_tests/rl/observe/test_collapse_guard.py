"""The collapse guard (--rl-env-collapse-action): when it acts, what it changes in the mixture, and, through the
real CLI on a tiny model, a run it stops with a checkpoint that resumes."""
import json
import sys
from collections import Counter

import pytest

from megatron.rl.agent.env_config import build_agent_from_config
from megatron.rl.base.errors import ConfigError
from megatron.rl.observe.findings import Finding
from megatron.rl.observe.guard import CollapseGuard, apply_guard_actions, check_guard_target
from tests.conftest import REPO_ROOT


def collapse(env, share=1.0):
    return Finding(f"answer_collapse/{env}", share, 0.8, "m")


def test_the_guard_acts_after_patience_consecutive_iterations_and_counts_again():
    g = CollapseGuard("stop", patience=3)
    seen = {it: [(a.kind, a.env) for a in g.update(f, it)] for it, f in enumerate(
        [[collapse("a")], [collapse("a")], [], [collapse("a")], [collapse("a"), collapse("b")], [collapse("a")],
         [collapse("a"), collapse("mixture")], [collapse("a")], [collapse("a")]], 1)}
    # a healthy iteration (3) resets; the mixture-wide finding never acts; after acting the count starts again
    assert seen == {1: [], 2: [], 3: [], 4: [], 5: [], 6: [("stop", "a")], 7: [], 8: [], 9: [("stop", "a")]}
    assert CollapseGuard("off", patience=1).update([collapse("a")], 1) == []
    [a] = CollapseGuard("stop", patience=1).update([collapse("short", 0.95)], 70)
    assert "'short'" in a.reason and "95%" in a.reason and "iteration 70" in a.reason and "\n" not in a.reason
    assert "--rl-env-collapse-action stop" in a.reason
    with pytest.raises(ValueError, match="choose one of"):
        CollapseGuard("pause", 1)


def mixture():
    return build_agent_from_config([{"type": "arithmetic", "name": "arith", "weight": 3},
                                    {"type": "arithmetic", "name": "short", "weight": 1}], seed=1)


def test_downweight_lowers_the_environments_share_of_groups_and_is_checkpointed():
    agent = mixture()
    before = agent.allocation(64)
    [action] = CollapseGuard("downweight", patience=1).update([collapse("short")], 5)
    metrics, stop = apply_guard_actions([action], agent, factor=0.5)
    assert stop is None and metrics == {"guard/weight/short": 0.5}
    after = agent.allocation(64)
    assert before == {"arith": 48, "short": 16} and after["short"] < before["short"] and sum(after.values()) == 64
    apply_guard_actions([action], agent, factor=0.5)
    assert [e.weight for e in agent.entries] == [3.0, 0.25]
    resumed = mixture()
    resumed.load_state_dict(json.loads(json.dumps(agent.state_dict())))
    assert [e.weight for e in resumed.entries] == [3.0, 0.25] and resumed.allocation(64) == agent.allocation(64)
    with pytest.raises(ValueError, match="no training environment 'nope'"):
        agent.scale_weight("nope", 0.5)


def test_stop_returns_the_one_line_reason():
    [action] = CollapseGuard("stop", patience=1).update([collapse("short")], 5)
    metrics, stop = apply_guard_actions([action], mixture(), factor=0.5)
    assert metrics == {"guard/stop": 1.0} and stop == action.reason


def test_downweight_needs_a_mixture():
    check_guard_target("downweight", mixture())
    check_guard_target("stop", build_agent_from_config([{"type": "arithmetic"}], seed=1))
    with pytest.raises(ConfigError, match="--rl-env-collapse-action downweight needs a mixture"):
        check_guard_target("downweight", build_agent_from_config([{"type": "arithmetic"}], seed=1))


AGENTS = "tests.unit_tests.rl.rl_test_agents"
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "8", "--global-batch-size", "32",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "11", "--grpo-prompts-per-step", "8",
         "--grpo-group-size", "4", "--rl-max-new-tokens", "4", "--log-interval", "1", "--langrl-allow-imports",
         "--rl-prompts-per-eval", "0", "--rl-warn-env-window", "1"]


def test_a_stopped_run_saves_a_checkpoint_that_resumes(tmp_path):
    """Through train_rl.main on a tiny random model: one environment of a 3:1 mixture records a constant answer
    from the first iteration. With --rl-env-collapse-action stop and patience 2 the run stops after iteration 2
    of 6 (exit status 3), saved; the same command with the guard off resumes from that checkpoint. With
    downweight, the collapsed environment's weight halves (recorded as guard/weight/<env>) and it gets fewer of the
    next step's groups."""
    import subprocess

    env = tmp_path / "env.yaml"
    env.write_text(f'environments: [{{type: "{AGENTS}:HashReward", name: hash, weight: 3}},'
                   f' {{type: "{AGENTS}:ConstantAnswer", name: const, weight: 1}}]\n')
    ckpt, jsonl = tmp_path / "ckpt", tmp_path / "m.jsonl"
    common = [*FLAGS, "--langrl-env-config", str(env), "--save", str(ckpt), "--load", str(ckpt),
              "--save-interval", "100", "--rl-metrics-jsonl", str(jsonl)]
    cases = {"stop": [*common, "--train-iters", "6", "--rl-env-collapse-action", "stop",
                      "--rl-env-collapse-patience", "2"],
             "resume": [*common, "--train-iters", "3"],
             "down": [*FLAGS, "--langrl-env-config", str(env), "--train-iters", "2", "--rl-env-collapse-action",
                      "downweight", "--rl-env-collapse-patience", "1", "--rl-metrics-jsonl", str(tmp_path / "d.jsonl")]}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tests/unit_tests/rl/scripts/rl_cli_cases.py"),
                           str(tmp_path / "cases.json"), str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=500, env={**__import__("os").environ, "OMP_NUM_THREADS": "1",
                                            "PYTHONPATH": str(REPO_ROOT)})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    results = json.loads(out.read_text())
    assert results["stop"] == {"ok": True, "rc": 3}, (results, log[-4000:])
    assert results["resume"] == {"ok": True, "rc": 0} and results["down"] == {"ok": True, "rc": 0}, results
    reason = next(line for line in log.splitlines() if "stopped at iteration 2:" in line)
    assert "environment 'const' collapsed" in reason and f"resume with --load {ckpt}" in reason
    assert "answer_collapse/const" not in reason and "'7'" in log  # the warning before it quotes the answer
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    its = [r for r in records if "reward_mean" in r]
    assert [r["iteration"] for r in its] == [1, 2, 3], "stopped after 2, resumed for the 3rd"
    assert its[1]["guard/stop"] == 1.0 and its[0]["warn/answer_collapse/const"] == 1.0
    assert "warn/answer_collapse/hash" not in its[0]
    down = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    its = [r for r in down if "reward_mean" in r]
    # iteration 1: 2 of the 8 groups (3:1), collapsed: the weight halves; iteration 2: 1 group (3:0.5), too few
    # rollouts for the window of 1 iteration to judge, so no second action
    assert [r["env/const/groups"] for r in its] == [2.0, 1.0]
    assert its[0]["guard/weight/const"] == 0.5 and "guard/weight/const" not in its[1]
    assert Counter(r["iteration"] for r in down if "reward_mean" in r) == {1: 1, 2: 1}
