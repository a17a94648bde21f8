"""`python -m megatron.rl.server.inference --backend megatron`: named errors before any model is built.

(Serving a real checkpoint end to end: tests/unit_tests/rl/tools/test_checkpoint_alone.py, slow.)
"""
import pytest

from megatron.rl.inference.api import InferenceError


def test_megatron_backend_without_a_checkpoint_says_how_to_name_one():
    from megatron.rl.server.inference.__main__ import build_backend

    # a named error, not "missing 2 required positional arguments: 'model' and 'tokenizer'"
    with pytest.raises(InferenceError, match="-- --load CKPT_DIR"):
        build_backend("megatron", {}, [])
    with pytest.raises(InferenceError, match="--load CKPT_DIR"):
        build_backend("megatron", {}, ["--num-layers", "2"])


def test_megatron_backend_refuses_several_processes(monkeypatch, tmp_path):
    from megatron.rl.inference.megatron_checkpoint import megatron_backend_from_cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InferenceError, match="WORLD_SIZE=2"):
        megatron_backend_from_cli(["--load", str(tmp_path)])


def test_megatron_backend_on_a_directory_without_a_checkpoint(tmp_path):
    from megatron.rl.inference.megatron_checkpoint import megatron_backend_from_cli

    with pytest.raises(InferenceError, match="--use-checkpoint-args.*no latest_checkpointed_iteration.txt"):
        megatron_backend_from_cli(["--load", str(tmp_path)])


def test_megatron_backend_checks_the_engine_flags_before_loading(tmp_path):
    """The engine's flags are served flags too: a bad value is named before the checkpoint is read."""
    from megatron.rl.inference.megatron_checkpoint import megatron_backend_from_cli

    model = ["--load", str(tmp_path), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
    with pytest.raises(InferenceError, match="--inference-dynamic-batching-max-requests=0: must be >= 1"):
        megatron_backend_from_cli([*model, "--inference-dynamic-batching-max-requests", "0"])
    with pytest.raises(InferenceError, match="--cuda-graph-impl transformer_engine: not supported"):
        megatron_backend_from_cli([*model, "--cuda-graph-impl", "transformer_engine"])
