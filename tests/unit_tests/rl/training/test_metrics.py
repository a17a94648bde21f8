"""The metrics JSONL file (strict JSON; rewritten on resume, never duplicating iterations) and text to TensorBoard."""
import json
import math

import pytest

from megatron.rl.training.metrics import MetricsJsonl, MetricsWriter, metrics_json_line, truncate_metrics_jsonl


def test_non_finite_values_are_written_as_null_and_the_rest_round_trips():
    record = {"iteration": 3, "reward_mean": float("nan"), "grad_norm": float("inf"), "rl_loss": -0.25,
              "failed_rollouts": 64.0, "note": "x"}
    line = metrics_json_line(record)
    assert line.endswith("\n") and line.count("\n") == 1
    parsed = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # strict reader
    assert parsed == {"iteration": 3, "reward_mean": None, "grad_norm": None, "rl_loss": -0.25,
                      "failed_rollouts": 64.0, "note": "x"}
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in parsed.values())


def _attempt(path, start, stop, resume_from, torn=False):
    """What one run attempt writes: an evaluation at its start when fresh, then per iteration a training
    record, a samples record and (every 2) an evaluation; ``torn``: killed in the middle of a line."""
    out = MetricsJsonl(path, resume_from)
    if resume_from == 0:
        out.write({"iteration": 0, "eval/pass@1": 0.0, "attempt": start})
    for it in range(start + 1, stop + 1):
        out.write({"iteration": it, "reward_mean": it / 10, "attempt": start})
        out.write({"iteration": it, "samples": [{"completion": " " * 8}]})
        if it % 2 == 0:
            out.write({"iteration": it, "eval/pass@1": it / 10, "attempt": start})
    if torn:
        with path.open("a") as f:
            f.write('{"iteration": %d, "reward_' % (stop + 1))
    return out


def _training_iterations(path):
    return [r["iteration"] for r in map(json.loads, path.read_text().splitlines()) if "reward_mean" in r]


def test_resume_drops_what_the_failed_attempt_wrote_past_the_checkpoint(tmp_path):
    path = tmp_path / "sub" / "m.jsonl"
    _attempt(path, 0, 5, 0, torn=True)  # died during iteration 6; its last checkpoint was iteration 3
    _attempt(path, 3, 8, 3)  # the resumed attempt
    lines = [json.loads(line) for line in path.read_text().splitlines()]  # every line parses: torn one gone
    assert _training_iterations(path) == list(range(1, 9))  # no iteration twice
    by_it = {r["iteration"]: r["attempt"] for r in lines if "reward_mean" in r}
    assert by_it == {1: 0, 2: 0, 3: 0, 4: 3, 5: 3, 6: 3, 7: 3, 8: 3}
    assert [r["iteration"] for r in lines if "eval/pass@1" in r] == [0, 2, 4, 6, 8]
    assert [r["iteration"] for r in lines if "samples" in r] == list(range(1, 9))
    # the first attempt's file is kept aside, torn line and all
    prev = (tmp_path / "sub" / "m.jsonl.prev").read_text()
    assert prev.count('"reward_mean"') == 5 and prev.endswith('"reward_')


def test_fresh_start_replaces_the_file_and_a_clean_file_is_left_alone(tmp_path):
    path = tmp_path / "m.jsonl"
    _attempt(path, 0, 4, 0)
    before = path.read_text()
    assert truncate_metrics_jsonl(path, 4) == (before.count("\n"), 0)  # resuming at its end: nothing to drop
    assert path.read_text() == before and not (tmp_path / "m.jsonl.prev").exists()
    _attempt(path, 0, 2, 0)  # a new run from scratch into the same file: only its own lines
    assert _training_iterations(path) == [1, 2]
    assert sum(1 for r in map(json.loads, path.read_text().splitlines()) if r["iteration"] == 0) == 1
    assert truncate_metrics_jsonl(tmp_path / "missing.jsonl", 3) == (0, 0)


def test_tensorboard_gets_text_and_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(tensorboard_dir=str(tmp_path))
    w.log_scalars({"env/a/reward_mean": 0.5, "skip": float("nan")}, 3)
    w.log_text("rl/samples", "**1. a** reward 0\n\n```\n        \n```", 3)
    w.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("env/a/reward_mean")] == [(3, 0.5)]
    assert "skip" not in acc.Tags()["scalars"]
    [event] = acc.Tensors("rl/samples/text_summary")
    assert event.step == 3 and b"```\n        \n```" in event.tensor_proto.string_val[0]
