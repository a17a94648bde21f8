"""train_rl.py end to end through the real CLI: metrics, train-inference gap, bad input, exact resume, SIGKILL.

The policy is a tiny random GPT; the HashReward agent (rl_test_agents.py) gives rewards that vary between
samples, so losses and gradients are non-zero from the first iteration. CPU fp32, in-process Megatron
inference, sequence packing on, two optimizer steps per iteration (16 rollouts, --global-batch-size 8).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

AGENTS = "tests.unit_tests.rl.rl_test_agents"
CASES_SCRIPT = REPO_ROOT / "tests/unit_tests/rl/scripts/rl_cli_cases.py"
N_ITERS = 3
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--train-iters", str(N_ITERS), "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "11",
         "--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--rl-max-new-tokens", "8",
         "--rl-use-sequence-packing", "--grpo-entropy-term-weight", "0.001", "--log-interval", "1",
         "--langrl-allow-imports"]
# Determined by the sampled tokens and the training math: must match bit for bit after a resume.
COMPARED = ("reward_mean", "rl_loss", "grad_norm", "clip_fraction_low", "entropy_mean",
            "ratio_mean", "response_length_mean", "num_sequences")
# Read the engine's own log-probs, whose last bits depend on how requests happened to be batched (timing):
# the same to ~1e-8, not bit for bit. Sampling is per-request seeded, so tokens do not depend on it.
COMPARED_APPROX = ("logprob_gap_mean", "logprob_gap_max")


def _env(tmp: Path, agent: str, name: str = "env.yaml", extra: str = "") -> Path:
    p = tmp / name
    p.write_text(f'environments: [{{type: "{AGENTS}:{agent}", weight: 1}}{extra}]\n')
    return p


def _cmd(env: Path, *extra) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "train_rl.py"), *FLAGS, "--langrl-env-config", str(env),
            *map(str, extra)]


def _proc_env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def _run(cmd, timeout=400) -> str:
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_proc_env(), capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-6000:]}"
    return out


def _records(path: Path) -> dict[int, dict]:
    """Training records by iteration (evaluation records are the ones with eval/ keys)."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "reward_mean" in rec:
            assert rec["iteration"] not in out, f"iteration {rec['iteration']} logged twice in {path}"
            out[rec["iteration"]] = rec
    return out


def _assert_same_metrics(resumed: dict[int, dict], full: dict[int, dict], iterations):
    for it in iterations:
        for key in COMPARED:
            assert resumed[it][key] == full[it][key], (it, key, resumed[it][key], full[it][key])
        for key in COMPARED_APPROX:
            assert resumed[it][key] == pytest.approx(full[it][key], abs=1e-6), (it, key)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted run: 3 iterations, evaluation at 0, 2, 3, a checkpoint after every iteration."""
    tmp = tmp_path_factory.mktemp("rl_e2e")
    env = _env(tmp, "HashReward")
    metrics, ckpt = tmp / "full.jsonl", tmp / "ckpt_full"
    start = time.perf_counter()
    log = _run(_cmd(env, "--rl-metrics-jsonl", metrics, "--save", ckpt, "--save-interval", "1",
                    "--eval-interval", "2", "--rl-prompts-per-eval", "8"))
    return {"tmp": tmp, "env": env, "log": log, "metrics": metrics, "ckpt": ckpt,
            "records": _records(metrics), "seconds": time.perf_counter() - start}


def test_train_rl_end_to_end(full_run):
    log, recs = full_run["log"], full_run["records"]
    for it in range(1, N_ITERS + 1):
        # the default short line: reward, loss, gap, seconds (HashReward's evaluations report no pass@1)
        assert re.search(rf"INFO megatron.rl.rl_loop: iteration {it}/{N_ITERS} \| reward [0-9.e-]+±[0-9.e-]+ \| "
                         rf"loss [0-9.e-]+ \| gap [0-9.e-]+ \| [0-9.e+]+s$", log, re.M), log[-3000:]
    assert len(re.findall(r"evaluation at iteration (\d+)", log)) == 3
    assert sorted(recs) == [1, 2, 3]
    required = ("reward_mean", "reward_std", "rl_loss", "grad_norm", "logprob_gap_mean", "logprob_gap_max",
                "packing_efficiency", "response_length_mean", "clip_fraction_low", "clip_fraction_high",
                "generation_tokens_per_s", "train_tokens_per_s", "time_generate_s", "time_logprobs_s",
                "time_train_s", "optimizer_steps", "num_sequences")
    for it, rec in recs.items():
        missing = [k for k in required if k not in rec]
        assert not missing, (it, missing)
        # the trainer scores exactly what the in-process backend sampled (same weights, same temperature)
        assert rec["logprob_gap_max"] < 1e-5 and rec["logprob_gap_mean"] <= rec["logprob_gap_max"], rec
        assert 0.0 <= rec["reward_mean"] <= 1.0 and rec["reward_std"] > 0, rec
        assert rec["optimizer_steps"] == 2 and rec["num_sequences"] == 16 and rec["failed_rollouts"] == 0
        assert rec["cpu_threads"] >= 1  # the count the iteration ran with (its floats depend on it)
        assert 0 < rec["packing_efficiency"] <= 1 and rec["grad_norm"] > 0
        assert 1 <= rec["response_length_mean"] <= 8
        # one environment: its per-environment numbers are the run's, computed separately
        assert rec["env/HashReward/groups"] == 4 and rec["env/HashReward/failed_rollouts"] == 0, rec
        assert rec["env/HashReward/reward_mean"] == pytest.approx(rec["reward_mean"], abs=1e-12)
        assert rec["env/HashReward/response_length_mean"] == pytest.approx(rec["response_length_mean"], abs=1e-12)
        assert rec["turns_per_episode_mean"] == 1.0
        # a random policy rarely emits EOS: most responses hit the 8-token cap, and the run says so
        assert rec["length_capped_fraction"] > 0.5 and rec["warn/length_cap"] == 1.0, rec
    assert log.count("of responses stopped at the length cap (--rl-max-new-tokens=8)") == 1  # rate-limited
    assert any(abs(r["rl_loss"]) > 1e-4 for r in recs.values())
    lines = [json.loads(line) for line in full_run["metrics"].read_text().splitlines()]
    evals = [rec for rec in lines if any(k.startswith("eval/") for k in rec)]
    assert [e["iteration"] for e in evals] == [0, 2, 3]
    samples = [rec for rec in lines if "samples" in rec]
    assert [r["iteration"] for r in samples] == [1, 2, 3]  # --rl-log-samples defaults to 4
    for r in samples:
        assert len(r["samples"]) == 4
        assert [s["reward"] for s in r["samples"]] == sorted(s["reward"] for s in r["samples"])  # spread, low first
        for s in r["samples"]:
            assert s["env"] == "HashReward" and re.fullmatch(r"Q\d+:", s["prompt"]) and s["status"] == "ok"
            # the logged reward is the reward of the logged completion (HashReward's formula)
            assert s["reward"] == (sum(s["completion"].encode("utf-8", "replace")) % 11) / 10.0, s
    assert sorted(p.name for p in full_run["ckpt"].glob("iter_*")) == [f"iter_000000{i}" for i in (1, 2, 3)]


def test_resume_from_saved_checkpoint_is_exact(full_run, tmp_path):
    """Resume from the full run's iteration-1 checkpoint (copied alone) and finish: the same metrics, bit-exact.

    The metrics file is the full run's, as if that run had died after iteration 3 but its checkpoints 2 and 3
    were lost: the resumed run must drop what the earlier attempt wrote past iteration 1 (marked stale here)
    instead of appending a second copy of iterations 2 and 3."""
    load = tmp_path / "ckpt"
    load.mkdir()
    shutil.copytree(full_run["ckpt"] / "iter_0000001", load / "iter_0000001")
    (load / "latest_checkpointed_iteration.txt").write_text("1")
    metrics = tmp_path / "resumed.jsonl"
    old = [json.loads(line) for line in full_run["metrics"].read_text().splitlines()]
    metrics.write_text("".join(json.dumps({**r, "stale": r["iteration"] > 1}) + "\n" for r in old) + '{"iterat')
    log = _run(_cmd(full_run["env"], "--rl-metrics-jsonl", metrics, "--load", load, "--save", load,
                    "--save-interval", "1", "--eval-interval", "2", "--rl-prompts-per-eval", "8"))
    assert "resumed from" in log
    resumed = _records(metrics)  # asserts no iteration is logged twice
    assert sorted(resumed) == [1, 2, 3]
    _assert_same_metrics(resumed, full_run["records"], [1, 2, 3])
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert not any(r.get("stale") for r in lines), "lines past the resumed iteration were kept"
    assert [r["iteration"] for r in lines if any(k.startswith("eval/") for k in r)] == [0, 2, 3]
    assert [r["iteration"] for r in lines if "samples" in r] == [1, 2, 3]
    assert (tmp_path / "resumed.jsonl.prev").read_text().count("\n") == len(old)  # the old file is kept aside


def test_eval_only_prints_a_pass_at_k_table(full_run, tmp_path):
    """--eval-only on the full run's last checkpoint: one row per environment, pass@k columns, no training."""
    env = tmp_path / "eval.yaml"
    env.write_text(f'environments:\n  - {{type: "{AGENTS}:HashPassAt", name: hash, weight: 1}}\n'
                   f'  - {{type: "{AGENTS}:HashReward", name: plain, weight: 1}}\n')
    out = tmp_path / "eval.json"
    flags = [f for f in FLAGS if f not in ("--train-iters", str(N_ITERS))]
    log = _run([sys.executable, str(REPO_ROOT / "train_rl.py"), *flags, "--langrl-env-config", str(env), "--eval-only",
                "--load", str(full_run["ckpt"]), "--rl-prompts-per-eval", "6", "--rl-eval-pass-at-k", "1", "2", "4",
                "--rl-eval-temperature", "1.0", "--rl-eval-output", str(out)])
    assert f"evaluation of {full_run['ckpt']}/iter_0000003 (iteration 3)" in log
    result = json.loads(out.read_text())
    header = re.search(r"^environment +prompts +pass@1 +pass@2 +pass@4 +mean reward +failed$", log, re.M)
    assert header, log[-3000:]
    rows = {m.group(1): m.group(2).split() for m in re.finditer(r"^(hash|plain|mean) +(.*)$", log, re.M)}
    h = [result[f"eval/hash/{k}"] for k in ("num_prompts", "pass@1", "pass@2", "pass@4", "mean_reward")]
    assert rows["hash"][:5] == [f"{h[0]:.0f}", *(f"{v:.3f}" for v in h[1:])], (rows, result)
    assert h[0] == 6 and h[1] <= h[2] <= h[3]  # pass@k grows with k
    assert rows["plain"][1:4] == ["-", "-", "-"]  # a RewardOnlyAgent reports no pass@k
    assert rows["mean"][0] == "12" and result["eval/pass@4"] == result["eval/hash/pass@4"]
    assert " iteration " not in log and not (full_run["ckpt"] / "iter_0000004").exists()


# --------------------------------------------------------------------------- bad input through the CLI


BAD_FLAGS = [f for f in FLAGS if f != "--rl-use-sequence-packing"]
BAD_FLAGS[BAD_FLAGS.index("--train-iters") + 1] = "1"


@pytest.fixture(scope="module")
def bad_input_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl_bad")
    evalonly = tmp / "evalonly.yaml"
    evalonly.write_text("environments:\n  - {type: arithmetic, weight: 0}\n"
                        "  - {type: arithmetic, weight: 1, evaluation_only: true}\n")
    cases = {"evaluation_only": [*BAD_FLAGS, "--langrl-env-config", str(evalonly)]}
    for agent in ("EmptyDataset", "NaNReward", "LongPrompt", "NearLimitPrompt", "HalfConstant"):
        env = _env(tmp, agent, f"{agent}.yaml")
        cases[agent] = [*BAD_FLAGS, "--langrl-env-config", str(env), "--rl-prompts-per-eval", "0",
                        "--rl-metrics-jsonl", str(tmp / f"{agent}.jsonl")]
    cases["HalfConstant"] += ["--grpo-filter-groups-with-same-reward", "--train-iters", "2"]
    cases["AllFailed"] = [*cases["NaNReward"], "--train-iters", "4", "--rl-max-all-failed-iterations", "2",
                          "--rl-metrics-jsonl", str(tmp / "AllFailed.jsonl")]
    (tmp / "cases.json").write_text(json.dumps(cases))
    out = tmp / "out.json"
    log = _run([sys.executable, str(CASES_SCRIPT), str(tmp / "cases.json"), str(out)], timeout=500)
    results = json.loads(out.read_text())

    def records(agent):
        p = tmp / f"{agent}.jsonl"
        return _records(p) if p.exists() else {}

    return results, records, log


def test_env_config_with_only_evaluation_entries_is_a_named_error(bad_input_results):
    results, _, _ = bad_input_results
    r = results["evaluation_only"]
    assert not r["ok"] and r["error_type"] == "EnvConfigError", r
    assert "weight" in r["error"] and "evalonly.yaml" in r["error"], r


def test_agent_with_empty_dataset_is_a_named_error(bad_input_results):
    results, _, _ = bad_input_results
    r = results["EmptyDataset"]
    assert not r["ok"] and r["error_type"] == "AgentError", r
    assert "has no train problems" in r["error"] and "returned 0" in r["error"], r
    assert "EmptyDataset" in r["error"], r  # names the environment, so the config entry can be found


def test_nan_reward_is_a_counted_failed_rollout_and_skips_the_update(bad_input_results):
    results, records, log = bad_input_results
    assert results["NaNReward"]["ok"], results["NaNReward"]
    rec = records("NaNReward")[1]
    assert rec["failed_rollouts"] == 16 and rec["skipped_update"] == 1.0 and "rl_loss" not in rec, rec
    assert "reward must be a finite float" in log and "failed 16 | skipped" in log  # the short iteration line


def test_run_stops_when_every_rollout_keeps_failing(bad_input_results):
    results, records, _ = bad_input_results
    r = results["AllFailed"]
    assert not r["ok"] and r["error_type"] == "AllRolloutsFailedError", r
    assert "2 consecutive iterations" in r["error"] and "--rl-max-all-failed-iterations" in r["error"], r
    assert sorted(records("AllFailed")) == [1, 2]  # stopped after the second, not at --train-iters 4


def test_prompt_longer_than_seq_length_is_a_logged_failed_rollout(bad_input_results):
    results, records, log = bad_input_results
    assert results["LongPrompt"]["ok"], results["LongPrompt"]
    rec = records("LongPrompt")[1]
    assert rec["failed_rollouts"] == 16 and rec["skipped_update"] == 1.0 and "rl_loss" not in rec, rec
    assert re.search(r"prompt is 30\d tokens but the model's maximum sequence length is 64", log)


def test_prompt_near_seq_length_truncates_generation(bad_input_results):
    results, records, _ = bad_input_results
    assert results["NearLimitPrompt"]["ok"], results["NearLimitPrompt"]
    rec = records("NearLimitPrompt")[1]
    # the 59-token prompt leaves 5 of the 8 requested tokens within --seq-length 64; nothing fails
    assert rec["failed_rollouts"] == 0 and rec["response_length_mean"] <= 5 and rec["num_sequences"] == 16, rec
    assert rec["logprob_gap_max"] < 1e-5 and "rl_loss" in rec


def test_filtered_groups_leave_a_smaller_batch_that_still_trains(bad_input_results):
    results, records, log = bad_input_results
    assert results["HalfConstant"]["ok"], results["HalfConstant"]
    recs = records("HalfConstant")
    assert sorted(recs) == [1, 2]
    for rec in recs.values():
        # 4 prompts per iteration, the 2 odd-indexed ones have constant rewards and are filtered
        assert rec["filtered_groups"] == 2 and rec["num_sequences"] == 8, rec
        assert rec["optimizer_steps"] == 2 and rec["skipped_steps"] == 0, rec
        assert rec["grad_norm"] > 0 and abs(rec["rl_loss"]) < 10, rec
        # the constant-reward rollouts still count in the reward statistics
        assert rec["reward_std"] > 0


# --------------------------------------------------------------------------- interrupted runs (slow)


def _popen(cmd, log_path: Path):
    f = log_path.open("w")
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=_proc_env(), stdout=f, stderr=subprocess.STDOUT,
                            start_new_session=True), f


def _kill_group(proc):
    """SIGKILL the run and the checkpoint writer it started (its own session, started by this test)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def _wait_for(pred, proc, what: str, timeout: float = 400.0, poll: float = 0.002):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(poll)
    _kill_group(proc)
    raise AssertionError(f"timed out waiting for {what}")


def _resume_to_end(full_run, ckpt: Path, metrics: Path) -> str:
    return _run(_cmd(full_run["env"], "--rl-metrics-jsonl", metrics, "--load", ckpt, "--save", ckpt,
                     "--save-interval", "1"))


@pytest.mark.slow
def test_stop_after_k_iterations_then_resume_is_exact(full_run, tmp_path):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    _run(_cmd(full_run["env"], "--rl-metrics-jsonl", metrics, "--save", ckpt, "--save-interval", "1",
              "--exit-interval", "1"))
    assert sorted(_records(metrics)) == [1]
    _resume_to_end(full_run, ckpt, metrics)
    recs = _records(metrics)
    assert sorted(recs) == [1, 2, 3]
    _assert_same_metrics(recs, full_run["records"], [1, 2, 3])


@pytest.mark.slow
def test_sigkill_mid_step_then_resume_is_exact(full_run, tmp_path):
    ckpt, metrics, log_path = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "killed.log"
    proc, f = _popen(_cmd(full_run["env"], "--rl-metrics-jsonl", metrics, "--save", ckpt, "--save-interval", "1"),
                     log_path)
    try:
        # iteration 1 is saved and published; kill as soon as iteration 2 has started (mid-step)
        done = _wait_for(lambda: (ckpt / "latest_checkpointed_iteration.txt").exists(), proc, "the first save")
        assert done, log_path.read_text()[-4000:]
        _kill_group(proc)
    finally:
        f.close()
    assert proc.returncode == -signal.SIGKILL
    killed = _records(metrics) if metrics.exists() else {}
    assert 3 not in killed, "the run finished before the kill"
    last = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert last in (1, 2)
    log = _resume_to_end(full_run, ckpt, metrics)
    assert f"resumed from {ckpt}/iter_000000{last}" in log
    recs = _records(metrics)  # lines the killed run wrote past its checkpoint were dropped, not duplicated
    assert sorted(recs) == list(range(1, N_ITERS + 1))
    _assert_same_metrics(recs, full_run["records"], recs)


@pytest.mark.slow
def test_sigkill_mid_save_then_resume_is_exact(full_run, tmp_path):
    ckpt, metrics, log_path = tmp_path / "ckpt", tmp_path / "m.jsonl", tmp_path / "killed.log"
    proc, f = _popen(_cmd(full_run["env"], "--rl-metrics-jsonl", metrics, "--save", ckpt, "--save-interval", "1"),
                     log_path)
    try:
        # the save of iteration 2 is in progress while its .tmp- directory exists
        caught = _wait_for(lambda: any(ckpt.glob("iter_0000002.tmp-*")), proc, "the iteration-2 save")
        _kill_group(proc)
    finally:
        f.close()
    assert caught, f"the iteration-2 save finished before it could be caught:\n{log_path.read_text()[-3000:]}"
    # the killed save never published: the tracker still names iteration 1, no complete iter_0000002
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (ckpt / "iter_0000002" / "metadata.json").exists()
    killed = _records(metrics)
    assert sorted(killed) == [1, 2]  # iteration 2 trained and logged, its checkpoint never completed
    log = _resume_to_end(full_run, ckpt, metrics)
    assert f"resumed from {ckpt}/iter_0000001" in log
    recs = _records(metrics)  # the killed run's iteration-2 line was dropped, not duplicated
    assert sorted(recs) == [1, 2, 3]
    _assert_same_metrics(recs, full_run["records"], [1, 2, 3])
    assert (ckpt / "iter_0000003").is_dir() and not any(ckpt.glob("*.tmp-*"))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp2_stop_and_resume_is_exact(tmp_path):
    """torchrun, DP=2: each rank draws its own prompts and sampling seeds; resuming restores both exactly."""
    from tests.conftest import run_torchrun

    env = _env(tmp_path, "HashReward")
    script = REPO_ROOT / "train_rl.py"
    base = [*FLAGS, "--langrl-env-config", env, "--save-interval", "1"]
    full_m, part_m = tmp_path / "full.jsonl", tmp_path / "part.jsonl"
    run_torchrun(script, [*base, "--rl-metrics-jsonl", full_m, "--save", tmp_path / "ck_full"], timeout=500)
    part = [*base, "--rl-metrics-jsonl", part_m, "--save", tmp_path / "ck", "--load", tmp_path / "ck"]
    run_torchrun(script, [*part, "--exit-interval", "1"], timeout=500)
    run_torchrun(script, part, timeout=500)
    full, resumed = _records(full_m), _records(part_m)
    assert sorted(full) == sorted(resumed) == [1, 2, 3]
    assert all(r["num_sequences"] == 16 for r in full.values())
    _assert_same_metrics(resumed, full, [1, 2, 3])
    for r in full.values():  # per-environment numbers gathered over both DP ranks
        assert r["env/HashReward/groups"] == 4 and r["env/HashReward/reward_mean"] == pytest.approx(r["reward_mean"])
    samples = [json.loads(line) for line in full_m.read_text().splitlines() if '"samples"' in line]
    assert [len(r["samples"]) for r in samples] == [4, 4, 4]
    assert {s["problem_id"] for r in samples for s in r["samples"]} > {s["problem_id"] for s in samples[0]["samples"]}
