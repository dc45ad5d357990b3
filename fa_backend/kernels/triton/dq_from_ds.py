"""dQ = (scale dS) K from the scale * dS^T a backward's dK / dV launch wrote to memory (`flash_bwd_split.DS_GEMM`).

A plain GEMM per query block and head that reads only the key blocks the block sees: under a causal mask, half the
products of a dense matmul over the square and no zero-filling of the entries the dK / dV launch skipped (every key
past a row's diagonal is taken as zero here, whatever the buffer holds there). fp32 accumulation, dQ stored in its
own dtype; deterministic (one program per output tile, keys summed in order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._common import _kv_bounds, _tile_store
from ._launch import cdiv, grid_1d
from ._tma import head_tiles

# (BLOCK_M, BLOCK_N, warps, stages): a 128 x 256 fp32 accumulator over two warpgroups (sm90 compile: 154 registers,
# 208 causal, no spills), dS^T and K tiles by TMA, 16 + 32 KB a stage of 64 keys (192 KB for four). H100, forty-sixth
# session (scripts/time_bwd_split.py --dims 256 --dq-tiles ..., whole d=256 backward TFLOP/s at
# 2k / 8k / 16k, without a causal mask; causal): 128 x 64 x 8 x 4 276 / 301 / 304; 218 / 272 / 275, x 3 stages 273 /
# 295 / 297; 215 / 262 / 266, 128 x 32 x 8 x 4 276 / 294 / 300; 215 / 268 / 272, 128 x 128 x 8 x 2 269 / 290 / 291;
# 213 / 259 / 263, 64 x 64 x 4 x 3 266 / 286 / 288; 209 / 262 / 265
TILE: tuple[int, int, int, int] = (128, 64, 8, 4)
# (under the interpreter taller than the dK / dV launch's 16-row tiles, as on the GPU: entries it skipped are read)
_INTERPRETER_TILE = (32, 16, 4, 1)


@triton.jit
def _dq_keys(acc_a, acc_b, DS, KA, KB, off_b, off_h, off_hk, m0, rows, start, end, causal_offset,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, MASKED: tl.constexpr):
    """acc += dS K over keys [start, end) of query rows [m0, m0 + BLOCK_M); MASKED: keys past a row's diagonal
    count as zero (the dK / dV launch may not have written them)."""
    for n0 in range(start, end, BLOCK_N):
        ds = tl.trans(DS.load([off_b, off_h, n0, m0]).reshape(BLOCK_N, BLOCK_M))
        if MASKED:
            cols = n0 + tl.arange(0, BLOCK_N)
            ds = tl.where(cols[None, :] <= rows[:, None] + causal_offset, ds, 0.0)
        acc_a = tl.dot(ds, KA.load([off_b, off_hk, n0, 0]).reshape(BLOCK_N, D_A), acc_a)
        acc_b = tl.dot(ds, KB.load([off_b, off_hk, n0, D_A]).reshape(BLOCK_N, D_B), acc_b)
    return acc_a, acc_b


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "causal_offset"])
def _dq_from_ds(
    DS, KA, KB, DQ, stride_qb, stride_qh, stride_qm,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, causal_offset,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    # head-major, so that the programs running together share their head's K in L2; causal: a head's longest
    # query blocks first
    pid = tl.program_id(0)
    bh = pid // NUM_M_BLOCKS
    pid_m = pid % NUM_M_BLOCKS
    if CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m
    off_b = bh // NUM_HEADS_Q
    off_h = bh % NUM_HEADS_Q
    off_hk = off_h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    # DS (dS^T: rows, one per key, SEQ_Q long at a 16-byte aligned stride; queries past SEQ_Q come zero-filled) and
    # K's two column tiles by host descriptors (_tma.head_tiles)
    acc_a = tl.zeros([BLOCK_M, D_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, D_B], dtype=tl.float32)
    n_full, hi = _kv_bounds(m0, SEQ_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    if CAUSAL:
        acc_a, acc_b = _dq_keys(acc_a, acc_b, DS, KA, KB, off_b, off_h, off_hk, m0, rows, 0, n_full, causal_offset,
                                BLOCK_M, BLOCK_N, D_A, D_B, False)
        acc_a, acc_b = _dq_keys(acc_a, acc_b, DS, KA, KB, off_b, off_h, off_hk, m0, rows, n_full, hi, causal_offset,
                                BLOCK_M, BLOCK_N, D_A, D_B, True)
    else:  # (keys past SEQ_K come zero-filled, in dS^T and in K)
        acc_a, acc_b = _dq_keys(acc_a, acc_b, DS, KA, KB, off_b, off_h, off_hk, m0, rows, 0, SEQ_K, causal_offset,
                                BLOCK_M, BLOCK_N, D_A, D_B, False)
    DQ_h = DQ + off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
    _tile_store(DQ_h, m0, SEQ_Q, stride_qm, 0, HEAD_DIM, acc_a, BLOCK_M, D_A)
    _tile_store(DQ_h, m0, SEQ_Q, stride_qm, D_A, HEAD_DIM, acc_b, BLOCK_M, D_B)


def dq_from_ds(ds_t: torch.Tensor, k: torch.Tensor, dq: torch.Tensor, causal_offset: int | None,
               widths: tuple[int, int]) -> None:
    """Write dq (b, hq, sq, d) = ds_t^T k per query head: ds_t (b, hq, sk, sq) holds scale * dS^T with a unit last
    stride and rows 16-byte aligned, k (b, hkv, sk, d) its key heads (hq a multiple of hkv); causal_offset None
    without a causal mask, else key j counts for query i only if j <= i + causal_offset. widths: the two column
    tiles (powers of two) that cover d."""
    b, hq, sq, d = dq.shape
    sk = k.shape[2]
    block_m, block_n, num_warps, num_stages = _INTERPRETER_TILE if _launch._INTERPRET else TILE
    m_blocks = cdiv(sq, block_m)
    if not m_blocks * b * hq:
        return
    _launch.launch(_dq_from_ds, grid_1d(m_blocks * b * hq), (
        head_tiles(ds_t, block_n, block_m), head_tiles(k, block_n, widths[0]), head_tiles(k, block_n, widths[1]),
        dq, *dq.stride()[:3],
        hq, hq // k.shape[1], sq, sk, m_blocks, causal_offset or 0,
    ), dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, D_A=widths[0], D_B=widths[1],
            CAUSAL=causal_offset is not None, num_warps=num_warps, num_stages=num_stages))
