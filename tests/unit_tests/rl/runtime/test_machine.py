"""The machine-type line that learning figures are reported beside."""
from __future__ import annotations

from megatron.rl.runtime.machine import isa_flags, machine_type

_XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile
"""
_EPYC_AVX2 = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse2 avx avx2 fma\n"


def test_isa_flags_name_the_kernel_choosing_features_in_a_fixed_order():
    assert isa_flags(_XEON) == ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                                "amx_tile", "amx_bf16"]
    assert isa_flags(_EPYC_AVX2) == ["avx2", "fma"]
    assert isa_flags("") == []


def test_machine_type_names_this_machine():
    line = machine_type()
    assert "logical CPUs" in line and line.split(",")[0].strip()
