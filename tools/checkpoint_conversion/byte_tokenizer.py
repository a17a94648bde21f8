"""Our byte-level tokenizer (``--tokenizer-type ByteLevelTokenizer``) as Hugging Face tokenizer files.

``AutoTokenizer.from_pretrained(DIR)`` loads what :func:`write_byte_level_tokenizer` writes as a tokenizer giving
our ids: UTF-8 bytes 0..255, then ``<|eod|>`` 256, ``<|pad|>`` 257, ``<|bos|>`` 258. Must not add anything to
the text (no BOS: the model never saw one), nor read special-token text as special ids. The chat template is the
built-in one. :func:`is_byte_level_tokenizer` recognises the files, so they convert back.

Why each choice: docs/checkpoint_conversion.md.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["write_byte_level_tokenizer", "is_byte_level_tokenizer", "TOKENIZER_JSON", "TOKENIZER_CONFIG"]

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def _specials() -> list[str]:
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    return [f"<|{name}|>" for name in ByteLevelTokenizer.SPECIAL_NAMES]


def _byte_symbols() -> dict[str, int]:
    """Symbol -> id for the 256 bytes, in the byte-to-printable-character map of the ``ByteLevel`` pre-tokenizer
    (the id of a byte's symbol is the byte's value)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(shifted)}
    return {chars[b]: b for b in range(256)}


def _tokenizer_json() -> dict:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=_byte_symbols(), merges=[]))
    # no regex split and no prefix space: the text's bytes, in order, nothing added
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in _specials()])
    return json.loads(tok.to_str())


def _tokenizer_config(model_max_length: int | None) -> dict:
    from megatron.rl.base.chat import BUILTIN_CHAT_TEMPLATE_JINJA

    eod, pad, bos = _specials()
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod, "pad_token": pad, "bos_token": None,
              "additional_special_tokens": [bos], "add_bos_token": False, "add_eos_token": False,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False,
              "chat_template": BUILTIN_CHAT_TEMPLATE_JINJA}
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    return config


def special_token_ids() -> dict[str, int | None]:
    """The ``config.json`` entries that agree with the written tokenizer (no BOS: see the module docstring)."""
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    tok = ByteLevelTokenizer()
    return {"eos_token_id": tok.eod, "pad_token_id": tok.pad, "bos_token_id": None}


def write_byte_level_tokenizer(save_dir: str | Path, model_max_length: int | None = None) -> list[Path]:
    """Write the tokenizer files into ``save_dir`` (created); returns their paths."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for name, content in ((TOKENIZER_JSON, _tokenizer_json()), (TOKENIZER_CONFIG, _tokenizer_config(model_max_length))):
        (save_dir / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        out.append(save_dir / name)
    return out


def is_byte_level_tokenizer(tokenizer_dir: str | Path) -> bool:
    """Whether ``tokenizer_dir`` holds exactly the tokenizer :func:`write_byte_level_tokenizer` writes (same
    vocabulary, pre-tokenizer, decoder and special tokens; a file merely claiming to be one is not enough)."""
    tokenizer_dir = Path(tokenizer_dir)
    try:
        found = json.loads((tokenizer_dir / TOKENIZER_JSON).read_text(encoding="utf-8"))
        config = json.loads((tokenizer_dir / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(found, dict) or not isinstance(config, dict):
        return False
    want = _tokenizer_json()
    keys = ("model", "pre_tokenizer", "decoder", "normalizer", "post_processor")
    same_ids = [(t.get("id"), t.get("content")) for t in found.get("added_tokens") or [] if isinstance(t, dict)] == \
        [(t["id"], t["content"]) for t in want["added_tokens"]]
    return same_ids and all(found.get(k) == want.get(k) for k in keys) and not config.get("add_bos_token")
