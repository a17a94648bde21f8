"""The quickstart's console: whole iteration lines, and a failed stage names its error (not torchrun's report)."""
import sys

import pytest

from examples.rl.quickstart import Eta, Phases, console_line, first_error, main, pretrain, run, thread_changes

PRETRAIN_LINE = ("[2026-11-22 17:00:00] [rank 0] INFO megatron.rl.training.loop:  iteration      575/     600 | "
                 "consumed samples:        18400 | elapsed time per iteration (ms): 101.3 | learning rate: 3.123E-04 | "
                 "global batch size:    32 | lm loss: 1.234567E+00 | grad norm: 0.812 | tokens/s: 20211 | "
                 "number of skipped iterations:   0 |\n")

TORCHRUN_FAILURE = """[2026-11-22 17:00:00] [rank 0] INFO megatron.rl.training.initialize: initialised megatron
train_rl.py: error: CheckpointError: vocabulary mismatch loading /ck: the checkpoint was saved with padded vocab 384
E1122 17:00:01.000000 1 torch/distributed/elastic/multiprocessing/api.py:900] failed (exitcode: 2) local_rank: 0
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Root Cause (first observed failure):
  traceback : train_rl.py: error: CheckpointError: vocabulary mismatch loading /ck: the checkpoint was saved
============================================================
"""


def test_iteration_lines_are_kept_whole():
    assert len(PRETRAIN_LINE) > 200
    assert console_line(PRETRAIN_LINE) == PRETRAIN_LINE.rstrip()  # the iteration number survives
    assert console_line("[..] INFO megatron.rl.rl_loop:  evaluation at iteration 10 | pass@1: 0.5 | 1.0s") is not None
    assert console_line("[..] WARNING megatron.rl.observe.warnings: iteration 3: possible training problem:") is not None
    assert console_line("[..] INFO megatron.rl.training.checkpoint.save_load: saved checkpoint /x") is None


def test_first_error_prefers_the_one_line_report_over_torchruns():
    lines = TORCHRUN_FAILURE.splitlines(keepends=True)
    assert first_error(lines) == ("train_rl.py: error: CheckpointError: vocabulary mismatch loading /ck: the "
                                  "checkpoint was saved with padded vocab 384")
    crash = ["Traceback (most recent call last):\n", '  File "x.py", line 1\n', "ZeroDivisionError: division by zero\n"]
    assert first_error(crash) == "ZeroDivisionError: division by zero"
    assert first_error(["all good\n"]) is None


def test_a_failed_stage_names_its_error(tmp_path, capsys):
    cmd = [sys.executable, "-c", "import sys; print('x.py: error: ConfigError: --foo=1: bad', file=sys.stderr); "
                                 "sys.exit(2)"]
    with pytest.raises(SystemExit) as e:
        run(cmd, tmp_path / "logs" / "stage.log")
    assert str(e.value).startswith("stage failed (exit 2): x.py: error: ConfigError: --foo=1: bad\nfull log: ")
    assert "x.py: error: ConfigError" in capsys.readouterr().out  # echoed as it happened, too


def test_iteration_lines_say_how_long_is_left():
    eta = Eta()
    line = PRETRAIN_LINE.rstrip()
    assert eta.prefix("[..] INFO x: saved checkpoint", now=0.0) == ""
    assert eta.prefix(line.replace("575/", "25/"), now=10.0) == "[25/600] "  # no rate yet
    # 25 iterations in 5 s since the first line seen: 0.2 s each, 25 left -> 5 s
    assert eta.prefix(line.replace("575/", "50/"), now=15.0) == "[50/600, ~1:50 left] "
    assert eta.prefix(line, now=120.0) == "[575/600, ~0:05 left] "


def test_phases_say_what_runs_what_is_skipped_and_how_long_it_took(tmp_path, capsys):
    """A rerun that finds the corpus and the pretrained checkpoint says it reuses them (and pretrains nothing)."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "arithmetic.jsonl").write_text("{}\n")
    (tmp_path / "pretrain").mkdir()
    (tmp_path / "pretrain" / "latest_checkpointed_iteration.txt").write_text("600")
    phases = Phases(4, start=0.0)
    assert pretrain(tmp_path, nproc=1, gpu=False, phases=phases) == tmp_path / "pretrain"
    out = capsys.readouterr().out
    assert f"[1/4] corpus: skipped, {tmp_path / 'data' / 'arithmetic.jsonl'} exists" in out
    assert (f"[2/4] pretraining: skipped, reusing the pretrained checkpoint {tmp_path / 'pretrain'} (iteration 600; "
            "delete the directory to pretrain again)") in out
    phases.begin("GRPO", "200 iterations", "about 1:10-3:30 on 2 idle CPU cores")
    phases.end()
    out = capsys.readouterr().out
    assert "=== [3/4] GRPO: 200 iterations; about 1:10-3:30 on 2 idle CPU cores (" in out and " elapsed) ===" in out
    assert "GRPO done in 0:00 (" in out


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "(default: 600)" in out and "(default: 200)" in out and "(default: 5e-4)" in out


def test_a_thread_count_that_changed_is_reported_once_at_the_end():
    assert thread_changes([]) is None and thread_changes([(1, 2.0), (2, 2.0)]) is None
    line = thread_changes([(3, 1.0), (1, 2.0), (2, 2.0), (4, 1.0), (5, 2.0)])
    assert line.startswith("CPU threads changed during RL (2 -> 1 -> 2)") and "--cpu-threads N" in line
    assert console_line("[..] INFO megatron.rl.runtime.cpu_threads: CPU threads: 2 -> 1 (other processes kept "
                        "0.9 of 2 usable cores busy)") is not None
