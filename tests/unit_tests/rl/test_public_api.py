"""The package layout rules and the public API."""
import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_megatron_is_a_namespace_package_shared_with_megatron_core():
    assert not (REPO_ROOT / "megatron" / "__init__.py").exists()
    assert not (REPO_ROOT / "megatron" / "core").exists() and not (REPO_ROOT / "megatron" / "training").exists()
    import megatron.core
    import megatron.rl

    assert "site-packages" in megatron.core.__file__ and str(REPO_ROOT) in megatron.rl.__file__


def test_every_export_resolves_and_import_is_lazy():
    code = ("import sys, megatron.rl as m\n"
            "assert 'megatron.core' not in sys.modules, 'import megatron.rl must not import megatron-core'\n"
            "missing = [n for n in m.__all__ if getattr(m, n, None) is None]\n"
            "assert not missing, missing\n"
            "print(len(m.__all__))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.strip()) >= 20
