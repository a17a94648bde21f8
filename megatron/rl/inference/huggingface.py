"""Hugging Face ``transformers`` backend: ``build_inference_interface("huggingface", model_path=DIR)``.

Loads ``AutoModelForCausalLM`` + ``AutoTokenizer`` from a local directory (never downloads) and runs its own
batched decoding loop with a KV cache, so every request keeps its own sampling settings and stop strings and the
log-probs follow the API convention (``softmax(logits / T)`` before truncation). Prompts are left-padded with
position ids over real tokens only, so a padded row computes what it would alone.

Details: docs/inference.md.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from megatron.rl.inference.api import (CANCELLED, GenerationArgs, InferenceError, InferenceInterface,
                                       InferenceRequest, InferenceResponse, logprob_temperature, run_isolated)
from megatron.rl.inference.chat_template import render_chat
from megatron.rl.inference.sampling import sample_next
from megatron.rl.inference.stopping import completes_stop, finish_response
from megatron.rl.runtime.cpu_threads import follow as follow_thread_budget
from megatron.rl.runtime.openmp import release_thread_pool

logger = logging.getLogger(__name__)

__all__ = ["HuggingFaceInference", "sample_batch"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def sample_batch(logits: torch.Tensor, args: Sequence[GenerationArgs],
                 generators: Sequence[torch.Generator | None]) -> tuple[list[int], list[float]]:
    """Pick one token per row of ``logits`` [batch, vocab], each row with its own sampling settings.

    Returns ``(tokens, logprobs)`` (length batch), sampled by :func:`megatron.rl.inference.sampling.sample_next`
    (the sampler every backend shares): each log-prob is under ``softmax(logits / T)`` of its row (T=1 when
    greedy), before top-k/top-p truncation; a row with its own generator is reproducible whatever else is in
    the batch.
    """
    tokens, log_probs = sample_next(logits, args, generators)
    return tokens.tolist(), log_probs.tolist()


def _has_tokenizer_files(path: str) -> bool:
    names = os.listdir(path)
    return any(n.startswith(("tokenizer", "vocab.")) or n == "merges.txt" or n.endswith((".model", ".tiktoken"))
               for n in names)


@dataclass
class _Row:
    """Decoding state of one sample."""
    args: GenerationArgs
    prompt_text: str
    prompt_ids: list[int]
    generator: torch.Generator | None
    budget: int
    request: InferenceRequest | None = None
    gen_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    cancelled: bool = False


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
        if tokenizer is None and not _has_tokenizer_files(model_path):
            # transformers would report a missing sentencepiece/tiktoken package instead
            raise InferenceError(f"huggingface backend: model_path={model_path!r} has no tokenizer files "
                                 "(tokenizer.json, tokenizer_config.json, vocab/merges or *.model); a directory "
                                 "written by tools/convert_megatron_to_hf.py carries them, or pass --tokenizer-dir "
                                 "to the conversion")
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
        elif req.prefix_token_ids is not None:  # token in: the prefix as given, the text after it on its own
            prompt_text = req.prompt
            prompt_ids = list(req.prefix_token_ids) + self.tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
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
                    budget=min(ga.max_tokens, self.max_seq_len - len(prompt_ids)), request=req)

    # -- decoding ---------------------------------------------------------------------------------------
    def _accept(self, row: _Row, tok: int, lp: float) -> None:
        row.gen_ids.append(tok)
        row.logprobs.append(lp)
        row.done = (tok in self.eos_ids or len(row.gen_ids) >= row.budget
                    or completes_stop(row.gen_ids, row.args.stop, self.eos_ids, self._decode))

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

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
            for r in rows:  # a cancelled request (its caller left) stops here; its row is fed pad tokens
                if not r.done and r.request is not None and r.request.cancelled:
                    r.done = r.cancelled = True
            if all(r.done for r in rows):
                break
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past,
                             use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float().cpu()
            next_ids = torch.full((len(rows),), self.pad_id, dtype=torch.long)
            live = [i for i, r in enumerate(rows) if not r.done]
            toks, lps = sample_batch(logits[live], [rows[i].args for i in live], [rows[i].generator for i in live])
            for i, tok, lp in zip(live, toks, lps):
                self._accept(rows[i], tok, lp)
                next_ids[i] = tok
            if all(r.done for r in rows):
                break
            step_ids = next_ids.view(-1, 1).to(dev)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=dev)], dim=1)

    def _generate_sync(self, flat: list[InferenceRequest]) -> list[InferenceResponse]:
        follow_thread_budget()  # a worker thread: the trainer's torch thread count (other processes' load)
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
            elif p.cancelled:
                out.append(InferenceResponse.failed(CANCELLED, prompt_text=p.prompt_text))
            else:
                out.append(finish_response(p.prompt_ids, p.gen_ids, p.logprobs, eos_ids=self.eos_ids,
                                           stops=p.args.stop, detokenize=self._decode, prompt_text=p.prompt_text))
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
