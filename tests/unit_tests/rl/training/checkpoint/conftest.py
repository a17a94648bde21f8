"""Fixtures for checkpoint tests: a 1-process gloo group with megatron parallel state (TP=PP=1)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # ckpt_tiny_model, shared with scripts/

import ckpt_tiny_model as tiny  # noqa: E402


@pytest.fixture(scope="module")
def dist1():
    """torch.distributed with one process and megatron parallel state for TP=PP=1."""
    from megatron.core import parallel_state as ps

    created = not torch.distributed.is_initialized()
    tiny.init_single_process()
    if torch.distributed.get_world_size() != 1:
        pytest.skip("needs a 1-process group")
    tiny.set_layout()
    yield tiny
    ps.destroy_model_parallel()
    if created:
        torch.distributed.destroy_process_group()
