"""Hugging Face <-> Megatron (torch_dist) checkpoint conversion for Llama 3.x, Qwen2/2.5, Qwen3 and Qwen3-MoE.

Modules, one job each: :mod:`.layout` (pure tensor functions for megatron-core's fused layouts),
:mod:`.families` with :mod:`.llama` and :mod:`.qwen` (per-family config checks and Megatron-LM flags),
:mod:`.mapping` (state-dict names), :mod:`.hf_io` (Hugging Face directories), :mod:`.hf_to_megatron` /
:mod:`.megatron_to_hf` (the two conversions and their command lines).

Design notes: docs/checkpoint_conversion.md.
"""
