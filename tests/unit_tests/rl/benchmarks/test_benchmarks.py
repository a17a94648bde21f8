"""Smoke tests of the training benchmarks at toy size: each runs end to end and prints its table with the
expected rows; the numbers that do not depend on timing (packing efficiency, FLOP counts) are checked
against an independent computation. Timings are never asserted."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common as C  # noqa: E402
import training_packing  # noqa: E402


def run_bench(script: str, *args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def table_rows(text: str) -> dict[str, list[str]]:
    """First column -> the other cells, for every data row of the markdown tables in ``text``."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("|-"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_length_mix_is_seeded_and_fits():
    a = training_packing.sample_lengths(200, 512, seed=3)
    assert a == training_packing.sample_lengths(200, 512, seed=3)
    assert a != training_packing.sample_lengths(200, 512, seed=4)
    assert all(20 <= p <= 200 and r >= 1 and p + r <= 512 for p, r in a)
    responses = sorted(r for _, r in a)
    assert responses[len(a) // 2] < 0.5 * responses[-1]  # long-tailed: the median far below the longest


def test_without_device_mode_runs_a_peer_outside_this_threads_torch_function_modes_and_restores_them():
    import torch
    from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    outer, inner = Counting(), Counting()
    with outer, inner:
        torch.ones(2).sum()
        seen = Counting.calls
        assert seen >= 2
        with C.without_device_mode():
            torch.ones(2).sum()  # a peer's torch calls: no mode sees them
            assert not _get_current_function_mode_stack()
        assert Counting.calls == seen
        assert _get_current_function_mode_stack() == [outer, inner]
        torch.ones(2).sum()
        assert Counting.calls > seen


def test_training_flops_formula_and_matmul_params():
    # 6*N*T + 12*L*S*h*T, written out for N=1000, T=10, L=2, S=8, h=4
    assert C.training_flops(1000, 10, 2, 8, 4) == 6 * 1000 * 10 + 12 * 2 * 8 * 4 * 10
    table = "| a | b |\n|---|---|\n| x | 1 |"
    assert table_rows(table) == {"a": ["b"], "x": ["1"]}


@pytest.mark.slow  # runs the benchmark script end to end (~30-60 s of CPU): opt-in
def test_training_packing_table():
    args = ["--seq-length", "256", "--num-seqs", "16", "--hidden", "32", "--layers", "1", "--heads", "2",
            "--micro-batch-size", "2", "--response-median", "16", "--rounds", "1"]
    out = run_bench("training_packing.py", *args)
    rows = table_rows(out)
    assert {"packed", "packed, masked", "padded", "packed / padded"} <= set(rows)
    assert rows["packed, masked"][:3] == rows["packed"][:3]  # the same rows; only the attention differs
    # Efficiencies equal what the packing plan gives for the same seeded lengths, computed here directly.
    # Micro-batches are cropped to their rows (no pipeline parallelism): the positions are counted per
    # micro-batch as rows up to the last non-empty one x its longest row.
    from megatron.rl.sequence_packing_utils import distribute_bins, plan_packing

    lengths = [p + r for p, r in training_packing.sample_lengths(16, 256, 0, 16.0, 1.0)]
    for name, max_per_bin in (("packed", 16), ("padded", 1)):
        info = plan_packing(lengths, 256, max_per_bin)
        plan = distribute_bins(info.num_bins, 1, 2)
        rows_total = plan.num_microbatches * 2
        assert rows[name][0] == str(rows_total)
        slots = 0
        for mb in plan.assignment[0]:
            used = [sum(lengths[s] for s in info.bins[b]) for b in mb if b is not None]
            slots += len(used) * max(used)
        assert rows[name][2] == f"{100 * sum(lengths) / slots:.1f}%"
    assert int(rows["padded"][0]) == 16 > int(rows["packed"][0])
    for ratio_row in ("packed / padded", "packed / padded, per-round median",
                      "packed / packed masked, per-round median"):
        assert all(re.fullmatch(r"[0-9.]+x", c) for c in rows[ratio_row][5:7]), rows[ratio_row]


@pytest.mark.slow  # runs the benchmark script end to end (~30-60 s of CPU): opt-in
def test_mfu_table():
    out = run_bench("mfu.py", "--models", "toy", "--rounds", "1", "--matmul-size", "256")
    rows = table_rows(out)
    assert "matmul peak (fp32)" in rows
    (toy,) = [k for k in rows if k.startswith("toy:")]
    # toy: 2 layers, h=64, SwiGLU ffn f, no biases, padded vocab 384; matmul N per layer = qkv 3h^2 +
    # proj h^2 + fc1 2hf + fc2 fh, plus the output layer V*h.
    from megatron.rl.training.config import parse_args

    cfg = parse_args(C.model_flags(64, 2, 2, 64) + C.optim_flags(4, 4), world_size=1)
    h, f = 64, cfg.model.ffn_hidden_size
    n = 2 * (4 * h * h + 3 * h * f) + 384 * h
    assert rows[toy][0].endswith(f"{n / 1e6:.2f}M")
    assert rows[toy][2] == f"{C.training_flops(n, 4 * 64, 2, 64, 64) / 1e9:.2f}"
    assert rows[toy][5].endswith("%")


@pytest.mark.slow  # runs the benchmark script end to end (~30-60 s of CPU): opt-in
def test_grpo_step_table():
    out = run_bench("grpo_step.py", "--iters", "2", "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4",
                    "--hidden", "32", "--layers", "1", "--heads", "2", "--seq-length", "64",
                    "--micro-batch-size", "2")
    rows = table_rows(out)
    for phase in ("generate", "log-probs", "train", "other (gather, packing, metrics)", "total"):
        assert phase in rows, out
    parts = sum(float(rows[p][0]) for p in ("generate", "log-probs", "train", "other (gather, packing, metrics)"))
    assert parts == pytest.approx(float(rows["total"][0]), abs=2e-3)


def test_grpo_vs_trl_without_trl_skips_its_column(monkeypatch, capsys):
    import grpo_vs_trl

    monkeypatch.setattr(grpo_vs_trl, "trl_available", lambda: False)
    ran = []
    monkeypatch.setattr(grpo_vs_trl, "run_side", lambda side, *a: ran.append(side) or [
        {"total": 1.0, "cpu": 1.5, "generate": 0.5, "logprobs": 0.0, "train": 0.5, "packing_efficiency": 0.9}])
    results = grpo_vs_trl.run(grpo_vs_trl.parse(["--shapes", "tiny", "--rounds", "1", "--steps", "2"]))
    out = capsys.readouterr().out
    assert "TRL not installed" in out
    assert set(ran) == {"ours", "ours-padded"} and set(results["tiny"]) == set(ran)
    assert "| trl" not in out


def test_equal_work_accepts_token_counts_within_2_percent_only():
    from grpo_vs_trl import equal_work

    trl = {"generated_tokens": 2048.0, "trained_tokens": 2048.0}
    assert equal_work({"generated_tokens": 2048.0, "trained_tokens": 2048.0}, trl) is None
    assert equal_work({"generated_tokens": 2008.0, "trained_tokens": 2088.0}, trl) is None  # 1.95% both ways
    assert "generated_tokens 2000 vs 2048" in equal_work({"generated_tokens": 2000.0, "trained_tokens": 2048.0}, trl)
    assert "trained_tokens 512 vs 2048" in equal_work({"generated_tokens": 2048.0, "trained_tokens": 512.0}, trl)
    assert "not measured" in equal_work({"generated_tokens": 2048.0}, trl)


def test_grpo_vs_trl_prints_no_ratio_for_unequal_work(monkeypatch, capsys):
    import grpo_vs_trl

    monkeypatch.setattr(grpo_vs_trl, "trl_available", lambda: True)
    tokens = {"ours": 2048.0, "ours-padded": 512.0, "trl": 2048.0}  # ours-padded: a 16-token budget vs 64
    monkeypatch.setattr(grpo_vs_trl, "run_side", lambda side, *a: [
        {"total": 1.0, "cpu": 1.5, "generate": 0.5, "logprobs": 0.0, "train": 0.5,
         "generated_tokens": tokens[side], "trained_tokens": tokens[side]}])
    grpo_vs_trl.run(grpo_vs_trl.parse(["--shapes", "tiny", "--rounds", "1", "--steps", "2"]))
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert rows["ours"][9] == "1.00x" and rows["ours"][4] == "2048", rows
    assert rows["ours-padded"][9] == "unequal work" and rows["ours-padded"][11] == "unequal work", rows
    assert "no ratio to TRL for ours-padded: generated_tokens 512 vs 2048" in out


def test_grpo_vs_trl_pairs_each_round_with_trls_run_next_to_it(monkeypatch, capsys):
    """The machine slows by 2x in round 2: the medians over all steps mix the rounds, the paired ratios do not."""
    import grpo_vs_trl

    monkeypatch.setattr(grpo_vs_trl, "trl_available", lambda: True)
    calls = {"ours": 0, "trl": 0}
    per_round = {"ours": [1.0, 2.0, 1.0], "trl": [1.2, 2.2, 1.3]}

    def run_side(side, *a):
        total = per_round[side][calls[side]]
        calls[side] += 1
        return [{"total": total, "cpu": total, "generate": total / 2, "logprobs": 0.0, "train": total / 2,
                 "generated_tokens": 2048.0, "trained_tokens": 2048.0}]

    monkeypatch.setattr(grpo_vs_trl, "run_side", run_side)
    grpo_vs_trl.run(grpo_vs_trl.parse(["--shapes", "tiny", "--sides", "ours", "trl", "--rounds", "3",
                                       "--steps", "2"]))
    out = capsys.readouterr().out
    assert ("paired by round, ours: TRL s/step / this median 1.20x (range 1.10-1.30); this generate / TRL's "
            "median 0.83x (range 0.77-0.91); 3 rounds") in out, out


@pytest.mark.parametrize("shape", ["small", "large", "long"])
def test_grpo_vs_trl_ours_runs_the_default_layout_and_ours_padded_the_old_one(shape, tmp_path):
    """``ours`` passes no layout flag, so it measures the default: rows of one group, all in one micro-batch, as
    the hand-set ``ours-packed`` recipe it was chosen from; ``ours-padded`` pins one rollout per row."""
    import grpo_vs_trl

    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.training.config import parse_args

    s = grpo_vs_trl.shape_of(shape)
    layouts = {}
    for side in ("ours", "ours-padded", "ours-packed"):
        argv = grpo_vs_trl.our_argv(s, 2, side, env_config=grpo_vs_trl.equal_work_env_config(tmp_path))
        assert ("--rl-layout" in argv) == (side == "ours-padded")
        layouts[side] = rl_config_from_args(parse_args(argv, extra_args_providers=[add_rl_args],
                                                       world_size=1)).training_layout
    ours, padded, recipe = layouts["ours"], layouts["ours-padded"], layouts["ours-packed"]
    assert ours.packed and ours.shares_prompts and ours.microbatch_rows >= s.prompts  # one micro-batch of groups
    assert ours.row_length >= recipe.row_length  # at least the recipe's row: a whole group fits
    assert not padded.packed and padded.microbatch_rows == s.prompts * s.group_size


def test_grpo_vs_trl_forces_the_token_budget_of_both_sides():
    import yaml
    from grpo_vs_trl import equal_work_env_config

    from megatron.rl.agent.env_config import build_agent_from_config

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = equal_work_env_config(tmp)
        args = yaml.safe_load(path.read_text())["environments"][0]["args"]
        agent = build_agent_from_config(path).training_entries[0].agent
    assert args["max_tokens"] is None and args["stop"] == []
    assert agent.max_tokens is None and agent.stop == []  # the budget follows --rl-max-new-tokens, no stop string


def test_grpo_vs_trl_long_shape_puts_one_fixed_block_before_every_prompt_of_both_sides(monkeypatch):
    import grpo_vs_trl

    from megatron.rl.environments.arithmetic import ArithmeticAgent

    monkeypatch.setattr(ArithmeticAgent, "make_prompt", ArithmeticAgent.make_prompt)  # restored afterwards
    shape = grpo_vs_trl.shape_of("long", 16)
    assert shape.group_size == 16 and shape.preamble_chars == 512 and grpo_vs_trl.shape_of("long").group_size == 8
    block = grpo_vs_trl.long_prompt_block(shape.preamble_chars)
    assert len(block) == len(block.encode()) == 512  # bytes: 512 tokens of the byte tokenizer
    plain, _ = grpo_vs_trl.agent_problems(2)
    grpo_vs_trl.add_prompt_block(shape.preamble_chars)
    problems, _ = grpo_vs_trl.agent_problems(2)  # TRL's dataset; our agent asks the same make_prompt
    assert [p["prompt"] for p in problems] == [block + p["prompt"] for p in plain]
    # a packed row holds the whole group: the prompt once, then every rollout's completion and one more token
    row = grpo_vs_trl.group_row_length(shape, 16 + shape.preamble_chars)
    assert row % 32 == 0 and row >= len(problems[0]["prompt"]) + 16 * (shape.new_tokens + 1)
    assert shape.seq_length >= len(problems[0]["prompt"]) + shape.new_tokens  # unpacked rows fit too


@pytest.mark.slow
def test_grpo_vs_trl_table():
    import grpo_vs_trl

    out = run_bench("grpo_vs_trl.py", "--shapes", "tiny", "--rounds", "1", "--steps", "2",
                    "--sides", "ours", "ours-packed", "trl", "ours-fixed")
    rows = table_rows(out)
    assert {"ours", "ours-packed", "ours-fixed"} <= set(rows), out
    rollout_tokens = str(grpo_vs_trl.SHAPES["tiny"].prompts * grpo_vs_trl.SHAPES["tiny"].group_size
                         * grpo_vs_trl.SHAPES["tiny"].new_tokens)
    for side in ("ours", "ours-packed", "ours-fixed"):  # every rollout ran to the budget
        assert rows[side][4] == rows[side][5] == rollout_tokens, rows
    if grpo_vs_trl.trl_available():
        assert rows["trl"][4] == rows["trl"][5] == rollout_tokens, rows
        assert re.fullmatch(r"[0-9.]+x", rows["ours"][9]), rows
    else:
        assert "TRL not installed" in out
    # cropped micro-batches compute fewer positions than [micro-batch, seq-length] ones
    assert float(rows["ours"][7]) > float(rows["ours-fixed"][7])
    assert float(rows["ours"][2]) < 0.05 * float(rows["ours-fixed"][2]) + 1e-3  # no scoring pass
    assert float(rows["ours-packed"][8]) > 0.1 and rows["ours"][8] in ("0.00", "-")  # prompts computed once per row


def test_async_rollouts_every_batch_has_the_same_long_tail_lengths():
    import async_rollouts

    batches = [[async_rollouts.answer_budget(i, 16) for i in range(16 * k, 16 * k + 16)] for k in range(20)]
    assert all(sorted(b) == sorted(batches[0]) for b in batches)  # the same work in every iteration
    assert len({tuple(b) for b in batches}) > 1  # in different orders
    lengths = sorted(batches[0])
    assert lengths[0] == 4 and lengths[-1] == 256 and lengths[8] <= 10  # answers of 4-256 tokens, a long tail
    lighter = sorted(async_rollouts.answer_budget(i, 16, alpha=1.0) for i in range(16))
    assert lighter[0] == 4 and lighter[-1] == 128  # alpha 1: a lighter tail, up to 128 tokens


@pytest.mark.slow
def test_async_rollouts_benchmark_runs_and_prints_its_table():
    out = run_bench("async_rollouts.py", "--iters", "2", "--prompts", "4", "--group-size", "2",
                    "--settings", "synchronous", "lag 1 + partial")
    rows = table_rows(out)
    assert set(rows) >= {"synchronous", "lag 1 + partial"}
    assert rows["synchronous"][1] == "1.00x" and rows["synchronous"][3] == "1.00x"
    assert rows["synchronous"][7] == "0.00"  # no staleness when synchronous


@pytest.mark.slow  # runs the benchmark script end to end (~30-60 s of CPU): opt-in
def test_decode_step_table():
    out = run_bench("decode_step.py", "--rows", "4", "--new-tokens", "4", "--rounds", "2")
    rows = table_rows(out)
    # 4 new tokens: megatron times at most the 3 decode steps after the first (prefill) step (fewer when the engine
    # admitted the requests over two steps), HF the 2 after its second logits call; both rounds count
    assert 1 <= int(rows["megatron"][0]) <= 6 and rows["huggingface"][0] == "4", out
    assert "megatron / huggingface" in out


@pytest.mark.slow  # runs the benchmark script end to end: opt-in
def test_decode_step_paired_table():
    out = run_bench("decode_step.py", "--rows", "4", "--new-tokens", "6", "--rounds", "2", "--paired")
    rows = table_rows(out)
    # 6 new tokens: our steps 1-5 decode (fewer at 4 rows when admission took two steps), each paired with an HF step
    for r in ("1", "2"):
        steps, ours, hf, ratio = rows[r]
        assert 1 <= int(steps) <= 5 and float(ours) > 0 and float(hf) > 0, out
        assert float(ratio) > 0, out
    assert "ours / HF per step: median" in out
