"""GRPO / PPO post-training of a Megatron Core GPT on rollouts from agents (environments).

    python train_rl.py <Megatron flags> --langrl-env-config ENV.yaml            # from a checkout
    torchrun --nproc-per-node N train_rl.py <Megatron flags> --langrl-env-config ENV.yaml
    python -m megatron.rl.train_rl <Megatron flags> --langrl-env-config ENV.yaml  # installed package
    torchrun --nproc-per-node N -m megatron.rl.train_rl ...                     # (or: megatron-rl-train ...)

The repository's ``train_rl.py`` only calls :func:`main` here, so the checkout and the installed package
run the same code.

Takes the Megatron-LM model/parallel/optimizer/checkpoint flags of ``pretrain_gpt.py`` plus the RL flags
of :mod:`megatron.rl.rl_config` (``python train_rl.py --help`` lists them). ``--train-iters`` counts RL
iterations; start from ``--pretrained-checkpoint`` and resume with ``--load`` / ``--save``.
``--eval-only --load CKPT`` evaluates a checkpoint (pass@k per environment) instead of training.

Bad input (flags, the environment config, a checkpoint that cannot be loaded, tokenizer, megatron-core
version) exits with status 2 and a one-line message naming what to fix, like ``pretrain_gpt.py``. A run the
collapse guard stops (``--rl-env-collapse-action stop``) saves its checkpoint and exits with status 3.
"""
import sys

from megatron.rl.logging import setup_distributed_logging
from megatron.rl.training.cli_errors import run_cli
from megatron.rl.training.config import parse_args


def _train_or_evaluate(argv=None) -> int:
    # run_cli has set logging up at INFO; --log-level applies once the flags are parsed. torch and the trainer
    # load after the entry point is set up to report user errors.
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args

    cfg = parse_args(argv, extra_args_providers=[add_rl_args])
    setup_distributed_logging(cfg.logging.log_level)
    rl = rl_config_from_args(cfg)
    from megatron.rl.rl_eval import run_eval_only  # heavy: megatron-core
    from megatron.rl.rl_loop import run_rl  # heavy: megatron-core

    if rl.observe.eval_only:
        run_eval_only(cfg, rl)
        return 0
    # 3: the collapse guard stopped the run (--rl-env-collapse-action stop); its checkpoint resumes it
    return 3 if run_rl(cfg, rl).stop_reason is not None else 0


def main(argv=None) -> int:
    """Train (or evaluate); user errors are one line on stderr (and in torchrun's report) and status 2."""

    return run_cli("train_rl.py", _train_or_evaluate, argv)


# The guard keeps this module importable (a spawned process re-imports the main module) without running it.
if __name__ == "__main__":
    sys.exit(main())
