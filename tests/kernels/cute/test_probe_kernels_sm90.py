"""Compile-only: the DSL builds our tiny probe kernels for sm_90a on any machine (no GPU needed).

Skipped without nvidia-cutlass-dsl. The PTX is checked for the Hopper instructions the kernels ask for.
"""

from __future__ import annotations

import pytest

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING

pytestmark = [pytest.mark.cute, pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}")]


@pytest.fixture(autouse=True)
def _private_dsl_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FA_BACKEND_CUTE_CACHE_DIR", str(tmp_path / "dsl-cache"))


def test_vector_add_compiles_for_sm90a(tmp_path):
    from fa_backend.kernels.cute import probe_kernels

    compiled = probe_kernels.compile_vector_add("sm_90a", str(tmp_path))
    ptx = compiled.__ptx__
    assert ".target sm_90a" in ptx
    assert "add.f16" in ptx or "add.rn.f16" in ptx
    assert list(tmp_path.glob("*.sm_90a.cubin"))


def test_wgmma_tile_compiles_for_sm90a(tmp_path):
    from fa_backend.kernels.cute import probe_kernels

    ptx = probe_kernels.compile_wgmma_tile("sm_90a", str(tmp_path)).__ptx__
    assert ".target sm_90a" in ptx
    # K = 64 in steps of 16: four m64n64k16 wgmma, one TMA load per operand, one commit and wait
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16") == 4
    assert ptx.count("cp.async.bulk.tensor.2d.shared::cta.global") == 2
    assert ptx.count("wgmma.commit_group") == 1 and ptx.count("wgmma.wait_group") == 1


def test_wgmma_needs_the_sm90a_target():
    from fa_backend.kernels.cute import probe_kernels

    with pytest.raises(Exception, match="expects arch to be sm_90a, but got sm_90"):
        probe_kernels.compile_wgmma_tile("sm_90")
