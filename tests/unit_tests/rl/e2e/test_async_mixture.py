"""Asynchronous rollouts on a two-environment mixture end where synchronous training ends.

The quickstart's pretrained model and recipe on its arithmetic task mixed 3:1 with a subtraction environment it
never saw (``subtraction_agents.py``, imported as a user's own module), trained synchronously and with the README's
recommended asynchronous setting (lag 1, partial rollouts, group-wise submission and consumption). Held-out pass@1
of each environment at the end (mean of the last three evaluations, 4 samples per prompt) must not fall more than
0.05 below the synchronous run's.

What it guards: the whole asynchronous path on a mixture (G submission serving a weighted mixture one group at
a time, G consumption, partial rollouts across updates, the version and log-prob bookkeeping, the off-policy
correction) against the synchronous one. Importance weights taken against the wrong policy collapse the mixture
to pass@1 0 within 20 iterations. The difference between the trust-region correction (the asynchronous default)
and truncated IS alone is smaller than this bound over 60 iterations of one seed; it shows over 200 iterations
and two seeds (docs/benchmarks.md).

Partial rollouts pause at points that depend on timing, so the asynchronous trajectory is not reproducible bit for
bit; four samples per prompt and the mean of three evaluations keep the evaluation noise well inside the bound.
"""
import sys

import pytest

from tests.conftest import REPO_ROOT

ITERS = 60
EVAL = ["--eval-interval", "10", "--rl-eval-samples", "4", "--rl-eval-pass-at-k", "1"]


@pytest.mark.slow
def test_asynchronous_mixture_ends_within_0_05_of_synchronous(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO_ROOT / "examples" / "rl"))
    sys.path.insert(0, str(REPO_ROOT))
    import quickstart
    from tools.async_quality import VARIANTS, last_three_mean, read_metrics, run_variant

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    pre_ckpt = quickstart.pretrain(tmp_path / "qs", nproc=1, gpu=False)
    metrics = {name: run_variant(quickstart, name, VARIANTS[name] + EVAL, seed=1, pre_ckpt=pre_ckpt, out=tmp_path,
                                 iters=ITERS, nproc=1, mixture=True)
               for name in ("sync", "lag1_partial_GG")}
    ends = {env: tuple(last_three_mean(read_metrics(metrics[n], f"eval/{env}/pass@1")[0]) for n in metrics)
            for env in ("arith", "sub")}
    _, train = read_metrics(metrics["lag1_partial_GG"])
    assert max(r["staleness_max"] for r in train.values()) == 1.0  # it did train on stale tokens
    # the mixture's share held under G consumption: 1 group in 4 (up to the groups still in flight at the end)
    assert abs(sum(r.get("env/sub/groups", 0) for r in train.values()) - 4 * ITERS) <= 2
    assert all(lagged >= sync - 0.05 for sync, lagged in ends.values()), ends
