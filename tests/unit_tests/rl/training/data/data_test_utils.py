"""Helpers for tokenizer/data tests: tiny Hugging Face tokenizers (no downloads), JSONL writers."""
from __future__ import annotations

import json
from pathlib import Path

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you today?",
          "Grüße aus Köln, 日本語のテキスト.", "1 + 2 = 3 and 4 * 5 = 20"] * 3

HF_CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}|{% endfor %}"
                    "{% if add_generation_prompt %}[assistant]{% endif %}")


def save_tiny_hf_tokenizer(path: Path, chat_template: str | None = None, generation_eos: list[int] | None = None,
                           pad: bool = True) -> Path:
    """Train a ~300-token byte-level BPE in memory and save it with save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>", "<eot>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    kwargs = dict(bos_token="<s>", eos_token="</s>", additional_special_tokens=["<eot>"])
    if pad:
        kwargs["pad_token"] = "<pad>"
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)
    if chat_template is not None:
        hf_tok.chat_template = chat_template
    path.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(path)
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


def write_jsonl(path: Path, texts: list[str], key: str = "text") -> Path:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path
