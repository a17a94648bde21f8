"""Which machine type a run's figures come from: the CPU model and the instruction sets that change its floats.

Must not: decide anything. What a tiny model learns moves with the CPU's float kernels (AVX2, AVX-512, AMX
pick different matrix-product code), so learning figures are reported beside this line.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["machine_type", "isa_flags"]

# the CPU features that choose oneDNN/MKL kernels, in the order they are named
_ISA = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def isa_flags(cpuinfo: str) -> list[str]:
    """The kernel-choosing flags in a ``/proc/cpuinfo`` text, in :data:`_ISA` order."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return [f for f in _ISA if f in flags]


def machine_type() -> str:
    """``<CPU model>, <n> logical CPUs; <flags>; AMX: yes|no`` (the platform's name where /proc is absent)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.machine())
    flags = isa_flags(cpuinfo)
    amx = "yes" if "amx_tile" in flags else "no"
    return f"{model}, {os.cpu_count()} logical CPUs; flags {' '.join(flags) or 'no AVX2'}; AMX: {amx}"
