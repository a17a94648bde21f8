"""MoE routes carried with a rollout (megatron.rl.base.routes): compact storage, JSON, multi-turn merging."""
from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from megatron.rl.base.routes import Routes, route_dtype
from megatron.rl.base.types import Rollout, TokenRollout


def _routes(layers=3, tokens=5, k=2, experts=8, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.stack([np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]) for _ in range(layers)])
    out[:, -1] = -1  # the last token: no route
    return out


def test_int16_unless_the_expert_count_needs_int32_and_the_bytes_per_token():
    assert route_dtype(8) == route_dtype(32767) == "int16" and route_dtype(32768) == "int32"
    small = Routes.from_tensor(_routes(layers=48, tokens=10, k=8, experts=128), num_experts=128)
    assert small.dtype == "int16" and small.nbytes / small.num_tokens == 48 * 8 * 2  # 768 B per token
    big = Routes.from_tensor(np.full((2, 4, 2), 40000), num_experts=40001)
    assert big.dtype == "int32" and big.nbytes == 2 * 4 * 2 * 4
    assert (big.tensor() == 40000).all()
    assert Routes.merged(big, Routes.from_tensor(np.zeros((2, 4, 2), int)), keep=2).dtype == "int32"


def test_round_trip_through_python_and_json_keeps_every_index():
    raw = _routes()
    routes = Routes.from_tensor(raw)
    assert np.array_equal(routes.tensor().numpy(), raw) and np.array_equal(routes.array(), raw)
    text = routes.model_dump_json()
    assert isinstance(json.loads(text)["data"], str)  # base64 in JSON
    assert Routes.model_validate_json(text) == routes
    assert Routes.model_validate(routes.model_dump(mode="json")) == routes  # a dict parsed from JSON (the bank)
    assert Routes.model_validate(routes.model_dump()) == routes


def test_a_token_rollout_carries_routes_through_json_and_checks_their_length():
    routes = Routes.from_tensor(_routes(tokens=4))
    r = TokenRollout(prompt="p", completion="c", reward=1.0, token_ids=[1, 2, 3, 4], generation_mask=[0, 0, 1, 1],
                     prompt_length=2, routes=routes)
    back = Rollout.model_validate(json.loads(r.model_dump_json()))
    assert isinstance(back, TokenRollout) and back.routes == routes
    with pytest.raises(ValidationError, match="routes cover 4 tokens but token_ids has 3"):
        TokenRollout(prompt="p", completion="c", reward=1.0, token_ids=[1, 2, 3], generation_mask=[0, 1, 1],
                     prompt_length=1, routes=routes)
    with pytest.raises(ValidationError, match="needs"):
        Routes(num_layers=2, num_tokens=3, topk=2, data=b"\0" * 5)


def test_multi_turn_merge_keeps_earlier_turns_routes_and_fills_what_they_lack():
    first = _routes(tokens=6, seed=1)  # turn 1: 6 tokens, the last never routed
    second = _routes(tokens=10, seed=2)  # turn 2's request: turn 1 + observation + generation
    merged = Routes.merged(Routes.from_tensor(first), Routes.from_tensor(second), keep=6).array()
    assert np.array_equal(merged[:, :5], first[:, :5])  # turn 1's tokens keep the routes they were generated with
    assert np.array_equal(merged[:, 5:], second[:, 5:])  # its last token: turn 2 routed it
    assert Routes.merged(None, Routes.from_tensor(second), keep=0).num_tokens == 10
    assert Routes.merged(None, Routes.from_tensor(second), keep=3) is None  # earlier turns without routes
    assert Routes.merged(Routes.from_tensor(first), None, keep=3) is None
