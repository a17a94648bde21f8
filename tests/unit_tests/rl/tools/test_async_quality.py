"""tools/async_quality.py: the side-by-side pass@1 table and the reading of a run's metrics (no training)."""
import json

import pytest

from tools.async_quality import VARIANTS, curve_table, last_three_mean, mean_curve, read_metrics, with_seed


def test_table_rows_and_differences_to_the_synchronous_run():
    curves = {"sync": {0: 0.4, 10: 0.5, 20: 0.6, 30: 0.7}, "lag1": {0: 0.4, 10: 0.45, 20: 0.62, 30: 0.61}}
    lines = curve_table(curves)
    assert lines[0].split() == ["iter", "sync", "lag1", "lag1-sync"]
    assert lines[2].split() == ["10", "0.500", "0.450", "-0.050"]
    # last row: mean of the last three evaluations (10, 20, 30) and its difference
    assert lines[-1].split() == ["last3", "0.600", "0.560", "-0.040"]


def test_missing_evaluations_show_as_dashes():
    lines = curve_table({"sync": {0: 0.4, 10: 0.5}, "lag1": {0: 0.4}})
    assert lines[2].split() == ["10", "0.500", "-", "-"]


def test_mean_over_seeds_uses_the_iterations_every_seed_evaluated():
    assert mean_curve([{0: 0.2, 10: 0.4}, {0: 0.4, 10: 0.6, 20: 0.9}]) == {0: pytest.approx(0.3), 10: pytest.approx(0.5)}
    assert last_three_mean({0: 0.1, 10: 0.2, 20: 0.3, 30: 0.7}) == pytest.approx(0.4)


def test_seed_is_replaced_and_variants_differ_only_in_async_flags():
    assert with_seed(["--x", "1", "--seed", "1"], 5) == ["--x", "1", "--seed", "5"]
    assert with_seed(["--x", "1"], 5) == ["--x", "1", "--seed", "5"]
    assert VARIANTS["sync"] == [] and all(f.startswith("--rl-") for v in VARIANTS.values() for f in v if f[:2] == "--")


def test_read_metrics_splits_evaluations_from_iterations(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"iteration": 0, "eval/pass@1": 0.3}, {"iteration": 1, "reward_mean": 0.2, "staleness_mean": 1.0},
            {"iteration": 1, "samples": []}, {"iteration": 10, "eval/pass@1": 0.5}]
    path.write_text("\n".join(map(json.dumps, rows)) + "\n")
    evals, train = read_metrics(path)
    assert evals == {0: 0.3, 10: 0.5} and list(train) == [1] and train[1]["staleness_mean"] == 1.0
    assert read_metrics(tmp_path / "missing.jsonl") == ({}, {})
