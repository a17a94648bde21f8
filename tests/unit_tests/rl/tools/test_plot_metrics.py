"""tools/plot_metrics.py: EMA smoothing, the per-environment comparison, a title that clears the top panel."""
from __future__ import annotations

import json
import random

import pytest

from tools.plot_metrics import ema, env_panels, figure, main, run_info, run_title


def _ema_reference(points, weight):
    """Closed form, written another way: the value at t is the mean of the points, point i weighted by
    ``(1 - weight ** gap_i) * weight ** (t - it_i)`` (the first point's gap is infinite)."""
    out = []
    for k, (t, _) in enumerate(points):
        terms = [((1 - weight ** (it - points[i - 1][0])) if i else 1.0) * weight ** (t - it)
                 for i, (it, _) in enumerate(points[:k + 1])]
        out.append((t, sum(w * v for w, (_, v) in zip(terms, points)) / sum(terms)))
    return out


@pytest.mark.parametrize("weight", [0.0, 0.5, 0.9, 0.99])
def test_ema_matches_its_closed_form_with_gaps(weight):
    rng = random.Random(1)
    its = sorted(rng.sample(range(200), 40))
    points = [(it, rng.gauss(0, 1)) for it in its]
    got = ema(points, weight)
    for (a, x), (b, y) in zip(got, _ema_reference(points, weight)):
        assert a == b and x == pytest.approx(y, abs=1e-12)
    assert ema(points, 0.0) == points
    # debiased: a constant series stays that constant from the first point on
    assert all(v == pytest.approx(3.0) for _, v in ema([(i, 3.0) for i in range(0, 50, 5)], 0.9))


def test_ema_refuses_weights_outside_zero_one():
    with pytest.raises(SystemExit, match="--smooth"):
        ema([(1, 1.0)], 1.0)


def _series():
    out = {}
    for it in range(1, 41):
        out.setdefault("reward_mean", []).append((it, it / 40))
        for env, scale in (("arithmetic", 1.0), ("countdown", 0.2)):
            out.setdefault(f"env/{env}/reward_mean", []).append((it, scale * it / 40))
            out.setdefault(f"env/{env}/response_length_mean", []).append((it, 8.0 + it % 3))
        if it % 10 == 0:
            for env in ("arithmetic", "countdown", "math"):
                out.setdefault(f"eval/{env}/pass@1", []).append((it, it / 100))
    return out


def test_env_panels_put_each_environment_of_a_metric_in_one_panel():
    panels = env_panels(_series())
    assert [name for name, _ in panels] == ["reward_mean", "response_length_mean", "eval pass@1"]
    assert sorted(panels[0][1]) == ["arithmetic", "countdown"] and sorted(panels[2][1]) == ["arithmetic", "countdown",
                                                                                             "math"]


@pytest.mark.parametrize("envs", [False, True])
def test_title_clears_the_top_panel_with_many_panels(envs):
    metrics = None if envs else ["reward_mean", "env/*/reward_mean", "env/*/response_length_mean", "eval/*/pass@1"]
    fig = figure(_series(), metrics, title="a title", smooth=0.9, envs=envs)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    top = max(ax.get_tightbbox(renderer).y1 for ax in fig.axes)
    assert len(fig.axes) >= 3 and title.y0 >= top - 0.5, (title, top)
    smoothed = fig.axes[0].lines
    assert smoothed[0].get_alpha() == 0.25 and smoothed[1].get_alpha() is None  # raw faint, smoothed line solid
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_command_line_writes_one_png_comparing_the_environments(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    records = {}
    for name, points in _series().items():
        for it, v in points:
            records.setdefault(it, {"iteration": it})[name] = v
    path.write_text("".join(json.dumps(r) + "\n" for r in records.values()))
    out = tmp_path / "envs.png"
    assert main([str(path), "--envs", "--smooth", "0.8", "--out", str(out), "--title", "run"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no per-environment series"):
        main([str(path), "--envs", "--metrics", "kl_mean", "--out", str(out)])


def _texts(fig) -> list[str]:
    return [t.get_text() for t in fig.texts] + ([fig._supxlabel.get_text()] if fig._supxlabel else [])


@pytest.mark.parametrize("envs", [False, True])
def test_constant_metrics_are_one_line_of_text_not_panels(envs):
    import matplotlib.pyplot as plt

    series = _series()
    series["failed_rollouts"] = [(it, 0.0) for it in range(1, 41)]
    series["skipped_update"] = [(it, 0.0) for it in range(1, 41)]
    for env in ("arithmetic", "countdown"):
        series[f"env/{env}/failed_rollouts"] = [(it, 0.0) for it in range(1, 41)]
    metrics = None if envs else ["reward_mean", "failed_rollouts", "skipped_update", "env/*/response_length_mean"]
    fig = figure(series, metrics, envs=envs)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert "failed_rollouts" not in titles and "skipped_update" not in titles
    assert "reward_mean" in titles and len(titles) == 3, titles
    expected = "constant: failed_rollouts = 0" + ("" if envs else ", skipped_update = 0")
    assert expected in _texts(fig), _texts(fig)
    plt.close(fig)
    # every metric constant: they keep their panels (nothing else to draw)
    fig = figure(series, ["failed_rollouts", "skipped_update"])
    assert len(fig.axes) == 2 and not fig._supxlabel
    plt.close(fig)


def test_title_names_the_run_and_its_start_from_the_run_record(tmp_path):
    run = tmp_path / "my_run"
    run.mkdir()
    path = run / "metrics.jsonl"
    assert run_info(_write(path, [{"iteration": 1, "reward_mean": 0.5}])) == ("my_run", None)  # no run record
    _write(path, [{"iteration": 0, "run": {"name": "qs", "started": "2026-11-28T09:12:30+00:00"}},
                  {"iteration": 1, "reward_mean": 0.5},
                  {"iteration": 1, "run": {"name": "qs", "started": "2026-11-28T11:00:00+00:00"}},  # resumed
                  {"iteration": 2, "reward_mean": 0.7}])
    assert run_info(path) == ("qs", "2026-11-28 09:12 UTC")
    assert run_title("qs", "2026-11-28 09:12 UTC") == "run qs, started 2026-11-28 09:12 UTC"
    assert run_title("qs", None, "GRPO") == "GRPO\nrun qs"
    out = tmp_path / "m.png"
    assert main([str(path), "--metrics", "reward_mean", "--out", str(out)]) == 0 and out.stat().st_size > 0


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
