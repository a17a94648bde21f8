"""A tiny local reward model that prefers digits: a 2-layer Llama sequence classifier (one label) trained for a
few seconds to score a text by the share of its characters that are digits. No downloads."""
from __future__ import annotations

import random
import string
from pathlib import Path

from tests.unit_tests.rl.training.data.data_test_utils import save_tiny_hf_tokenizer

ALPHABET = string.ascii_letters + string.punctuation + " "


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def _random_text(rng: random.Random) -> str:
    n, share = rng.randint(1, 8), rng.random()
    return "".join(rng.choice(string.digits) if rng.random() < share else rng.choice(ALPHABET) for _ in range(n))


def build_digit_reward_model(path: str | Path, steps: int = 300, seed: int = 0, num_labels: int = 1) -> Path:
    """Train and save the reward model under ``path`` (tokenizer included); returns the path."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    path = Path(path)
    save_tiny_hf_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, num_labels=num_labels)
    model = LlamaForSequenceClassification(cfg)
    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        texts = [_random_text(rng) for _ in range(64)]
        batch = tok(texts, return_tensors="pt", padding=True)
        target = torch.tensor([digit_share(t) for t in texts])
        loss = ((model(**batch).logits[:, 0] - target) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    return path
