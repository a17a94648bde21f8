"""examples/rl/model_configs/*.sh: the recommended inference layout (INFERENCE_ARGS) passes our checks on 8 GPUs."""
from __future__ import annotations

import pytest

from megatron.rl.rl_config import add_rl_args, rl_config_from_args
from megatron.rl.training.config import parse_args
from tests.unit_tests.rl.examples.test_model_configs import NAMES, bash_array

RL = ["--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "64", "--train-iters", "1",
      "--lr", "1e-6", "--bf16", "--grpo-prompts-per-step", "8", "--grpo-group-size", "8"]


@pytest.mark.parametrize("name", NAMES)
def test_recommended_inference_layout_is_valid_on_8_gpus(name, tmp_path, monkeypatch):
    monkeypatch.setattr("megatron.rl.runtime.cuda_usable", lambda: True)  # the configs are for GPUs
    env = tmp_path / "env.yaml"
    env.write_text("environments: [{type: arithmetic, weight: 1}]\n")
    inference_args = [f for f in bash_array(name, "INFERENCE_ARGS") if f]  # an empty array prints one ""
    args = [*bash_array(name, "MODEL_ARGS"), *bash_array(name, "PARALLEL_ARGS"), *inference_args, *RL,
            "--langrl-env-config", str(env)]
    rl = rl_config_from_args(parse_args(args, extra_args_providers=[add_rl_args], world_size=8))
    train_tp = int(bash_array(name, "PARALLEL_ARGS")[1])
    layout = rl.inference_layout
    # a copy exactly when the trainer's TP is above 1, and then with a smaller TP
    assert layout.enabled == (train_tp > 1)
    if layout.enabled:
        assert layout.tensor_model_parallel_size < train_tp
