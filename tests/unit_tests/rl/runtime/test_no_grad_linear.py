"""The local linear layers' calls without autograd Functions (runtime/no_grad_linear.py) give megatron-core's bits,
and leave every call that records gradients to megatron-core."""
import pytest
import torch

from megatron.rl.runtime import no_grad_linear


class _Group:
    """A one-rank tensor-parallel group: what the wrapped functions ask of it."""

    def size(self):
        return 1


@pytest.fixture(scope="module", autouse=True)
def _installed():
    no_grad_linear.install()


def _layers():
    from megatron.core.tensor_parallel import layers

    return layers


def _linear_args(bias: bool, g: torch.Generator):
    x = torch.randn(7, 3, 48, generator=g)
    w = torch.randn(40, 48, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True) if bias else None
    return x, w, b


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_without_gradients_gives_megatrons_bits(mode, bias):
    g = torch.Generator().manual_seed(0)
    x, w, b = _linear_args(bias, g)
    kwargs = dict(gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
                  grad_output_buffer=None, wgrad_deferral_limit=0, tp_group=_Group())
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with ctx():
        ours = _layers().linear_with_grad_accumulation_and_async_allreduce(input=x, weight=w, bias=b, **kwargs)
        ref = no_grad_linear.original("linear_with_grad_accumulation_and_async_allreduce")(
            input=x, weight=w, bias=b, **kwargs)
    assert torch.equal(ours, ref)
    assert ours.grad_fn is None


def test_linear_recording_gradients_is_megatrons_function():
    g = torch.Generator().manual_seed(1)
    x, w, b = _linear_args(True, g)
    out = _layers().linear_with_grad_accumulation_and_async_allreduce(
        input=x, weight=w, bias=b, gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False,
        tp_group=_Group())
    assert "LinearWithGradAccumulationAndAsyncCommunication" in type(out.grad_fn).__name__
    out.sum().backward()
    assert w.grad is not None and b.grad is not None


def test_region_functions(monkeypatch):
    from megatron.core.tensor_parallel import mappings

    # Without torch.distributed, megatron-core's group lookup returns None; pass the one-rank group through.
    monkeypatch.setattr(mappings, "get_tensor_model_parallel_group_if_none", lambda group, **_: group)
    layers = _layers()
    x = torch.randn(5, 4, requires_grad=True)
    with torch.inference_mode():
        assert layers.copy_to_tensor_model_parallel_region(x, group=_Group()) is x
        assert layers.reduce_from_tensor_model_parallel_region(x, group=_Group()) is x
    copied = layers.copy_to_tensor_model_parallel_region(x, group=_Group())  # records gradients: megatron-core's
    reduced = layers.reduce_from_tensor_model_parallel_region(x, group=_Group())
    assert "CopyToModelParallelRegion" in type(copied.grad_fn).__name__
    assert "ReduceFromModelParallelRegion" in type(reduced.grad_fn).__name__


def test_installed_by_the_cpu_layer():
    from megatron.rl.runtime import patches, setup_runtime

    if setup_runtime().cpu_layer_active:
        assert no_grad_linear.installed()
        assert "local linear layers: no autograd Function without gradients" in patches.APPLIED
