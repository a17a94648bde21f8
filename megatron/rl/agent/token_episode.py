"""Token-in/token-out multi-turn episodes: the tokens trained on are exactly the tokens the engine produced.

Turn 0 sends the prompt as text (or chat messages) and keeps the engine's ``token_ids``. Every later turn
sends the episode's tokens so far as ``InferenceRequest.prefix_token_ids`` with the environment's
observation as the text after them, so earlier turns are never re-tokenized: a generated token sequence
that would tokenize differently as text (a multi-byte character split across tokens, a merge the model did
not choose) stays as the policy sampled it. The backend tokenizes the observation alone.

Masks and log-probs follow :class:`~megatron.rl.base.types.TokenRollout`: prompt and observation tokens
get mask 0 and log-prob 0.0, generated tokens mask 1 and the engine's log-prob.
"""
from __future__ import annotations

import dataclasses

from megatron.rl.inference.api import GenerationArgs, InferenceRequest, InferenceResponse
from megatron.rl.base.errors import RLError

__all__ = ["TokenEpisode", "TokenMismatchError"]


class TokenMismatchError(RLError, RuntimeError):
    """The backend answered a token-in request with tokens that do not start with the prefix it was given."""


@dataclasses.dataclass
class TokenEpisode:
    """The token record of one episode, extended turn by turn (see the module docstring).

    token_ids [L], generation_mask [L], logprobs [L] or None (None once any turn came without log-probs),
    prompt_length: the first turn's prompt tokens, turns: responses added.
    """

    token_ids: list[int] = dataclasses.field(default_factory=list)
    generation_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] | None = dataclasses.field(default_factory=list)
    prompt_length: int = 0
    turns: int = 0

    @property
    def started(self) -> bool:
        return bool(self.token_ids)

    def next_request(self, text: str, generation_args: GenerationArgs,
                     messages: list | None = None) -> InferenceRequest:
        """The request for the next turn: the first turn's prompt (``text`` or chat ``messages``), or the
        episode's tokens followed by ``text`` (the observation, possibly empty) afterwards."""
        if not self.started:
            if messages is not None:
                return InferenceRequest(messages=messages, generation_args=generation_args)
            return InferenceRequest(prompt=text, generation_args=generation_args)
        return InferenceRequest(prompt=text, prefix_token_ids=list(self.token_ids), generation_args=generation_args)

    def add(self, response: InferenceResponse) -> None:
        """Append a turn's response (to the request :meth:`next_request` built).

        Raises TokenMismatchError when the response does not begin with the episode's tokens.
        """
        ids, pl = list(response.token_ids), response.prompt_length
        n = len(self.token_ids)
        if ids[:n] != self.token_ids or pl < n:
            raise TokenMismatchError(f"the backend's tokens for turn {self.turns} do not start with the "
                                     f"{n} tokens of the episode so far (token-in prompt not honoured)")
        generated = len(ids) - pl
        if not self.started:
            self.prompt_length = pl
        self.token_ids = ids
        self.generation_mask += [0] * (pl - n) + [1] * generated
        if self.logprobs is None or response.logprobs is None:
            self.logprobs = None
        else:
            self.logprobs += [0.0] * (pl - n) + list(response.logprobs)
        self.turns += 1
