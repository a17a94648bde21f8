"""The Megatron backend with tensor parallelism (TP=2, two processes over gloo)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "megatron_tp2_generate.py"


@pytest.mark.multiprocess
def test_tp2_logprobs_match_teacher_forced_and_ranks_agree():
    proc = run_torchrun(SCRIPT, timeout=300)
    assert proc.stdout.count("TP2 OK") == 2, proc.stdout[-4000:]
