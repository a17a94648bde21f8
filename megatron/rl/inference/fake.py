"""A tiny deterministic inference backend for tests: ``build_inference_interface("fake")``.

A real (if silly) language model over UTF-8 bytes plus EOS (id 256), whose next-token logits depend only on the
previous token (a seeded 257x257 table); sampling, stopping and log-prob conventions are the real backends'
own, so :meth:`FakeInference.score` reproduces them exactly. Knobs: ``max_seq_len``, ``delay_s``, ``eos_bias``;
counters show how requests were batched. Each request fails alone.

Details: docs/inference.md.
"""
from __future__ import annotations

import asyncio
from typing import Sequence

import numpy as np
import torch

from megatron.rl.inference.api import (CANCELLED, InferenceInterface, InferenceRequest, InferenceResponse,
                                       run_isolated)
from megatron.rl.inference.chat_template import builtin_chat_template
from megatron.rl.inference.control import TrainerControl
from megatron.rl.inference.sampling import sample_next, tempered_log_probs
from megatron.rl.inference.stopping import completes_stop, finish_response
from megatron.rl.inference.validation import sample_count

__all__ = ["FakeInference"]

EOS_ID = 256
VOCAB_SIZE = 257


@InferenceInterface.register("fake")
class FakeInference(InferenceInterface, TrainerControl):
    """Deterministic byte-level bigram model (see the module docstring)."""

    supports_weight_updates = True  # no weights of the trainer's to miss: any update is trivially seen

    def __init__(self, max_seq_len: int = 2048, delay_s: float = 0.0, eos_bias: float = -1.0, table_seed: int = 0):
        self.max_seq_len = int(max_seq_len)
        self.delay_s = float(delay_s)
        table = np.random.default_rng(table_seed).normal(scale=2.0, size=(VOCAB_SIZE, VOCAB_SIZE))
        allowed = np.zeros(VOCAB_SIZE, dtype=bool)
        allowed[32:127] = True
        allowed[EOS_ID] = True
        table[:, ~allowed] = -np.inf
        table[:, EOS_ID] = eos_bias
        self.table = table
        self.num_batches = 0
        self.num_requests = 0
        self.max_batch_size = 0

    # -- tokenizer-ish helpers (the fake is its own tokenizer) -----------------------------------------
    @staticmethod
    def tokenize(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def detokenize(ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def logits(self, prev_token: int) -> np.ndarray:
        """Next-token logits [vocab] given the previous token."""
        return self.table[prev_token]

    def score(self, token_ids: Sequence[int], prompt_length: int, temperature: float = 1.0) -> list[float]:
        """Teacher-forced log-probs of ``token_ids[prompt_length:]`` under ``softmax(logits / T)``."""
        positions = range(prompt_length, len(token_ids))
        if not positions:
            return []
        logits = torch.from_numpy(np.stack([self.logits(token_ids[i - 1]) for i in positions]))
        log_probs = tempered_log_probs(logits, torch.full((len(positions),), float(temperature), dtype=torch.float64))
        return [float(log_probs[row, token_ids[i]]) for row, i in enumerate(positions)]

    # -- generation -----------------------------------------------------------------------------------
    def _generate_one(self, req: InferenceRequest, index: int) -> InferenceResponse:
        ga = req.generation_args
        prompt_text = req.prompt if req.prompt is not None else builtin_chat_template(req.messages or [])
        prompt_ids = list(req.prefix_token_ids or []) + self.tokenize(prompt_text)
        if len(prompt_ids) >= self.max_seq_len:
            return InferenceResponse.failed(
                f"prompt is {len(prompt_ids)} tokens, the model's maximum sequence length is {self.max_seq_len}; "
                "shorten the prompt", prompt_text=prompt_text)
        # Unseeded requests are still deterministic (seeded by their position), which keeps tests exact.
        generator = torch.Generator().manual_seed(ga.seed if ga.seed is not None else 1_000_003 + index)
        tokens: list[int] = []
        logprobs: list[float] = []
        budget = min(ga.max_tokens, self.max_seq_len - len(prompt_ids))
        previous = prompt_ids[-1]
        for _ in range(budget):
            if req.cancelled:  # the caller left (a disconnected HTTP client): stop within one token
                return InferenceResponse.failed(CANCELLED, prompt_text)
            token, lp = sample_next(torch.from_numpy(self.logits(previous))[None], [ga], [generator])
            previous = int(token[0])
            tokens.append(previous)
            logprobs.append(float(lp[0]))
            if previous == EOS_ID or completes_stop(tokens, ga.stop, {EOS_ID}, self.detokenize):
                break
        return finish_response(prompt_ids, tokens, logprobs, eos_ids={EOS_ID}, stops=ga.stop,
                               detokenize=self.detokenize, prompt_text=prompt_text)

    def _generate_batch(self, flat: list[InferenceRequest]) -> list[InferenceResponse]:
        return [self._generate_one(r, i) for i, r in enumerate(flat)]

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        samples = sum(sample_count(r) for r in requests)
        self.num_batches += 1
        self.num_requests += samples
        self.max_batch_size = max(self.max_batch_size, samples)
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
        return await asyncio.to_thread(run_isolated, requests, self._generate_batch)
