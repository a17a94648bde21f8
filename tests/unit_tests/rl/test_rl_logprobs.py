"""megatron.rl.rl_loss.vocab_parallel_logprobs and vocab_parallel_entropy (vocab-parallel log-probs and entropy at a temperature) vs full-vocabulary log_softmax."""
from __future__ import annotations

import json

import pytest

from megatron.rl.algorithms.logprobs import logprob_temperature as effective_temperature
from tests.conftest import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests/unit_tests/rl/scripts/rl_logprobs_check.py"


def test_effective_temperature():
    assert effective_temperature(0) == 1.0
    assert effective_temperature(0.0) == 1.0
    assert effective_temperature(0.7) == 0.7


@pytest.mark.multiprocess
def test_token_logprobs_and_entropy_tp2_and_tp1_match_log_softmax():
    proc = run_torchrun(SCRIPT, nproc=2, timeout=300)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("OK "))
    worst = json.loads(line[3:])
    assert len(worst) == 2 * 3 * 3  # TP in {2, 1} x T in {1, 0.7, 0} x {lp, entropy, grad}
    assert max(worst.values()) < 1e-5, worst
