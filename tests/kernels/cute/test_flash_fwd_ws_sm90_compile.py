"""Compile-only: the warp-specialised sm90 forward builds for sm_90a, and its PTX holds what the design says
(register split, wgmma shapes and counts, TMA loads, the K/V pipeline's barriers, no local memory).

It cannot run here (no GPU) and is not routed; numerics on an H200 are still to come.
"""

from __future__ import annotations

import re

import pytest
import torch

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.kernels.cute.ptxas import needs_ptxas, ptxas_report

pytestmark = [pytest.mark.cute, pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}")]

VARIANTS = [  # dtype, head_dim, causal, bottom_right, overlap
    (torch.bfloat16, 128, False, False, False),
    (torch.bfloat16, 128, True, False, False),
    (torch.float16, 64, True, True, False),
    (torch.float16, 64, False, False, False),
    (torch.bfloat16, 128, True, True, True),
    (torch.float16, 64, False, False, True),
    (torch.bfloat16, 96, False, False, True),
    (torch.bfloat16, 192, True, False, True),  # 64-key blocks (TILE_NS)
    (torch.float16, 256, False, False, True),
    (torch.bfloat16, 256, True, True, False),
]


def _tile_n(d: int) -> int:
    from fa_backend.kernels.cute import flash_fwd_ws

    return flash_fwd_ws.TILE_NS.get(d, flash_fwd_ws.TILE_N)


@pytest.fixture(autouse=True)
def _private_dsl_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FA_BACKEND_CUTE_CACHE_DIR", str(tmp_path / "dsl-cache"))


@pytest.fixture(scope="module", params=VARIANTS, ids=lambda v: f"{str(v[0])[6:]}-d{v[1]}-causal{int(v[2])}-br{int(v[3])}{'-overlap' * v[4]}")
def compiled(request, tmp_path_factory):
    """(variant, PTX text, dump directory) of one variant, compiled once for the module's tests."""
    from fa_backend.kernels.cute import flash_fwd_ws

    dump = tmp_path_factory.mktemp("ws")
    *variant, overlap = request.param
    ptx = flash_fwd_ws.compile_flash_fwd_ws(*variant, "sm_90a", str(dump), overlap=overlap).__ptx__
    return request.param, ptx, dump


def _wgmma_counts(ptx: str) -> dict[str, int]:
    return {shape: ptx.count(f"wgmma.mma_async.sync.aligned.{shape}")
            for shape in set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)", ptx))}


def test_registers_move_from_the_producer_to_the_consumers(compiled):
    from fa_backend.kernels.cute import flash_fwd_ws

    _, ptx, _ = compiled
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(flash_fwd_ws.PRODUCER_REGS)]
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(flash_fwd_ws.CONSUMER_REGS)]
    assert ".reqntid 384, 1, 1" in ptx  # 3 warpgroups
    # what setmaxnreg hands out must fit the register file
    assert (flash_fwd_ws.PRODUCER_REGS + 2 * flash_fwd_ws.CONSUMER_REGS) * 128 <= 65536


def test_wgmma_shapes_and_counts(compiled):
    from fa_backend.kernels.cute import flash_fwd_ws

    (dtype, d, causal, _, overlap), ptx, _ = compiled
    t = "bf16" if dtype == torch.bfloat16 else "f16"
    qk = f"m64n{_tile_n(d)}k16.f32.{t}.{t}"  # S = Q K^T per consumer: head_dim / 16 instructions
    pv = f"m64n{d}k16.f32.{t}.{t}"  # O += P V: tile_n / 16 instructions
    expected = {qk: d // 16}
    expected[pv] = expected.get(pv, 0) + _tile_n(d) // 16
    loops = 2 if causal else 1  # overlap, causal: a loop of the masked blocks, then one without the mask
    if overlap:  # the first S and the last P V are peeled off the loops
        expected = {shape: (1 + loops) * count for shape, count in expected.items()}
    assert _wgmma_counts(ptx) == expected
    # overlap: in each loop one wait that leaves the newest group (P V) in flight while the softmax runs
    assert ptx.count("wgmma.wait_group.sync.aligned \t1;") == loops * int(overlap)
    # P V takes P from registers ({4 registers}) and V transposed (MN-major: last immediate 1)
    pv_lines = [line for line in ptx.splitlines() if f"aligned.{pv}" in line and "{%r" in line.split("}, ")[1]]
    assert pv_lines and all(line.rstrip().endswith("1, 1;") for line in pv_lines)


def _own_ranges(d: int, consumers: int = 2) -> bool:
    """Whether the consumers of a tile pass the key blocks their rows do not see (FlashForwardSm90WS.own_ranges)."""
    from fa_backend.kernels.cute import flash_fwd_ws

    return flash_fwd_ws.WG_M * consumers > _tile_n(d)


def test_tma_loads_and_pipeline_barriers(compiled):
    (_, d, causal, _, overlap), ptx, _ = compiled
    # 4-D TMA loads of two Q halves, one K and one V tile; a 128-byte swizzled box row holds 64 16-bit
    # values, so each tile takes d / 64 boxes (d = 96: 192-byte rows, 64-byte swizzle, 32 values per box)
    boxes = d // 64 if d % 64 == 0 else d // 32
    assert ptx.count("cp.async.bulk.tensor.4d.shared::cta.global") == 4 * boxes
    # and O's TMA store (the default epilogue), one per consumer, d / 64 boxes
    assert ptx.count("cp.async.bulk.tensor.4d.global.shared::cta") == boxes
    assert "cp.async.bulk.tensor" not in ptx.replace("cp.async.bulk.tensor.4d.shared::cta.global", "").replace(
        "cp.async.bulk.tensor.4d.global.shared::cta", "")
    # expected bytes: Q once, then a K and a V stage per block (one elected producer lane each)
    assert ptx.count("mbarrier.arrive.expect_tx") == 3
    # waits: consumers on Q, K full, V full; the producer on K empty, V empty. Overlap peels the first
    # K stage and the last V stage off the loop: one more K and V wait and release each; causal overlap runs the
    # masked blocks in a loop of their own: one more of each again. Where a tile spans more rows than a key block
    # (d=192 / 256 here), the blocks a consumer's rows do not see (_pass_blocks: every block for a consumer without
    # a row before seqlen_q; causal, those past the diagonal of its rows too, in a loop of its own) are waited for
    # and released, K and V
    loops = 2 if causal and overlap else 1
    passed = (4 if causal else 2) if _own_ranges(d) else 0
    assert ptx.count("mbarrier.try_wait.parity") == 3 + 2 * loops + 2 * overlap + passed
    # consumers release K and V stages
    assert ptx.count("mbarrier.arrive.shared.b64") == 2 * loops + 2 * overlap + passed
    assert ptx.count("elect.sync") >= 4 * boxes + 3  # TMA copies and producer arrives go to one lane


def test_softmax_exp2_count_and_no_local_memory(compiled):
    from fa_backend.kernels.cute import flash_fwd_ws

    (_, d, causal, _, overlap), ptx, _ = compiled
    # one exp2 per score a consumer thread holds, plus one rescale factor per row half (twice with overlap:
    # the first block's softmax is peeled off the loop; three times with causal overlap: masked blocks loop apart)
    per_block = flash_fwd_ws.WG_M * _tile_n(d) // flash_fwd_ws.WG_THREADS + 2
    expected = per_block * ((3 if causal else 2) if overlap else 1)
    if _tile_n(d) < flash_fwd_ws.TILE_N and not overlap:
        # the serial loop over 64-key blocks: the compiler copies the scores' exp2 (not the rescale factors') into
        # the block's masked and unmasked paths; still one exp2 per score on either path
        expected = 2 * per_block - 2
    assert ptx.count("ex2.approx") == expected
    assert "ld.local" not in ptx and "st.local" not in ptx


@needs_ptxas
def test_ptxas_allocates_without_spills(compiled):
    _, ptx, dump = compiled
    report = ptxas_report(ptx, dump)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    registers = int(re.search(r"Used (\d+) registers", report)[1])
    assert registers <= 65536 // 384  # 384 threads must fit before setmaxnreg moves registers


@pytest.mark.parametrize("dtype,d,causal,bottom_right", [(torch.bfloat16, 128, False, False),
                                                         (torch.float16, 64, True, True)])
def test_pingpong_takes_turns(tmp_path, dtype, d, causal, bottom_right):
    # the overlap variant's GEMMs, each issue between a wait on this consumer's named barrier and an arrive on
    # the other's (256 threads: both consumers); consumer 0 arrives on its own barrier once to go first
    from fa_backend.kernels.cute import flash_fwd_ws

    ptx = flash_fwd_ws.compile_flash_fwd_ws(dtype, d, causal, bottom_right, "sm_90a", str(tmp_path),
                                            pingpong=True).__ptx__
    (tmp_path / "overlap").mkdir()
    overlap = flash_fwd_ws.compile_flash_fwd_ws(dtype, d, causal, bottom_right, "sm_90a", str(tmp_path / "overlap"),
                                                overlap=True).__ptx__
    assert _wgmma_counts(ptx) == _wgmma_counts(overlap)
    loops = 2 if causal else 1  # causal: the masked blocks' loop, then the unmasked one
    assert ptx.count("wgmma.wait_group.sync.aligned \t1;") == loops
    first = f"bar.arrive {flash_fwd_ws.PINGPONG_BARRIER}, 256;"
    assert ptx.count(first) == 1
    turns = re.findall(r"bar\.sync\s+%r\d+, 256;", ptx)
    hand_overs = re.findall(r"bar\.arrive\s+%r\d+, 256;", ptx)
    # the first S, each S + P V pair, the last P V (two consumers on 128-key blocks: the tile's range, no block
    # passed)
    assert not _own_ranges(d)
    assert len(turns) == len(hand_overs) == 2 + loops
    # no turns without pingpong (the set-up's barrier and the consumer's own before its O store only)
    assert "bar.sync" not in re.sub(r"bar\.sync\s+%r\d+, 128;", "", overlap.replace("bar.sync \t0;", ""))
    assert "ld.local" not in ptx and "st.local" not in ptx


def test_three_consumers_take_192_rows(tmp_path):
    # FA3's d <= 64 tile: 4 warpgroups (512 threads), Q in three 64-row stages, 160 registers per consumer
    from fa_backend.kernels.cute import flash_fwd_ws

    ptx = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 64, True, False, "sm_90a", str(tmp_path),
                                            consumers=3).__ptx__
    assert ".reqntid 512, 1, 1" in ptx
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx) == [str(flash_fwd_ws.CONSUMER_REGS_3)]
    assert (flash_fwd_ws.PRODUCER_REGS + 3 * flash_fwd_ws.CONSUMER_REGS_3) * 128 <= 65536
    assert ptx.count("cp.async.bulk.tensor.4d.shared::cta.global") == 5  # three Q stages, K, V (d = 64: one box)
    assert "ld.local" not in ptx and "st.local" not in ptx


def _issue_order(ptx: str) -> str:
    """The PTX's S = Q K^T issues (S, wgmma m64n128), P V issues (V, m64n64: d=64) and 16-bit pair conversions (c), in
    program order, runs collapsed."""
    events = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(128|64)k16|cvt\.rn\.bf16x2\.f32", ptx)
    return re.sub(r"(.)\1+", r"\1", "".join({"128": "S", "64": "V", "": "c"}[e] for e in events))


@needs_ptxas
def test_three_consumers_take_turns_without_spills(tmp_path):
    """The op's d=64 variant (FASTEST: three consumers in ping-pong), causal: the GEMM turns go round (consumer c waits on named
    barrier 1 + c and hands over on 1 + (c + 1) % 3), and ptxas allocates it in the consumers' 160 registers without
    spills, because each block's probabilities are converted before the next S = Q K^T is issued (the plain
    conversion was sunk past it, between S and P V, and ptxas spilled 556 bytes)."""
    from fa_backend.kernels.cute import flash_fwd_ws

    kw = flash_fwd_ws.FASTEST[64, True]
    assert kw == dict(consumers=3, pingpong=True)
    ptx = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 64, True, False, "sm_90a", str(tmp_path), **kw).__ptx__
    order = _issue_order(ptx)
    assert "ScV" not in order, order  # no conversion between an S issue and the P V issue after it
    # the first S, its P, then the masked loop's S + P V pair and its P, the unmasked loop's, the last P V
    assert order.startswith("ScSVcSVcV"), order
    # wg = warpgroup - 1: consumer c syncs on 1 + c = its warpgroup index and arrives on 1 + (c + 1) % 3
    # (hand-overs: the first S, the two loops' pairs, the last P V; a passed block's and a consumer without blocks',
    # with and without rows: _pass_blocks, _last_turn)
    assert _own_ranges(64, consumers=3)
    assert len(re.findall(r"bar\.arrive\s+%r\d+, 256;", ptx)) == 4 + 4 and "bar.arrive 1, 256;" in ptx
    assert re.search(r"mul\.lo\.s32\s+%r\d+, %r\d+, 3;", ptx)  # the (c + 1) % 3 of the hand-over
    # causal masking (the first block's and the masked loop's): per value one select to -inf on a bit of its row
    # half's mask word (_fwd_parts.mask_scores; ptxas: R2P + FSEL), no compare of the value's column with a bound
    # (that form had one setp with an immediate per value, 128 here)
    selects = (re.findall(r"selp\.f32\s+%r\d+, 0fFF800000, %r\d+, %p\d+;", ptx)
               + re.findall(r"selp\.f32\s+%r\d+, %r\d+, 0fFF800000, %p\d+;", ptx))
    assert len(selects) == 2 * 64
    assert len(re.findall(r"setp\.\w+\.s32\s+%p\d+, %r\d+, -?\d+;", ptx)) < 64
    report = ptxas_report(ptx, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report


@pytest.mark.parametrize("d,dv,kw", [(128, 128, dict(pingpong=True)), (64, 64, dict(consumers=3, pingpong=True)),
                                     (192, 128, dict(overlap=True))])
def test_tma_store_epilogue(tmp_path, d, dv, kw):
    # tma_store: each consumer's O rows go to its Q stage by stmatrix (dv / 16 x4 instructions per thread: 8 values
    # each) and out by one TMA store (dv / 64 boxes of 128-byte swizzled rows) behind its own named barrier; no
    # 16-bit global store of O is left (the register epilogue has dv / 2 of them per thread)
    from fa_backend.kernels.cute import flash_fwd_ws

    ptx = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, False, False, "sm_90a", str(tmp_path), tma_store=True,
                                            head_dim_v=dv, **kw).__ptx__
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == dv // 16
    assert ptx.count("cp.async.bulk.tensor.4d.global.shared::cta") == dv // 64
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)) == 1
    assert re.findall(r"st\.global\S*\.b16", ptx) == []
    assert re.findall(r"bar\.sync\s+%r\d+, 128;", ptx)  # the consumer's own barrier (id 3 + its index)
    assert "ld.local" not in ptx and "st.local" not in ptx
    if d == dv == 128:  # the register epilogue, once (CI time): one 16-bit global store per O value of a thread
        (tmp_path / "registers").mkdir()
        plain = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, False, False, "sm_90a",
                                                  str(tmp_path / "registers"), tma_store=False, **kw).__ptx__
        assert len(re.findall(r"st\.global\S*\.b16", plain)) == dv // 2


def test_variants_are_compiled_once_under_their_own_name():
    from fa_backend.kernels.cute import _compile_cache, flash_fwd_ws

    _compile_cache.CACHE.clear()  # GPU tests earlier in the session may have compiled this variant
    before = len(_compile_cache.CACHE)
    first = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 64, True)
    assert flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 64, True) is first
    assert len(_compile_cache.CACHE) == before + 1
    assert flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 64, True, overlap=True) is not first
    assert len(_compile_cache.CACHE) == before + 2
    assert flash_fwd_ws.KERNEL_NAME != "flash_fwd_sm90"


@pytest.mark.parametrize("dtype,d,consumers", [(torch.float32, 64, 2), (torch.float16, 80, 2), (torch.bfloat16, 320, 2),
                                              (torch.bfloat16, 192, 3), (torch.float16, 256, 3)])
def test_unsupported_variants_are_refused(dtype, d, consumers):
    from fa_backend.kernels.cute import flash_fwd_ws

    with pytest.raises(ValueError, match="supported"):
        flash_fwd_ws.compile_flash_fwd_ws(dtype, d, False, consumers=consumers)


def _block_ranges(cases: list[tuple[bool, bool, int, int, int]], d: int = 64) -> list[tuple[int, int, int, int]]:
    """FlashForwardSm90WS._block_range traced with constant arguments (it then computes in Python), with the tile's
    first row (_first_unit)."""
    import cutlass
    import cutlass.cute as cute

    from fa_backend.kernels.cute.flash_fwd_ws import WG_M, FlashForwardSm90WS

    found = []

    @cute.jit
    def probe():
        for causal, bottom_right, m_block, sq, sk in cases:
            kernel = FlashForwardSm90WS(cutlass.BFloat16, d, causal, bottom_right)
            found.append((*kernel._block_range(m_block, sq, sk), kernel._first_unit(m_block, sq) * WG_M))

    cute.compile(probe, options="--gpu-arch sm_90a")
    return found


@pytest.mark.parametrize("d", [64, 256])  # 128- and 64-key blocks
def test_block_range_visits_what_is_visible_and_masks_only_where_needed(d):
    """Against brute force over the tile's rows and keys: the visited blocks are exactly those holding a key
    some row of the tile sees, and the masked ones (counted from the last) exactly those where some
    (row, key) of the block is hidden."""
    from fa_backend.kernels.cute.flash_fwd_ws import TILE_M

    TILE_N = _tile_n(d)

    cases = [(causal, bottom_right and causal, m_block, sq, sk)
             for causal in (False, True) for bottom_right in (False, True)
             for sq, sk in ((1, 1), (128, 128), (300, 200), (200, 300), (100, 1000), (1000, 100), (384, 512))
             for m_block in range((sq + TILE_M - 1) // TILE_M)]
    for (causal, bottom_right, m_block, sq, sk), (n_blocks, n_masked, offset, first) in zip(cases,
                                                                                             _block_ranges(cases, d)):
        assert offset == (sk - sq if bottom_right else 0)
        _check_tile_rows(first, m_block, TILE_M, sq, causal and d == 256)
        last = first + TILE_M - 1
        keys = [range(n * TILE_N, (n + 1) * TILE_N) for n in range((sk + TILE_N - 1) // TILE_N)]
        # a key seen by some row is seen by the tile's last row; a key hidden from some row, from its first
        wanted = [n for n, block in enumerate(keys) if any(j < sk and (not causal or j <= last + offset) for j in block)]
        assert n_blocks == (max(wanted) + 1 if wanted else 0), (causal, bottom_right, m_block, sq, sk)
        hidden = [n for n in range(n_blocks)
                  if not all(j < sk and (not causal or j <= first + offset) for j in keys[n])]
        assert hidden == list(range(n_blocks - n_masked, n_blocks)), (causal, bottom_right, m_block, sq, sk)


def _check_tile_rows(first: int, m_block: int, tile_m: int, sq: int, lead_pad: bool) -> None:
    """A query tile's first row (FlashForwardSm90WS._first_unit): m_block * tile_m, or, lead_pad, as many 64-row units
    earlier as the tiles hold past ceil(sq / 64), so that the last tile ends with sq's unit and the first one holds
    the padding (fewer than a tile's units: never a tile of padding only)."""
    units = -(-sq // 64)
    pad = (-(-sq // tile_m) * tile_m // 64 - units) * 64 if lead_pad else 0
    assert first == m_block * tile_m - pad and pad < tile_m and (m_block > 0 or first + tile_m > 0)


def _own_blocks(cases: list[tuple[bool, int, int, int, int]], d: int, consumers: int) -> list[tuple[int, ...]]:
    """FlashForwardSm90WS._block_range and _own_blocks (causal) traced with constant arguments: per case
    (bottom_right, m_block, consumer, sq, sk), (the tile's blocks, the consumer's blocks, how many of those masked,
    the consumer's first row: _first_unit's)."""
    import cutlass
    import cutlass.cute as cute

    from fa_backend.kernels.cute.flash_fwd_ws import WG_M, FlashForwardSm90WS

    found = []

    @cute.jit
    def probe():
        for bottom_right, m_block, consumer, sq, sk in cases:
            kernel = FlashForwardSm90WS(cutlass.BFloat16, d, True, bottom_right, pingpong=True, consumers=consumers)
            n_blocks, _, offset = kernel._block_range(m_block, sq, sk)
            row0 = (kernel._first_unit(m_block, sq) + consumer) * WG_M
            own, own_masked = kernel._own_blocks(row0, sk, n_blocks, offset)
            found.append((n_blocks, own, own_masked, row0))

    cute.compile(probe, options="--gpu-arch sm_90a")
    return found


@pytest.mark.parametrize("d,consumers", [(64, 3), (256, 2)])  # 192-row tiles of 128-key blocks; 128 rows of 64 keys
def test_each_consumer_visits_the_blocks_its_rows_see(d, consumers):
    """Causal, against brute force over one consumer's 64 rows: of the tile's blocks it visits exactly those holding
    a key one of its rows sees (the rest are passed, _pass_blocks), and masks exactly those where one of its
    (row, key) pairs is hidden."""
    from fa_backend.kernels.cute.flash_fwd_ws import WG_M

    tile_m, tile_n = consumers * WG_M, _tile_n(d)
    shapes = ((1, 1), (300, 200), (200, 300), (100, 1000), (1000, 100), (2048, 2048), (384, 520), (4096, 4096))
    cases = [(bottom_right, m_block, c, sq, sk) for bottom_right in (False, True) for sq, sk in shapes
             for m_block in range((sq + tile_m - 1) // tile_m) for c in range(consumers)]
    passed, rows = 0, {}
    for (bottom_right, m_block, c, sq, sk), (n_blocks, own, n_masked, first) in zip(cases,
                                                                                   _own_blocks(cases, d, consumers)):
        if c == 0:
            _check_tile_rows(first, m_block, tile_m, sq, lead_pad=True)
        if not 0 <= first < sq:  # the tiles' padding: this consumer computes nothing (_consume_tile)
            continue
        rows.setdefault((bottom_right, sq, sk), []).extend(range(first, min(first + WG_M, sq)))
        offset = sk - sq if bottom_right else 0
        last = first + WG_M - 1
        keys = [range(n * tile_n, (n + 1) * tile_n) for n in range(n_blocks)]
        wanted = [n for n, block in enumerate(keys) if any(j < sk and j <= last + offset for j in block)]
        assert own == (max(wanted) + 1 if wanted else 0), (bottom_right, m_block, c, sq, sk)
        hidden = [n for n in range(own) if not all(j < sk and j <= first + offset for j in keys[n])]
        assert hidden == list(range(own - n_masked, own)), (bottom_right, m_block, c, sq, sk)
        passed += n_blocks - own
    assert passed > 0  # the cases do leave blocks to pass
    for (_, sq, _), covered in rows.items():  # the consumers that compute cover every row once
        assert sorted(covered) == list(range(sq))


@pytest.mark.parametrize("d,kw", [(128, dict(overlap=True)), (128, dict(pingpong=True)),
                                  (64, dict(consumers=3, pingpong=True))])
def test_persistent_variant_compiles_without_spills(tmp_path, d, kw):
    # the persistent variants: two Q tiles, each with its own "landed" and "free" mbarriers (the consumers hand a Q
    # tile back once their O rows' TMA store has read it), the tile loop in both roles, no local memory
    from fa_backend.kernels.cute import flash_fwd_ws

    (tmp_path / "p").mkdir()
    (tmp_path / "n").mkdir()
    ptx = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, True, False, "sm_90a", str(tmp_path / "p"),
                                            persistent=True, **kw).__ptx__
    plain = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, True, False, "sm_90a", str(tmp_path / "n"),
                                              **kw).__ptx__
    assert "ld.local" not in ptx and "st.local" not in ptx
    assert ptx.count("mbarrier.init") == plain.count("mbarrier.init") + 3
    assert "%nctaid.x" in ptx and "%nctaid.x" not in plain  # the tile stride is the grid size
    # the O rows go out through the Q tile by TMA in both (the persistent form used to store from registers)
    assert re.findall(r"st\.global\S*\.b16", ptx) == []
    stores = "cp.async.bulk.tensor.4d.global.shared::cta"
    assert ptx.count(stores) == plain.count(stores) > 0


def test_persistent_variant_needs_two_q_tiles_of_shared_memory():
    from fa_backend.kernels.cute import flash_fwd_ws

    with pytest.raises(ValueError, match="two Q tiles"):
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 256, False, pingpong=True, persistent=True)
    with pytest.raises(ValueError, match="two Q tiles"):
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 192, False, overlap=True, persistent=True, head_dim_v=128)


@needs_ptxas
@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, False), (96, True)])
def test_key_mask_variants_compile_without_spills(tmp_path, shared_ptx, d, causal):
    """The op's variant (FASTEST) with a bool key mask: four 32-bit word loads per key block and a bit test per
    score (behind a uniform all-open branch), in the registers the variant already had: no spills, no local
    memory; the variant without a mask does not read words (its PTX is the verified one)."""
    from fa_backend.kernels.cute import flash_fwd_ws

    kw = flash_fwd_ws.FASTEST[d, causal]
    ptx = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, causal, False, "sm_90a", str(tmp_path), key_mask=True,
                                            pointer_args=True, **kw).__ptx__
    assert "ld.local" not in ptx and "st.local" not in ptx
    if (d, causal) == (128, False):  # once (a compile costs seconds in CI): the words are read, and only when masked
        plain = shared_ptx(flash_fwd_ws.compile_flash_fwd_ws, torch.bfloat16, d, causal, False, pointer_args=True, **kw)
        assert ptx.count("ld.global.b32") > plain.count("ld.global.b32")
    report = ptxas_report(ptx, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert not re.findall(r"C75\d\d", report), report


@needs_ptxas
# three variants (a compile costs seconds in CI): ping-pong at d=128 (also the plain check), DROPOUT_FASTEST's ping-pong
# at d=64, overlap on 64-key blocks at d=256 (the H200 tests run every head dim)
@pytest.mark.parametrize("d,causal", [(128, False), (64, True), (256, True)])
def test_dropout_variants_compile_without_spills(tmp_path, shared_ptx, d, causal):
    """The op's dropout variant (fastest_kwargs: FASTEST, ping-pong at d=64): one Philox-4x32-10 draw per row and
    32-key block at each of the two places a block's probabilities are made (the first block and the loop; once in
    the serial loop): at least 10 wide multiplies per draw (of its 20, the first round's c2 = 0 product folds away
    and the second round's is shared by the draws of a row, whose counters share their high word), no local
    memory, no spills; the PTX of a variant without dropout has no draw at all."""
    from fa_backend.kernels.cute import flash_fwd_ws

    kw = flash_fwd_ws.fastest_kwargs(d, causal, dropout=True)
    ptx = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, causal, False, "sm_90a", str(tmp_path), dropout=True,
                                            pointer_args=True, **kw).__ptx__
    assert "ld.local" not in ptx and "st.local" not in ptx
    draws_per_block = 2 * _tile_n(d) // 32  # two rows per thread
    sites = 2 if kw.get("overlap") or kw.get("pingpong") else 1
    assert ptx.count("mul.wide.u32") >= sites * draws_per_block * 10, ptx.count("mul.wide.u32")
    report = ptxas_report(ptx, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert not re.findall(r"C75\d\d", report), report
    if (d, causal) == (128, False):
        plain = shared_ptx(flash_fwd_ws.compile_flash_fwd_ws, torch.bfloat16, d, causal, False, pointer_args=True, **kw)
        assert "mul.wide.u32" not in plain


@needs_ptxas
@pytest.mark.parametrize("causal,keep_bits", [(False, True), (True, True), (True, 2)])
def test_keep_bits_variant_stores_a_byte_per_draw(tmp_path, causal, keep_bits):
    """The d=128 dropout forward that saves its keep bits for the backward (keep_bits, kernels/keep_bits.py; 2: of
    every second row of tiles, the stores predicated PTX: with an `if`, the causal build's loops branched around
    them): one byte store per draw, eight per thread and block (two rows x four 32-key blocks) at each place a
    block's probabilities are made (the first block and the loop, the causal build's masked loop too), no local
    memory, no spills."""
    from fa_backend.kernels.cute import flash_fwd_ws

    kw = flash_fwd_ws.fastest_kwargs(128, causal, dropout=True)
    ptx = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 128, causal, False, "sm_90a", str(tmp_path), dropout=True,
                                            pointer_args=True, keep_bits=keep_bits, **kw).__ptx__
    assert "ld.local" not in ptx and "st.local" not in ptx
    sites = 3 if causal else 2
    assert len(re.findall(r"st\.global(?:\.\w+)*\.[ub]8", ptx)) == 8 * sites
    report = ptxas_report(ptx, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert not re.findall(r"C75\d\d", report), report


def test_keep_bits_needs_dropout_on_128_key_blocks():
    from fa_backend.kernels.cute import flash_fwd_ws

    for d, dropout in ((128, False), (256, True)):
        with pytest.raises(ValueError, match="keep_bits=True needs"):
            flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, False, dropout=dropout, pointer_args=True,
                                              keep_bits=True)
    with pytest.raises(ValueError, match="keep_bits=3"):
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 128, False, dropout=True, pointer_args=True, keep_bits=3)


def test_dropout_variants_take_the_pointer_convention_only(tmp_path):
    from fa_backend.kernels.cute import flash_fwd_ws

    with pytest.raises(ValueError, match="pointer"):
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 128, False, dropout=True, pointer_args=False)


@needs_ptxas
@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_v_variants_compile_without_spills(tmp_path, causal):
    """MLA's head dims (Q and K at 192, V and O at 128), the op's variants: 128-key blocks (the V stages are smaller,
    so two K / V stages of 128 keys fit), S = Q K^T in 12 and O += P V in 8 m64n128k16 instructions per block (each
    twice: the overlap variants peel a first S and a last P V), Q and K in 3 TMA boxes of 64 columns, V in 2; no local
    memory, no spills, no C75xx."""
    from fa_backend.kernels.cute import flash_fwd_ws

    d, dv = 192, 128
    assert flash_fwd_ws.tile_n(d, dv) == 128
    kw = flash_fwd_ws.fastest_kwargs(d, causal, head_dim_v=dv)
    ptx = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, causal, False, "sm_90a", str(tmp_path),
                                            pointer_args=True, head_dim_v=dv, **kw).__ptx__
    # (three times with a causal mask: the masked blocks loop apart)
    assert _wgmma_counts(ptx) == {"m64n128k16.f32.bf16.bf16": (3 if causal else 2) * (d // 16 + 128 // 16)}
    assert ptx.count("cp.async.bulk.tensor.4d.shared::cta.global") == 2 * 3 + 3 + 2
    assert "ld.local" not in ptx and "st.local" not in ptx
    report = ptxas_report(ptx, tmp_path)
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert not re.findall(r"C75\d\d", report), report


def test_head_dims_v_outside_the_pairs_are_refused():
    from fa_backend.kernels.cute import flash_fwd_ws

    with pytest.raises(ValueError, match="head_dim_v=64"):
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 128, False, head_dim_v=64)


def test_the_backend_declares_the_kernels_head_dims():
    """The cute backend's limits are data that must not drift from the kernels' (the backend cannot import them
    where the DSL is missing); the backward's head-dim pairs are the forward's or fewer (the op then runs Triton's)."""
    from fa_backend.dispatch.backends import CuteBackend
    from fa_backend.kernels.cute import flash_bwd_wide, flash_fwd_ws

    assert CuteBackend.SUPPORTED_HEAD_DIMS == frozenset(flash_fwd_ws.HEAD_DIMS)
    assert CuteBackend.SUPPORTED_HEAD_DIM_V_PAIRS == flash_fwd_ws.HEAD_DIM_V_PAIRS
    assert flash_bwd_wide.HEAD_DIM_V_PAIRS <= flash_fwd_ws.HEAD_DIM_V_PAIRS
    assert all((d, dv, causal) in flash_fwd_ws.HEAD_DIM_V_FASTEST
               for d, dv in flash_fwd_ws.HEAD_DIM_V_PAIRS for causal in (False, True))


@pytest.mark.parametrize("block_n,d,kw,match", [
    (168, 128, {}, "multiple of 16"), (272, 64, {}, "multiple of 16"), (176, 128, dict(causal=True), "causal=True"),
    (176, 128, dict(key_mask=True), "key_mask=True"), (176, 128, dict(persistent=True), "persistent=True"),
    (176, 128, dict(dropout=True, pointer_args=True), "dropout=True"), (128, 256, {}, "shared memory"),
    (192, 128, {}, "shared memory")])
def test_wide_key_blocks_are_refused_where_they_cannot_run(block_n, d, kw, match):
    """block_n: refused (ValueError, before any build) with a causal mask, key mask, dropout or the persistent schedule,
    off the wgmma's 16-key steps, or where its K / V stages exceed shared memory."""
    from fa_backend.kernels.cute import flash_fwd_ws

    kw = dict(kw)
    causal = kw.pop("causal", False)
    with pytest.raises(ValueError, match=match):
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, causal, False, overlap=True, block_n=block_n, **kw)



@pytest.mark.parametrize("kv_stages,d,kw,match", [
    (1, 64, {}, "supported: 2, 3 or 4"), (5, 64, {}, "supported: 2, 3 or 4"), (3, 128, {}, "shared memory"),
    (3, 256, {}, "shared memory"), (4, 96, dict(persistent=True), "shared memory")])
def test_deeper_kv_rings_are_refused_where_they_cannot_run(kv_stages, d, kw, match):
    """kv_stages: refused (ValueError, before any build) outside 2 to 4, or where its K / V stages exceed shared
    memory beside the Q tile(s): d=128's 128-key stages fit two, d=256's 64-key ones two, d=96's persistent three."""
    from fa_backend.kernels.cute import flash_fwd_ws

    with pytest.raises(ValueError, match=match):
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, d, False, False, overlap=True, kv_stages=kv_stages, **kw)


@needs_ptxas
def test_deeper_kv_rings_compile_without_spills(tmp_path, shared_ptx):
    """d=64's three ping-pong consumers with a three-deep K / V ring: its own cache key, and ptxas keeps it spill-free
    at 128 registers a thread."""
    from fa_backend.kernels.cute import flash_fwd_ws

    assert flash_fwd_ws._name_and_tile(False, True, 3, kv_stages=3, head_dim=64)[1] == (192, 128, 3)
    ptx = shared_ptx(flash_fwd_ws.compile_flash_fwd_ws, torch.bfloat16, 64, False, False, pingpong=True,
                     consumers=3, kv_stages=3)
    report = ptxas_report(ptx, tmp_path)
    assert "0 bytes spill stores" in report
