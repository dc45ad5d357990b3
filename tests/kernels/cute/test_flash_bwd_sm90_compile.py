"""Compile-only: the sm90 CuTe backward (kernels/cute/flash_bwd.py) builds for sm_90a, and its PTX holds what the
design says: five GEMMs on wgmma, P^T and dS^T from registers, TMA loads, dQ by two bulk reduce-adds per block
(or, dq_atomic=True, one fp32 atomic add per value); and the host-side reordering of the chunked dQ buffer.

It cannot run here; its numerics test (test_flash_bwd_gpu.py) needs an H200.
"""

from __future__ import annotations

import re

import pytest
import torch

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.kernels.cute.ptxas import needs_ptxas, ptxas_report

pytestmark = [pytest.mark.cute, pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}")]


@pytest.fixture(autouse=True)
def _private_dsl_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FA_BACKEND_CUTE_CACHE_DIR", str(tmp_path / "dsl-cache"))


def _wgmma_lines(ptx: str, shape: str) -> list[str]:
    return [line for line in ptx.splitlines() if f"wgmma.mma_async.sync.aligned.{shape} " in line]


@pytest.mark.parametrize("dtype,d,causal,bottom_right,dq_atomic", [
    (torch.bfloat16, 128, False, False, False),
    (torch.bfloat16, 128, True, False, False),
    (torch.float16, 64, True, True, False),
    (torch.bfloat16, 128, False, False, True),
    (torch.bfloat16, 96, True, True, False),
])
def test_compiles_for_sm90a(tmp_path, dtype, d, causal, bottom_right, dq_atomic):
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(dtype, d, causal, bottom_right, "sm_90a", str(tmp_path),
                                      dq_atomic=dq_atomic).__ptx__
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
    atomics = re.findall(r"(?:red|atom)\.global\.[a-z.]*f32", ptx)
    bulk_adds = re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32", ptx)
    if dq_atomic:
        assert len(atomics) == m * d // flash_bwd.THREADS and not bulk_adds
    else:  # the dQ block by bulk adds: one lane adds its two halves (the stage's Q and dO memory)
        assert not atomics and len(bulk_adds) == 2
    assert "cp.async.bulk.tensor.4d.shared::cta.global" in ptx  # TMA from the 4-D (s, d, h, b) views
    assert ptx.count("ex2.approx") == n * m // flash_bwd.THREADS  # one exp2 per score the thread holds
    # dS^T to shared memory: 8 x 8 matrices by stmatrix (four per instruction), no scalar 16-bit stores
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == n * m // (flash_bwd.THREADS * 8)
    assert "st.shared.b16" not in ptx
    # each score's (LSE, delta) pair from shared memory with the neighbouring query's: one 128-bit load per two
    # queries the thread holds (TILE_M / 8 * 2 / 2 = 8), no scalar loads
    assert re.findall(r"ld\.shared\.[a-z0-9.]+", ptx) == ["ld.shared.v4.b32"] * (m // 8)
    assert "ld.local" not in ptx and "st.local" not in ptx


@pytest.mark.parametrize("dq_buffer", [False, True])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
def test_two_warpgroups_compile_for_sm90a(tmp_path, causal, bottom_right, dq_buffer):
    """wgs=2: 128 keys per CTA, each warpgroup its own S^T / dP^T / dV / dK over 64 keys and half of the dQ block's
    columns over all 128 keys (two chains of K = 64), the dQ block by two bulk adds (dq_buffer: one per warpgroup,
    from the same instruction)."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, 128, causal, bottom_right, "sm_90a", str(tmp_path),
                                      wgs=2, dq_buffer=dq_buffer).__ptx__
    n, m, d = flash_bwd.TILE_N, flash_bwd.TILE_M, 128
    half = _wgmma_lines(ptx, f"m64n{d // 2}k16.f32.bf16.bf16")  # S^T, dP^T (N = TILE_M = 64) and dQ (N = d / 2)
    full = _wgmma_lines(ptx, f"m64n{d}k16.f32.bf16.bf16")  # dV, dK
    assert len(half) == 2 * d // 16 + 2 * n // 16 and len(full) == 2 * m // 16
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.global", ptx)) == (1 if dq_buffer else 2)
    assert not re.findall(r"(?:red|atom)\.global\.[a-z.]*f32", ptx)
    assert ptx.count("ex2.approx") == n * m // flash_bwd.THREADS
    assert "ld.local" not in ptx and "st.local" not in ptx
    dq_tail = ptx[ptx.rindex("wgmma.wait_group.sync.aligned"):ptx.index("cp.reduce.async.bulk")]
    if dq_buffer:
        # one CTA barrier per step (dS; setup and the first stage's rows add two), the dQ part behind two barriers
        # of the warpgroup's 128 threads (ids 1 and 2: bar.sync with a thread count)
        named = re.findall(r"bar\.sync\s+(%r\d+|\d+),\s*128;", dq_tail)
        assert len(named) == 2 and "st.shared.v2" not in dq_tail[:dq_tail.index("bar.sync")]
        assert len(re.findall(r"bar\.sync\s+0;", ptx)) == 3
    else:
        # the dQ halves overwrite the stage's Q / dO, which the other warpgroup's dK / dV GEMMs read: a barrier after
        # the dQ GEMM's wait comes before the first dQ store (before it, only the next rows' (LSE, delta) pair);
        # three per step still (dS, that one, dQ), five in all
        before, after = dq_tail.split("bar.sync", 1)
        dq_stores = m * d // 2 // flash_bwd.THREADS // 2  # this warpgroup's half of the block, two values a store
        assert before.count("st.shared.v2") <= 1 and after.split("bar.sync")[0].count("st.shared.v2") == dq_stores
        assert dq_tail.count("bar.sync") == 2
        assert ptx.count("bar.sync") == 5


@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
def test_warp_specialized_compiles_for_sm90a(shared_ptx, causal, bottom_right):
    """flash_bwd_ws: 384 threads, the producer warpgroup at 24 registers and the MMA warpgroups at 240; the same
    GEMMs as the two-warpgroup kernel; one CTA barrier (setup) and three barriers of the MMA warpgroups' 256 threads
    (setup, one per step, one before the epilogue overwrites K and V), then one of each warpgroup's 128 threads;
    the dQ block by one bulk add from the writer warp, the Q / dO loads through a full / empty mbarrier pipeline;
    one wgmma commit group per GEMM (five per step), each waited for where its result is read; dK and dV by
    stmatrix into the K / V tiles and TMA stores (d / 64 boxes each), no 16-bit global store."""
    from fa_backend.kernels.cute import flash_bwd, flash_bwd_ws

    ptx = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 128, causal, bottom_right, wgs=2,
                     warp_specialized=True)
    n, m, d = flash_bwd.TILE_N, flash_bwd.TILE_M, 128
    assert ".reqntid 384, 1, 1" in ptx and ".minnctapersm 1" in ptx
    assert re.findall(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx) == [
        ("dec", str(flash_bwd_ws.PRODUCER_REGS)), ("inc", str(flash_bwd_ws.MMA_REGS))]
    half = _wgmma_lines(ptx, f"m64n{d // 2}k16.f32.bf16.bf16")
    full = _wgmma_lines(ptx, f"m64n{d}k16.f32.bf16.bf16")
    assert len(half) == 2 * d // 16 + 2 * n // 16 and len(full) == 2 * m // 16
    assert re.findall(r"bar\.sync\s+([^;]*);", ptx)[:4] == ["0", "1, 256", "1, 256", "1, 256"]
    assert re.fullmatch(r"%r\d+, 128", re.findall(r"bar\.sync\s+([^;]*);", ptx)[4])
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.global", ptx)) == 1
    # dS^T per step, then dK and dV (64 x d each per warpgroup) once
    assert (ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16")
            == (n * m + 2 * n * d) // (flash_bwd.THREADS * 8))
    assert ptx.count("cp.async.bulk.tensor.4d.global.shared::cta") == 2 * d // 64
    assert not re.findall(r"st\.global\S*\.b16", ptx)
    assert ptx.count("mbarrier.arrive.expect_tx") == 2  # K and V once, Q and dO per step
    assert ptx.count("wgmma.commit_group.sync.aligned") == 5
    assert "ld.local" not in ptx and "st.local" not in ptx


@needs_ptxas
def test_warp_specialized_registers_fit(tmp_path, shared_ptx):
    """ptxas allocates the MMA warpgroups' code with the budget setmaxnreg.inc gives them: 168 registers for the
    384-thread launch, no spills, every wgmma group asynchronous."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 128, True, False, wgs=2, warp_specialized=True)
    report = ptxas_report(ptx, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert not re.findall(r"C75\d\d", report), report
    assert int(re.search(r"Used (\d+) registers", report)[1]) <= 65536 // 384


@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
def test_tile80_compiles_for_sm90a(shared_ptx, causal, bottom_right):
    """flash_bwd_ws with 80 query rows per step (tile_m=80): S^T / dP^T and the transposed dQ GEMM on m64n80k16
    (d / 16 each, and TILE_N * wgs / 16 for dQ^T = K^T dS^T), dV / dK on m64n128k16 over K = 80 (5 each)."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 128, causal, bottom_right, wgs=2,
                     warp_specialized=True, tile_m=80)
    n, d = flash_bwd.TILE_N, 128
    assert len(_wgmma_lines(ptx, "m64n80k16.f32.bf16.bf16")) == 2 * d // 16 + 2 * n // 16
    assert len(_wgmma_lines(ptx, f"m64n{d}k16.f32.bf16.bf16")) == 2 * 80 // 16
    assert re.findall(r"bar\.sync\s+([^;]*);", ptx)[:4] == ["0", "1, 256", "1, 256", "1, 256"]
    assert ptx.count("wgmma.commit_group.sync.aligned") == 5


@needs_ptxas
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
def test_tile80_keeps_wgmma_asynchronous(tmp_path, shared_ptx, causal, bottom_right):
    """With 80-row steps the scores' accumulators take 80 registers: the rows' LSE / delta come by warp shuffles
    (20 columns a thread, 40 shuffles a step) in FA4's order, and ptxas keeps the wgmmas asynchronous without
    spilling (the per-score reads spilled 12-28 bytes; the columns held in registers serialised the wgmmas)."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 128, causal, bottom_right, wgs=2,
                     warp_specialized=True, tile_m=80)
    report = ptxas_report(ptx, tmp_path)
    assert not re.findall(r"C75\d\d", report), report
    assert ptx.count("shfl.sync.idx") >= 2 * 2 * 80 // 8, "the rows' LSE / delta are not shuffled"
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) == 0, report


@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
def test_tile128_d64_compiles_for_sm90a(shared_ptx, causal, bottom_right):
    """flash_bwd_ws at d=64 with 128 query rows per step (FA4's d=64 tile): S^T / dP^T on m64n128k16 (d / 16
    each); dV / dK over K = 128 queries and each warpgroup's 64 rows of the dQ block over both key tiles, all on
    m64n64k16; FA4's order after the scores (dV waited for before dK is issued, dQ before its store)."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 64, causal, bottom_right, wgs=2,
                     warp_specialized=True, tile_m=128)
    n, d = flash_bwd.TILE_N, 64
    assert len(_wgmma_lines(ptx, "m64n128k16.f32.bf16.bf16")) == 2 * d // 16
    assert len(_wgmma_lines(ptx, "m64n64k16.f32.bf16.bf16")) == 2 * 128 // 16 + 2 * n // 16
    assert re.findall(r"bar\.sync\s+([^;]*);", ptx)[:4] == ["0", "1, 256", "1, 256", "1, 256"]
    assert ptx.count("wgmma.commit_group.sync.aligned") == 5


@needs_ptxas
@pytest.mark.parametrize("causal,bottom_right,key_mask", [(False, False, False), (True, True, False),
                                                          (False, False, True)])
def test_tile128_d64_keeps_wgmma_asynchronous(tmp_path, shared_ptx, causal, bottom_right, key_mask):
    """No C75xx serialisation at 128 rows, where the LSE and delta come by warp shuffles (flash_bwd._held_rows:
    the unpredicated exp2s in the kernel's own order made ptxas serialise the wgmmas), and no spill without a
    causal mask (20 bytes before; causal: at most 8)."""
    from fa_backend.kernels.cute import flash_bwd

    masked = {"key_mask": True, "pointer_args": True} if key_mask else {}  # the key-mask build takes pointers
    ptx = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 64, causal, bottom_right, wgs=2,
                     warp_specialized=True, tile_m=128, **masked)
    report = ptxas_report(ptx, tmp_path)
    assert not re.findall(r"C75\d\d", report), report
    assert ptx.count("shfl.sync.idx") >= 2 * 2 * 128 // 8, "the rows' LSE / delta are not shuffled"
    spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills and max(spills) <= (8 if causal else 0), report


@pytest.mark.parametrize("causal", [True])
def test_register_epilogue_variant(tmp_path, causal):
    """tma_store=False: dK / dV from registers (d / 2 16-bit stores per thread and gradient: one per value), no TMA
    store, the setup and per-step barriers only."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, 128, causal, False, "sm_90a", str(tmp_path), wgs=2,
                                      warp_specialized=True, tma_store=False).__ptx__
    assert len(re.findall(r"st\.global\S*\.b16", ptx)) == 2 * 128 // 2
    assert "cp.async.bulk.tensor.4d.global.shared::cta" not in ptx
    assert re.findall(r"bar\.sync\s+([^;]*);", ptx) == ["0", "1, 256", "1, 256"]
    with pytest.raises(ValueError, match="tma_store=True needs"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 128, causal, wgs=2, tma_store=True)


def test_unsupported_variants_are_value_errors():
    from fa_backend.kernels.cute import flash_bwd

    with pytest.raises(ValueError, match="head_dim=80"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 80, False)
    with pytest.raises(ValueError, match="dtype=torch.float32"):
        flash_bwd.compile_flash_bwd(torch.float32, 64, False)
    with pytest.raises(ValueError, match="wgs=2 with head_dim=64"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 64, False, wgs=2)
    with pytest.raises(ValueError, match="dq_buffer=True needs the bulk-add dQ"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 128, False, dq_atomic=True, dq_buffer=True)
    for kwargs in (dict(wgs=1), dict(wgs=2, dq_atomic=True)):
        with pytest.raises(ValueError, match="warp_specialized=True needs wgs=2"):
            flash_bwd.compile_flash_bwd(torch.bfloat16, 128, False, warp_specialized=True, **kwargs)
    for d, kwargs in ((128, dict(wgs=2, tile_m=80)), (128, dict(wgs=2, warp_specialized=True, tile_m=96)),
                      (128, dict(wgs=2, warp_specialized=True, tile_m=128)), (64, dict(wgs=2, warp_specialized=True,
                                                                                          tile_m=80))):
        with pytest.raises(ValueError, match="tile_m="):
            flash_bwd.compile_flash_bwd(torch.bfloat16, d, False, **kwargs)


@needs_ptxas
@pytest.mark.parametrize("dq_buffer", [False, True])
def test_two_warpgroups_wgmmas_stay_asynchronous(tmp_path, dq_buffer):
    """ptxas keeps every wgmma group asynchronous (no C7514 / C7515 serialisation, no injected waits or arrives)
    and allocates without spills."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, 128, True, False, "sm_90a", str(tmp_path), wgs=2,
                                      dq_buffer=dq_buffer).__ptx__
    report = ptxas_report(ptx, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert not re.findall(r"C75\d\d", report), report


@needs_ptxas
@pytest.mark.parametrize("causal", [False, True])
def test_64_row_steps_read_each_columns_rows_once(tmp_path, shared_ptx, causal):
    """The op's d=128 backward (64-row steps, FlashBackwardSm90WS.column_reads): the step's LSE and delta are read
    once per query column of the thread, one plane per statistic, each adjacent pair of columns with one 8-byte
    ld.shared.v2 (8 per statistic and step; interleaved (LSE, delta) rows made 8 ld.shared.v4 in the PTX that ptxas
    split into 32 scalar LDS), hidden scores go to -inf before an unpredicated exp2
    (one select per score), and ptxas keeps the wgmmas asynchronous without spills. (Read by runtime column under
    each score's predicate: 48 scalar loads, the addresses recomputed in the SASS each time, 686 instructions per
    step against 546.)"""
    from fa_backend.kernels.cute import flash_bwd

    ptx = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 128, causal, False, wgs=2, warp_specialized=True)
    assert ptx.count("ld.shared.v2.b32") == 16 and "ld.shared.v4" not in ptx
    selects = re.findall(r"selp\.f32\s+%r\d+, (?:%r\d+, 0fFF800000|0fFF800000, %r\d+), %p\d+;", ptx)
    assert len(selects) == ptx.count("ex2.approx") == 32
    report = ptxas_report(ptx, tmp_path)
    assert not re.findall(r"C75\d\d", report), report
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report


@needs_ptxas
@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (192, True), (256, False)])
def test_key_mask_variant_keeps_wgmma_asynchronous(tmp_path, d, causal):
    """The op's masked backward (d=128, 64-row steps, and flash_bwd_wide at d=192 / 256;
    ops.cute_flash.KEY_MASK_BACKWARD): the mask's per-row key bounds replace seqlen_k in the visibility test, loaded
    once per query head; no spills, no C75xx serialisation, and the exp2s stay if-converted (fails on the form that
    subtracted a 0 / +inf term)."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, d, causal, False, "sm_90a", str(tmp_path), wgs=2,
                                      warp_specialized=True, key_mask=True).__ptx__
    _assert_asynchronous_and_if_converted(ptx, tmp_path)


def _assert_asynchronous_and_if_converted(ptx: str, tmp_path) -> None:
    """ptxas on the PTX: no spills, no C75xx serialisation; and the exp2 of every score if-converted, as without a
    mask or dropout: no branch between the first and last MUFU.EX2 (the forms that kept one ran 21-35 % slower on
    the H200)."""
    report = ptxas_report(ptx, tmp_path)
    assert not re.findall(r"C75\d\d", report), report
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    sass = _sass(tmp_path / "kernel.cubin")
    if sass is not None:
        first, last = sass.index("MUFU.EX2"), sass.rindex("MUFU.EX2")
        assert " BRA " not in sass[first:last]


def _sass(cubin):
    """cuobjdump -sass of a cubin (the one Triton bundles), or None where there is none."""
    import pathlib
    import subprocess

    import triton

    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    return subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def test_key_mask_needs_the_warp_specialised_kernel():
    from fa_backend.kernels.cute import flash_bwd

    with pytest.raises(ValueError, match="key_mask=True needs warp_specialized=True"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 128, False, wgs=2, key_mask=True)


@needs_ptxas
@pytest.mark.parametrize("d,tile_m,causal", [(128, 64, False), (128, 64, True), (64, 128, True)])
def test_deterministic_variant_orders_its_dq_adds(tmp_path, d, tile_m, causal):
    """The deterministic variant (the op's backward under torch.use_deterministic_algorithms): the dQ writer spins on
    an acquire load of the block's turn flag before its bulk add and, once the add is complete (wait_group 0, not
    .read), releases the next turn; the MMA warpgroups' code is unchanged (no spills, no C75xx)."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, d, causal, False, "sm_90a", str(tmp_path), wgs=2,
                                      warp_specialized=True, tile_m=tile_m, deterministic=True).__ptx__
    assert ptx.count("ld.global.acquire.gpu.b32") == 1 and ptx.count("red.release.gpu.global.add.s32") == 1
    assert ptx.count("fence.proxy.async.global") == 2
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.global", ptx)) == 1
    waits = re.findall(r"cp\.async\.bulk\.wait_group(\.read)?\s+0;", ptx)
    assert waits.count(".read") == 2 and waits.count("") == 1  # .read: the writer's, and the dK / dV stores' own
    # the flag's release comes after the full wait, the acquire before the add
    assert ptx.index("ld.global.acquire.gpu.b32") < ptx.index("cp.reduce.async.bulk.global")
    full_wait = re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)
    assert full_wait and full_wait.start() < ptx.index("red.release.gpu.global.add.s32")
    report = ptxas_report(ptx, tmp_path)
    assert not re.findall(r"C75\d\d", report), report
    # no more spills than the unordered variant (none at d=128; d=64's 128-row kernel spills 20-24 bytes already)
    (tmp_path / "unordered").mkdir()
    unordered = flash_bwd.compile_flash_bwd(torch.bfloat16, d, causal, False, "sm_90a", str(tmp_path / "unordered"),
                                            wgs=2, warp_specialized=True, tile_m=tile_m).__ptx__
    assert _spill_bytes(report) <= _spill_bytes(ptxas_report(unordered, tmp_path / "unordered")), report
    assert d == 64 or _spill_bytes(report) == 0, report


def _spill_bytes(report: str) -> int:
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report).groups()
    return int(stores) + int(loads)


def test_deterministic_needs_the_warp_specialised_kernel_without_a_mask():
    from fa_backend.kernels.cute import flash_bwd

    for kwargs in (dict(wgs=1), dict(wgs=2, warp_specialized=True, key_mask=True)):
        with pytest.raises(ValueError, match="deterministic=True needs warp_specialized=True and no key mask"):
            flash_bwd.compile_flash_bwd(torch.bfloat16, 128, False, deterministic=True, **kwargs)


@pytest.mark.parametrize("d,causal,deterministic", [(256, False, False), (192, True, False), (256, True, True)])
def test_wide_head_dims_compile_for_sm90a(tmp_path, d, causal, deterministic):
    """flash_bwd_wide (d = 192 / 256): S^T / dP^T as m64n32 GEMMs over the warpgroup's 32 queries (d / 16 each),
    dV, dK and the dQ block as m64n(d/2) GEMMs with every operand in shared memory (64 / 16 each), P^T and dS^T
    stored by stmatrix, the dQ block's four pieces (each warpgroup's part through its column halves of the step's Q
    and dO tiles) by four bulk adds per step, no local memory; dK and dV (a warpgroup's column halves: 64 x d / 2
    each) by stmatrix into the K and V tiles and two TMA stores of d / 64 (d=192: 64-byte swizzle, d / 32) boxes."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, d, causal, True, "sm_90a", str(tmp_path), wgs=2,
                                      warp_specialized=True, deterministic=deterministic).__ptx__
    scores = _wgmma_lines(ptx, "m64n32k16.f32.bf16.bf16")
    grads = _wgmma_lines(ptx, f"m64n{d // 2}k16.f32.bf16.bf16")
    assert len(scores) == 2 * d // 16 and len(grads) == 3 * 64 // 16
    assert not [line for line in grads if "{%r" in line.split("}, ")[1]]  # A from shared memory, not registers
    assert len(re.findall(r"stmatrix", ptx)) == 4 + 2 * 64 * (d // 2) // (flash_bwd.THREADS * 8)
    boxes = d // 64 if d % 128 == 0 else d // 32
    assert ptx.count("cp.async.bulk.tensor.4d.global.shared::cta") == 2 * boxes
    assert not re.findall(r"st\.global\S*\.b16", ptx)
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32", ptx)) == 4
    assert ("ld.global.acquire" in ptx) == deterministic  # the turn flags
    assert "ld.local" not in ptx and "st.local" not in ptx


@needs_ptxas
@pytest.mark.parametrize("d", [192, 256])
def test_wide_head_dims_registers_fit(tmp_path, d):
    """The MMA warpgroups' accumulators (S^T and dP^T 16 + 16, dK, dV and the dQ block 3 x d / 4 registers per
    thread) fit the 240 registers setmaxnreg gives them: no spills, no wgmma serialised (C75xx)."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, d, True, False, "sm_90a", str(tmp_path), wgs=2,
                                      warp_specialized=True).__ptx__
    # P^T branch-free (_p_only(..., branch_free=True)): no branch between the first and last MUFU.EX2 (with the
    # exp2 under `if visible` ptxas kept one per score here: 418 SASS lines for the 16 exp2s at d=256 against 90)
    _assert_asynchronous_and_if_converted(ptx, tmp_path)


@needs_ptxas
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_v_variant_compiles_for_sm90a(tmp_path, causal):
    """flash_bwd_wide with MLA's head dims (q / k 192, v 128): S^T over 192 and dP^T over 128 columns as m64n32 GEMMs
    (12 + 8), dV as m64n64 (each warpgroup's 64 of v's columns, 4), dK and the dQ block as m64n96 (4 + 4); each
    warpgroup's dQ part in three bulk adds (the Q and dO tiles' column halves and its own region: six per step); no
    local memory, no spills, no C75xx, the exp2s without a branch between them."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, 192, causal, False, "sm_90a", str(tmp_path), wgs=2,
                                      warp_specialized=True, pointer_args=True, head_dim_v=128).__ptx__
    assert len(_wgmma_lines(ptx, "m64n32k16.f32.bf16.bf16")) == 192 // 16 + 128 // 16
    assert len(_wgmma_lines(ptx, "m64n64k16.f32.bf16.bf16")) == 64 // 16
    assert len(_wgmma_lines(ptx, "m64n96k16.f32.bf16.bf16")) == 2 * 64 // 16
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.global\.shared::cta\.bulk_group\.add\.f32", ptx)) == 6
    assert "ld.local" not in ptx and "st.local" not in ptx
    _assert_asynchronous_and_if_converted(ptx, tmp_path)


def test_head_dims_v_outside_the_pairs_are_refused():
    from fa_backend.kernels.cute import flash_bwd

    with pytest.raises(ValueError, match="head_dim_v=64"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 192, False, wgs=2, warp_specialized=True, head_dim_v=64)
    with pytest.raises(ValueError, match="dropout"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 192, False, wgs=2, warp_specialized=True, head_dim_v=128,
                                    dropout=True, pointer_args=True)


def test_wide_head_dims_refuse_other_variants():
    from fa_backend.kernels.cute import flash_bwd

    for kwargs in (dict(), dict(wgs=2), dict(wgs=2, warp_specialized=True, tile_m=128),
                   dict(wgs=2, warp_specialized=True, dq_buffer=True)):
        with pytest.raises(ValueError, match="head_dim=256 needs warp_specialized=True"):
            flash_bwd.compile_flash_bwd(torch.bfloat16, 256, False, **kwargs)


@needs_ptxas
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
def test_dropout_variant_draws_in_the_producer_warpgroup(tmp_path, shared_ptx, causal, bottom_right):
    """The op's dropout backward (d=128, 64-row steps; ops.cute_flash.DROPOUT_BACKWARD). With
    flash_bwd_ws.DRAW_WARPGROUP (the default): a fourth warpgroup draws (512 threads), two Philox chains per
    loop iteration (40 wide multiplies; 39 where LLVM shares the chains' first-round product of the zero counter
    word), 24 registers for the producer warpgroup, 40 for the drawing one, 224 for the MMA ones (DRAW_WG_REGS: the
    512 threads' pool); otherwise the producer's warps 2-3 draw, four chains at 56 / 224 (DRAW_REGS). No spills, no
    C75xx serialisation, the exp2s still if-converted; the variant without dropout draws nothing."""
    from fa_backend.kernels.cute import flash_bwd, flash_bwd_ws

    ptx = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 128, causal, bottom_right, wgs=2,
                     warp_specialized=True, pointer_args=True, dropout=True)
    regs = re.findall(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx)
    if flash_bwd_ws.DRAW_WARPGROUP:
        assert ".reqntid 512, 1, 1" in ptx
        assert ptx.count("mul.wide.u32") in (39, 40)
        assert regs == [("dec", "24"), ("dec", "40"), ("inc", "224")]
    else:
        assert 76 <= ptx.count("mul.wide.u32") <= 80
        assert regs == [("dec", "56"), ("inc", "224")]
    _assert_asynchronous_and_if_converted(ptx, tmp_path)
    if not causal:
        plain = flash_bwd.compile_flash_bwd(torch.bfloat16, 128, causal, bottom_right, "sm_90a", str(tmp_path / "p"),
                                            wgs=2, warp_specialized=True, pointer_args=True).__ptx__
        assert "mul.wide.u32" not in plain


@needs_ptxas
@pytest.mark.parametrize("causal", [False, True])
def test_keep_bits_variant_loads_instead_of_drawing(tmp_path, shared_ptx, causal):
    """The dropout backward on the forward's saved keep bits (keep_bits, kernels/keep_bits.py): no Philox draw
    left (no wide multiply), one 16-byte load of a step's bytes per drawing thread, the register split of the
    variants without dropout (24 / 240), no spills or C75xx serialisation, the exp2s still if-converted."""
    from fa_backend.kernels.cute import flash_bwd

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, 128, causal, False, "sm_90a", str(tmp_path), wgs=2,
                                      warp_specialized=True, pointer_args=True, dropout=True, keep_bits=True).__ptx__
    assert "mul.wide.u32" not in ptx
    drawn = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 128, causal, False, wgs=2, warp_specialized=True,
                       pointer_args=True, dropout=True)  # non-causal: the dropout test's variant, compiled once
    assert ptx.count("ld.global.v4.b32") == drawn.count("ld.global.v4.b32") + 1
    assert re.findall(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+);", ptx) == [("dec", "24"), ("inc", "240")]
    _assert_asynchronous_and_if_converted(ptx, tmp_path)


@needs_ptxas
def test_keep_bits_with_a_period_loads_and_draws(tmp_path, shared_ptx):
    """The dropout backward on every second row of tiles saved (keep_bits=2, kernels/keep_bits.py): the drawing
    variant (its warpgroup, its Philox draws and register split) plus one 16-byte load of a saved step's bytes per
    drawing thread; no spills or C75xx serialisation, the exp2s still if-converted. Causal bottom-right only (the
    drawing test's build, compiled once; the non-causal one differs in the mask code: CI time)."""
    from fa_backend.kernels.cute import flash_bwd, flash_bwd_ws

    ptx = flash_bwd.compile_flash_bwd(torch.bfloat16, 128, True, True, "sm_90a", str(tmp_path), wgs=2,
                                      warp_specialized=True, pointer_args=True, dropout=True, keep_bits=2).__ptx__
    drawn = shared_ptx(flash_bwd.compile_flash_bwd, torch.bfloat16, 128, True, True, wgs=2, warp_specialized=True,
                       pointer_args=True, dropout=True)
    regs = re.compile(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+);")
    assert regs.findall(ptx) == regs.findall(drawn)
    if flash_bwd_ws.DRAW_WARPGROUP:
        assert ".reqntid 512, 1, 1" in ptx
    assert ptx.count("mul.wide.u32") == drawn.count("mul.wide.u32") > 0
    assert ptx.count("ld.global.v4.b32") == drawn.count("ld.global.v4.b32") + 1
    _assert_asynchronous_and_if_converted(ptx, tmp_path)


def test_keep_bits_needs_the_dropout_variant_with_64_row_steps():
    from fa_backend.kernels.cute import flash_bwd

    for kw, match in ((dict(dropout=False), "keep_bits=True needs"), (dict(tile_m=128), "dropout=True needs")):
        args = dict(wgs=2, warp_specialized=True, pointer_args=True, dropout=True, keep_bits=True) | kw
        with pytest.raises(ValueError, match=match):
            flash_bwd.compile_flash_bwd(torch.bfloat16, 128, False, **args)
    with pytest.raises(ValueError, match="keep_bits=3"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 128, False, wgs=2, warp_specialized=True, pointer_args=True,
                                    dropout=True, keep_bits=3)


def test_dropout_backward_refuses_what_it_does_not_take():
    from fa_backend.kernels.cute import flash_bwd

    for kw in (dict(key_mask=True), dict(deterministic=True), dict(tile_m=80), dict(tile_m=128),
               dict(pointer_args=False)):
        args = dict(wgs=2, warp_specialized=True, pointer_args=True, dropout=True) | kw
        with pytest.raises(ValueError, match="dropout=True needs"):
            flash_bwd.compile_flash_bwd(torch.bfloat16, 128, False, **args)
    with pytest.raises(ValueError, match="dropout=True needs"):
        flash_bwd.compile_flash_bwd(torch.bfloat16, 256, False, wgs=2, warp_specialized=True, pointer_args=True,
                                    dropout=True)
