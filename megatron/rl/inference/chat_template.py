"""Render chat messages to a prompt string.

Order of preference:
1. a tokenizer with its own ``apply_chat_template`` that knows a template (a Hugging Face tokenizer whose
   ``chat_template`` is set, or our :class:`megatron.rl.training.tokenizer.Tokenizer`, which itself uses the HF
   template when it has one and its documented built-in one otherwise);
2. otherwise the simple built-in template below.

Built-in template (one block per message, then an open assistant block when ``add_generation_prompt``)::

    <|system|>
    You are helpful.
    <|user|>
    What is 2+2?
    <|assistant|>

i.e. ``"<|{role}|>\\n{content}\\n"`` per message, followed by ``"<|assistant|>\\n"``.
"""
from __future__ import annotations

from typing import Any, Sequence

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
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages_as_dicts(messages))
    if add_generation_prompt:
        text += "<|assistant|>\n"
    return text


def _is_hf_tokenizer(tokenizer: Any) -> bool:
    return hasattr(tokenizer, "chat_template") and hasattr(tokenizer, "apply_chat_template")


def render_chat(messages: Sequence[Any], tokenizer: Any = None, add_generation_prompt: bool = True) -> str:
    """Render ``messages`` to prompt text using the tokenizer's template when it has one.

    tokenizer: None, a ``transformers`` tokenizer, or one of our ``Tokenizer`` objects (anything with
    ``apply_chat_template(messages, add_generation_prompt=...) -> str``).
    """
    msgs = messages_as_dicts(messages)
    if tokenizer is None:
        return builtin_chat_template(msgs, add_generation_prompt)
    if _is_hf_tokenizer(tokenizer):
        # A transformers tokenizer: only use it when a template is actually configured (otherwise
        # transformers raises); render to text, tokenisation happens later with the prompt path.
        if getattr(tokenizer, "chat_template", None):
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
        return builtin_chat_template(msgs, add_generation_prompt)
    if hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
    return builtin_chat_template(msgs, add_generation_prompt)
