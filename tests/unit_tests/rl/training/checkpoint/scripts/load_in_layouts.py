"""Load a 1-process checkpoint under other parallel layouts (2 processes) and record, per layout: the
eval loss right after loading, the loss of one training step, and the eval loss after that step. The
last layout (PP=2 with 2 virtual stages) then saves, so the caller can load that back in 1 process.

Usage: torchrun --nproc-per-node 2 load_in_layouts.py CKPT_DIR OUT_JSON RESAVE_DIR
"""
import json
import sys
import time
from pathlib import Path

LAYOUTS = {  # name: (tp, pp, vpp); the data-parallel size is what is left of the 2 processes
    "tp2": (2, 1, None),
    "pp2": (1, 2, None),
    "dp2": (1, 1, None),
    "pp2_vpp2": (1, 2, 2),
}

if __name__ == "__main__":  # the torch_dist writer starts a subprocess
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ckpt_tiny_model as tiny
    import torch

    from megatron.rl.training.checkpoint.save_load import load_checkpoint, save_checkpoint

    ckpt_dir, out, resave_dir = sys.argv[1:4]
    tiny.init_torchrun()
    arch = tiny.Arch()
    results = {}
    for name, (tp, pp, vpp) in LAYOUTS.items():
        tiny.set_layout(tp, pp, vpp)
        chunks, opt, sched = tiny.build(arch, distopt=True, seed=77)  # distributed optimizer, DP-sharded
        t0 = time.perf_counter()
        info = load_checkpoint(ckpt_dir, chunks, opt, sched, model_args=arch.model_args())
        load_s = time.perf_counter() - t0
        from megatron.rl.training.checkpoint.rng import parallel_layout

        row = {"layout": parallel_layout(), "local_params": sum(p.numel() for c in chunks for p in c.parameters()),
               "iteration": info.iteration, "run_state": info.run_state, "loaded_rng": info.loaded_rng,
               "load_s": load_s, "eval_before": tiny.eval_loss(chunks)}
        row["step_loss"] = tiny.train_step(chunks, opt, sched, info.iteration)
        row["eval_after"] = tiny.eval_loss(chunks)
        row["lr"] = opt.param_groups[0]["lr"]
        if name == "pp2_vpp2":
            t0 = time.perf_counter()
            save_checkpoint(resave_dir, info.iteration + 1, chunks, opt, sched, run_state={"from": name},
                            model_args=arch.model_args())
            row["save_s"] = time.perf_counter() - t0
        results[name] = row
        del chunks, opt, sched
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
