"""tools/show_samples.py and the pattern support of tools/plot_metrics.py on a metrics JSONL file."""
import json

import pytest

from tools.plot_metrics import expand_metrics, read_jsonl
from tools.show_samples import main, read_samples


@pytest.fixture
def jsonl(tmp_path):
    p = tmp_path / "m.jsonl"
    sample = {"env": "a", "problem_id": "p1", "reward": 0.0, "status": "ok", "failure_reason": None,
              "response_tokens": 8, "turns": 1, "finish_reasons": ["length"], "prompt": "Q: 1+1=?",
              "completion": " " * 8}
    lines = [{"iteration": 1, "reward_mean": 0.5, "env/a/reward_mean": 0.0, "env/b/reward_mean": 1.0},
             {"iteration": 1, "samples": [sample, {**sample, "env": "b", "reward": 1.0, "completion": "2"}]},
             {"iteration": 2, "reward_mean": 0.25, "env/a/reward_mean": 0.5, "env/b/reward_mean": 0.0},
             {"iteration": 2, "samples": [{**sample, "status": "failed", "failure_reason": "scoring failed: boom",
                                           "turns": 3}]}]
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def test_read_samples_and_print_them_with_visible_whitespace(jsonl, capsys):
    assert sorted(read_samples(jsonl)) == [1, 2]
    main([str(jsonl), "--iteration", "1", "--env", "a"])
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "iteration 1 | a | problem p1 | reward 0 | ok | 8 tokens | finish length"
    assert "  completion: '        '" in out and "env b" not in out
    main([str(jsonl)])  # default: the last iteration
    out = capsys.readouterr().out
    assert "iteration 2 |" in out and "3 turns" in out and "failure:    scoring failed: boom" in out
    main([str(jsonl), "--last", "2"])
    assert capsys.readouterr().out.count("\n\niteration ") == 2  # three samples
    with pytest.raises(SystemExit, match="no samples for iteration 7"):
        main([str(jsonl), "--iteration", "7"])


def test_plot_patterns_pick_every_environment(jsonl):
    series = read_jsonl(jsonl)  # the samples lines carry no numbers and are skipped
    assert series["env/a/reward_mean"] == [(1, 0.0), (2, 0.5)] and "samples" not in series
    assert expand_metrics(["reward_mean", "env/*/reward_mean"], list(series)) == [
        "reward_mean", "env/a/reward_mean", "env/b/reward_mean"]
