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
