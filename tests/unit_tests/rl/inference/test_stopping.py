"""EOS / stop-string trimming shared by the backends, against an incremental reference written another way."""
from __future__ import annotations

import random

import pytest

from megatron.rl.inference.stopping import completes_stop, finish_response

EOS = 0
ALPHABET = {1: "a", 2: "b", 3: "c", 4: "ab", 5: " ", 6: "bc"}


def detok(ids):
    assert EOS not in ids  # the finaliser never shows EOS ids to the tokenizer
    return "".join(ALPHABET[i] for i in ids)


def reference(tokens, stops):
    """What a backend that checks after every token returns: decode the growing prefix, stop at the first hit."""
    text = ""
    for n, token in enumerate(tokens, start=1):
        if token == EOS:
            return tokens[:n], text, "stop"
        text = detok([t for t in tokens[:n]])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return tokens[:n], text[:min(hits)], "stop"
    return list(tokens), text, "length"


@pytest.mark.parametrize("seed", range(200))
def test_finish_response_matches_the_incremental_reference(seed):
    rng = random.Random(seed)
    tokens = [rng.choice([1, 2, 3, 4, 5, 6] * 6 + [EOS]) for _ in range(rng.randint(1, 12))]
    stops = rng.sample(["b", "ca", "ab ", "cc", "zz", "a b", "bcb"], rng.randint(0, 2))
    log_probs = [-0.1 * (i + 1) for i in range(len(tokens))]
    r = finish_response([7, 8], tokens, log_probs, eos_ids={EOS}, stops=stops, detokenize=detok, prompt_text="p")
    kept, text, finish = reference(tokens, stops)
    assert (r.generated_token_ids, r.text, r.finish_reason) == (kept, text, finish)
    assert r.logprobs == log_probs[:len(kept)] and r.token_ids[:2] == [7, 8] and r.prompt_length == 2


def test_completes_stop_tail_only_sees_a_stop_string_ending_at_the_newest_token():
    tokens = [1] * 50 + [2, 3]  # "a" * 50 + "bc"
    assert completes_stop(tokens, ["bc"], {EOS}, detok, tail_only=True)
    assert completes_stop(tokens, ["aab"], {EOS}, detok, tail_only=True)
    assert not completes_stop(tokens, ["zz"], {EOS}, detok, tail_only=True)
    assert not completes_stop(tokens, [], {EOS}, detok)
