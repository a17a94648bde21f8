"""RoPE with cos/sin once per step (runtime/rope_cache.py) == megatron-core's per-layer RoPE, bit for bit."""
import types

import pytest
import torch

from megatron.rl.runtime import rope_cache
from tests.conftest import needs_entry

pytestmark = needs_entry("dynamic inference RoPE: cos/sin once per step")


class _Context:
    """The attributes of megatron-core's DynamicInferenceContext that the two RoPE methods read."""

    def __init__(self, positions, decode_only):
        self.padded_active_token_count = len(positions)
        self.token_to_pos_ids = positions.clone()
        self.token_to_position_in_request = positions.clone()
        self._decode_only = decode_only
        self.gpu_view = self  # 0.19's methods read the positions from the context's device snapshot

    def is_decode_only(self):
        return self._decode_only


def _config(interleaved=False):
    return types.SimpleNamespace(apply_rope_fusion=False, multi_latent_attention=False, rotary_interleaved=interleaved,
                                 mrope_section=None)


@pytest.fixture(scope="module", autouse=True)
def _installed():
    rope_cache.install()


def _freqs(length, dim, g):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(length, dtype=torch.float32) + torch.rand(1, generator=g), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :]  # megatron's [S, 1, 1, dim]


@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_share", [1.0, 0.5])
def test_matches_megatron_bit_for_bit_and_follows_new_positions(decode_only, interleaved, rotary_share):
    g = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim = 37, 4, 2, 16
    freqs = _freqs(96, int(dim * rotary_share), g)  # a share < 1 rotates part of each head (--rotary-percent)
    config, cp = _config(interleaved), object()  # cp_group is only read by the packed (thd) path
    ctx = _Context(torch.randint(0, 96, (n,), generator=g), decode_only)
    ref = _Context(ctx.token_to_pos_ids, decode_only)
    for step in range(3):
        for layer in range(2):  # later layers of a step reuse the cached cos/sin
            q = torch.randn(n, 1, heads, dim, generator=g)
            k = torch.randn(n, 1, kv_heads, dim, generator=g)
            got_q = rope_cache._apply_query(ctx, q.clone(), freqs, config, None, cp)
            want_q = rope_cache.original("query")(ref, q.clone(), freqs, config, None, cp)
            got_k = rope_cache._apply_key(ctx, k.clone(), freqs, config, cp)
            want_k = rope_cache.original("key")(ref, k.clone(), freqs, config, cp)
            assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), (step, layer)
        # the next step: the context rewrites its position buffers in place (new tokens, other requests)
        new = torch.randint(0, 96, (n,), generator=g)
        for c in (ctx, ref):
            c.token_to_pos_ids.copy_(new)
            c.token_to_position_in_request.copy_(new)


def test_other_configurations_take_megatrons_path(monkeypatch):
    calls = []
    monkeypatch.setitem(rope_cache._ORIGINALS, "query", lambda *a: calls.append("query") or a[1])
    ctx = _Context(torch.arange(4), True)
    fused = types.SimpleNamespace(apply_rope_fusion=True, multi_latent_attention=False, rotary_interleaved=False)
    rope_cache._apply_query(ctx, torch.zeros(4, 1, 2, 8), _freqs(8, 8, torch.Generator()), fused, None, object())
    packed = _config()
    rope_cache._apply_query(ctx, torch.zeros(4, 1, 2, 8), _freqs(8, 8, torch.Generator()), packed, torch.tensor([0, 4]),
                            object())
    assert calls == ["query", "query"]


def test_installed_by_the_cpu_layer():
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    from megatron.rl.runtime import setup_runtime

    if setup_runtime().cpu_layer_active:
        assert DynamicInferenceContext.apply_rotary_emb_query is rope_cache._apply_query
        assert DynamicInferenceContext.apply_rotary_emb_key is rope_cache._apply_key
