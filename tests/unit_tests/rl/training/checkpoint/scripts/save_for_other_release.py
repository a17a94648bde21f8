"""Train the tiny model K steps, save a checkpoint at K, train on to N, and write to OUT_PT what was saved (weights,
Adam moments and step by parameter name, the LR schedule, the torch generator state) and the continuation's
losses and weights, for a test that loads the checkpoint with another megatron-core release.

Usage: python save_for_other_release.py SAVE_DIR OUT_PT
"""
import sys
from pathlib import Path

K, N = 2, 4
RUN_STATE = {"consumed_samples": 8, "written_by": "save_for_other_release.py"}

if __name__ == "__main__":  # the torch_dist writer starts a subprocess
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ckpt_tiny_model as tiny
    import torch

    from megatron.rl.runtime import versions
    from megatron.rl.training.checkpoint.save_load import save_checkpoint

    save_dir, out = sys.argv[1:3]
    tiny.init_single_process()
    tiny.set_layout()
    arch = tiny.Arch(dropout=0.1)  # dropout: the continuation depends on the restored generator state too
    chunks, opt, sched = tiny.build(arch, False)
    for step in range(K):
        tiny.train_step(chunks, opt, sched, step)
    saved = {"params": tiny.full_params(chunks), "adam": tiny.adam_state_by_name(chunks, opt),
             "sched_steps": sched.num_steps, "lr": opt.param_groups[0]["lr"], "torch_rng": torch.get_rng_state()}
    save_checkpoint(save_dir, K, chunks, opt, sched, run_state=RUN_STATE, model_args=arch.model_args())
    losses = [tiny.train_step(chunks, opt, sched, step) for step in range(K, N)]
    torch.save({"release": versions.installed_version(), "k": K, "n": N, "run_state": RUN_STATE, "saved": saved,
                "losses": losses, "final_params": tiny.full_params(chunks)}, out)
    torch.distributed.destroy_process_group()
