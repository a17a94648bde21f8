"""The converted model's generation_config.json: end-of-document id, and the stop strings of a run's one
environment (none with several, or without a recorded environment config)."""
from __future__ import annotations

from tools.checkpoint_conversion.generation_config import environment_stop_strings, generation_config


def _flags(path) -> dict:
    return {"flags": {"langrl_env_config": str(path)}, "sha256": {}}


def test_one_environment_gives_its_stop_strings(tmp_path):
    env = tmp_path / "env.yaml"
    env.write_text("environments:\n  - type: countdown\n    weight: 1\n  - type: arithmetic\n    weight: 1\n"
                   "    evaluation_only: true\n")
    assert environment_stop_strings(_flags(env)) == (["\n"], "countdown has no stop strings")
    env.write_text('environments:\n  - type: arithmetic\n    args: {stop: ["</answer>", "\\n\\n"]}\n')
    assert environment_stop_strings(_flags(env))[0] == ["</answer>", "\n\n"]


def test_no_stop_strings_say_why(tmp_path):
    env = tmp_path / "env.yaml"
    env.write_text("environments:\n  - {type: countdown, weight: 1}\n  - {type: arithmetic, weight: 3}\n")
    stop, why = environment_stop_strings(_flags(env))
    assert stop == [] and why == "the run trained on 2 environments (countdown, arithmetic)"
    assert environment_stop_strings(None)[0] == [] and "records no environment config" in environment_stop_strings(
        None)[1]
    assert "no longer exists" in environment_stop_strings(_flags(tmp_path / "gone.yaml"))[1]


def test_generation_config_keeps_the_originals_values_and_adds_what_is_missing():
    assert generation_config({}, 256, 257, ["\n"]) == {"eos_token_id": 256, "pad_token_id": 257,
                                                        "stop_strings": ["\n"], "_from_model_config": False}
    original = {"eos_token_id": [1, 2], "temperature": 0.7, "stop_strings": ["\n"]}
    assert generation_config(original, 256, None, ["\n", "END"]) == {
        "eos_token_id": [1, 2], "temperature": 0.7, "stop_strings": ["\n", "END"], "_from_model_config": False}
    assert "stop_strings" not in generation_config({}, 0, None, [])
