"""Backward for head dims 129-192 on two column tiles (128 + 64), 193-256 on 128 + 128, instead of one 256-wide tile.

The counterpart of `flash_fwd_split`: the general backward (`flash_bwd._bwd_dkdv` / `_bwd_dq`) runs d=192 on
256-wide tiles, a quarter of its products on zero columns. Here Q, K, V and dO are read by TMA as a 128-column and a
64-column tile (two 128-column tiles from d=193; columns past the head dim zero-filled), each product over the head
dim is the sum of two dots, and dQ, dK and dV are kept in two accumulators each. The same two launches as the
general backward (dK / dV per key block, summing a GQA group in registers; dQ per query block), deterministic, after
the same delta pass. Plain calls (causal or not, GQA; no mask, dropout, softcap, ALiBi or window), fp16 / bf16, a
positive scale, strides TMA accepts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from . import _configs, _launch
from ._features import _LOG2E
from ._common import _band_keep, _ds_dot, _grid_order, _kv_bounds, _load_lse_log2, _q_bounds, _tile_store
from ._launch import cdiv, grid_1d
from ._tma import head_tiles, tma_ok
from .dq_from_ds import dq_from_ds
from .flash_fwd_split import split_widths


@triton.jit
def _dkdv_split_loop(dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, QA, QB, DOA, DOB, off_b, off_h, LSE, DELTA,
                     start, end, n0, SEQ_Q, SEQ_K, causal_offset, qk_scale, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, MASKED: tl.constexpr,
                     CAUSAL: tl.constexpr, EXACT_DS: tl.constexpr, DS=None, ds_scale=1.0,
                     STORE_DS: tl.constexpr = False):
    """Accumulate dK, dV of keys [n0, n0 + BLOCK_N) over query rows [start, end) of head (off_b, off_h), scores
    transposed (keys x queries). Query rows past SEQ_Q get LSE = +inf (P = 0); MASKED applies the causal band.
    STORE_DS: dS^T * ds_scale also written, rounded once to the inputs' dtype, through DS (the (b, hq, SEQ_K,
    SEQ_Q) dS^T's descriptor)."""
    cols = n0 + tl.arange(0, BLOCK_N)
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        q_a = QA.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, D_A)
        q_b = QB.load([off_b, off_h, start_m, D_A]).reshape(BLOCK_M, D_B)
        lse = _load_lse_log2(LSE, rows, SEQ_Q)
        s_t = tl.dot(k_b, tl.trans(q_b), tl.dot(k_a, tl.trans(q_a)))
        p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])
        if MASKED:
            p_t = tl.where(_band_keep(rows[None, :], cols[:, None], SEQ_K, causal_offset, 0, CAUSAL, False), p_t, 0.0)
        do_a = DOA.load([off_b, off_h, start_m, 0]).reshape(BLOCK_M, D_A)
        do_b = DOB.load([off_b, off_h, start_m, D_A]).reshape(BLOCK_M, D_B)
        p16 = p_t.to(do_a.dtype)
        dv_a = tl.dot(p16, do_a, dv_a)
        dv_b = tl.dot(p16, do_b, dv_b)
        delta = tl.load(DELTA + rows, mask=rows < SEQ_Q, other=0.0)
        dp_t = tl.dot(v_b, tl.trans(do_b), tl.dot(v_a, tl.trans(do_a)))
        ds_t = p_t * (dp_t - delta[None, :])
        if STORE_DS:  # (a TMA store: rows past SEQ_K and columns past SEQ_Q clipped)
            DS.store([off_b, off_h, n0, start_m], (ds_t * ds_scale).to(DS.dtype).reshape(1, 1, BLOCK_N, BLOCK_M))
        dk_a = _ds_dot(ds_t, q_a, dk_a, EXACT_DS)
        dk_b = _ds_dot(ds_t, q_b, dk_b, EXACT_DS)
    return dk_a, dk_b, dv_a, dv_b


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_N_BLOCKS", "causal_offset"])
def _bwd_dkdv_split(
    QA, QB, KA, KB, VA, VB, DOA, DOB, LSE, DELTA, DK, DV,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    NUM_HEADS_Q, NUM_HEADS_K, GROUP, SEQ_Q, SEQ_K, NUM_N_BLOCKS, causal_offset, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D_A: tl.constexpr, D_B: tl.constexpr, CAUSAL: tl.constexpr, EXACT_DS: tl.constexpr = False,
    BLOCK_MAJOR: tl.constexpr = False, ONE_LOOP: tl.constexpr = False, DS=None, STORE_DS: tl.constexpr = False,
):
    # Q, K, V, dO (and DS, dS^T, with STORE_DS) by host descriptors (_tma.head_tiles), one per column tile: the first
    # tile's columns at 0, the second's at D_A (columns past the head dim zero-filled)
    # (causal: key block 0 sees the most query rows, so block order is longest first)
    bh, pid_n = _grid_order(tl.program_id(0), NUM_N_BLOCKS, BLOCK_MAJOR)
    off_b = bh // NUM_HEADS_K
    off_hk = bh % NUM_HEADS_K
    n0 = pid_n * BLOCK_N
    k_a = KA.load([off_b, off_hk, n0, 0]).reshape(BLOCK_N, D_A)
    k_b = KB.load([off_b, off_hk, n0, D_A]).reshape(BLOCK_N, D_B)
    v_a = VA.load([off_b, off_hk, n0, 0]).reshape(BLOCK_N, D_A)
    v_b = VB.load([off_b, off_hk, n0, D_A]).reshape(BLOCK_N, D_B)
    dk_a = tl.zeros([BLOCK_N, D_A], dtype=tl.float32)
    dk_b = tl.zeros([BLOCK_N, D_B], dtype=tl.float32)
    dv_a = tl.zeros([BLOCK_N, D_A], dtype=tl.float32)
    dv_b = tl.zeros([BLOCK_N, D_B], dtype=tl.float32)
    # (STORE_DS: dS^T's TMA stores start at a query index that is a multiple of 8, 16 bytes)
    m_lo, m_mid = _q_bounds(n0, SEQ_Q, causal_offset, BLOCK_M, BLOCK_N, CAUSAL, 8 if STORE_DS else 1)
    if ONE_LOOP:  # (causal only) one masked loop over every row the block sees: one copy of the loop body, not two
        m_mid = SEQ_Q
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        bh_q = (off_b * NUM_HEADS_Q + off_h).to(tl.int64)
        LSE_h = LSE + bh_q * SEQ_Q
        DELTA_h = DELTA + bh_q * SEQ_Q
        if CAUSAL:
            dk_a, dk_b, dv_a, dv_b = _dkdv_split_loop(
                dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, QA, QB, DOA, DOB, off_b, off_h, LSE_h, DELTA_h,
                m_lo, m_mid, n0, SEQ_Q, SEQ_K, causal_offset, qk_scale, BLOCK_M, BLOCK_N, D_A, D_B, True, CAUSAL,
                EXACT_DS, DS, sm_scale, STORE_DS)
        # (keys past SEQ_K: zero-filled rows whose dK / dV rows are never stored, so no mask here)
        if not ONE_LOOP:
            dk_a, dk_b, dv_a, dv_b = _dkdv_split_loop(
                dk_a, dk_b, dv_a, dv_b, k_a, k_b, v_a, v_b, QA, QB, DOA, DOB, off_b, off_h, LSE_h, DELTA_h,
                m_mid, SEQ_Q, n0, SEQ_Q, SEQ_K, causal_offset, qk_scale, BLOCK_M, BLOCK_N, D_A, D_B, False, CAUSAL,
                EXACT_DS, DS, sm_scale, STORE_DS)
    DK_h = DK + off_b.to(tl.int64) * stride_dkb + off_hk.to(tl.int64) * stride_dkh
    DV_h = DV + off_b.to(tl.int64) * stride_dvb + off_hk.to(tl.int64) * stride_dvh
    _tile_store(DK_h, n0, SEQ_K, stride_dkn, 0, HEAD_DIM, dk_a * sm_scale, BLOCK_N, D_A)
    _tile_store(DK_h, n0, SEQ_K, stride_dkn, D_A, HEAD_DIM, dk_b * sm_scale, BLOCK_N, D_B)
    _tile_store(DV_h, n0, SEQ_K, stride_dvn, 0, HEAD_DIM_V, dv_a, BLOCK_N, D_A)
    _tile_store(DV_h, n0, SEQ_K, stride_dvn, D_A, HEAD_DIM_V, dv_b, BLOCK_N, D_B)


@triton.jit
def _dq_split_loop(dq_a, dq_b, q_a, q_b, do_a, do_b, lse, delta, KA, KB, VA, VB, off_b, off_hk, start, end,
                   rows, SEQ_K, causal_offset, qk_scale, BLOCK_N: tl.constexpr, D_A: tl.constexpr,
                   D_B: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, EXACT_DS: tl.constexpr):
    """Accumulate dQ of one query block over keys [start, end) of KV head (off_b, off_hk); MASKED hides keys past
    SEQ_K and the causal band."""
    for start_n in range(start, end, BLOCK_N):
        k_a = KA.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, D_A)
        k_b = KB.load([off_b, off_hk, start_n, D_A]).reshape(BLOCK_N, D_B)
        p = tl.math.exp2(tl.dot(q_b, tl.trans(k_b), tl.dot(q_a, tl.trans(k_a))) * qk_scale - lse[:, None])
        if MASKED:
            cols = start_n + tl.arange(0, BLOCK_N)
            p = tl.where(_band_keep(rows[:, None], cols[None, :], SEQ_K, causal_offset, 0, CAUSAL, False), p, 0.0)
        v_a = VA.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, D_A)
        v_b = VB.load([off_b, off_hk, start_n, D_A]).reshape(BLOCK_N, D_B)
        dp = tl.dot(do_b, tl.trans(v_b), tl.dot(do_a, tl.trans(v_a)))
        ds = p * (dp - delta[:, None])
        dq_a = _ds_dot(ds, k_a, dq_a, EXACT_DS)
        dq_b = _ds_dot(ds, k_b, dq_b, EXACT_DS)
    return dq_a, dq_b


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "causal_offset"])
def _bwd_dq_split(
    QA, QB, KA, KB, VA, VB, DOA, DOB, LSE, DELTA, DQ, stride_dqb, stride_dqh, stride_dqm,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, causal_offset, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D_A: tl.constexpr, D_B: tl.constexpr, CAUSAL: tl.constexpr, EXACT_DS: tl.constexpr = False,
    BLOCK_MAJOR: tl.constexpr = False,
):
    bh, pid_m = _grid_order(tl.program_id(0), NUM_M_BLOCKS, BLOCK_MAJOR)
    if CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m  # longest rows first
    off_b = bh // NUM_HEADS_Q
    off_h = bh % NUM_HEADS_Q
    off_hk = off_h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    # (Q, K, V and dO by host descriptors, as in _bwd_dkdv_split)
    q_a = QA.load([off_b, off_h, m0, 0]).reshape(BLOCK_M, D_A)
    q_b = QB.load([off_b, off_h, m0, D_A]).reshape(BLOCK_M, D_B)
    do_a = DOA.load([off_b, off_h, m0, 0]).reshape(BLOCK_M, D_A)
    do_b = DOB.load([off_b, off_h, m0, D_A]).reshape(BLOCK_M, D_B)
    lse = _load_lse_log2(LSE + bh.to(tl.int64) * SEQ_Q, rows, SEQ_Q)
    delta = tl.load(DELTA + bh.to(tl.int64) * SEQ_Q + rows, mask=rows < SEQ_Q, other=0.0)
    dq_a = tl.zeros([BLOCK_M, D_A], dtype=tl.float32)
    dq_b = tl.zeros([BLOCK_M, D_B], dtype=tl.float32)
    n_full, hi = _kv_bounds(m0, SEQ_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    dq_a, dq_b = _dq_split_loop(dq_a, dq_b, q_a, q_b, do_a, do_b, lse, delta, KA, KB, VA, VB, off_b, off_hk,
                                0, n_full, rows, SEQ_K, causal_offset, qk_scale, BLOCK_N, D_A, D_B, False, CAUSAL,
                                EXACT_DS)
    dq_a, dq_b = _dq_split_loop(dq_a, dq_b, q_a, q_b, do_a, do_b, lse, delta, KA, KB, VA, VB, off_b, off_hk,
                                n_full, hi, rows, SEQ_K, causal_offset, qk_scale, BLOCK_N, D_A, D_B, True, CAUSAL,
                                EXACT_DS)
    DQ_h = DQ + off_b.to(tl.int64) * stride_dqb + off_h.to(tl.int64) * stride_dqh
    _tile_store(DQ_h, m0, SEQ_Q, stride_dqm, 0, HEAD_DIM, dq_a * sm_scale, BLOCK_M, D_A)
    _tile_store(DQ_h, m0, SEQ_Q, stride_dqm, D_A, HEAD_DIM, dq_b * sm_scale, BLOCK_M, D_B)


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK / dV and dQ launches. H100, d=192, scripts/time_bwd_split.py,
# whole-backward TFLOP/s at 2k / 8k without a causal mask; with one. Thirty-ninth session: dK / dV 32 x 128 x 8 x 2
# (128 keys per program, so each warpgroup's S^T / dP^T products are 64 keys by 32 queries and its dK / dV products
# take the full 128 / 64 columns; 308 bytes of spills at 255 registers, paid back) with dQ 128 x 64 x 8 x 2: 280 / 320;
# 185 / 242, against the thirty-seventh session's dK / dV 64 x 64 x 8 x 2 (whose 8 warps split 64-wide products into
# 32-wide wgmmas, bound by shared-memory reads of their A operand) 212 / 239; 163 / 220 in the same run; dK / dV
# 16 x 128 x 8 x 2 219 / 244; 174 / 229, 16 x 128 x 8 x 3 231 / 260; 166 / 216, 32 x 128 x 8 x 3 257 / 294 (non-causal),
# 32 x 128 x 4 x 2 96 / 100; dQ 128 x 32 x 8 x 3 equal; a third dQ stage or 64-row dK / dV steps over 128 keys do not
# fit in shared memory. Thirty-seventh session, against 64 x 64 x 8 x 2: dK / dV 32 x 64 x 8 x 2 173 / 189; 134 / 175;
# three stages 200 / 226; 156 / 213; one 131 / 146; 4 warps 178 / 200; 138 / 179; dQ 64 x 64 (with 32-row dK / dV)
# 141 / 150; 112 / 143; dQ with one stage 175 / 191; 137 / 183. The general kernels: 132 / 133; 111 / 132.
# d=256 on 128 + 128 (thirty-ninth session, same tables): 64 x 64 x 8 x 2 for both 191 / 202; 153 / 189, the general
# kernels 172 / 170; 144 / 174; dK / dV 32 x 64 x 8 x 2 159 / 164; 136 / 168, 16 x 64 x 8 x 2 118 / 120; 105 / 125;
# a third dK / dV stage or 128-row dQ steps do not fit in shared memory.
Tile = tuple[int, int, int, int]
TILES: dict[int, tuple[Tile, Tile]] = {192: ((32, 128, 8, 2), (128, 64, 8, 2)), 256: ((64, 64, 8, 2), (64, 64, 8, 2)),
                                       96: ((64, 64, 8, 2), (128, 64, 8, 2))}
_INTERPRETER_TILES: tuple[Tile, Tile] | None = ((16, 16, 4, 1), (16, 16, 4, 1))  # None: TILES' (a test's choice)
# Head-dim classes taken (flash_fwd_split.SPLITS' form): 129-192 as 128 + 64, 193-256 as 128 + 128 (since the
# thirty-ninth session; the same products as the general kernel's 256-wide tiles, 1.06-1.20x its TFLOP/s above).
# scripts/time_bwd_split.py --dims 96 adds 65-96 as 64 + 32: an experiment, off by default (H100, thirty-ninth
# session: 0.74-0.84x the general backward's TFLOP/s at 2k / 8k at its best pair, 32 x 128 x 8 x 2 / 128 x 64 x 8 x 2 or
# 128 x 128 x 8 x 2).
SPLITS: dict[int, tuple[int, int]] = {192: (128, 64), 256: (128, 128)}

# Off: d = 129-256 takes the general backward on 256-wide tiles. Tests and scripts switch it to compare both.
ENABLED = True
# The split classes whose causal launches (dK / dV and dQ) run in block-major order (`_common._grid_order`: the
# longest programs of every head first; a greedy model of the grid's tail, 1280 programs of 4-64 steps at d=192 2k on
# 132 SMs, predicted about 9 %). H100, fortieth session (scripts/time_bwd_split.py --block-major --one-loop, whole
# causal backward, TFLOP/s at 2k / 4k / 8k / 16k): with two dK / dV loops d=192 +2-8 % (184 / 193, 214 / 231,
# 242 / 258, 267 / 272), d=256 none (154 / 153, 174 / 174, 189 / 188, 193 / 194); with one loop at d=192 206 / 211,
# 243 / 256, 274 / 287, 308 / 304 (1l / bm1l; 0.98 / 1.06 / 1.08 / 1.10x SDPA-flash).
CAUSAL_BLOCK_MAJOR: frozenset[int] = frozenset({192})
# The split classes (SPLITS' keys) whose causal dK / dV runs one masked loop over the rows a key block sees (the mask
# all-true past its diagonal) instead of a masked and an unmasked loop. sm90 compile, d=192 32 x 128 x 8 x 2: 444 bytes
# of spills against 896 for the two loops (308 without a causal mask), for a compare and select per score in every
# step. H100, fortieth session (scripts/time_bwd_split.py --one-loop, whole causal backward, TFLOP/s, two loops / one
# loop at 2k / 4k / 8k / 16k): d=192 184 / 203, 214 / 241, 242 / 275, 267 / 311 (0.94-1.12x SDPA-flash, was
# 0.86-0.96x); d=256 154 / 156, 174 / 177, 189 / 196, 193 / 190: not taken there. The dQ launch's key blocks in one
# masked loop as well (no spills to remove there) gave 206 / 207, 243 / 244, 274 / 275, 308 / 298 (code removed).
CAUSAL_ONE_LOOP: frozenset[int] = frozenset({192})
# The split classes whose dQ is not recomputed by its own launch (QK^T and dO V^T again, 7 products in all) but comes
# from dS^T, which the dK / dV launch then also writes to memory in the inputs' dtype, by a GEMM kernel (`dq_from_ds`:
# per query block over the key blocks it sees): 5 products, as FlashAttention-2's backward, at the price of a
# (batch, heads, sk, sq) buffer and its write and read. Not for the small calls that take dS unrounded (EXACT_DS).
# dQ takes scale * dS rounded once to the inputs' dtype, as FlashAttention-2's does (and as the dQ launch's products
# here); deterministic. Forty-fifth session (H100, scripts/time_bwd_split.py --dims 256 --ds-gemm, whole backward
# TFLOP/s at 2k / 8k / 16k against SDPA-flash), dQ by cuBLAS matmuls: without a causal mask 259 / 297 / 299 (1.06 /
# 1.14 / 1.13x; the dQ launch 192 / 199 / 199), causal 173 / 245 / 252 (0.84 / 0.98 / 0.97x) in 2048-row query
# panels after zero-filling what the dK / dV launch skips. Forty-sixth, the kernel instead (the script's --dq-kernel
# then, one run: matmuls / the kernel at its tile since, 128 x 64 x 8 x 4): without a causal mask 258 / 296 / 303
# against 276 / 301 / 304 (1.13 / 1.14 / 1.14x), causal 172 / 243 / 248 against 218 / 272 / 275 (1.06 / 1.08 /
# 1.05x): half the products of a dense matmul over the causal square and no zero-fill (dQ alone at 2k causal
# 0.43 -> 0.19 ms at 3 stages); the matmul path removed. d=192 lost with the matmuls (its one-loop causal dQ launch:
# 212 / 290 against 169 / 225 at 2k / 8k; without a mask 280 / 322 against 266 / 308): see DS_GEMM_CAUSAL_WHOLE.
DS_GEMM: frozenset[int] = frozenset({256})
# The split classes whose dQ comes from dS^T only in causal calls whose whole dS^T fits in one piece. H100,
# forty-sixth session, d=192 (scripts/time_bwd_split.py --dims 192 --ds-gemm --ds-mib 4096, TFLOP/s at 2k / 4k / 8k,
# dQ launch / dq_from_ds in 1 GiB pieces / in one piece): causal 212 / 257 / 287, 226 / 263 / 266, 226 / 266 / 293
# (2k: one piece of 640 MiB, 0.98 -> 1.05x SDPA-flash); without a causal mask 279 / 305 / 319, 283 / 302 / 262, 282 /
# 303 / 311. Pieces cost: each one's dK / dV launch runs fewer programs (8k: 4 pieces of 320), one after another.
DS_GEMM_CAUSAL_WHOLE: frozenset[int] = frozenset({192})
# The buffer's bytes at most: calls whose dS^T is larger run in pieces of whole (batch, key head) pairs, one after the
# other on one buffer (its GQA group's query heads with each key head); where one pair's does not fit, the dQ launch.
# The backward's memory beyond q, k, v, dout and the gradients stays bounded (FlashAttention's promise: nothing
# quadratic in the sequence length grows without limit).
DS_GEMM_MAX_BYTES = 1 << 30


def split_bwd_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dq: torch.Tensor,
                       dk: torch.Tensor, dv: torch.Tensor, lse: torch.Tensor, scale: float, plain: bool) -> bool:
    """Whether `flash_bwd_split` may compute this backward: plain (causal either way), scale > 0, both head dims
    in one class of SPLITS (129-192, 193-256), fp16 / bf16, gradients with a unit last stride, a contiguous LSE,
    strides TMA accepts for q, k, v and dout, no backward tile pinned by `_configs.override`."""
    if not (ENABLED and plain and scale > 0) or _configs._override.get("bwd"):
        return False
    d, dv_dim = q.shape[-1], v.shape[-1]
    if split_widths(d, dv_dim, SPLITS) is None:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not lse.is_contiguous():
        return False
    if any(t.stride(-1) != 1 for t in (dq, dk, dv)):
        return False
    return tma_ok(q, k, v, dout)


def flash_bwd_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float,
                    causal_offset: int | None, exact_ds: bool) -> None:
    """Write dq, dk, dv for a call `split_bwd_eligible` accepted (lse, delta: fp32 contiguous (b, hq, sq));
    causal_offset None without a causal mask, else key j is visible to query i iff j <= i + causal_offset."""
    for launch in launches(q, k, v, dout, lse, delta, dq, dk, dv, scale, causal_offset, exact_ds):
        launch()


def launches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
             delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float,
             causal_offset: int | None, exact_ds: bool) -> list[Callable[[], None]]:
    """`flash_bwd_split`'s launches as callables, in order (timed one by one by scripts/time_bwd_split.py
    --launches): dK / dV, then dQ; with DS_GEMM, dK / dV (writing dS^T) and dQ from it, for each piece of the
    call in turn."""
    b, hq, sq, d = q.shape
    hkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    top, width_a, width_b = split_widths(d, dv_dim, SPLITS)
    dkdv_tile, dq_tile = _INTERPRETER_TILES if _launch._INTERPRET and _INTERPRETER_TILES else TILES[top]
    kw = dict(HEAD_DIM=d, HEAD_DIM_V=dv_dim, D_A=width_a, D_B=width_b, CAUSAL=causal_offset is not None,
              **({"EXACT_DS": True} if exact_ds else {}),
              **({"BLOCK_MAJOR": True} if top in CAUSAL_BLOCK_MAJOR and causal_offset is not None else {}))
    dkdv_kw = dict(kw, **({"ONE_LOOP": True} if top in CAUSAL_ONE_LOOP and causal_offset is not None else {}))
    offset, qk_scale = causal_offset or 0, scale * _LOG2E

    def _column_tiles(t: torch.Tensor, rows: int) -> tuple:
        return head_tiles(t, rows, width_a), head_tiles(t, rows, width_b)

    def dkdv(q, k, v, dout, lse, delta, dk, dv, extra) -> Callable[[], None]:
        b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
        block_m, block_n, num_warps, num_stages = dkdv_tile
        n_blocks = cdiv(sk, block_n)
        if "DS" in extra:
            extra = dict(extra, DS=head_tiles(extra["DS"], block_n, block_m))
        return lambda: _launch.launch(_bwd_dkdv_split, grid_1d(n_blocks * b * hkv), (
            *_column_tiles(q, block_m), *_column_tiles(k, block_n), *_column_tiles(v, block_n),
            *_column_tiles(dout, block_m), lse, delta, dk, dv, *dk.stride()[:3], *dv.stride()[:3],
            hq, hkv, hq // hkv, sq, sk, n_blocks, offset, qk_scale, scale,
        ), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **dkdv_kw, **extra))

    pieces = None
    if ds_gemm_class(top, causal_offset) and not exact_ds:
        pieces = _ds_pieces(b, hkv, hq // hkv, sq, sk, q.element_size())
        if pieces is not None and len(pieces) > 1 and top not in DS_GEMM:
            pieces = None  # (DS_GEMM_CAUSAL_WHOLE: in one piece only)
    if pieces is None:
        block_m, block_n, num_warps, num_stages = dq_tile
        m_blocks = cdiv(sq, block_m)

        def dq_() -> None:
            _launch.launch(_bwd_dq_split, grid_1d(m_blocks * b * hq), (
                *_column_tiles(q, block_m), *_column_tiles(k, block_n), *_column_tiles(v, block_n),
                *_column_tiles(dout, block_m), lse, delta, dq, *dq.stride()[:3],
                hq, hq // hkv, sq, sk, m_blocks, offset, qk_scale, scale,
            ), dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **kw))

        return [dkdv(q, k, v, dout, lse, delta, dk, dv, {}), dq_]

    stride = cdiv(sq, 8) * 8  # dS^T's rows 16-byte aligned for the TMA stores
    group = hq // hkv
    largest = max((bs.stop - bs.start) * (hs.stop - hs.start) for bs, hs in pieces)
    buffer = torch.empty(largest * group * sk * stride, dtype=q.dtype, device=q.device)
    _launch.poison(buffer)  # (tests: an entry the dQ kernel takes before it is written is NaN)
    calls: list[Callable[[], None]] = []
    for bs, hs in pieces:
        qs = slice(hs.start * group, hs.stop * group)
        # (the kernel reads the LSE and delta of head h of batch b at (b * heads + h) * sq: a piece is whole batch
        # elements or key heads of one, so its slices stay contiguous)
        lse_p, delta_p = lse[bs, qs].contiguous(), delta[bs, qs].contiguous()
        ds_t = buffer[:(bs.stop - bs.start) * (qs.stop - qs.start) * sk * stride].view(
            bs.stop - bs.start, qs.stop - qs.start, sk, stride)[..., :sq]
        launch = dkdv(q[bs, qs], k[bs, hs], v[bs, hs], dout[bs, qs], lse_p, delta_p, dk[bs, hs], dv[bs, hs],
                      dict(DS=ds_t, STORE_DS=True))
        calls += [launch, functools.partial(dq_from_ds, ds_t, k[bs, hs], dq[bs, qs], causal_offset,
                                            (width_a, width_b))]
    return calls


def ds_gemm_class(top: int, causal_offset: int | None) -> bool:
    """Whether calls of split class `top` may take dQ from dS^T (DS_GEMM; DS_GEMM_CAUSAL_WHOLE when causal, if the
    call's dS^T fits in one piece)."""
    return top in DS_GEMM or (top in DS_GEMM_CAUSAL_WHOLE and causal_offset is not None)


def _ds_pieces(b: int, hkv: int, group: int, sq: int, sk: int, size: int) -> list[tuple[slice, slice]] | None:
    """DS_GEMM's pieces of a call, (batch slice, key-head slice) each, whose dS^T fits DS_GEMM_MAX_BYTES, as even as
    their count allows: whole batch elements where one holds all heads, else key heads of one batch element; None
    where one key head's group of one batch element does not fit."""
    pair = group * sk * (cdiv(sq, 8) * 8) * size
    fit = DS_GEMM_MAX_BYTES // pair
    if fit == 0:
        return None
    if fit >= hkv:
        per = cdiv(b, cdiv(b, fit // hkv))
        return [(slice(b0, min(b, b0 + per)), slice(0, hkv)) for b0 in range(0, b, per)]
    per = cdiv(hkv, cdiv(hkv, fit))
    return [(slice(b0, b0 + 1), slice(h0, min(hkv, h0 + per))) for b0 in range(b) for h0 in range(0, hkv, per)]
