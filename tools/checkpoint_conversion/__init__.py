"""Hugging Face <-> Megatron (torch_dist) checkpoint conversion for Llama 3.x, Qwen2/2.5, Qwen3 and Qwen3-MoE.

Modules, one job each:

- :mod:`.layout`: pure tensor functions for megatron-core's fused layouts (QKV per query group, SwiGLU
  gate/up in ``linear_fc1``, vocab padding).
- :mod:`.families`: the per-family registry (``@register_family``) that checks a Hugging Face ``config.json``
  for unsupported features and turns it into Megatron-LM flags; :mod:`.llama` and :mod:`.qwen` (qwen2,
  qwen3, qwen3_moe) register the families.
- :mod:`.mapping`: Hugging Face state-dict names <-> megatron-core ``GPTModel`` state-dict names.
- :mod:`.hf_io`: reading/writing Hugging Face checkpoint directories (safetensors, config, tokenizer files).
- :mod:`.hf_to_megatron` / :mod:`.megatron_to_hf`: the two conversions (also the CLI entry points used by
  ``tools/convert_hf_to_megatron.py`` and ``tools/convert_megatron_to_hf.py``).
"""
