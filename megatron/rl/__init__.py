"""megatron-rl: reinforcement-learning post-training (GRPO, PPO) for Megatron Core models.

Public API is re-exported here as the subpackages land; everything else is private by convention.
"""
__version__ = "0.1.0"
