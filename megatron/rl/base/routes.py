"""MoE routing of one sequence, as the inference engine chose it: the top-k experts of every token at every MoE layer.

:class:`Routes` travels with a rollout (``InferenceResponse.routes``, ``TokenRollout.routes``) so that the trainer
can replay it (``--rl-router-replay rollout``, :mod:`megatron.rl.routing.replay`). Layout ``[layers, tokens, k]``:
``layers`` counts the model's MoE layers in layer order, ``tokens`` the sequence's tokens (aligned with
``token_ids``), ``k`` the router's top-k; entry ``[l, t]`` holds the expert indices token ``t`` went to at MoE
layer ``l``, or ``-1`` everywhere when no route was recorded for it (the sequence's last token, which the engine
samples but never runs through the model; the trainer's router then chooses itself).

Stored compactly: the raw little-endian array (int16 when the expert count allows, else int32), as bytes in
memory and base64 text in JSON, so a rollout costs ``layers * k * 2`` bytes per token (int16): 8 B for a
2-layer top-2 model, 768 B for 48 MoE layers at top-8.
"""
from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator, model_validator

__all__ = ["Routes", "NO_ROUTE", "route_dtype"]

#: The index stored where no route was recorded.
NO_ROUTE = -1

_DTYPES = {"int16": np.dtype("<i2"), "int32": np.dtype("<i4")}
_INT16_EXPERTS = int(np.iinfo(np.int16).max)  # indices 0 .. 32766 and -1


def route_dtype(num_experts: int) -> str:
    """The narrowest stored dtype that holds expert indices ``0 .. num_experts - 1`` and ``-1``."""
    return "int16" if num_experts <= _INT16_EXPERTS else "int32"


class Routes(BaseModel):
    """The routing of one sequence: ``[num_layers, num_tokens, topk]`` expert indices (see the module docstring).

    Build with :meth:`from_tensor`, read with :meth:`tensor`. ``data`` is the array's bytes (base64 text in JSON).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_layers: int = Field(ge=1)
    num_tokens: int = Field(ge=0)
    topk: int = Field(ge=1)
    dtype: Literal["int16", "int32"] = "int16"
    data: bytes

    @field_validator("data", mode="before")
    @classmethod
    def _from_base64(cls, v: Any) -> Any:
        return base64.b64decode(v, validate=True) if isinstance(v, str) else v

    @field_serializer("data", when_used="json")
    def _to_base64(self, v: bytes) -> str:
        return base64.b64encode(v).decode("ascii")

    @model_validator(mode="after")
    def _check_size(self) -> "Routes":
        expected = self.num_layers * self.num_tokens * self.topk * _DTYPES[self.dtype].itemsize
        if len(self.data) != expected:
            raise ValueError(f"routes data has {len(self.data)} bytes; [{self.num_layers}, {self.num_tokens}, "
                             f"{self.topk}] {self.dtype} needs {expected}")
        return self

    @classmethod
    def from_tensor(cls, routes: Any, num_experts: int | None = None) -> "Routes":
        """From an integer array or CPU tensor ``[layers, tokens, k]`` (``-1`` = no route); stored as int16 unless
        ``num_experts`` (or the largest index) needs int32."""
        array = np.asarray(routes)
        if array.ndim != 3:
            raise ValueError(f"routes must be [layers, tokens, k], got shape {array.shape}")
        largest = int(array.max()) + 1 if array.size else 0
        dtype = route_dtype(max(num_experts or 0, largest))
        return cls(num_layers=array.shape[0], num_tokens=array.shape[1], topk=array.shape[2], dtype=dtype,
                   data=np.ascontiguousarray(array, dtype=_DTYPES[dtype]).tobytes())

    def array(self) -> np.ndarray:
        """The routes as a ``[layers, tokens, k]`` numpy array of the stored dtype (read-only, no copy)."""
        return np.frombuffer(self.data, dtype=_DTYPES[self.dtype]).reshape(self.num_layers, self.num_tokens,
                                                                             self.topk)

    def tensor(self):
        """The routes as a ``[layers, tokens, k]`` torch tensor of the stored dtype (a copy)."""
        import torch

        array = self.array()
        return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True))

    @property
    def nbytes(self) -> int:
        """Bytes of routing data held (``layers * tokens * k * itemsize``)."""
        return len(self.data)

    @staticmethod
    def merged(previous: "Routes | None", current: "Routes | None", keep: int) -> "Routes | None":
        """A multi-turn episode's routes: the first ``keep`` tokens' from ``previous`` (the turns so far, routed
        when they were generated), the rest, and any of those ``previous`` has no route for (its last token), from
        ``current`` (the latest request, which covers every token). None when ``current`` is None, or ``previous``
        is None while ``keep > 0``."""
        if current is None or (previous is None and keep > 0):
            return None
        if keep == 0:
            return current
        if keep > min(previous.num_tokens, current.num_tokens):
            raise ValueError(f"cannot keep {keep} tokens of routes over {previous.num_tokens} and "
                             f"{current.num_tokens} tokens")
        both = current.array().astype(np.int32)
        kept = previous.array()[:, :keep].astype(np.int32)
        both[:, :keep] = np.where(kept[..., :1] >= 0, kept, both[:, :keep])
        return Routes.from_tensor(both, max(_largest(previous), _largest(current)))


def _largest(routes: Routes) -> int:
    """An expert count the stored dtype was chosen for (keeps int32 routes int32 when merged)."""
    return _INT16_EXPERTS + 1 if routes.dtype == "int32" else 0
