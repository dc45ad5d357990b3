"""Compile-only: the sm90 forward kernel builds for sm_90a, and its PTX holds what the design says.

It cannot run here (no GPU) and is not routed; numerics on an H200 are still to come.
"""

from __future__ import annotations

import re

import pytest
import torch

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING

pytestmark = [pytest.mark.cute, pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}")]


@pytest.fixture(autouse=True)
def _private_dsl_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FA_BACKEND_CUTE_CACHE_DIR", str(tmp_path / "dsl-cache"))


def _wgmma_counts(ptx: str) -> dict[str, int]:
    return {shape: ptx.count(f"wgmma.mma_async.sync.aligned.{shape}")
            for shape in set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx))}


@pytest.mark.parametrize("dtype,d,causal,bottom_right", [
    (torch.bfloat16, 128, False, False),
    (torch.bfloat16, 128, True, False),
    (torch.float16, 64, True, True),
    (torch.float16, 128, False, False),
    (torch.bfloat16, 96, True, False),
])
def test_compiles_for_sm90a(tmp_path, dtype, d, causal, bottom_right):
    from fa_backend.kernels.cute import flash_fwd

    ptx = flash_fwd.compile_flash_fwd(dtype, d, causal, bottom_right, "sm_90a", str(tmp_path)).__ptx__
    t = "bf16" if dtype == torch.bfloat16 else "f16"
    qk = f"m64n{flash_fwd.TILE_N}k16.f32.{t}.{t}"  # S = Q K^T: head_dim / 16 instructions
    pv = f"m64n{d}k16.f32.{t}.{t}"  # O += P V: TILE_N / 16 instructions
    expected = {qk: d // 16}
    expected[pv] = expected.get(pv, 0) + flash_fwd.TILE_N // 16
    assert _wgmma_counts(ptx) == expected
    # P V takes P from registers ({4 registers}) and V transposed (MN-major: last immediate 1)
    pv_lines = [line for line in ptx.splitlines() if f"aligned.{pv}" in line and "{%r" in line.split("}, ")[1]]
    assert pv_lines and all(line.rstrip().endswith("1, 1;") for line in pv_lines)
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx  # TMA from the 4-D (s, d, h, b) views
    # one exp2 per score the thread holds, plus one rescale factor per row half
    assert ptx.count("ex2.approx") == flash_fwd.TILE_M * flash_fwd.TILE_N // flash_fwd.THREADS + 2
    assert "ld.local" not in ptx and "st.local" not in ptx  # no register spills


def test_variants_are_compiled_once():
    from fa_backend.kernels.cute import _compile_cache, flash_fwd

    _compile_cache.CACHE.clear()  # GPU tests earlier in the session may have compiled this variant
    before = len(_compile_cache.CACHE)
    first = flash_fwd.compile_flash_fwd(torch.float16, 64, False)
    assert flash_fwd.compile_flash_fwd(torch.float16, 64, False) is first
    assert len(_compile_cache.CACHE) == before + 1


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.float16, 80), (torch.bfloat16, 256)])
def test_unsupported_variants_are_refused(dtype, d):
    from fa_backend.kernels.cute import flash_fwd

    with pytest.raises(ValueError, match="supported"):
        flash_fwd.compile_flash_fwd(dtype, d, False)


@pytest.mark.parametrize("d", [64, 96, 128])
def test_score_accumulator_order_is_the_p_operand_order(d):
    """The kernel feeds the S accumulator's registers to P V unchanged and reads value i's row half as
    (i // 2) % 2: both hold only if the two layouts give every value the same (row, col)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup

    from fa_backend.kernels.cute import flash_fwd

    found = {}

    @cute.jit
    def layouts():
        qk = sm90.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
                                         cutlass.Float32, (1, 1, 1), (flash_fwd.TILE_M, flash_fwd.TILE_N))
        pv = sm90.make_trivial_tiled_mma(cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.MN,
                                         cutlass.Float32, (1, 1, 1), (flash_fwd.TILE_M, d),
                                         a_source=warpgroup.OperandSource.RMEM)
        tile = cute.make_identity_tensor((flash_fwd.TILE_M, flash_fwd.TILE_N))
        for t in (0, 5, 37, 127):
            s, p = qk.get_slice(t).partition_C(tile), pv.get_slice(t).partition_A(tile)
            found[t] = ([s[i] for i in range(cute.size(s))], [p[i] for i in range(cute.size(p))])

    cute.compile(layouts, options="--gpu-arch sm_90a")
    assert set(found) == {0, 5, 37, 127}
    for s, p in found.values():
        assert len(s) == flash_fwd.TILE_M * flash_fwd.TILE_N // flash_fwd.THREADS
        assert s == p
        rows = [r for r, _ in s]
        assert len(set(rows)) == 2 and all(r == rows[(i // 2) % 2 * 2] for i, r in enumerate(rows))


@pytest.mark.parametrize("case,match", [("head_dim_80", "head_dim"), ("negative_scale", "scale"),
                                        ("strided_head_dim", "strides"), ("gqa_ratio", "multiple"),
                                        ("mixed_dtypes", "dtypes")])
def test_runner_rejects_what_the_kernel_cannot_take(case, match):
    from fa_backend.kernels.cute.flash_fwd import _check_inputs

    d = 80 if case == "head_dim_80" else 64
    q = torch.randn(1, 3 if case == "gqa_ratio" else 2, 64, d, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 64, d, dtype=torch.float16 if case == "mixed_dtypes" else torch.bfloat16)
    v = torch.randn(1, 2, 64, d, dtype=torch.bfloat16)
    if case == "strided_head_dim":
        q = q.transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(ValueError, match=match):
        _check_inputs(q, k, v, -0.1 if case == "negative_scale" else 0.125)
    ok = torch.randn(1, 2, 64, 64, dtype=torch.bfloat16)
    _check_inputs(ok, ok, ok, 0.125)  # and a call it can take passes
