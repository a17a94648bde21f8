"""Tokenizers: byte-level and Hugging Face (from a local dir), registry, chat templates, vocab padding,
and compatibility with megatron-core's TextGenerationController."""
from __future__ import annotations

import functools
import pickle

import pytest
import torch

from megatron.rl.training.tokenizer import (
    ByteLevelTokenizer,
    HuggingFaceTokenizer,
    Tokenizer,
    TokenizerError,
    build_tokenizer,
    known_tokenizer_types,
    padded_vocab_size,
    register_tokenizer,
    render_builtin_chat_template,
)

TEXTS = ["", "hello", "héllo wörld — 日本語 🚀", "tabs\tand\nnewlines\r\n", "\x00\x7f", "ÿ" * 5]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]


def reference_offsets(text: str) -> list[int]:
    """Char offset of each UTF-8 byte of ``text``, computed from the characters (not by decoding bytes)."""
    out = []
    for char_index, ch in enumerate(text):
        out.extend([char_index] * len(ch.encode("utf-8")))
    return out


# ---------------------------------------------------------------- byte level


@pytest.mark.parametrize("text", TEXTS)
def test_byte_roundtrip_is_utf8(text):
    tok = ByteLevelTokenizer()
    ids = tok.tokenize(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids) == text


def test_byte_specials():
    tok = build_tokenizer("ByteLevelTokenizer", None)
    assert (tok.eod, tok.pad, tok.bos, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.eos_token_ids == {256} and tok.eos == 256
    ids = [tok.bos] + tok.tokenize("ab") + [tok.eod, tok.pad, 300, -1]
    assert tok.detokenize(ids) == "ab"  # specials and out-of-vocab (padded-vocab) ids dropped
    assert tok.detokenize(ids, skip_special_tokens=False) == "<|bos|>ab<|eod|><|pad|><|id:300|><|id:-1|>"
    # A generation cut inside a multi-byte character decodes with a replacement char instead of raising.
    assert tok.detokenize(tok.tokenize("é")[:1] + tok.tokenize("x")) == "\ufffdx"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_offsets_match_character_positions(text):
    tok = ByteLevelTokenizer()
    ids = tok.tokenize(text) + [tok.eod]
    assert tok.offsets(ids, tok.detokenize(ids)) == reference_offsets(text) + [len(text)]


def test_byte_stop_triggers_hold_every_token_that_can_complete_a_stop_string():
    """Brute force over random id streams (bytes of multi-byte characters cut anywhere, stray continuation
    bytes, specials): whenever appending an id makes a stop string appear in the text, that id is a trigger."""
    import random

    tok = ByteLevelTokenizer()
    stops = ["\n", "é", "🚀!", "ab", "\n\n"]
    triggers = tok.stop_triggers(stops)
    assert triggers == {ord("\n"), "é".encode()[-1], ord("!"), ord("b")}
    pieces = [list(ch.encode()) for ch in "ab\n!é🚀x"] + [[0x80], [0xC3], [0xF0, 0x9F], [tok.eod], [tok.pad], [300]]
    rng = random.Random(0)
    checked = 0
    for _ in range(3000):
        ids = [i for _ in range(rng.randint(1, 8)) for i in rng.choice(pieces)]
        text = ""
        for n in range(1, len(ids) + 1):
            before, text = text, tok.detokenize(ids[:n])
            for stop in stops:
                if stop in text and stop not in before:
                    checked += 1
                    assert ids[n - 1] in tok.stop_triggers([stop]), (ids[:n], stop)
    assert checked > 1000
    # no guarantee for a stop string that holds the replacement character: every token is checked
    assert tok.stop_triggers(["\ufffd"]) is None and tok.stop_triggers([]) is None
    assert Tokenizer.stop_triggers(tok, ["x"]) is None  # the interface's default: unknown


def test_byte_tokenizer_is_picklable():
    tok = ByteLevelTokenizer()
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize("añb") == tok.tokenize("añb") and clone.eod == tok.eod


def test_builtin_chat_template():
    tok = ByteLevelTokenizer()
    expected = "<|system|>\nBe brief.\n<|user|>\n2+2?\n"
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(MESSAGES) == expected + "<|assistant|>\n"
    with pytest.raises(TokenizerError, match="'role' and 'content'"):
        render_builtin_chat_template([{"content": "x"}])


# ---------------------------------------------------------------- registry, padding


def test_unknown_tokenizer_type_lists_known_types():
    with pytest.raises(TokenizerError) as err:
        build_tokenizer("GPT2BPETokenizer", None)
    msg = str(err.value)
    assert "--tokenizer-type 'GPT2BPETokenizer'" in msg
    assert "ByteLevelTokenizer" in msg and "HuggingFaceTokenizer" in msg


def test_register_tokenizer_decorator():
    @register_tokenizer("_TestUpperBytes")
    class UpperBytes(ByteLevelTokenizer):
        def tokenize(self, text):
            return super().tokenize(text.upper())

    try:
        assert "_TestUpperBytes" in known_tokenizer_types()
        assert build_tokenizer("_TestUpperBytes", None).tokenize("ab") == [65, 66]
        with pytest.raises(TokenizerError, match="already registered"):
            register_tokenizer("_TestUpperBytes")(ByteLevelTokenizer)
    finally:
        from megatron.rl.training import tokenizer as tokenizer_module

        tokenizer_module._REGISTRY.pop("_TestUpperBytes")


@pytest.mark.parametrize("vocab,divisible,tp,expected", [(259, 128, 1, 384), (259, 128, 2, 512), (256, 128, 1, 256),
                                                         (257, 128, 1, 384), (50257, 128, 8, 51200), (1, 1, 1, 1)])
def test_padded_vocab_size(vocab, divisible, tp, expected):
    assert padded_vocab_size(vocab, divisible, tp) == expected


def test_padded_vocab_size_rejects_bad_values():
    with pytest.raises(ValueError, match="make-vocab-size-divisible-by"):
        padded_vocab_size(10, 0, 1)


# ---------------------------------------------------------------- Hugging Face


def test_hf_tokenizer_from_local_dir(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(hf_tokenizer_dir), local_files_only=True)
    tok = build_tokenizer("HuggingFaceTokenizer", str(hf_tokenizer_dir))
    assert isinstance(tok, HuggingFaceTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.pad, tok.bos, tok.eod) == (0, 1, 2)
    assert tok.vocab_size == len(ref) > 250
    assert tok.eos_token_ids == {2, 3}  # eos_token plus generation_config.json's eos ids
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids == ref.encode(text, add_special_tokens=False)  # no BOS/EOS added
        assert tok.detokenize(ids) == text
    ids = [tok.bos] + tok.tokenize("Hello world") + [tok.eod]
    assert tok.detokenize(ids) == "Hello world"
    assert tok.detokenize(ids, skip_special_tokens=False) == "<s>Hello world</s>"
    assert tok.detokenize(ids + [tok.vocab_size + 5, -1]) == "Hello world"  # padded-vocab ids dropped
    assert pickle.loads(pickle.dumps(tok)).tokenize("fox") == tok.tokenize("fox")


def test_hf_offsets_cover_text(hf_tokenizer_dir):
    tok = HuggingFaceTokenizer(str(hf_tokenizer_dir))
    text = "The quick brown fox, Grüße!"
    ids = tok.tokenize(text)
    offsets = tok.offsets(ids, text)
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == len(ids)
    pieces = [text[a:b] for a, b in zip(offsets, offsets[1:] + [len(text)])]
    assert "".join(pieces) == text
    # With ASCII text every token is whole characters, so each piece is exactly that token's own text.
    ascii_text = "The quick brown fox jumps"
    ascii_ids = tok.tokenize(ascii_text)
    starts = tok.offsets(ascii_ids, ascii_text)
    assert [ascii_text[a:b] for a, b in zip(starts, starts[1:] + [len(ascii_text)])] == \
        [tok.detokenize([i]) for i in ascii_ids]


def test_hf_chat_template_from_tokenizer(hf_tokenizer_dir):
    tok = HuggingFaceTokenizer(str(hf_tokenizer_dir))
    assert tok.chat_template is not None
    assert tok.apply_chat_template(MESSAGES) == "[system]Be brief.|[user]2+2?|[assistant]"
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == "[system]Be brief.|[user]2+2?|"


def test_hf_without_template_or_pad_uses_builtin_and_eod(hf_tokenizer_dir_plain):
    tok = HuggingFaceTokenizer(str(hf_tokenizer_dir_plain))
    assert tok.chat_template is None
    assert tok.apply_chat_template(MESSAGES) == render_builtin_chat_template(MESSAGES)
    assert tok.pad == tok.eod == 2 and tok.eos_token_ids == {2}


def test_hf_missing_dir_and_missing_files(tmp_path):
    with pytest.raises(TokenizerError, match="directory not found.*never downloads"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="could not load a tokenizer from this directory"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "empty"))
    with pytest.raises(TokenizerError, match="needs --tokenizer-model"):
        build_tokenizer("HuggingFaceTokenizer", None)


@pytest.mark.parametrize("content", [b"\xff\xfe{}", b"[" * 100_000, b"[1, 2]", b'{"eos_token_id": "x"}', b"{"])
def test_hf_bad_generation_config_is_a_named_tokenizer_error(hf_tokenizer_dir, tmp_path, content):
    import shutil

    bad = tmp_path / "tok"
    shutil.copytree(hf_tokenizer_dir, bad)
    (bad / "generation_config.json").write_bytes(content)
    with pytest.raises(TokenizerError, match=r"generation_config\.json: not a generation config with integer "
                                             r"eos_token_id\(s\)"):
        HuggingFaceTokenizer(str(bad))


# ---------------------------------------------------------------- megatron-core inference compatibility


def _controller_with(tokenizer):
    """A TextGenerationController with only its tokenizer set: the tokenizer-facing methods need nothing
    else (the constructor needs a model and CUDA)."""
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    controller = TextGenerationController.__new__(TextGenerationController)
    controller.tokenizer = tokenizer
    return controller


@pytest.mark.parametrize("kind", ["byte", "hf"])
def test_megatron_core_text_generation_controller_accepts_tokenizer(kind, hf_tokenizer_dir):
    tok = ByteLevelTokenizer() if kind == "byte" else HuggingFaceTokenizer(str(hf_tokenizer_dir))
    from megatron.rl.runtime import versions

    controller = _controller_with(tok)
    prompt = "Grüße, fox"
    if versions.is_0_19():  # 0.19: static methods that take the tokenizer
        tokenize = functools.partial(type(controller).tokenize_prompt, tok)

        def detokenize(ids, **kwargs):
            return type(controller).detokenize(tok, ids, **kwargs)
    else:
        tokenize, detokenize = controller.tokenize_prompt, controller._detokenize
    assert tokenize(prompt) == tok.tokenize(prompt)
    assert tokenize(prompt, add_BOS=True) == [tok.bos] + tok.tokenize(prompt)

    generated = tok.tokenize(prompt + " jumps") + [tok.eod]
    tokens = torch.tensor(generated)
    text, segments = controller.detokenize_generations(tokens, torch.tensor([len(generated)]), False)
    assert text == prompt + " jumps" and segments is None
    text, segments = controller.detokenize_generations(tokens, torch.tensor([len(generated)]), True)
    assert text == prompt + " jumps"
    assert len(segments) == 1 and len(segments[0]) == len(generated) and "".join(segments[0]) == text
    # The controller detects the skip_special_tokens keyword and forwards it.
    assert detokenize([tok.bos, *tok.tokenize("a")], skip_special_tokens=False) != "a"
    assert detokenize([tok.bos, *tok.tokenize("a")]) == "a"
    # Attributes the engine reads directly (termination id, sampling clamp, GPTDataset pad handling).
    assert isinstance(tok.eod, int) and isinstance(tok.vocab_size, int) and isinstance(tok.pad, int)
    assert isinstance(dict(tok.unique_identifiers)["class"], str)
