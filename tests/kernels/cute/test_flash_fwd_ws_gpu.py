"""The warp-specialised sm90 CuTe forward (flash_fwd_ws) on the H200: outputs and LSE against the float64
reference (the checks of test_flash_fwd_gpu), with shapes that wrap the 2-stage K/V ring several times, leave
the second consumer warpgroup's rows partly or wholly past seqlen_q, and give rows no key. Needs the DSL and a
Hopper GPU."""

from __future__ import annotations

import functools

import pytest
import torch

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.kernels.cute.test_flash_fwd_gpu import HOPPER, _qkv, check_forward, check_strided

pytestmark = [pytest.mark.gpu, pytest.mark.cute,
              pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}"),
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]

SHAPES = [
    (2, 4, 4, 256, 256),  # whole tiles
    (1, 8, 2, 100, 333),  # GQA 4; the second consumer's rows 100..127 past seqlen_q; partial last key block
    (2, 2, 1, 333, 100),  # bottom-right causal: rows that see no key
    (1, 2, 2, 50, 1000),  # the second consumer has no row to store; 8 key blocks wrap the ring 4 times
    (1, 3, 3, 1024, 1024),  # causal: 8 query tiles, diagonal blocks in every one
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SHAPES)
@pytest.mark.parametrize("mode", ["serial", "overlap", "pingpong", "three_consumers"])
def test_forward_within_bar(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, mode):
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    run = functools.partial(flash_fwd_ws, overlap=mode == "overlap", pingpong=mode == "pingpong",
                            consumers=3 if mode == "three_consumers" else 2)
    check_forward(run, dtype, d, causal, bottom_right, b, hq, hkv, sq, sk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
# (300: the third consumer's rows partly past sq; 2048: the last 192-row tile's third consumer has no row and only
# passes the tile's blocks, flash_fwd_ws._pass_blocks)
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SHAPES + [(1, 2, 1, 300, 2000), (1, 2, 1, 2048, 2048)])
@pytest.mark.parametrize("mode", ["overlap", "pingpong"])
def test_three_consumers_overlapped_within_bar(dtype, causal, bottom_right, b, hq, hkv, sq, sk, mode):
    """Three consumers with intra-warpgroup overlap at d=64 (FA3 / FA4's 192 x 128 tile), and with their GEMM issues
    in round-robin turns (pingpong)."""
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    check_forward(functools.partial(flash_fwd_ws, overlap=True, pingpong=mode == "pingpong", consumers=3), dtype, 64,
                  causal, bottom_right, b, hq, hkv, sq, sk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,dv", [(192, 128)])  # flash_fwd_ws.HEAD_DIM_V_PAIRS
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SHAPES)
@pytest.mark.parametrize("mode", ["serial", "overlap", "pingpong"])
def test_head_dim_v_within_bar(dtype, d, dv, causal, bottom_right, b, hq, hkv, sq, sk, mode):
    """V (and O) with another head dim than Q and K: MLA's 192 / 128 on 128-key blocks."""
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    run = functools.partial(flash_fwd_ws, overlap=mode == "overlap", pingpong=mode == "pingpong")
    check_forward(run, dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, dv=dv)


@pytest.mark.parametrize("d,dv,mode", [(64, 64, "three_consumers"), (96, 96, "overlap"), (128, 128, "pingpong"),
                                       (256, 256, "overlap"), (192, 128, "pingpong")])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SHAPES[1:4])
def test_register_epilogue_within_bar(d, dv, mode, causal, bottom_right, b, hq, hkv, sq, sk):
    """tma_store=False: O from registers (value by value, rows past seqlen_q skipped), the epilogue the persistent
    variants keep; every other test here runs the default TMA store (O through each consumer's Q stage: rows past
    seqlen_q, the next head's in memory, clipped by the copy)."""
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    run = functools.partial(flash_fwd_ws, overlap=mode == "overlap", pingpong=mode == "pingpong",
                            consumers=3 if mode == "three_consumers" else 2, tma_store=False)
    check_forward(run, torch.bfloat16, d, causal, bottom_right, b, hq, hkv, sq, sk, dv=dv)


def test_head_dim_v_outside_the_pairs_is_a_value_error():
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    q, k, v = _qkv(1, 2, 2, 256, 256, 128, torch.bfloat16, dv=64)
    with pytest.raises(ValueError, match="head_dim_v"):
        flash_fwd_ws(q, k, v)


def test_strided_inputs():
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    check_strided(flash_fwd_ws, 300)


def test_matches_the_simple_kernel():
    """Same inputs, both sm90 kernels: they differ in tiling and summation order only."""
    from fa_backend.kernels.cute.flash_fwd import flash_fwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    q, k, v = _qkv(1, 4, 2, 700, 900, 128, torch.bfloat16)
    out_ws, lse_ws = flash_fwd_ws(q, k, v, causal=True, bottom_right=True)
    out, lse = flash_fwd(q, k, v, causal=True, bottom_right=True)
    torch.testing.assert_close(lse_ws, lse, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_ws, out, atol=2e-2, rtol=2e-2)



@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bottom_right", [False, True])
# 32k keys: K and V of a head take 16 MB at d=128 (L2 sections of 2 (batch, head) pairs), 8 MB at d=64 (4 pairs), so
# the causal tiles' longest-first order (_schedule) runs over several sections, the last one partial
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(1, 5, 5, 300, 32768), (2, 6, 3, 200, 32768)])
def test_longest_first_order_over_several_l2_sections(d, bottom_right, b, hq, hkv, sq, sk):
    from fa_backend.kernels.cute.flash_fwd_ws import FASTEST, flash_fwd_ws

    check_forward(functools.partial(flash_fwd_ws, **FASTEST[d, True]), torch.bfloat16, d, True, bottom_right, b, hq,
                  hkv, sq, sk)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
# more tiles than PERSISTENT_CTAS: each CTA walks 2-3 tiles (256 / 360 tiles); the second shape's bottom-right
# causal tiles past the keys visit no key block (no GEMM turn in either consumer)
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 16, 4, 1000, 1100), (3, 20, 20, 700, 300)])
@pytest.mark.parametrize("mode", ["serial", "overlap", "pingpong", "pingpong3", "overlap_registers"])
def test_persistent_walks_several_tiles_per_cta(d, causal, bottom_right, b, hq, hkv, sq, sk, mode):
    """Persistent CTAs over 2-3 tiles each: two Q tiles in turn (the O rows stored through the tile's own, by TMA;
    `overlap_registers`: from registers), three ping-pong consumers too."""
    from fa_backend.kernels.cute.flash_fwd_ws import PERSISTENT_CTAS, flash_fwd_ws

    assert b * hq * -(-sq // 128) > PERSISTENT_CTAS
    if mode == "pingpong3" and d != 64:
        pytest.skip("three persistent consumers: d=64 (at d=128 two 192-row Q tiles do not fit in shared memory)")
    run = functools.partial(flash_fwd_ws, overlap=mode.startswith("overlap"), pingpong=mode.startswith("pingpong"),
                            consumers=3 if mode == "pingpong3" else 2, persistent=True,
                            tma_store=False if mode == "overlap_registers" else None)
    check_forward(run, torch.bfloat16, d, causal, bottom_right, b, hq, hkv, sq, sk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SHAPES)
@pytest.mark.parametrize("mode", ["serial", "overlap", "pingpong"])
def test_large_head_dims_within_bar(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, mode):
    """d = 192 / 256 on 64-key blocks (flash_fwd_ws.TILE_NS): 3 / 4 TMA boxes per 128-byte-swizzled row, O in 96 /
    128 registers per thread."""
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    run = functools.partial(flash_fwd_ws, overlap=mode == "overlap", pingpong=mode == "pingpong")
    check_forward(run, dtype, d, causal, bottom_right, b, hq, hkv, sq, sk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,block_n", [(128, 176), (128, 160), (64, 176), (64, 192), (96, 176)])
# 176 = 11 x 16: key blocks that end inside a 32-key word and a 64-key half; 1000 keys: a partial last block; 100:
# fewer keys than one block; 2048 x 2048: the cell it was built for
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SHAPES[:2] + [(1, 2, 2, 50, 1000), (2, 4, 2, 300, 100),
                                                         (1, 2, 1, 2048, 2048)])
@pytest.mark.parametrize("mode", ["serial", "overlap", "pingpong"])
def test_wide_key_blocks_within_bar(dtype, d, block_n, b, hq, hkv, sq, sk, mode):
    """Non-causal variants on key blocks wider than tile_n's (block_n; FA3's 128 x 176 tile at d=128)."""
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    run = functools.partial(flash_fwd_ws, overlap=mode == "overlap", pingpong=mode == "pingpong", block_n=block_n)
    check_forward(run, dtype, d, False, False, b, hq, hkv, sq, sk)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,kv_stages,kw", [(64, 3, dict(consumers=3, pingpong=True)),
                                            (64, 4, dict(consumers=3, pingpong=True)),
                                            (64, 3, dict(overlap=True)), (96, 3, dict(overlap=True))])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
# 1000 keys: 8 blocks wrap a 3- or 4-deep ring with a partial last block; 100: one block
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SHAPES[:2] + [(1, 2, 2, 1000, 1000), (2, 4, 2, 300, 100)])
def test_deeper_kv_rings_within_bar(dtype, d, kv_stages, kw, causal, bottom_right, b, hq, hkv, sq, sk):
    """K / V rings deeper than KV_STAGES (kv_stages) where shared memory allows them."""
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    run = functools.partial(flash_fwd_ws, kv_stages=kv_stages, **kw)
    check_forward(run, dtype, d, causal, bottom_right, b, hq, hkv, sq, sk)
