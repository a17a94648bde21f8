"""Render chat messages to a prompt string for the inference backends.

Order of preference: a ``transformers`` tokenizer's own ``chat_template``; one of our
:class:`megatron.rl.training.tokenizer.Tokenizer` objects' ``apply_chat_template``; else the built-in template
of :func:`megatron.rl.base.chat.render_builtin_chat_template`, the one definition shared with the trainer so
prompts rendered here and there never drift.

The built-in template: docs/inference.md.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

from megatron.rl.base.chat import render_builtin_chat_template

__all__ = ["render_chat", "builtin_chat_template", "messages_as_dicts"]


def messages_as_dicts(messages: Sequence[Any]) -> list[dict[str, str]]:
    """Accept ChatMessage models or plain ``{"role", "content"}`` dicts."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            out.append({"role": str(m["role"]), "content": str(m["content"])})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def builtin_chat_template(messages: Sequence[Any], add_generation_prompt: bool = True) -> str:
    """The built-in template described in the module docstring."""
    return render_builtin_chat_template(messages_as_dicts(messages), add_generation_prompt)


def _is_transformers_tokenizer(tokenizer: Any) -> bool:
    tf = sys.modules.get("transformers")  # never import transformers just to answer "no"
    return tf is not None and isinstance(tokenizer, tf.PreTrainedTokenizerBase)


def render_chat(messages: Sequence[Any], tokenizer: Any = None, add_generation_prompt: bool = True) -> str:
    """Render ``messages`` to prompt text using the tokenizer's template when it has one.

    tokenizer: None, a ``transformers`` tokenizer, or one of our ``Tokenizer`` objects (anything with
    ``apply_chat_template(messages, add_generation_prompt=...) -> str``).
    """
    msgs = messages_as_dicts(messages)
    if tokenizer is None:
        return builtin_chat_template(msgs, add_generation_prompt)
    if _is_transformers_tokenizer(tokenizer):
        # transformers raises when no template is configured; render to text, tokenisation happens later
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        return builtin_chat_template(msgs, add_generation_prompt)
    if hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
    return builtin_chat_template(msgs, add_generation_prompt)
