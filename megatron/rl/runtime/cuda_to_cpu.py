"""A torch-function mode that sends megatron-core's CUDA device literals to the CPU.

megatron-core allocates with ``device="cuda"``, ``torch.cuda.current_device()`` (an int),
``.cuda()``, ``pin_memory=True`` and checks ``param.type() == "torch.cuda.FloatTensor"``. Editing
each call site is not an option (we never patch site-packages), so this mode intercepts torch calls
and rewrites those arguments. It costs a Python dispatch per torch call (~1.5-2 µs); see
``benchmarks/runtime_overhead.py`` for the measured step-time overhead.

One CPU-kernel workaround rides on it, since it sees the call anyway: ``Tensor.repeat_interleave`` with an
integer count on a tensor that needs a gradient (megatron-core's ``DotProductAttention`` repeats K and V per
query head with grouped-query attention) gets the same forward and a backward that adds the copies
(:class:`_RepeatInterleave`): torch's CPU backward of it took ~2x the whole attention score product's.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")

# Tensor.type() names that megatron's optimizer and grad clipping assert on.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def to_cpu_device(d):
    """Map a CUDA device spec ("cuda", "cuda:1", torch.device("cuda"), an int index) to the CPU."""
    if isinstance(d, str):
        return "cpu" if d.startswith("cuda") else d
    if isinstance(d, torch.device):
        return _CPU if d.type == "cuda" else d
    if isinstance(d, int) and not isinstance(d, bool):
        return "cpu"
    return d


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU. Kept minimal: it runs on every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs:
            if "device" in kwargs or "pin_memory" in kwargs:
                kwargs = dict(kwargs)
                if "device" in kwargs:
                    kwargs["device"] = to_cpu_device(kwargs["device"])
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False  # no pinned-memory allocator without an accelerator
        else:
            kwargs = {}
        if func in _SPECIAL:
            if func is torch.device:
                if args and ((isinstance(args[0], str) and args[0].startswith("cuda"))
                             or (isinstance(args[0], int) and not isinstance(args[0], bool))):
                    return _CPU
            elif func is torch.Tensor.to:
                args = tuple(to_cpu_device(a) if isinstance(a, (str, torch.device)) else a for a in args)
            elif func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
                return args[0]
            elif func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                return _CUDA_TYPE_NAMES.get(name, name)
            elif func is torch.Tensor.repeat_interleave:
                repeated = _repeat_with_grad(args, kwargs)
                if repeated is not None:
                    return repeated
        return func(*args, **kwargs)


_SPECIAL = frozenset({torch.device, torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.pin_memory,
                      torch.Tensor.type, torch.Tensor.repeat_interleave})


def _repeat_with_grad(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """``x.repeat_interleave(n, dim=d)`` through :class:`_RepeatInterleave` when ``x`` needs a gradient, else None."""
    if len(args) != 2 or set(kwargs) - {"dim"}:
        return None
    x, repeats = args
    dim = kwargs.get("dim")
    if (not isinstance(x, torch.Tensor) or not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 2
            or not isinstance(dim, int) or not x.requires_grad or not torch.is_grad_enabled()):
        return None
    return _RepeatInterleave.apply(x, repeats, dim % x.dim())


class _RepeatInterleave(torch.autograd.Function):
    """``repeat_interleave(n, dim)`` whose backward sums each element's ``n`` copies with ``n - 1`` additions.

    torch's CPU backward of it (reshape, zero-filled buffer, strided ``sum``) cost ~10 ms per call on a
    [29, 128, 2, 64] key in the GRPO benchmark's training step. The gradient is the same: for ``n = 2`` bit for
    bit (one addition either way), for larger ``n`` the additions run in order, which the reduction may not
    (``test_cpu_patches.py``).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, repeats: int, dim: int) -> torch.Tensor:
        ctx.repeats, ctx.dim = repeats, dim
        return x.repeat_interleave(repeats, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        copies = grad.unflatten(ctx.dim, (-1, ctx.repeats)).unbind(ctx.dim + 1)
        total = copies[0] + copies[1]
        for more in copies[2:]:
            total = total + more
        return total, None, None
