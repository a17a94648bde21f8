"""GRPO / PPO post-training from a checkout: ``python train_rl.py <flags>`` (see :mod:`megatron.rl.train_rl`).

An installed package runs the same code as ``python -m megatron.rl.train_rl`` or ``megatron-rl-train``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron.rl.train_rl import main  # noqa: E402 - after the checkout is on sys.path

# The guard keeps this module importable (a spawned process re-imports the main module) without running it.
if __name__ == "__main__":
    sys.exit(main())
