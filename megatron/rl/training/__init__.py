"""Our Megatron training loop on megatron-core: typed CLI config (Megatron-LM flag names), initialisation,
model provider, optimizer, the train step and pretraining driver, checkpointing, tokenizers, data and metrics.

Modules are imported directly (``from megatron.rl.training.config import parse_args``); this package
deliberately imports nothing so that importing one piece never drags in megatron-core model code.
"""
