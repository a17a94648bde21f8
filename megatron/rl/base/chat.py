"""Chat messages and the built-in chat template: the vocabulary agents, backends and the trainer share.

Built-in chat template (used when a tokenizer has no chat template of its own, e.g. the byte tokenizer)::

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ...

i.e. each message is rendered as ``"<|" + role + "|>\\n" + content + "\\n"``, and
``add_generation_prompt=True`` appends ``"<|assistant|>\\n"``. The markers are plain text (no special ids),
so any tokenizer can encode them. One definition, so prompts rendered by a backend and by the trainer
never drift.
"""
from __future__ import annotations

from typing import Annotated, Literal, Mapping, Sequence

from pydantic import AfterValidator, BaseModel

from megatron.rl.base.errors import RLError

__all__ = ["CHAT_ROLES", "ChatRole", "Text", "check_unicode", "ChatMessage", "ChatFormatError",
           "render_builtin_chat_template", "BUILTIN_CHAT_TEMPLATE_JINJA"]

#: roles a chat template is rendered with; anything else could smuggle template markup into the prompt
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_unicode(value: str) -> str:
    """``value`` unchanged when it is valid Unicode text; a lone surrogate (JSON ``"\\ud800"``) raises."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"not valid Unicode text (lone surrogate at index {e.start})") from None
    return value


Text = Annotated[str, AfterValidator(check_unicode)]
ChatRole = Literal[CHAT_ROLES]  # type: ignore[valid-type]


class ChatMessage(BaseModel):
    """One chat turn: ``role`` is one of ``CHAT_ROLES`` (system, developer, user, assistant, tool)."""

    role: ChatRole
    content: Text


class ChatFormatError(RLError, ValueError):
    """A chat message the built-in template cannot render."""


def render_builtin_chat_template(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
    """Render ``messages`` with the built-in template described in the module docstring.

    Args:
        messages: ``[{"role": ..., "content": ...}, ...]``; both keys are required.
        add_generation_prompt: append ``"<|assistant|>\\n"`` so the model continues as the assistant.
    """
    parts = []
    for i, message in enumerate(messages):
        if "role" not in message or "content" not in message:
            raise ChatFormatError(
                f"chat message {i} must have 'role' and 'content' keys, got keys {sorted(message)}"
            )
        parts.append(f"<|{message['role']}|>\n{message['content']}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


#: the built-in template as a Jinja chat template (what ``transformers``' ``apply_chat_template`` runs), for
#: tokenizer files written for a model trained with it; renders exactly what the function above renders
BUILTIN_CHAT_TEMPLATE_JINJA = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
