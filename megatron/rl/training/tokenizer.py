"""Tokenizers for training and in-process inference.

:class:`ByteLevelTokenizer` (default, no files: UTF-8 bytes, then ``eod = 256``, ``pad = 257``, ``bos = 258``)
and :class:`HuggingFaceTokenizer` (a local directory only, never downloaded), behind :class:`Tokenizer`. Both
satisfy what megatron-core's inference engine and ``GPTDataset`` call (and are picklable). New types register
with :func:`register_tokenizer`; :func:`build_tokenizer` builds one by name.

Details: docs/training.md.
"""
from __future__ import annotations

import codecs
import json
import logging
import os
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Type

from megatron.rl.base import chat
from megatron.rl.base.registry import Registry
from megatron.rl.base.errors import UserError

logger = logging.getLogger(__name__)

__all__ = [
    "Tokenizer",
    "TokenizerError",
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "register_tokenizer",
    "known_tokenizer_types",
    "build_tokenizer",
    "padded_vocab_size",
    "render_builtin_chat_template",
    "DEFAULT_TOKENIZER_TYPE",
]

DEFAULT_TOKENIZER_TYPE = "ByteLevelTokenizer"


class TokenizerError(UserError, ValueError):
    """Bad tokenizer configuration (unknown type, missing directory, unusable tokenizer)."""


def render_builtin_chat_template(messages: Sequence[Dict[str, str]], add_generation_prompt: bool = True) -> str:
    """:func:`megatron.rl.base.chat.render_builtin_chat_template`, raising :class:`TokenizerError` for bad messages."""
    try:
        return chat.render_builtin_chat_template(messages, add_generation_prompt)
    except chat.ChatFormatError as e:
        raise TokenizerError(str(e)) from None


class Tokenizer(ABC):
    """Interface every tokenizer implements.

    Attributes:
        vocab_size: number of token ids (unpadded; see :func:`padded_vocab_size` for the model's size).
        eod: end-of-document id (appended after each document in pretraining data; ends generation).
        pad: padding id.
        bos: beginning-of-sequence id, or None when the tokenizer has none.
    """

    vocab_size: int
    eod: int
    pad: int
    bos: Optional[int]

    @abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Text -> ids. Adds no special tokens (no BOS/EOS): callers add what they need."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text. Special tokens are dropped unless ``skip_special_tokens=False``."""

    @property
    def eos_token_ids(self) -> Set[int]:
        """Ids that end generation."""
        return {self.eod}

    @property
    def eos(self) -> int:
        """Alias of :attr:`eod` (megatron-core reads either name)."""
        return self.eod

    def offsets(self, ids: Sequence[int], text: str) -> List[int]:
        """Character offset in ``text`` (= ``detokenize(ids)``) at which each token starts.

        A token that only completes a character started by an earlier one (e.g. the 2nd byte of a UTF-8
        sequence) gets the offset of that character. Generic (quadratic) fallback: decode every prefix.
        """
        result, previous = [], 0
        for i in range(len(ids)):
            previous = max(previous, min(len(self.detokenize(ids[:i])), len(text)))
            result.append(previous)
        return result

    def stop_triggers(self, stops: Sequence[str]) -> Optional[FrozenSet[int]]:
        """The ids after which one of ``stops`` can newly appear in the generated text, or None if unknown.

        An engine checking stop strings after every token only needs to detokenize when the newest token is
        one of these. None (the default) means the tokenizer gives no such guarantee: check after every token.
        """
        return None

    def apply_chat_template(self, messages: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        """Render a conversation to text (the built-in template; HF tokenizers use their own when present)."""
        return render_builtin_chat_template(messages, add_generation_prompt)

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        """JSON-able identity; megatron-core's GPTDataset hashes it into its index-cache key."""
        return OrderedDict([("class", type(self).__name__)])


_REGISTRY: Registry[Type[Tokenizer]] = Registry("tokenizer type", "--tokenizer-type", error=TokenizerError)


def register_tokenizer(name: str) -> Callable[[Type[Tokenizer]], Type[Tokenizer]]:
    """Class decorator: make ``cls`` buildable as ``build_tokenizer(name, model)``.

    The class is constructed as ``cls(tokenizer_model)``. A different class under a taken name raises
    (a :class:`TokenizerError` and :class:`~megatron.rl.base.registry.DuplicateNameError`).
    """
    return _REGISTRY.register(name)


def known_tokenizer_types() -> List[str]:
    """Names accepted by ``--tokenizer-type``."""
    return _REGISTRY.names()


@register_tokenizer("ByteLevelTokenizer")
class ByteLevelTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are bytes, then ``eod=256``, ``pad=257``, ``bos=258``.

    Needs no files. ``detokenize`` drops special ids and ids outside the vocabulary (a model with a padded
    vocabulary can sample those), unless ``skip_special_tokens=False``, in which case they are written as
    ``<|eod|>``, ``<|pad|>``, ``<|bos|>``, ``<|id:N|>``; bytes decode with ``errors="replace"``, so any id
    sequence (e.g. a generation cut in the middle of a multi-byte character) decodes without raising.
    """

    NUM_BYTES = 256
    SPECIAL_NAMES = ("eod", "pad", "bos")

    def __init__(self, tokenizer_model: Optional[str] = None) -> None:
        if tokenizer_model:
            logger.warning("ByteLevelTokenizer needs no --tokenizer-model; ignoring %r", tokenizer_model)
        self.eod = self.NUM_BYTES
        self.pad = self.NUM_BYTES + 1
        self.bos = self.NUM_BYTES + 2
        self.vocab_size = self.NUM_BYTES + len(self.SPECIAL_NAMES)

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def _special_text(self, token_id: int) -> str:
        if self.NUM_BYTES <= token_id < self.vocab_size:
            return f"<|{self.SPECIAL_NAMES[token_id - self.NUM_BYTES]}|>"
        return f"<|id:{token_id}|>"

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, pending = [], bytearray()
        for token_id in ids:
            token_id = int(token_id)
            if 0 <= token_id < self.NUM_BYTES:
                pending.append(token_id)
            elif not skip_special_tokens:
                out.append(pending.decode("utf-8", errors="replace"))
                pending = bytearray()
                out.append(self._special_text(token_id))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def stop_triggers(self, stops: Sequence[str]) -> Optional[FrozenSet[int]]:
        # UTF-8 decoding (errors="replace") is stable up to the end of every complete character: bytes added
        # later never change text already decoded there. A stop string without U+FFFD therefore appears for the
        # first time exactly when its last byte is appended (special ids in between render as nothing).
        if not stops or any(not s or "\ufffd" in s for s in stops):
            return None
        return frozenset(s.encode("utf-8")[-1] for s in stops)

    def offsets(self, ids: Sequence[int], text: str) -> List[int]:
        # Feed bytes through an incremental decoder: a token starts at the number of characters
        # completed before it (linear time, consistent with detokenize's errors="replace").
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        result, chars = [], 0
        for token_id in ids:
            token_id = int(token_id)
            result.append(min(chars, len(text)))
            if 0 <= token_id < self.NUM_BYTES:
                chars += len(decoder.decode(bytes([token_id])))
        return result


@register_tokenizer("HuggingFaceTokenizer")
class HuggingFaceTokenizer(Tokenizer):
    """A ``transformers`` tokenizer from a local directory (``AutoTokenizer.from_pretrained(dir,
    local_files_only=True)``; never downloads).

    ``eod`` is the tokenizer's ``eos_token_id``; ``pad`` is ``pad_token_id`` or ``eod``; ``bos`` is
    ``bos_token_id`` (may be None); ``vocab_size`` is ``len(tokenizer)`` (base vocabulary plus added tokens).
    ``eos_token_ids`` also includes the ids listed as ``eos_token_id`` in the directory's
    ``generation_config.json`` (chat models often end turns with a different token than ``eos_token``).
    ``apply_chat_template`` uses the tokenizer's own chat template when it has one, else the built-in one.
    ``tokenize`` adds no BOS/EOS; ``detokenize`` drops ids outside ``[0, vocab_size)``.
    """

    def __init__(self, tokenizer_model: Optional[str]) -> None:
        if not tokenizer_model:
            raise TokenizerError(
                "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR "
                "(a local directory with tokenizer files, e.g. one written by save_pretrained)"
            )
        path = os.path.abspath(os.path.expanduser(tokenizer_model))
        if not os.path.isdir(path):
            raise TokenizerError(
                f"--tokenizer-model {tokenizer_model!r}: directory not found (HuggingFaceTokenizer loads from a "
                "local directory only and never downloads; save the tokenizer there with save_pretrained first)"
            )
        try:
            from transformers import AutoTokenizer
        except ImportError as err:  # pragma: no cover - depends on the environment
            raise TokenizerError("HuggingFaceTokenizer needs `transformers` (pip install 'megatron-rl[hf]')") from err
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:
            raise TokenizerError(
                f"--tokenizer-model {tokenizer_model!r}: could not load a tokenizer from this directory "
                f"(expected tokenizer.json / tokenizer_config.json or a vocab file): {type(err).__name__}: {err}"
            ) from err
        self.path = path
        tok = self._tokenizer
        if tok.eos_token_id is None:
            raise TokenizerError(
                f"--tokenizer-model {tokenizer_model!r}: the tokenizer defines no eos_token, which is needed as the "
                "end-of-document id; set eos_token in its tokenizer_config.json"
            )
        self.eod = int(tok.eos_token_id)
        self.pad = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eod
        self.bos = int(tok.bos_token_id) if tok.bos_token_id is not None else None
        self.vocab_size = len(tok)
        self._eos_ids = {self.eod} | self._generation_config_eos_ids(path)

    @staticmethod
    def _generation_config_eos_ids(path: str) -> Set[int]:
        config_file = os.path.join(path, "generation_config.json")
        if not os.path.isfile(config_file):
            return set()
        try:
            with open(config_file, encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
            if value is None:
                return set()
            return {int(v) for v in (value if isinstance(value, list) else [value])}
        except (OSError, ValueError, RecursionError, AttributeError, TypeError) as e:
            raise TokenizerError(f"{config_file}: not a generation config with integer eos_token_id(s) "
                                 f"({type(e).__name__}: {str(e)[:200]})") from None

    @property
    def hf_tokenizer(self):
        """The underlying ``transformers`` tokenizer."""
        return self._tokenizer

    @property
    def eos_token_ids(self) -> Set[int]:
        return set(self._eos_ids)

    @property
    def chat_template(self) -> Optional[str]:
        """The tokenizer's own (Jinja) chat template, or None when it has none."""
        return getattr(self._tokenizer, "chat_template", None)

    def tokenize(self, text: str) -> List[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def detokenize(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Ids outside the vocabulary (a padded-vocab model can sample them) have no text: drop them rather
        # than let the Rust decoder raise on negatives.
        valid = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return self._tokenizer.decode(valid, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: List[Dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            return render_builtin_chat_template(messages, add_generation_prompt)
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        return OrderedDict([("class", type(self).__name__), ("tokenizer_path", self.path),
                            ("vocab_size", self.vocab_size)])


def build_tokenizer(tokenizer_type: str = DEFAULT_TOKENIZER_TYPE, tokenizer_model: Optional[str] = None) -> Tokenizer:
    """Build the tokenizer registered as ``tokenizer_type`` (``--tokenizer-type``) from ``tokenizer_model``
    (``--tokenizer-model``; unused by the byte tokenizer).

    Raises:
        TokenizerError: unknown type (the message lists the known ones) or an unusable ``tokenizer_model``.
    """
    if tokenizer_type not in _REGISTRY:
        raise TokenizerError(
            f"--tokenizer-type {tokenizer_type!r} is not a known tokenizer type; known types: "
            f"{', '.join(known_tokenizer_types())}"
        )
    cls = _REGISTRY.get(tokenizer_type)
    tokenizer = cls(tokenizer_model)
    logger.info("built tokenizer %s (vocab_size=%d, eod=%d, pad=%d, bos=%s)", tokenizer_type,
                tokenizer.vocab_size, tokenizer.eod, tokenizer.pad, tokenizer.bos)
    return tokenizer


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's rule: round ``vocab_size`` up to a multiple of ``make_vocab_size_divisible_by * tp`` so the
    embedding splits evenly across tensor-parallel ranks (``--make-vocab-size-divisible-by``)."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    if make_vocab_size_divisible_by < 1 or tp < 1:
        raise ValueError(
            f"--make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) and tensor-parallel size ({tp}) "
            "must be >= 1"
        )
    multiple = make_vocab_size_divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple
