"""Which machine type a run's figures come from: the CPU model and the instruction sets that change its floats, read
from ``/proc/cpuinfo`` (here, for every module that reads it).

Must not: decide anything. What a tiny model learns moves with the CPU's float kernels (AVX2, AVX-512, AMX
pick different matrix-product code), so learning figures are reported beside this line.
"""
from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["machine_type", "isa_flags", "cpuinfo_field", "read_cpuinfo"]

# the CPU features that choose oneDNN/MKL kernels, in the order they are named
_ISA = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def read_cpuinfo() -> str | None:
    """The text of ``/proc/cpuinfo``, or None where there is none (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def cpuinfo_field(cpuinfo: str, name: str) -> str | None:
    """The value of the first ``name : value`` line of a ``/proc/cpuinfo`` text (the first CPU's), or None."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def isa_flags(cpuinfo: str) -> list[str]:
    """The kernel-choosing flags in a ``/proc/cpuinfo`` text, in :data:`_ISA` order."""
    flags = set((cpuinfo_field(cpuinfo, "flags") or "").split())
    return [f for f in _ISA if f in flags]


def machine_type() -> str:
    """``<CPU model>, <n> logical CPUs; <flags>; AMX: yes|no`` (the platform's name where /proc is absent)."""
    cpuinfo = read_cpuinfo()
    if cpuinfo is None:
        return f"{platform.processor() or platform.machine()}, {os.cpu_count()} logical CPUs"
    model = cpuinfo_field(cpuinfo, "model name") or platform.machine()
    flags = isa_flags(cpuinfo)
    amx = "yes" if "amx_tile" in flags else "no"
    return f"{model}, {os.cpu_count()} logical CPUs; flags {' '.join(flags) or 'no AVX2'}; AMX: {amx}"
