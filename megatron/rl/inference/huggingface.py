"""Hugging Face ``transformers`` backend: ``build_inference_interface("huggingface", model_path=DIR)``.

Loads ``AutoModelForCausalLM`` + ``AutoTokenizer`` from a *local* directory (never downloads) and runs
its own batched decoding loop with a KV cache instead of ``model.generate``: every request in a batch
keeps its own temperature / top-k / top-p / seed / stop strings, and we control exactly which
log-probs are reported (``softmax(logits / T)`` before truncation, T=1 when greedy; see
:mod:`megatron.rl.inference.api`).

Batching: prompts are left-padded to a common length (position ids count only real tokens, so a padded
row computes exactly what it would alone); rows that finish keep being fed a pad token whose output
is ignored. Stop strings are matched on the decoded generated text; the returned ``text`` is cut before
the stop string while ``token_ids`` / ``logprobs`` keep every generated token up to and including the
one that completed it (that is what the model actually produced).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from megatron.rl.inference.api import (GenerationArgs, InferenceError, InferenceInterface, InferenceRequest,
                                       InferenceResponse, logprob_temperature, run_isolated)
from megatron.rl.inference.chat_template import render_chat
from megatron.rl.runtime.openmp import release_thread_pool

logger = logging.getLogger(__name__)

__all__ = ["HuggingFaceInference", "sample_batch"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def sample_batch(logits: torch.Tensor, args: Sequence[GenerationArgs],
                 generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` [batch, vocab], each row with its own sampling settings.

    Returns ``(tokens, logprobs)`` (length batch). Each log-prob is under ``softmax(logits / T)`` of its row
    (T=1 when greedy), before top-k/top-p truncation. Rows with ``temperature == 0`` take the argmax; the
    others draw one uniform number from their own generator (so a seeded request is reproducible whatever
    else is in the batch) and invert the CDF of the truncated, renormalised distribution.
    """
    logits = logits.float()
    temps = torch.tensor([logprob_temperature(a.temperature) for a in args], dtype=logits.dtype)
    logp = torch.log_softmax(logits / temps[:, None], dim=-1)  # [B, V]
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, a in enumerate(args) if a.temperature > 0]
    if sampled:
        idx = torch.tensor(sampled)
        sorted_p, order = torch.sort(logp[idx].exp(), dim=-1, descending=True, stable=True)  # [S, V]
        vocab = sorted_p.shape[-1]
        top_k = torch.tensor([args[i].top_k if args[i].top_k > 0 else vocab for i in sampled])
        top_p = torch.tensor([args[i].top_p for i in sampled], dtype=sorted_p.dtype)
        rank = torch.arange(vocab)[None, :]
        cum = torch.cumsum(sorted_p, dim=-1)
        # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass *before* it is
        # still short of top_p (the first token always stays)
        keep = (rank < top_k[:, None]) & ((cum - sorted_p) < top_p[:, None] * cum[:, -1:])
        kept = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        cdf = torch.cumsum(kept, dim=-1)
        u = torch.stack([torch.rand((), generator=generators[i], dtype=cdf.dtype) for i in sampled]) * cdf[:, -1]
        pos = torch.searchsorted(cdf, u[:, None], right=True).clamp(max=vocab - 1)
        pos = torch.minimum(pos, keep.sum(-1, keepdim=True) - 1)  # never step past the kept prefix
        tokens[idx] = order.gather(-1, pos)[:, 0]
    lps = logp.gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), lps.tolist()


@dataclass
class _Row:
    """Decoding state of one sample."""
    args: GenerationArgs
    prompt_text: str
    prompt_ids: list[int]
    generator: torch.Generator | None
    budget: int
    gen_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish: str | None = None


@InferenceInterface.register("huggingface")
class HuggingFaceInference(InferenceInterface):
    """A local ``transformers`` causal LM.

    Args:
        model_path: local directory with ``config.json``, weights and tokenizer files.
        device: torch device ("cpu", "cuda", "cuda:1"); default: cuda if available else cpu.
        dtype: "float32" (default), "bfloat16" or "float16".
        max_batch_size: most samples decoded together; larger request lists run in several batches.
        max_seq_len: prompt + generation limit; default ``config.max_position_embeddings``.
        model / tokenizer: pass already-built objects instead of loading (``model_path`` then optional).
    """

    def __init__(self, model_path: str | None = None, device: str | None = None, dtype: str = "float32",
                 max_batch_size: int = 64, max_seq_len: int | None = None, model: Any = None, tokenizer: Any = None,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if dtype not in _DTYPES:
            raise ValueError(f"huggingface backend: dtype={dtype!r} is not one of {sorted(_DTYPES)}")
        if model is None or tokenizer is None:
            if model_path is None or not os.path.isdir(model_path):
                raise InferenceError(f"huggingface backend: model_path={model_path!r} is not a local directory; "
                                     "pass a directory containing config.json, weights and tokenizer files "
                                     "(this backend never downloads)")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(
            model_path, local_files_only=True, trust_remote_code=trust_remote_code)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=_DTYPES[dtype],
                                                         trust_remote_code=trust_remote_code)
        self.model = model.to(self.device).eval()
        self.max_batch_size = int(max_batch_size)
        self.max_seq_len = int(max_seq_len or getattr(self.model.config, "max_position_embeddings", 2048))
        self.eos_ids = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0))
        # One decoding loop at a time: torch modules are not safe to run from two threads at once.
        self._lock = threading.Lock()

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for src in (self.tokenizer.eos_token_id, getattr(getattr(self.model, "generation_config", None),
                                                         "eos_token_id", None)):
            if src is None:
                continue
            ids.update([src] if isinstance(src, int) else list(src))
        return ids

    # -- request preparation ----------------------------------------------------------------------------
    def _prepare(self, req: InferenceRequest) -> _Row | InferenceResponse:
        ga = req.generation_args
        if req.messages is not None:
            prompt_text = render_chat(req.messages, self.tokenizer)
            prompt_ids = self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]  # template has specials
        else:
            prompt_text = req.prompt
            prompt_ids = self.tokenizer(prompt_text)["input_ids"]
        if not prompt_ids:
            return InferenceResponse.failed("prompt tokenizes to zero tokens", prompt_text=prompt_text)
        if len(prompt_ids) >= self.max_seq_len:
            return InferenceResponse.failed(
                f"prompt is {len(prompt_ids)} tokens, the model's maximum sequence length is {self.max_seq_len}; "
                "shorten the prompt", prompt_text=prompt_text)
        gen = None
        if ga.temperature > 0:
            gen = torch.Generator(device="cpu")
            if ga.seed is not None:
                gen.manual_seed(ga.seed)
            else:
                gen.seed()
        return _Row(args=ga, prompt_text=prompt_text, prompt_ids=list(prompt_ids), generator=gen,
                    budget=min(ga.max_tokens, self.max_seq_len - len(prompt_ids)))

    # -- decoding ---------------------------------------------------------------------------------------
    def _accept(self, row: _Row, tok: int, lp: float) -> None:
        row.gen_ids.append(tok)
        row.logprobs.append(lp)
        if tok in self.eos_ids:
            row.finish = "stop"
            row.text = self.tokenizer.decode(row.gen_ids[:-1], skip_special_tokens=True)
            return
        if row.args.stop:
            text = self.tokenizer.decode(row.gen_ids, skip_special_tokens=True)
            hits = [text.find(s) for s in row.args.stop if s in text]
            if hits:
                row.finish, row.text = "stop", text[: min(hits)]
                return
        if len(row.gen_ids) >= row.budget:
            row.finish = "length"
            row.text = self.tokenizer.decode(row.gen_ids, skip_special_tokens=True)

    @torch.inference_mode()
    def _decode_batch(self, rows: list[_Row]) -> None:
        """Left-padded batched decoding with a KV cache; fills ``rows`` in place."""
        dev = self.device
        lengths = [len(r.prompt_ids) for r in rows]
        width = max(lengths)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids)
            mask[i, width - lengths[i]:] = 1
        input_ids, mask = input_ids.to(dev), mask.to(dev)
        # positions count real tokens only, so a padded row sees the same positions as it would alone
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        past = None
        step_ids, step_pos = input_ids, positions
        max_steps = max(r.budget for r in rows)
        for _ in range(max_steps):
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past,
                             use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()
            next_ids = torch.full((len(rows),), self.pad_id, dtype=torch.long)
            live = [i for i, r in enumerate(rows) if r.finish is None]
            toks, lps = sample_batch(logits[live], [rows[i].args for i in live], [rows[i].generator for i in live])
            for i, tok, lp in zip(live, toks, lps):
                self._accept(rows[i], tok, lp)
                next_ids[i] = tok
            if all(r.finish is not None for r in rows):
                break
            step_ids = next_ids.view(-1, 1).to(dev)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=dev)], dim=1)

    def _generate_sync(self, flat: list[InferenceRequest]) -> list[InferenceResponse]:
        prepared = [self._prepare(r) for r in flat]
        rows = [p for p in prepared if isinstance(p, _Row)]
        with self._lock:
            # similar prompt lengths together: less padding per batch
            order = sorted(range(len(rows)), key=lambda i: len(rows[i].prompt_ids))
            for s in range(0, len(order), self.max_batch_size):
                self._decode_batch([rows[i] for i in order[s:s + self.max_batch_size]])
        out = []
        for p in prepared:
            if isinstance(p, InferenceResponse):
                out.append(p)
            else:
                out.append(InferenceResponse(text=p.text, token_ids=p.prompt_ids + p.gen_ids,
                                             prompt_length=len(p.prompt_ids), logprobs=p.logprobs,
                                             finish_reason=p.finish, prompt_text=p.prompt_text))
        return out

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        # decoding runs on a worker thread so the event loop (e.g. the inference server) stays responsive;
        # run_isolated fails invalid requests alone and retries a failing batch in halves
        if self.device.type == "cpu":
            release_thread_pool()  # this thread now only waits: let the worker's OpenMP pool spin
        return await asyncio.to_thread(run_isolated, requests, self._generate_sync)

    @torch.inference_mode()
    def score(self, token_ids: list[int], prompt_length: int, temperature: float = 1.0) -> list[float]:
        """Teacher-forced log-probs of ``token_ids[prompt_length:]`` under ``softmax(logits / T)`` (T=1 if 0)."""
        ids = torch.tensor([token_ids], device=self.device)
        logits = self.model(input_ids=ids).logits[0, :-1].float()
        logp = torch.log_softmax(logits / logprob_temperature(temperature), dim=-1)
        targets = ids[0, 1:]
        lp = logp.gather(-1, targets[:, None])[:, 0]
        return lp[prompt_length - 1:].tolist()
