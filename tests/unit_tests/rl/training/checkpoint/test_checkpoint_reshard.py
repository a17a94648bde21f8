"""A checkpoint saved by 1 process (TP=PP=DP=1, distributed optimizer) loads under TP=2, PP=2, DP=2 and
PP=2 with virtual stages (2 processes): same loss on fixed data, same loss and update for the next
optimizer step (fully_reshardable optimizer format). The PP=2+VPP checkpoint then loads back in 1 process."""
import json
from pathlib import Path

import pytest

from megatron.rl.training.checkpoint.save_load import load_checkpoint, save_checkpoint

SCRIPTS = Path(__file__).parent / "scripts"
K = 2
TOL = 1e-5


@pytest.mark.multiprocess
def test_load_under_other_layouts(dist1, tmp_path, torchrun):
    tiny = dist1
    arch = tiny.Arch()
    chunks, opt, sched = tiny.build(arch, distopt=True)
    for s in range(K):
        tiny.train_step(chunks, opt, sched, s)
    save_checkpoint(tmp_path / "tp1", K, chunks, opt, sched, run_state={"consumed_samples": K * tiny.GBS},
                    model_args=arch.model_args())

    # the 1-process reference: fresh model, load, eval, one step, eval, one more step
    chunks, opt, sched = tiny.build(arch, distopt=True, seed=77)
    load_checkpoint(tmp_path / "tp1", chunks, opt, sched, model_args=arch.model_args())
    ref = {"eval_before": tiny.eval_loss(chunks), "step_loss": tiny.train_step(chunks, opt, sched, K),
           "eval_after": tiny.eval_loss(chunks), "lr": opt.param_groups[0]["lr"]}
    ref_next_step = tiny.train_step(chunks, opt, sched, K + 1)

    out = tmp_path / "layouts.json"
    torchrun(SCRIPTS / "load_in_layouts.py", [tmp_path / "tp1", out, tmp_path / "vpp"])
    got = json.loads(out.read_text())
    assert sorted(got) == ["dp2", "pp2", "pp2_vpp2", "tp2"]
    full = sum(p.numel() for c in chunks for p in c.parameters())
    sizes = {n: tuple(r["layout"][d] for d in ("tp", "pp", "vpp", "dp")) for n, r in got.items()}
    assert sizes == {"tp2": (2, 1, 0, 1), "pp2": (1, 2, 0, 1), "dp2": (1, 1, 0, 2), "pp2_vpp2": (1, 2, 2, 1)}
    assert got["dp2"]["local_params"] == full  # rank 0 holds a full replica ...
    assert all(got[n]["local_params"] < full for n in ("tp2", "pp2", "pp2_vpp2"))  # ... or only its shard
    for name, row in got.items():
        assert row["iteration"] == K and row["run_state"] == {"consumed_samples": K * tiny.GBS}, name
        assert row["loaded_rng"] is False, name  # layout changed: RNG state dropped, not misapplied
        assert row["lr"] == ref["lr"], name  # scheduler state restored
        for key in ("eval_before", "step_loss", "eval_after"):
            assert abs(row[key] - ref[key]) < TOL, (name, key, row[key], ref[key])
    # the step changed the model: eval_after differs from eval_before by far more than the tolerance
    assert abs(ref["eval_after"] - ref["eval_before"]) > 100 * TOL

    # saved by PP=2 x 2 virtual stages, loaded by 1 process: continues like the 1-process run
    chunks, opt, sched = tiny.build(arch, distopt=True, seed=5)
    info = load_checkpoint(tmp_path / "vpp", chunks, opt, sched, model_args=arch.model_args())
    assert info.iteration == K + 1 and info.run_state == {"from": "pp2_vpp2"} and not info.loaded_rng
    assert abs(tiny.eval_loss(chunks) - got["pp2_vpp2"]["eval_after"]) < TOL
    assert abs(tiny.train_step(chunks, opt, sched, K + 1) - ref_next_step) < TOL
