"""Packed-weight inference linears (runtime/packed_linear.py): a weight is packed for a row count once two calls in
a row have it, packed results equal the plain matmul to fp32 rounding, nothing is packed outside a scope, and a
pack made before the weights changed is never used once the scope's packs are dropped."""
import pytest
import torch

from megatron.rl.runtime import no_grad_linear, packed_linear

pytestmark = pytest.mark.skipif(not packed_linear.available(), reason="torch built without MKL")


def _weight(rows: int = 512, cols: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def test_a_row_count_is_packed_at_its_second_call_and_matches_the_matmul():
    w, x = _weight(), torch.randn(24, 1, 512)
    with torch.inference_mode(), packed_linear.packing() as packs:
        assert packs.linear(x, w) is None, "the first call with a row count runs the plain matmul"
        out = packs.linear(x, w)
        assert packs.packed == 1
        again = packs.linear(x, w)
        assert packs.packed == 1, "the pack is reused"
    assert out.shape == (24, 1, 512)
    torch.testing.assert_close(out, torch.matmul(x, w.t()), rtol=1e-5, atol=1e-4)
    assert torch.equal(out, again)


def test_small_weights_other_dtypes_and_no_scope_run_the_plain_matmul():
    with torch.inference_mode(), packed_linear.packing() as packs:
        small = _weight(64, 64)
        x = torch.randn(8, 64)
        assert packs.linear(x, small) is None and packs.linear(x, small) is None
        w = _weight().double()
        xd = torch.randn(8, 512, dtype=torch.float64)
        assert packs.linear(xd, w) is None and packs.linear(xd, w) is None
        assert packs.packed == 0
    assert packed_linear.current() is None
    with packed_linear.packing(enabled=False) as packs:
        assert packs is None and packed_linear.current() is None


def test_cleared_packs_follow_the_updated_weights():
    w, x = _weight(), torch.randn(16, 512)
    with torch.inference_mode(), packed_linear.packing() as packs:
        packs.linear(x, w)
        packs.linear(x, w)
        w.add_(1.0)  # an optimizer step in place, as the trainer updates the engine's weights
        stale = packs.linear(x, w)
        packs.clear()
        assert packs.linear(x, w) is None
        fresh = packs.linear(x, w)
    expected = torch.matmul(x, w.t())
    assert (stale - expected).abs().max() > 1.0, "a pack holds the weights it was made from"
    torch.testing.assert_close(fresh, expected, rtol=1e-5, atol=1e-4)


def test_the_local_linear_uses_the_scope_only_without_gradients():
    no_grad_linear.install()
    from megatron.core.tensor_parallel import layers

    class _Group:
        def size(self):
            return 1

    kwargs = dict(gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
                  grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=_Group())
    w = _weight().requires_grad_(True)
    x = torch.randn(10, 1, 512)
    with packed_linear.packing() as packs:
        with torch.inference_mode():
            for _ in range(3):
                out = layers.linear_with_grad_accumulation_and_async_allreduce(x, w, None, **kwargs)
        assert packs.packed == 1
        y = layers.linear_with_grad_accumulation_and_async_allreduce(x.requires_grad_(True), w, None, **kwargs)
        assert packs.packed == 1 and y.requires_grad, "a call recording gradients goes to megatron-core"
    torch.testing.assert_close(out, torch.matmul(x.detach(), w.detach().t()), rtol=1e-5, atol=1e-4)


def test_a_weight_keeps_one_pack_for_the_row_count_that_last_repeated():
    w = _weight()
    x16, x24 = torch.randn(16, 512), torch.randn(24, 512)
    with torch.inference_mode(), packed_linear.packing() as packs:
        for _ in range(2):
            packs.linear(x16, w)
        for _ in range(3):  # prefill-sized calls between decode steps are never packed
            assert packs.linear(x24, w) is None
            assert packs.linear(x16, w) is not None
        assert packs.packed == 1
        assert packs.linear(x24, w) is None and packs.linear(x24, w) is not None and packs.packed == 2
        assert packs.linear(x16, w) is None, "the older pack was dropped"


@pytest.mark.parametrize("capability,vendor,pays", [("AVX512", "GenuineIntel", True), ("AVX2", "GenuineIntel", False),
                                                    ("AVX512", "AuthenticAMD", False), ("AVX2", "AuthenticAMD", False)])
def test_packs_are_the_default_only_where_they_were_measured_faster(capability, vendor, pays):
    cpuinfo = f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2\n"
    assert packed_linear.packs_pay(capability, cpuinfo) is pays
    assert not packed_linear.packs_pay(capability, "")


def test_the_engine_default_follows_this_machine():
    from megatron.rl.inference.engine.build import EngineSettings

    assert EngineSettings().packed_weights is packed_linear.pays_off()
    assert EngineSettings.for_device("cpu").packed_weights is packed_linear.pays_off()
