"""Packing rollouts into rows for training: the plan, the packed tensors, prefix sharing, micro-batches, the packed
forward. Its public name is :mod:`megatron.rl.sequence_packing_utils`."""
