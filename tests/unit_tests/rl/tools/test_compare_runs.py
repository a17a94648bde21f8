"""tools/compare_runs.py: two runs' metrics compared value by value, timings left out, thread changes named."""
import json

from tools.compare_runs import compare, load, main


def _run(tmp_path, name, threads=(2, 2, 2), grad_norm=1.25, completion="4", extra=()):
    lines = [{"iteration": 0, "run": {"name": name, "started": "2026-11-29T12:00:00+00:00"}},
             {"iteration": 0, "eval/pass@1": 0.25}]
    for it, count in enumerate(threads, 1):
        lines.append({"iteration": it, "reward_mean": 0.5, "grad_norm": grad_norm if it == 2 else 1.0,
                      "time_total_s": 0.1 * it + len(name), "generation_tokens_per_s": 100.0 + len(name),
                      "engine_steps_total": 10.0 * it + len(name), "cpu_threads": float(count)})
        lines.append({"iteration": it, "samples": [{"env": "a", "completion": completion if it == 3 else "2"}]})
    lines += list(extra)
    path = tmp_path / name / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_identical_runs_agree_whatever_their_timings(tmp_path, capsys):
    first, second = _run(tmp_path, "a"), _run(tmp_path, "bb")
    assert main([str(first), str(second.parent)]) == 0
    out = capsys.readouterr().out
    # per training record: reward_mean and grad_norm (3 x 2), and the evaluation's pass@1
    assert out.startswith("7 values compared, 0 differ; 3 sample records compared, 0 differ"), out
    assert "CPU threads" not in out


def test_a_changed_value_and_a_changed_completion_are_named(tmp_path, capsys):
    first, second = _run(tmp_path, "a"), _run(tmp_path, "b", grad_norm=1.2500001, completion="5")
    assert main([str(first), str(second)]) == 1
    out = capsys.readouterr().out
    assert "1 differ" in out and "iteration 2 training grad_norm: 1.25 vs 1.2500001" in out, out
    assert "sample completions differ from iteration 3 on" in out


def test_a_thread_change_is_named_as_the_likely_cause(tmp_path, capsys):
    first, second = _run(tmp_path, "a"), _run(tmp_path, "b", threads=(2, 1, 2), grad_norm=1.5)
    assert main([str(first), str(second)]) == 1
    out = capsys.readouterr().out
    assert "CPU threads (first: 2; second: 2 -> 1 -> 2)" in out and "--cpu-threads N" in out, out
    c = compare(load(first), load(_run(tmp_path, "c", threads=(1, 1, 1))))
    assert c.threads == {"first": [2], "second": [1]} and not c.differ  # a fixed other count: said, not a change


def test_runs_of_other_iterations_and_missing_files(tmp_path, capsys):
    first = _run(tmp_path, "a")
    longer = _run(tmp_path, "b", extra=[{"iteration": 4, "reward_mean": 0.5}])
    assert main([str(first), str(longer)]) == 2
    assert "only in the second run: training 4 (1)" in capsys.readouterr().out
    assert main([str(first), str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such file" in capsys.readouterr().err
