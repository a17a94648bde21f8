"""pretrain() under torchrun (or 1 process) that writes per-iteration losses to --history-out (rank 0)."""
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 5)))


def _extra(parser):
    parser.add_argument("--history-out", required=True)
    return parser


def main():
    import torch.distributed as dist

    from megatron.rl.training.config import parse_args
    from megatron.rl.training.initialize import destroy_megatron
    from megatron.rl.training.loop import pretrain

    cfg = parse_args(sys.argv[1:], extra_args_providers=[_extra])
    result = pretrain(cfg)
    if dist.get_rank() == 0:
        with open(cfg.extra.history_out, "w") as f:
            json.dump({str(s.iteration): {"lm loss": s.losses["lm loss"], "grad norm": s.grad_norm,
                                          "lr": s.learning_rate} for s in result.history}, f)
    destroy_megatron()


if __name__ == "__main__":
    main()
