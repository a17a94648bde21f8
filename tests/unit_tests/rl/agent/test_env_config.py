"""YAML environment configs: parsing, group allocation, every error case, and a user-defined agent end to end."""
import asyncio
import json
import random
import subprocess
import sys
import textwrap
from fractions import Fraction

import pytest

from megatron.rl.agent.api import GroupedRolloutRequest
from megatron.rl.agent.env_config import EnvConfigError, build_agent_from_config, load_env_config
from megatron.rl.agent.weighted_multi_task import WeightedMultiTaskAgent, allocate_groups, next_carry
from megatron.rl.inference.api import GenerationArgs
from megatron.rl.inference.fake import FakeInference
from tests.conftest import REPO_ROOT

CONFIGS = REPO_ROOT / "examples" / "rl" / "environment_configs"


def _write(tmp_path, text, name="env.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


# -- allocation ----------------------------------------------------------------------------------------------
def hamilton(total, weights):
    """Reference largest-remainder apportionment in exact rationals (no minimum)."""
    quotas = [Fraction(total) * Fraction(w).limit_denominator(10**6) / sum(
        Fraction(x).limit_denominator(10**6) for x in weights) for w in weights]
    alloc = [q.numerator // q.denominator for q in quotas]
    rest = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - alloc[i]), i))
    for i in rest[:total - sum(alloc)]:
        alloc[i] += 1
    return alloc


@pytest.mark.parametrize("total, weights, expected", [
    (8, [3, 1], [6, 2]), (10, [9, 1], [9, 1]), (4, [1, 1, 1], [2, 1, 1]), (3, [100, 1, 1], [1, 1, 1]),
    (3, [0, 1], [0, 3]), (7, [0.5, 0.25, 0.25], [3, 2, 2]), (5, [1], [5]), (2, [1000, 1], [1, 1]),
])
def test_allocation_examples(total, weights, expected):
    assert allocate_groups(total, weights) == expected


def test_allocation_properties_against_reference():
    rng = random.Random(0)
    for _ in range(500):
        weights = [rng.choice([0, 0.5, 1, 2, 3, 7.5]) for _ in range(rng.randint(1, 5))]
        if sum(weights) == 0:
            continue
        positive = sum(w > 0 for w in weights)
        total = rng.randint(positive, 40)
        alloc = allocate_groups(total, weights)
        assert sum(alloc) == total
        assert all((a >= 1) if w > 0 else a == 0 for a, w in zip(alloc, weights))
        ref = hamilton(total, weights)
        if all(r >= 1 for r, w in zip(ref, weights) if w > 0):
            assert alloc == ref  # the minimum-one rule did not bind: plain largest remainder


@pytest.mark.parametrize("total, weights, match", [
    (4, [1, -1], "finite and >= 0"), (4, [0, 0], "sum to 0"), (1, [1, 1], "at least one group"),
    (4, [float("nan")], "finite"),
])
def test_allocation_errors(total, weights, match):
    with pytest.raises(ValueError, match=match):
        allocate_groups(total, weights)


def _run_steps(total, weights, steps):
    carry, history = None, []
    for _ in range(steps):
        alloc = allocate_groups(total, weights, carry)
        carry = next_carry(total, weights, carry, alloc)
        history.append(alloc)
    return history


def test_carried_rounding_makes_the_mix_follow_the_weights_over_steps():
    assert _run_steps(16, [1, 1, 1], 3) == [[6, 5, 5], [5, 6, 5], [5, 5, 6]]  # not [6, 5, 5] three times
    rng = random.Random(1)
    for _ in range(200):
        weights = [rng.choice([0, 0.5, 1, 2, 3, 7.5]) for _ in range(rng.randint(1, 5))]
        if sum(weights) == 0:
            continue
        positive = sum(w > 0 for w in weights)
        total, steps = rng.randint(max(positive, 1), 40), rng.randint(1, 30)
        history = _run_steps(total, weights, steps)
        for alloc in history:
            assert sum(alloc) == total
            assert all((a >= 1) if w > 0 else a == 0 for a, w in zip(alloc, weights))
        got = [sum(col) for col in zip(*history)]
        quota = [Fraction(total * steps) * Fraction(w) / sum(map(Fraction, weights)) for w in weights]
        if all(q / steps >= 1 for q, w in zip(quota, weights) if w > 0):  # the at-least-one rule never binds
            assert all(abs(g - q) < 1 for g, q in zip(got, quota)), (weights, total, steps, got, quota)


def test_tiny_weights_keep_one_group_and_the_carry_stays_bounded():
    history = _run_steps(4, [100, 1], 50)
    assert all(a == [3, 1] for a in history)
    carry = None
    for alloc in history:
        carry = next_carry(4, [100, 1], carry, alloc)
        assert all(-1 <= c <= 1 for c in carry)


def test_multi_task_agent_carries_its_allocation_across_steps_and_checkpoints():
    agent = build_agent_from_config(CONFIGS / "multi_task.yaml", seed=5)  # arithmetic 3 : countdown 1
    request = GroupedRolloutRequest(num_groups=6, rollouts_per_group=1, inference_interface=FakeInference(),
                                    generation_args=GenerationArgs(max_tokens=2, seed=1))

    def step(a):
        out = asyncio.run(a.generate_grouped_rollouts(request))
        return sum(g.env_id == "countdown" for g in out.groups)

    assert [step(agent) for _ in range(3)] == [1, 2, 1]  # quota 1.5 countdown groups a step (ties: first entry)
    fresh = build_agent_from_config(CONFIGS / "multi_task.yaml", seed=5)
    fresh.load_state_dict(json.loads(json.dumps(agent.state_dict())))  # the carry survives a checkpoint
    assert [step(fresh) for _ in range(2)] == [step(agent) for _ in range(2)] == [2, 1]  # a fresh carry: [1, 2]


# -- parsing -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["arithmetic.yaml", "countdown.yaml", "math.yaml", "calculator.yaml",
                                  "multi_task.yaml"])
def test_shipped_configs_build(name):
    agent = build_agent_from_config(CONFIGS / name)
    assert isinstance(agent, WeightedMultiTaskAgent) and agent.entries


def test_multi_task_config_allocation_and_rollouts():
    agent = build_agent_from_config(CONFIGS / "multi_task.yaml", seed=5)
    assert [(e.name, e.weight, e.evaluation_only) for e in agent.entries] == \
        [("arithmetic", 3.0, False), ("countdown", 1.0, False), ("math", 1.0, True)]
    assert agent.allocation(8) == {"arithmetic": 6, "countdown": 2}
    out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=8, rollouts_per_group=2, inference_interface=FakeInference(),
        generation_args=GenerationArgs(max_tokens=4, seed=1))))
    assert [g.env_id for g in out.groups] == ["arithmetic"] * 6 + ["countdown"] * 2
    assert all(r.env_id == g.env_id for g in out.groups for r in g.rollouts)
    state = agent.state_dict()
    assert state["agents"]["arithmetic"]["train_stream"]["consumed_global"] == 6
    fresh = build_agent_from_config(CONFIGS / "multi_task.yaml", seed=5)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    # the whole multi-task agent round-trips through JSON (what the environment server relies on)
    clone = WeightedMultiTaskAgent.model_validate_json(agent.model_dump_json())
    assert [type(e.agent) for e in clone.entries] == [type(e.agent) for e in agent.entries]


def test_plain_list_form_names_and_relative_paths(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "qa.jsonl").write_text('{"q": "1+1?", "a": "2"}\n{"q": "2+2?", "a": "4"}\n')
    p = _write(tmp_path, """
        - type: huggingface_dataset
          args: {data_path: data/qa.jsonl, prompt_field: q, answer_field: a}
        - type: arithmetic
        - type: arithmetic
          weight: 2
        """)
    entries = load_env_config(p)
    assert [e.name for e in entries] == ["huggingface_dataset", "arithmetic_1", "arithmetic_2"]
    assert entries[0].agent.data_path == str(tmp_path / "data" / "qa.jsonl")
    assert entries[0].agent.get_problem(1, False)["prompt"] == "2+2?"


@pytest.mark.parametrize("text, pieces", [
    ("environments:\n  - type: arithmetic\n    args: {max_digits: 2\n", ["env.yaml:", "invalid YAML"]),
    ("- type: no_such_env\n", ["environments[0]", "key 'type'", "unknown Agent type 'no_such_env'",
                               "registered types:", "arithmetic", "countdown"]),
    ("- type: arithmetic\n  weight: -1\n", ["environments[0]", "key 'weight'", "-1"]),
    ("- type: arithmetic\n  weight: 0\n- type: countdown\n  weight: 0\n", ["key 'weight'", "sum to 0"]),
    ("- type: arithmetic\n- type: huggingface_dataset\n  args: {data_path: missing.jsonl}\n",
     ["environments[1]", "key 'args'", "data_path", "missing.jsonl", "does not exist"]),
    ("- type: arithmetic\n  wieght: 2\n", ["environments[0]", "unknown key(s) ['wieght']"]),
    ("- type: arithmetic\n  args: {max_digitz: 3}\n", ["environments[0]", "key 'args'", "max_digitz"]),
    ("- type: arithmetic\n  args: {max_digits: many}\n", ["key 'args'", "max_digits"]),
    ("- type: arithmetic\n  evaluation_only: true\n", ["evaluation_only"]),
    ("- type: arithmetic\n  name: a\n- type: countdown\n  name: a\n", ["environments[1]", "key 'name'", "unique"]),
    ("- args: {}\n", ["environments[0]", "key 'type' is required"]),
    ("- type: megatron.os:system\n", ["import path", "allow_imports"]),
    ("imports: [os]\nenvironments: [{type: arithmetic}]\n", ["key 'imports'", "allow_imports"]),
    ("[]\n", ["non-empty list"]),
    ("environment: []\n", ["unknown top-level key"]),
])
def test_config_errors_name_file_entry_and_key(tmp_path, text, pieces):
    p = _write(tmp_path, text)
    with pytest.raises(EnvConfigError) as info:
        load_env_config(p)
    msg = str(info.value)
    assert str(p) in msg
    for piece in pieces:
        assert piece in msg, msg


def test_malformed_yaml_reports_line_and_column(tmp_path):
    p = _write(tmp_path, "environments:\n  - type: arithmetic\n    args: {max_digits: 2\n")
    with pytest.raises(EnvConfigError, match=r"env\.yaml:4:1: invalid YAML"):
        load_env_config(p)
    with pytest.raises(EnvConfigError, match="does not exist"):
        load_env_config(tmp_path / "nope.yaml")


def test_import_path_type_with_allow_flag(tmp_path):
    p = _write(tmp_path, "- type: tests.unit_tests.rl.agent.user_agents_fixture:ReverseWordAgent\n")
    entries = load_env_config(p, allow_imports=True)
    assert entries[0].name == "ReverseWordAgent" and type(entries[0].agent).__name__ == "ReverseWordAgent"
    p = _write(tmp_path, "- type: json:JSONDecoder\n", "bad.yaml")
    with pytest.raises(EnvConfigError, match="not an Agent subclass"):
        load_env_config(p, allow_imports=True)


def test_user_defined_agent_end_to_end_in_a_fresh_process(tmp_path):
    """The README walkthrough: a decorator-registered agent in the user's module, named in YAML, trained on."""
    cfg = _write(tmp_path, """
        imports: [tests.unit_tests.rl.agent.user_agents_fixture]
        environments:
          - type: reverse_word
            weight: 1
          - type: arithmetic
            weight: 1
        """)
    script = textwrap.dedent(f"""
        import asyncio, json
        from megatron.rl.agent import Agent, GroupedRolloutRequest, build_agent_from_config
        from megatron.rl.inference import GenerationArgs, build_inference_interface
        assert "reverse_word" not in Agent._type_registry  # only the YAML's imports register it
        agent = build_agent_from_config({str(cfg)!r}, allow_imports=True)
        out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
            num_groups=4, rollouts_per_group=2, inference_interface=build_inference_interface("fake"),
            generation_args=GenerationArgs(max_tokens=6, seed=0))))
        print(json.dumps([[g.env_id, g.problem_id, g.rollouts[0].prompt] for g in out.groups]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    groups = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [g[0] for g in groups] == ["reverse_word"] * 2 + ["arithmetic"] * 2
    assert all(g[2] == f"Reverse {g[1]}:" for g in groups[:2])


def test_cli_flags_provider():
    import argparse

    from megatron.rl.agent.env_config import DEFAULT_ENV_CONFIG, add_env_config_args

    parser = add_env_config_args(argparse.ArgumentParser())
    ns = parser.parse_args([])
    assert ns.langrl_env_config == DEFAULT_ENV_CONFIG and ns.langrl_allow_imports is False
    assert (REPO_ROOT / DEFAULT_ENV_CONFIG).is_file()
    ns = parser.parse_args(["--langrl-env-config", "x.yaml", "--langrl-allow-imports"])
    assert ns.langrl_env_config == "x.yaml" and ns.langrl_allow_imports


# -- hostile YAML ---------------------------------------------------------------------------------------------
_BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"]
                  + [f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]"
                     for p, c in zip("abcdefgh", "bcdefghi")]
                  + ["environments:", "  - type: arithmetic", "    args: {max_digits: *i}"]) + "\n"


def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    import time

    assert len(_BOMB) < 600  # 9**9 = 387 million values once expanded
    p = _write(tmp_path, _BOMB)
    t = time.perf_counter()
    with pytest.raises(EnvConfigError, match=r"env\.yaml:2:\d+: invalid YAML: alias \*a is not allowed") as info:
        load_env_config(p)
    assert time.perf_counter() - t < 5.0 and len(str(info.value)) < 500


def test_any_alias_is_refused_and_long_values_are_shortened(tmp_path):
    p = _write(tmp_path, "base: &w 2\nenvironments:\n  - type: arithmetic\n    weight: *w\n")
    with pytest.raises(EnvConfigError, match=r"alias \*w"):
        load_env_config(p)
    long_list = "[" + ", ".join(["1"] * 5000) + "]"
    with pytest.raises(EnvConfigError, match="key 'args' must be a mapping") as info:
        load_env_config(_write(tmp_path, f"- type: arithmetic\n  args: {long_list}\n"))
    assert len(str(info.value)) < 500
    with pytest.raises(EnvConfigError, match="key 'weight'") as info:
        load_env_config(_write(tmp_path, f"- type: arithmetic\n  weight: '{'9' * 10000}'\n"))
    assert len(str(info.value)) < 500 and "without quotes" in str(info.value)


@pytest.mark.parametrize("text, value", [("1e-3", 1e-3), ("2E2", 200.0), ("+1e0", 1.0), ("0.5", 0.5), ("3", 3)])
def test_yaml_exponent_floats_are_numbers(tmp_path, text, value):
    p = _write(tmp_path, f"- type: arithmetic\n  weight: {text}\n- type: countdown\n")
    assert load_env_config(p)[0].weight == value
