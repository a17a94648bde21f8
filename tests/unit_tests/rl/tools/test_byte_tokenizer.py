"""Our byte-level tokenizer as Hugging Face files: AutoTokenizer gives our ids, and conversions carry it both ways."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_hf_models import build_tiny_hf_model, save_tiny_tokenizer  # noqa: E402

from tools.checkpoint_conversion.byte_tokenizer import is_byte_level_tokenizer, write_byte_level_tokenizer

# text that trips tokenizers: multi-byte characters, our special tokens' text, GPT-2's byte-symbol characters,
# control characters, leading spaces (no prefix space may be added)
ALPHABET = ["a", "Z", "7", " ", "  ", "\n", "\t", "\r", "\x00", "+", "=?", "é", "€", "🙂", "Ġ", "<|eod|>", "<|bos|>",
            "<|pad|>", "<|", "|>", "Q: 3+5=? A:"]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("byte_tok")
    write_byte_level_tokenizer(path, model_max_length=128)
    return AutoTokenizer.from_pretrained(path), path


def test_auto_tokenizer_encodes_decodes_and_templates_as_ours(hf_tok):
    from megatron.rl.base.chat import render_builtin_chat_template
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    tok, _ = hf_tok
    ours = ByteLevelTokenizer()
    assert (len(tok), tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (259, ours.eod, ours.pad, None)
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 12)))
        assert tok(text)["input_ids"] == ours.tokenize(text), text  # the standard call: nothing added
        ids = [rng.randrange(259) for _ in range(rng.randint(0, 16))]  # any bytes, even invalid UTF-8
        assert tok.decode(ids, skip_special_tokens=True) == ours.detokenize(ids), ids
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2=?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}]
    for gen in (True, False):
        assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
            render_builtin_chat_template(messages, gen)


def test_only_exactly_our_files_count_as_the_byte_level_tokenizer(hf_tok, tmp_path):
    _, path = hf_tok
    assert is_byte_level_tokenizer(path)
    save_tiny_tokenizer(tmp_path / "word")
    assert not is_byte_level_tokenizer(tmp_path / "word") and not is_byte_level_tokenizer(tmp_path / "none")
    changed = json.loads((path / "tokenizer.json").read_text())
    changed["added_tokens"][2]["content"] = "<s>"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "tokenizer.json").write_text(json.dumps(changed))
    (tmp_path / "other" / "tokenizer_config.json").write_text((path / "tokenizer_config.json").read_text())
    assert not is_byte_level_tokenizer(tmp_path / "other")


def test_byte_level_model_converts_both_ways_with_its_tokenizer(tmp_path):
    """A byte-vocabulary model with our tokenizer: HF -> Megatron trains it with --tokenizer-type
    ByteLevelTokenizer, Megatron -> HF writes the same tokenizer, a config that agrees with it (no BOS), and the
    same weights; AutoTokenizer + AutoModelForCausalLM then score text as the original model did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron.rl.runtime import setup_runtime
    from megatron.rl.training.checkpoint.args import read_checkpoint_flags
    from tools.checkpoint_conversion.hf_to_megatron import convert_hf_to_megatron
    from tools.checkpoint_conversion.megatron_to_hf import convert_megatron_to_hf

    setup_runtime()
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "hf_back"
    model = build_tiny_hf_model(hf_dir, "llama", tokenizer=False, vocab_size=259)
    write_byte_level_tokenizer(hf_dir)
    convert_hf_to_megatron(hf_dir, ckpt)
    flags = read_checkpoint_flags(ckpt)
    assert (flags["tokenizer_type"], flags["tokenizer_model"]) == ("ByteLevelTokenizer", None)
    assert "--tokenizer-type ByteLevelTokenizer" in (ckpt / "megatron_args.txt").read_text()

    import shutil

    shutil.rmtree(ckpt / "hf_config")  # the config is then written from the model flags
    shutil.rmtree(ckpt / "tokenizer")  # and the tokenizer from --tokenizer-type ByteLevelTokenizer
    convert_megatron_to_hf(ckpt, back)
    assert is_byte_level_tokenizer(back)
    config = json.loads((back / "config.json").read_text())
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (256, 257, None)
    assert config["vocab_size"] == 384  # the padded vocabulary (259 -> a multiple of 128) the model was built with
    tok = AutoTokenizer.from_pretrained(back)
    reloaded = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    assert reloaded.config.bos_token_id is None and tok.bos_token_id is None  # nothing suggests prepending one
    batch = tok(["Q: 3+5=? A: 8", "héllo"], return_tensors="pt", padding=True)
    with torch.no_grad():
        got = reloaded(**batch).logits
        want = model(**batch).logits
    torch.testing.assert_close(got[..., :259], want, atol=1e-5, rtol=0)


def test_a_model_without_any_tokenizer_converts_with_a_warning(tmp_path, caplog):
    from megatron.rl.runtime import setup_runtime
    from tools.checkpoint_conversion.hf_to_megatron import convert_hf_to_megatron
    from tools.checkpoint_conversion.megatron_to_hf import convert_megatron_to_hf

    setup_runtime()
    hf_dir, ckpt = tmp_path / "hf", tmp_path / "megatron"
    build_tiny_hf_model(hf_dir, "qwen2", tokenizer=False)  # vocab 200: not our byte vocabulary
    convert_hf_to_megatron(hf_dir, ckpt)
    with caplog.at_level("WARNING"):
        convert_megatron_to_hf(ckpt, tmp_path / "back")
    assert "will carry no tokenizer" in caplog.text and "--tokenizer-dir" in caplog.text
    assert not list((tmp_path / "back").glob("tokenizer*"))
