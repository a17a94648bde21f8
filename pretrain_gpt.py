"""Pretrain a GPT with megatron-core and megatron-rl's training loop (Megatron-LM flag names).

    python pretrain_gpt.py <flags>                          # one process (CPU or one GPU)
    torchrun --nproc-per-node N pretrain_gpt.py <flags>     # N processes (TP x PP x DP)

Example (tiny model on CPU, under a minute):

    python pretrain_gpt.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --micro-batch-size 4 --global-batch-size 8 --train-iters 50 --lr 1e-3 --mock-data --log-interval 10

Runs from the repository root without installing: the repo's ``megatron/`` is a namespace portion next to
the megatron-core wheel's. Bad input (flags, paths, tokenizer, megatron-core version) exits with status 2
and a one-line message naming what to fix, before any model is built.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _pretrain(argv=None) -> int:
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.loop import pretrain

    pretrain(parse_args(argv))
    return 0


def main(argv=None) -> int:
    """Pretrain; user errors are one line on stderr (and in torchrun's report) and status 2, as in train_rl.py."""
    from megatron.rl.training.cli_errors import run_cli

    return run_cli("pretrain_gpt.py", _pretrain, argv)


# The guard keeps this module importable (a spawned process re-imports the main module) without running it.
if __name__ == "__main__":
    sys.exit(main())
