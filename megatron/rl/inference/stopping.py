"""When generation ends and what a finished sample returns: EOS ids, stop strings, trimming.

Shared by every backend that decodes itself (megatron, huggingface, fake), so they agree on the contract
in :mod:`megatron.rl.inference.api`:

* generation ends at the first EOS id (the EOS token is kept in ``token_ids`` / ``logprobs``, not in
  ``text``) or when the generated text contains a stop string;
* ``text`` is cut *before* the first stop string, while ``token_ids`` / ``logprobs`` keep every token up to
  and including the one that completed it (the trainer sees what was actually sampled);
* ``finish_reason`` is "stop" for either, "length" otherwise.

``detokenize`` is always called with the EOS ids removed.
"""
from __future__ import annotations

from typing import Callable, Collection, Sequence

from megatron.rl.inference.api import InferenceResponse

__all__ = ["first_stop", "visible_text", "completes_stop", "finish_response"]

Detokenize = Callable[[Sequence[int]], str]


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in ``text`` of the earliest occurrence of any of ``stops``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def visible_text(tokens: Sequence[int], eos_ids: Collection[int], detokenize: Detokenize) -> str:
    """The text of ``tokens`` without their EOS ids."""
    return detokenize([t for t in tokens if t not in eos_ids])


def completes_stop(tokens: Sequence[int], stops: Sequence[str], eos_ids: Collection[int], detokenize: Detokenize,
                   tail_only: bool = False) -> bool:
    """Does the text of the generated ``tokens`` contain a stop string (checked after each new token)?

    ``tail_only``: decode only the last tokens that can hold a stop string ending at the newest token (a token
    renders at least a quarter character), so the per-step cost does not grow with the generation.
    """
    if not stops:
        return False
    if tail_only:
        tokens = tokens[-(4 * max(len(s) for s in stops) + 4):]
    return first_stop(visible_text(tokens, eos_ids, detokenize), stops) is not None


def finish_response(prompt_ids: list[int], tokens: list[int], log_probs: list[float], *, eos_ids: Collection[int],
                    stops: Sequence[str], detokenize: Detokenize, prompt_text: str | None) -> InferenceResponse:
    """The response of one finished sample: ``tokens`` / ``log_probs`` as generated, trimmed per the contract.

    ``tokens`` may run past the end (an engine that notices a stop string a step late): everything after the
    first EOS, or after the token that completed the first stop string, is dropped.
    """
    finish = "length"
    for i, token in enumerate(tokens):
        if token in eos_ids:
            tokens, log_probs, finish = tokens[:i + 1], log_probs[:i + 1], "stop"
            break
    text = visible_text(tokens, eos_ids, detokenize)
    if stops:
        cut = first_stop(text, stops)
        if cut is not None:
            text, finish = text[:cut], "stop"
            # the shortest prefix whose text holds a stop string: keep the tokens up to the one completing it
            lo, hi = 1, len(tokens)
            if first_stop(visible_text(tokens[:-1], eos_ids, detokenize), stops) is None:
                lo = hi  # the last token completed it: the usual case (engines stop right after that token)
            while lo < hi:
                mid = (lo + hi) // 2
                if first_stop(visible_text(tokens[:mid], eos_ids, detokenize), stops) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            tokens, log_probs = tokens[:hi], log_probs[:hi]
    return InferenceResponse(text=text, token_ids=list(prompt_ids) + list(tokens), prompt_length=len(prompt_ids),
                             logprobs=list(log_probs), finish_reason=finish, prompt_text=prompt_text)
