"""Save iteration 1, then get SIGKILLed in the middle of saving iteration 2 (after the shards are written,
before dist_checkpointing writes its metadata.json). Writes the eval loss at iteration 1 to argv[2].

Usage: python save_then_die.py SAVE_DIR OUT_JSON
"""
import json
import os
import signal
import sys
from pathlib import Path

if __name__ == "__main__":  # the torch_dist writer starts a subprocess
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import ckpt_tiny_model as tiny
    from megatron.core.dist_checkpointing import serialization

    from megatron.rl.training.checkpoint.save_load import save_checkpoint

    save_dir, out = sys.argv[1], sys.argv[2]
    tiny.init_single_process()
    tiny.set_layout()
    arch = tiny.Arch()
    chunks, opt, sched = tiny.build(arch, False)
    tiny.train_step(chunks, opt, sched, 0)
    save_checkpoint(save_dir, 1, chunks, opt, sched, run_state={"step": 1}, model_args=arch.model_args())
    Path(out).write_text(json.dumps({"eval_loss": tiny.eval_loss(chunks)}))
    tiny.train_step(chunks, opt, sched, 1)

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    serialization.save_config = die  # called once every shard is on disk, to write the completion marker
    save_checkpoint(save_dir, 2, chunks, opt, sched, run_state={"step": 2}, model_args=arch.model_args())
    raise SystemExit("not reached: the save above must have been killed")
