"""--rl-metrics-jsonl lines are strict JSON: non-finite values become null."""
import json
import math

from megatron.rl.rl_loop import metrics_json_line


def test_non_finite_values_are_written_as_null_and_the_rest_round_trips():
    record = {"iteration": 3, "reward_mean": float("nan"), "grad_norm": float("inf"), "rl_loss": -0.25,
              "failed_rollouts": 64.0, "note": "x"}
    line = metrics_json_line(record)
    assert line.endswith("\n") and line.count("\n") == 1
    parsed = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))  # strict reader
    assert parsed == {"iteration": 3, "reward_mean": None, "grad_norm": None, "rl_loss": -0.25,
                      "failed_rollouts": 64.0, "note": "x"}
    assert not any(isinstance(v, float) and not math.isfinite(v) for v in parsed.values())
