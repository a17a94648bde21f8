"""Build a tiny random-init Llama + byte-level BPE tokenizer in a directory (no downloads)."""
from __future__ import annotations

from pathlib import Path

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you today?",
          "1 + 2 = 3, 4 * 5 = 20, what is 7 - 3?", "<|user|> hi <|assistant|> hello"] * 4

CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]: {% endif %}")


def build_tiny_hf_model(path: str | Path, chat_template: bool = False, seed: int = 0, vocab_size: int = 300) -> Path:
    """Save a ~50k-parameter LlamaForCausalLM and its tokenizer to ``path``; return the path."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template:
        hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(hf_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                      bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                      pad_token_id=hf_tok.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharper-than-default logits so sampling is not uniform noise
        model.lm_head.weight.mul_(20.0)
    model.save_pretrained(path)
    return path
