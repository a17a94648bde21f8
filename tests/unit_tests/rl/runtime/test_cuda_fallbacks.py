"""The CUDA-without-flash-attn fallback points megatron-core's paged attention at the torch kernels."""
import torch

from megatron.core.transformer import attention
from megatron.rl.runtime import cuda_fallbacks, torch_attention


def _reset(monkeypatch, kvcache, varlen):
    monkeypatch.setattr(cuda_fallbacks, "_installed", False)
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", kvcache)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", varlen)
    monkeypatch.setattr(attention, "is_fa_min_version", attention.is_fa_min_version)


def test_installs_torch_kernels_when_flash_attn_is_missing(monkeypatch, caplog):
    _reset(monkeypatch, None, None)
    assert cuda_fallbacks.install_paged_attention_fallback() is True
    assert attention.flash_attn_with_kvcache is torch_attention.flash_attn_with_kvcache
    assert attention.flash_attn_varlen_func is torch_attention.flash_attn_varlen_func
    assert attention.is_fa_min_version("99.0.0")
    assert "flash-attn is not installed" in caplog.text
    caplog.clear()
    assert cuda_fallbacks.install_paged_attention_fallback() is True  # idempotent, warns once
    assert "flash-attn" not in caplog.text
    assert cuda_fallbacks.paged_attention_fallback_active()


def test_leaves_a_real_flash_attn_alone(monkeypatch):
    def real_kvcache(*a, **k):
        raise AssertionError("not called")

    _reset(monkeypatch, real_kvcache, real_kvcache)
    assert cuda_fallbacks.install_paged_attention_fallback() is False
    assert attention.flash_attn_with_kvcache is real_kvcache
    assert not cuda_fallbacks.paged_attention_fallback_active()


def test_fallback_decode_matches_dense_attention():
    """The kernel the fallback installs is device-agnostic: one decode step equals plain softmax attention."""
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, block = 3, 4, 2, 8, 4
    lens = torch.tensor([5, 1, 8])
    blocks = torch.randn(6, block, kv_heads, dim), torch.randn(6, block, kv_heads, dim)
    table = torch.tensor([[0, 1], [2, -1], [3, 4]])
    q = torch.randn(batch, 1, heads, dim)
    out = torch_attention.flash_attn_with_kvcache(q, *blocks, cache_seqlens=lens, block_table=table,
                                                  softmax_scale=dim ** -0.5)
    for b in range(batch):
        ids = table[b][table[b] >= 0]
        k = blocks[0][ids].reshape(-1, kv_heads, dim)[: lens[b]].repeat_interleave(heads // kv_heads, dim=1)
        v = blocks[1][ids].reshape(-1, kv_heads, dim)[: lens[b]].repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,khd->hk", q[b, 0], k) * dim ** -0.5
        ref = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
        torch.testing.assert_close(out[b, 0], ref, atol=1e-5, rtol=1e-5)


def test_training_runs_flush_subnormals_to_zero_and_restore():
    """Subnormal floats hit x86's slow path (~100x per op); the quickstart slowed 20-30x once weights drifted there.
    The flag is scoped to the run: outside it, subnormal Python floats (request validation) keep their value."""
    from megatron.rl.runtime import flush_denormals

    tiny = torch.tensor([1e-40], dtype=torch.float32)  # subnormal in fp32
    with flush_denormals():
        assert float(tiny * 1.0) == 0.0
        assert float(torch.tensor([1e-37]) * 1.0) > 0  # normal numbers are untouched
    assert float(tiny * 1.0) > 0
    assert 0.0 < float("5e-324")
