"""GRPO / PPO post-training of a Megatron Core GPT on rollouts from agents (environments).

    python train_rl.py <Megatron flags> --langrl-env-config ENV.yaml            # one process
    torchrun --nproc-per-node N train_rl.py <Megatron flags> --langrl-env-config ENV.yaml

Takes the Megatron-LM model/parallel/optimizer/checkpoint flags of ``pretrain_gpt.py`` plus the RL flags
of :mod:`megatron.rl.rl_config` (``python train_rl.py --help`` lists them). ``--train-iters`` counts RL
iterations; start from ``--pretrained-checkpoint`` and resume with ``--load`` / ``--save``.

Bad input (flags, the environment config, a checkpoint that cannot be loaded, tokenizer, megatron-core
version) exits with status 2 and a one-line message naming what to fix, like ``pretrain_gpt.py``.
"""
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    from megatron.rl.agent.env_config import EnvConfigError
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_loop import run_rl
    from megatron.rl.runtime.cpu_patches import UnsupportedMegatronCoreVersion
    from megatron.rl.training.checkpoint_paths import CheckpointError
    from megatron.rl.training.config import ConfigError, parse_args
    from megatron.rl.training.initialize import destroy_megatron
    from megatron.rl.training.tokenizer import TokenizerError

    try:
        cfg = parse_args(argv, extra_args_providers=[add_rl_args])
        rl = rl_config_from_args(cfg)
        run_rl(cfg, rl)
    except (ConfigError, EnvConfigError, CheckpointError, TokenizerError, UnsupportedMegatronCoreVersion) as e:
        logging.getLogger("train_rl").error("%s: %s", type(e).__name__, e)
        return 2
    finally:
        destroy_megatron()
    return 0


# The guard matters: torch_dist checkpoint saving starts a subprocess that re-imports this module.
if __name__ == "__main__":
    sys.exit(main())
