"""Packing rollouts into rows for training: prefix sharing, micro-batches, the packed forward."""
