"""Compile-only: the sm90 CuTe backward (kernels/cute/flash_bwd.py) builds for sm_90a, and its PTX holds what the
design says: five GEMMs on wgmma, P^T and dS^T from registers, TMA loads, one fp32 atomic add per dQ value.

It cannot run here; its numerics test (test_flash_bwd_gpu.py) needs an H200.
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


def _wgmma_lines(ptx: str, shape: str) -> list[str]:
    return [line for line in ptx.splitlines() if f"wgmma.mma_async.sync.aligned.{shape} " in line]


@pytest.mark.parametrize("dtype,d,causal,bottom_right", [
    (torch.bfloat16, 128, False, False),
    (torch.bfloat16, 128, True, False),
    (torch.float16, 64, True, True),
])
def test_compiles_for_sm90a(tmp_path, dtype, d, causal, bottom_right):
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(dtype, d, causal, bottom_right, "sm_90a", str(tmp_path)).__ptx__
    t = "bf16" if dtype == torch.bfloat16 else "f16"
    n, m = flash_bwd.TILE_N, flash_bwd.TILE_M
    scores = _wgmma_lines(ptx, f"m64n{m}k16.f32.{t}.{t}")  # S^T = K Q^T and dP^T = V dO^T: d / 16 each
    grads = _wgmma_lines(ptx, f"m64n{d}k16.f32.{t}.{t}")  # dV, dK (K = TILE_M) and the dQ block (K = TILE_N)
    if d == m:
        assert len(scores) == 2 * d // 16 + 2 * m // 16 + n // 16
    else:
        assert len(scores) == 2 * d // 16 and len(grads) == 2 * m // 16 + n // 16
        # dV and dK take P^T / dS^T from registers ({4 registers} as A), the dQ block both operands from
        # shared memory; dO, Q and K as MN-major B operands (transposed views: last immediate 1)
        from_regs = [line for line in grads if "{%r" in line.split("}, ")[1]]
        assert len(from_regs) == 2 * m // 16
        assert all(line.rstrip().endswith("1, 1;") for line in grads)
    assert len(re.findall(r"(?:red|atom)\.global\.[a-z.]*f32", ptx)) == m * d // flash_bwd.THREADS
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx  # TMA from the 4-D (s, d, h, b) views
    assert ptx.count("ex2.approx") == n * m // flash_bwd.THREADS  # one exp2 per score the thread holds
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_unsupported_variants_are_value_errors():
    from fa_backend.kernels.cute import flash_bwd

    with pytest.raises(ValueError, match="head_dim=96"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 96, False)
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        flash_bwd.compile_flash_bwd(torch.float32, 64, False)
