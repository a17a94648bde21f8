"""The CPU compatibility layer: registry, idempotence, version guard, device rewriting, RNG, and the
distributed-optimizer checkpoint fix measured end to end."""
import json
import math
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

from megatron.rl.runtime import cpu_patches, setup_runtime
from megatron.rl.runtime.cuda_to_cpu import CudaToCpuMode

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is never installed with CUDA")
SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture(scope="module", autouse=True)
def runtime():
    return setup_runtime()


def test_every_patch_documented_and_installed(runtime):
    assert runtime.cpu_layer_active and runtime.backend == "gloo" and runtime.device.type == "cpu"
    assert len(cpu_patches.PATCHES) >= 10
    for name, patch in cpu_patches.PATCHES.items():
        assert patch.why.strip() and len(patch.why) > 20, name
    # every CPU patch written for the installed megatron-core is applied, in registration order; the others are not
    from megatron.rl.runtime import versions
    written = [name for name, p in cpu_patches.PATCHES.items() if versions.written_for(p.versions)]
    assert cpu_patches.INSTALLED == written and len(written) >= 10
    assert set(cpu_patches.PATCHES) - set(written) == {
        name for name, p in cpu_patches.PATCHES.items() if not versions.written_for(p.versions)}


def test_install_is_idempotent():
    assert cpu_patches.install() == []
    setup_runtime()
    from torch.overrides import _get_current_function_mode_stack
    assert sum(isinstance(m, CudaToCpuMode) for m in _get_current_function_mode_stack()) == 1


def test_duplicate_patch_name_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        cpu_patches.cpu_patch("torch.cuda.synchronize", "again")(lambda: None)


def test_untested_megatron_core_version_refused(monkeypatch):
    monkeypatch.delenv(cpu_patches.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(cpu_patches.UnsupportedMegatronCoreVersion,
                       match=r"0\.17\.0.*megatron-core==0\.16\.1 \(Python 3\.10-3\.11\) or megatron-core==0\.19\.2"):
        cpu_patches.check_mcore_version("0.17.0")
    for supported in ("0.16.1", "0.19.0", "0.19.2", "0.19.2+abc1234"):  # 0.19 appends a git hash inside a checkout
        assert cpu_patches.check_mcore_version(supported) == supported
    monkeypatch.setenv(cpu_patches.ALLOW_UNTESTED_ENV, "1")
    assert cpu_patches.check_mcore_version("0.17.0") == "0.17.0"
    from importlib import metadata
    assert cpu_patches.check_mcore_version() == metadata.version("megatron-core")


def test_cuda_device_literals_land_on_cpu():
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.device("cuda") == torch.device("cpu") and torch.device(0) == torch.device("cpu")
    x = torch.ones(3)
    assert x.cuda() is x and x.to("cuda").device.type == "cpu" and x.pin_memory() is x
    assert torch.ones(2, pin_memory=True).device.type == "cpu"
    assert x.type() == "torch.cuda.FloatTensor"  # what megatron's optimizer asserts
    assert x.type(torch.float64).dtype == torch.float64  # conversions still work
    assert torch.cuda.mem_get_info()[1] > 0


def test_device_mode_is_per_thread_and_setup_runtime_enters_it():
    results = {}

    def worker():
        try:
            torch.zeros(1, device="cuda")
            results["before"] = "ok"
        except (RuntimeError, AssertionError) as e:  # CPU-only torch: not compiled with CUDA
            results["before"] = type(e).__name__
        setup_runtime()
        results["after"] = torch.zeros(1, device="cuda").device.type

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert results == {"before": results["before"], "after": "cpu"} and results["before"] != "ok"


def test_rng_tracker_fork_keeps_default_stream_and_is_reproducible():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    def draw(use_fork):
        torch.manual_seed(7)
        model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
        forked = None
        if use_fork:
            with get_cuda_rng_tracker().fork():
                forked = torch.randn(4)
        return forked, torch.randn(4)

    f1, d1 = draw(True)
    f2, d2 = draw(True)
    _, d3 = draw(False)
    assert torch.equal(f1, f2) and torch.equal(d1, d2)
    assert torch.equal(d1, d3), "forking the model-parallel RNG must not advance the default stream"
    assert not torch.equal(f1, d1)


def test_torch_norm_allows_sequence_parallel_and_tags_weights():
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    cfg = types.SimpleNamespace(layernorm_zero_centered_gamma=False, memory_efficient_layer_norm=False,
                                persist_layer_norm=False, normalization="RMSNorm", sequence_parallel=True)
    norm = WrappedTorchNorm(cfg, 8)
    assert isinstance(norm, torch.nn.RMSNorm)
    assert all(getattr(p, "sequence_parallel", False) for p in norm.parameters())
    cfg.sequence_parallel = False
    assert not any(getattr(p, "sequence_parallel", False) for p in WrappedTorchNorm(cfg, 8).parameters())


def test_nvtx_stubbed_even_where_imported_before_install():
    from megatron.rl.runtime import versions

    # the module of the installed release that imports the markers by name
    module = ("megatron.core.inference.text_generation_controllers.text_generation_controller" if versions.is_0_19()
              else "megatron.core.inference.engines.dynamic_engine")
    code = (f"import {module} as bound\n"  # binds nvtx names first
            "from megatron.rl.runtime import setup_runtime\n"
            "setup_runtime()\n"
            "import torch\n"
            "bound.range_push('x'); bound.range_pop()\n"
            "torch.cuda.nvtx.range_push('y'); torch.cuda.nvtx.range_pop()\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_setup_runtime_never_installs_with_cuda():
    code = (
        "import torch; torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1\n"
        "from megatron.rl.runtime import setup_runtime, cpu_patches\n"
        "info = setup_runtime(); assert not info.cpu_layer_active and info.backend == 'nccl', info\n"
        "assert cpu_patches.INSTALLED == []\n"
        "try:\n    cpu_patches.install()\nexcept RuntimeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: the CPU runtime layer must not be installed when CUDA is available" in out.stdout


@pytest.mark.multiprocess
def test_distributed_optimizer_checkpoint_resume_is_exact(tmp_path, torchrun):
    proc = torchrun(SCRIPTS / "dist_optimizer_roundtrip.py", [tmp_path / "ckpt"], nproc=2)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["steps"] == [3.0], "every Adam state must carry the saved step count"
    assert res["distinct_step_tensors"], "Adam 'step' tensors must not be shared across params after load"
    assert res["resumed"] == pytest.approx(res["uninterrupted"], abs=1e-6)
    assert all(math.isfinite(x) for x in res["moe_losses"]) and res["moe_losses"][-1] < res["moe_losses"][0]


@pytest.mark.parametrize("repeats,dim", [(2, 2), (3, 1), (2, -2)])
def test_repeat_interleave_under_the_device_mode_keeps_forward_and_gradient(repeats, dim):
    """The mode routes a repeat that needs a gradient through an addition-based backward (megatron-core's GQA K/V
    repeat): the same forward, the same gradient (bit for bit with two copies), and only where grad is needed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 2, 4, generator=g, requires_grad=True)
    upstream = torch.randn(x.shape[:dim % 4] + (x.shape[dim] * repeats,) + x.shape[dim % 4 + 1:], generator=g)
    plain = x.repeat_interleave(repeats, dim=dim)
    (want,) = torch.autograd.grad(plain, x, upstream)
    with CudaToCpuMode():
        mine = x.repeat_interleave(repeats, dim=dim)
        with torch.no_grad():
            untouched = x.repeat_interleave(repeats, dim=dim)
    assert type(mine.grad_fn).__name__ == "_RepeatInterleaveBackward"
    assert untouched.grad_fn is None and torch.equal(untouched, plain.detach())
    assert torch.equal(mine, plain)
    (got,) = torch.autograd.grad(mine, x, upstream)
    if repeats == 2:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
