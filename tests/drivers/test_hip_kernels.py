"""The kernels built for AMD GPUs with `hipcc` (Debian's HIP toolchain, no device needed: the
target is named) on every run, with the options and defines the driver gives hiprtc on the
device: every kernel of every source for gfx90a (MI200, wave64), gfx940 (MI300, wave64) and
gfx1030 (RDNA2, wave32), and the compiler's resource report read: registers, LDS and scratch
within the target's limits, no spills. Nothing here skips: without hipcc these fail, naming
the packages to install (.ci/run installs them)."""

from __future__ import annotations

import pytest

from engine.drivers.cuda import compile as cc
from engine.drivers.cuda import compile_hip as hip

EM_AMDGPU = 224


@pytest.fixture(scope="module", params=sorted(hip.TARGETS))
def built(request):
    arch = request.param
    units = hip.compile_all(arch)
    usage = {}
    for unit in units.values():
        usage |= hip.resource_usage(unit.log)
    return arch, units, usage


def test_every_kernel_builds_for_the_target(built):
    """Each source is a clang offload bundle holding the target's amdgcn code object (an ELF
    for EM_AMDGPU), and the report names every kernel the sources define."""
    arch, units, usage = built
    for unit in units.values():
        assert unit.code.startswith(b"__CLANG_OFFLOAD_BUNDLE__"), unit.name
        assert f"amdgcn-amd-amdhsa--{arch}".encode() in unit.code, unit.name
        elf = unit.code.index(b"\x7fELF")
        assert int.from_bytes(unit.code[elf + 18 : elf + 20], "little") == EM_AMDGPU, unit.name
    assert set(usage) == set(cc.kernel_names()), arch


def test_the_resource_report_is_within_the_targets_limits_and_nothing_spills(built):
    arch, _, usage = built
    for name, u in usage.items():
        assert u.vgprs <= hip.MAX_VGPRS and u.agprs <= hip.MAX_VGPRS, (arch, name, u)
        assert u.sgprs <= hip.MAX_SGPRS, (arch, name, u)
        assert u.lds <= hip.MAX_LDS, (arch, name, u)
        assert (u.scratch, u.vgpr_spill, u.sgpr_spill) == (0, 0, 0), (arch, name, u)
        assert u.occupancy >= 1, (arch, name, u)  # a block of its launch bounds fits a compute unit


def test_the_attention_kernel_is_sized_by_the_wavefront(built):
    """paged_attention's per-lane registers hold head_dim / LANES dimensions, and its LDS the
    same 4 warps' partial rows whatever the lane count (4 x 256 floats + 8 floats)."""
    arch, _, usage = built
    assert usage["paged_attention_f16"].lds == usage["paged_attention_bf16"].lds == 4 * 256 * 4 + 2 * 4 * 4


def test_the_options_are_the_drivers():
    assert hip.hiprtc_options("gfx90a:sramecc+:xnack-", 64) == ["--gpu-architecture=gfx90a:sramecc+:xnack-", "-O3",
                                                              "-std=c++17", "-DLANES=64"]
    assert "-DLANES=32" in hip.options(hip.TARGETS["gfx1030"])


def test_the_report_check_sees_scratch():
    code = """#include "platform.h"
    extern "C" __global__ void local(float* o, int n) {
      float a[512];
      for (int i = 0; i < 512; i++) a[i] = o[i * n + threadIdx.x];
      float s = 0;
      for (int i = 0; i < 512; i++) s += a[(i * n) & 511] * a[i];
      o[threadIdx.x] = s;
    }"""
    usage = hip.resource_usage(hip.compile_source(code, "local.cu", "gfx90a").log)
    assert usage["local"].scratch > 0


def test_a_syntax_error_fails_naming_the_file():
    broken = cc.source("kernels.cu").replace("const int half = head_dim >> 1;", "const int half = head_dim >> ;")
    with pytest.raises(cc.CompileError, match=r"kernels\.cu"):
        hip.compile_source(broken, "kernels.cu", "gfx1030")


def test_a_lane_count_other_than_the_targets_is_refused():
    """platform.h holds LANES to the wavefront the compiler builds for: kernels written for 32
    lanes never reach a 64-lane target unnoticed."""
    with pytest.raises(cc.CompileError, match="LANES differs"):
        hip.compile_source(cc.source("kernels.cu"), "kernels.cu", "gfx90a", lanes=32)
