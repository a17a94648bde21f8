"""A reward model: a local sequence-classification model with a scalar head scores (prompt, completion) pairs.

``RewardModelConfig`` is the ``reward_model:`` section of a ``type: model_reward`` entry: a Hugging Face
``AutoModelForSequenceClassification`` directory with one label, read locally, never downloaded, loaded on
first use. Any failure (load, batch, non-finite score, timeout) raises :class:`RewardModelError`, which the
caller turns into failed rollouts; a score is never silently replaced. Megatron reward checkpoints are not
supported.

YAML section: docs/agents.md.
"""
from __future__ import annotations

import asyncio
import math
import threading
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from megatron.rl.agent.judge import check_template
from megatron.rl.base.optional import import_optional
from megatron.rl.base.errors import RLError

__all__ = ["RewardModelConfig", "RewardModel", "RewardModelError"]


class RewardModelError(RLError, RuntimeError):
    """The reward model could not score a batch (the message says why)."""


class RewardModelConfig(BaseModel):
    """A reward model's YAML section (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    path: str
    weight: float = Field(default=1.0, allow_inf_nan=False)
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    batch_size: int = Field(default=16, ge=1)
    max_length: int = Field(default=512, ge=2)
    template: str = "{prompt}{completion}"
    timeout_s: float | None = Field(default=120.0, gt=0, allow_inf_nan=False)

    @field_validator("template")
    @classmethod
    def _fields(cls, v: str) -> str:

        return check_template(v, ("prompt", "completion"), "reward_model.template")


class RewardModel(BaseModel):
    """Scores texts with a local sequence-classification model (see the module docstring)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    config: RewardModelConfig

    _model: Any = PrivateAttr(default=None)
    _tokenizer: Any = PrivateAttr(default=None)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    def _load(self) -> None:
        import_optional("transformers", "hf", "a reward model")
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        cfg = self.config
        try:
            tok = AutoTokenizer.from_pretrained(cfg.path, local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(cfg.path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise RewardModelError(f"cannot load the reward model from {cfg.path!r}: {str(e)[:300]}") from e
        if model.config.num_labels != 1:
            raise RewardModelError(f"the reward model at {cfg.path!r} has num_labels={model.config.num_labels}; a "
                                   "reward model needs one scalar output (num_labels=1)")
        tok.truncation_side = "left"  # keep the completion when a text is too long
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token or tok.unk_token
        if tok.pad_token is None:
            raise RewardModelError(f"the reward model's tokenizer at {cfg.path!r} has no pad, eos or unk token to pad "
                                   "batches with")
        model.config.pad_token_id = tok.pad_token_id  # how decoder classifiers find each row's last token
        self._model, self._tokenizer = model.to(device=cfg.device, dtype=getattr(torch, cfg.dtype)).eval(), tok

    def score_sync(self, texts: list[str]) -> list[float]:
        """Scores of ``texts``, in order; raises RewardModelError (load failure, non-finite score)."""

        with self._lock:
            if self._model is None:
                self._load()
            out: list[float] = []
            bs = self.config.batch_size
            for start in range(0, len(texts), bs):
                batch = self._tokenizer(texts[start:start + bs], return_tensors="pt", padding=True, truncation=True,
                                        max_length=self.config.max_length)
                with torch.inference_mode():
                    logits = self._model(**{k: v.to(self.config.device) for k, v in batch.items()}).logits
                out += [float(x) for x in logits[:, 0].float().cpu()]
        bad = [i for i, s in enumerate(out) if not math.isfinite(s)]
        if bad:
            raise RewardModelError(f"the reward model gave non-finite scores for {len(bad)} of {len(out)} texts")
        return out

    async def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Scores of ``(prompt, completion)`` pairs, computed in a worker thread within ``timeout_s``."""
        texts = [self.config.template.format_map({"prompt": p, "completion": c}) for p, c in pairs]
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.score_sync, texts), timeout=self.config.timeout_s)
        except asyncio.TimeoutError:
            raise RewardModelError(f"no scores within timeout_s={self.config.timeout_s} for {len(texts)} texts") \
                from None
        except RewardModelError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure of the model on this batch fails its rollouts
            raise RewardModelError(f"scoring raised {type(e).__name__}: {str(e)[:300]}") from e
