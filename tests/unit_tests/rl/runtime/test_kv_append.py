"""KV append by index_copy_ (runtime/kv_append.py) writes exactly what megatron-core's advanced-index put writes."""
import pytest
import torch

from megatron.rl.runtime import kv_append


class _Context:
    """The attributes of megatron-core's DynamicInferenceContext that append_key_value_cache reads."""

    def __init__(self, layers, blocks, block_size, heads, dim):
        self.memory_buffer = torch.zeros(2, layers, blocks, block_size, heads, dim)
        self.layer_map = list(range(layers))
        self.cache_mla_latent = False
        self.token_to_block_idx = torch.zeros(64, dtype=torch.long)
        self.token_to_local_position_within_kv_block = torch.zeros(64, dtype=torch.long)
        self.padded_active_token_count = 0
        self.gpu_view = self  # megatron-core 0.19 reads the step's index buffers through a view of the context

    def set_step(self, blocks, local):
        n = len(blocks)
        self.token_to_block_idx[:n] = blocks  # in place, as megatron-core updates them every step
        self.token_to_local_position_within_kv_block[:n] = local
        self.padded_active_token_count = n


@pytest.fixture(scope="module", autouse=True)
def _installed():
    kv_append.install()


def test_same_cache_as_megatron_over_steps_and_layers(monkeypatch):
    from megatron.core.inference.contexts import dynamic_context

    # megatron-core's own torch path is the reference (0.19 imports its Triton kernel, which refuses CPU tensors)
    monkeypatch.setattr(dynamic_context, "triton_append_key_value_cache", None)
    g = torch.Generator().manual_seed(0)
    layers, blocks, block_size, heads, dim = 3, 9, 4, 2, 8
    ours, ref = _Context(layers, blocks, block_size, heads, dim), _Context(layers, blocks, block_size, heads, dim)
    for step, n in enumerate([12, 12, 7]):
        slots = torch.randperm(blocks * block_size, generator=g)[:n]  # distinct slots, like distinct tokens
        block_idx, local = slots // block_size, slots % block_size
        block_idx[-1] = blocks - 1 if step < 2 else -1  # a negative block id wraps, as advanced indexing does
        for c in (ours, ref):
            c.set_step(block_idx, local)
        for layer in range(1, layers + 1):  # megatron's layer numbers are 1-based
            key = torch.randn(n, 1, heads, dim, generator=g)
            value = torch.randn(n, 1, heads, dim, generator=g)
            kv_append._append(ours, layer, key, value)
            kv_append.original()(ref, layer, key.clone(), value.clone())
        assert torch.equal(ours.memory_buffer, ref.memory_buffer), step
    assert ours.memory_buffer.abs().sum() > 0


def test_installed_by_the_cpu_layer():
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    from megatron.rl.runtime import setup_runtime

    if setup_runtime().cpu_layer_active:
        assert DynamicInferenceContext.append_key_value_cache is kv_append._append
