"""GRPO / PPO post-training of a Megatron Core GPT on rollouts from agents (environments).

    python train_rl.py <Megatron flags> --langrl-env-config ENV.yaml   # or torchrun / python -m megatron.rl.train_rl

Takes ``pretrain_gpt.py``'s model/parallel/optimizer/checkpoint flags plus the RL flags of
:mod:`megatron.rl.rl_config` (``--help`` lists them); ``--eval-only --load CKPT`` evaluates instead of training.
Bad input exits with status 2 and one line naming what to fix; a run the collapse guard stops exits with
status 3. The repository's ``train_rl.py`` only calls :func:`main` here.

Launch forms: docs/training.md.
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
