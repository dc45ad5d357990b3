"""FlashAttention forward in Triton: exact attention with an fp32 online softmax.

One program computes BLOCK_M query rows of one (batch, head) and streams the keys and values
of that head's KV head (GQA: query head h reads KV head h // GROUP, nothing is repeated in
memory). Scores are kept in the log2 domain (scale * log2(e) folded into one multiplier), so
each probability costs one exp2. The key loop runs in two stages: blocks that every row of the
tile sees completely (no mask arithmetic), then the blocks on the causal diagonal or at the end
of the key sequence, which are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._layout import new_attention_output
from ._common import (LN2, LOG2E, MASK_BITS_ROW, MASK_BOOL, MASK_BOOL_ROW, RESCALE_LOG2, _band_keep, _dropout_keep,
                      _grid_order, _kv_bounds, _load_mask, _load_rows, _open_key_range, _score_mods,
                      _nan_rows, _tile_ptrs, _varlen_invalid, _window_lo)
from ._configs import fwd_config, fwd_exact_pv_config, fwd_without_tma
from .flash_fwd_split import flash_fwd_split, split_eligible
from .flash_fwd_ws import flash_fwd_ws, ws_eligible
from ._features import dropout_draw, kernel_features, plain_call, tile_class
from . import _launch, _mask_bounds
from ._tma import head_tiles, tma_ok
from .varlen_rows import fill_rows_outside
from ._launch import cdiv, grid_1d, tile_dims


@triton.jit
def _fwd_kv_loop(
    acc, l_i, m_i, q, K, V,
    stride_kn, stride_kd, stride_vn, stride_vd,
    start, end, offs_m, SEQ_Q, SEQ_K, causal_offset, qk_scale,
    Mask, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
    seed, rng_offset, bh, drop_threshold, DROP_SEQ_Q, DROP_SEQ_K,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, SCALE_NEG: tl.constexpr,
    MASK_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW_LEFT: tl.constexpr,
    DROPOUT: tl.constexpr, LAZY_RESCALE: tl.constexpr,
    gap_at=None, gap_len=None, GAP: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    EXACT_PV: tl.constexpr = False, KD=None, VD=None, desc_b=0, desc_h=0,
):
    """Fold keys [start, end) into (acc, l_i, m_i). GAP: the keys are [start, gap_at) and
    [gap_at + gap_len, end + gap_len) instead, in one loop (two ranges in one loop body keep the
    register allocation of a two-loop kernel; a third loop body spills at 128 x 64 tiles on sm90).
    USE_TMA: K and V tiles by TMA through the host descriptors KD / VD (_tma.head_tiles) at batch desc_b and
    head desc_h (rows past SEQ_K and padded head-dim columns come zero-filled, as the masked pointer loads give
    them)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if not USE_TMA:
        k_ptrs = _tile_ptrs(K, start, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
        v_ptrs = _tile_ptrs(V, start, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
    MODS: tl.constexpr = MASK_KIND != 0 or HAS_ALIBI or SOFTCAP
    # A bool attn_mask alone: scores are masked before they are scaled, so that p = exp2(qk * scale - m) stays
    # one FFMA (the host never passes qk_scale = 0 here, where -inf * 0 would be NaN: _features.kernel_features).
    KEEP_ONLY: tl.constexpr = (MASK_KIND == MASK_BOOL or MASK_KIND == MASK_BOOL_ROW or MASK_KIND == MASK_BITS_ROW) \
        and not HAS_ALIBI and not SOFTCAP
    # The band (causal, window, keys past SEQ_K) on MASKED tiles; packed row masks hide the keys past SEQ_K.
    BAND: tl.constexpr = MASKED and (CAUSAL or WINDOW_LEFT or MASK_KIND != MASK_BITS_ROW)
    for x in range(start, end, BLOCK_N):
        if GAP:
            start_n = x + (x >= gap_at).to(tl.int32) * gap_len
            if not USE_TMA:
                k_ptrs = _tile_ptrs(K, start_n, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
                v_ptrs = _tile_ptrs(V, start_n, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
        else:
            start_n = x
        cols = start_n + offs_n
        if USE_TMA:
            k = KD.load([desc_b, desc_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            k = _load_rows(k_ptrs, cols, SEQ_K, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        mask_vals = _load_mask(offs_m[:, None], cols[None, :], start_n, SEQ_Q, SEQ_K, Mask, stride_mm, stride_mn,
                               MASK_KIND)
        qk = tl.dot(q, tl.trans(k))
        if KEEP_ONLY:
            keep = mask_vals != 0
            if BAND:
                keep = keep & _band_keep(offs_m[:, None], cols[None, :], SEQ_K, causal_offset, left_offset,
                                         CAUSAL, WINDOW_LEFT)
            if SCALE_NEG:
                qk = tl.where(keep, qk, float("inf"))
                m_ij = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            else:
                qk = tl.where(keep, qk, float("-inf"))
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # no visible key so far: avoid inf - inf
            p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        elif MASKED or MODS:
            if MODS:
                s, _ = _score_mods(qk, offs_m[:, None], cols[None, :], qk_scale, softcap_in, mask_vals, slope2,
                                   alibi_offset, MASK_KIND, HAS_ALIBI, SOFTCAP)
                if BAND:
                    keep = _band_keep(offs_m[:, None], cols[None, :], SEQ_K, causal_offset, left_offset,
                                      CAUSAL, WINDOW_LEFT)
                    s = tl.where(keep, s, float("-inf"))
            else:
                keep = _band_keep(offs_m[:, None], cols[None, :], SEQ_K, causal_offset, left_offset,
                                  CAUSAL, WINDOW_LEFT)
                s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key so far keeps m = -inf; shift by 0 instead to avoid inf - inf.
            m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
        else:
            # max(s * c) = max(s) * c for c >= 0 (min for c < 0): one FMA per score below.
            if SCALE_NEG:
                m_ij = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            if LAZY_RESCALE:
                # Keep the running max (the reference of both acc and l, so the result stays exact) until
                # some row's max grows by more than RESCALE_LOG2: then p <= 2**RESCALE_LOG2, and the
                # tile's acc * alpha multiply and alpha's exp2 are skipped. Always taken on the first
                # block (m = -inf).
                if tl.max(m_ij - m_i, 0) > RESCALE_LOG2:
                    alpha = tl.math.exp2(m_i - m_ij)
                    acc = acc * alpha[:, None]
                    l_i = l_i * alpha
                    m_i = m_ij
                m_ij = m_i
                p = tl.math.exp2(qk * qk_scale - m_i[:, None])
                l_i = l_i + tl.sum(p, 1)
            else:
                p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
                alpha = tl.math.exp2(m_i - m_ij)
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None]
        if USE_TMA:
            v = VD.load([desc_b, desc_h, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            v = _load_rows(v_ptrs, cols, SEQ_K, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        if DROPOUT:
            # The normaliser l keeps every probability; dropped ones leave only the P @ V sum.
            keep_d = _dropout_keep(seed, rng_offset, bh, offs_m, start_n, DROP_SEQ_Q, DROP_SEQ_K, drop_threshold,
                                   BLOCK_N, DROPOUT)
            p = tl.where(keep_d, p, 0.0)
        if EXACT_PV:
            # P @ V of unrounded probabilities (fp32 products, no TF32): the fp32 output flash_bwd recomputes for
            # delta = sum_j P_ij dP_ij, with the P its backward kernels use
            acc = tl.dot(p, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
        if not GAP and not USE_TMA:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


# Sequence-length arguments are not specialised (divisibility / == 1): a new length would
# otherwise compile a new kernel variant. Feature arguments are None (constexpr) when unused.
#
# VARLEN (packed sequences, FlashAttention-2's varlen layout): Q/O are (total_q, h, d) and K/V
# (total_k, h, d), passed with batch stride 0 and row stride = stride of dim 0; sequence b owns rows
# [CuSeqQ[b], CuSeqQ[b + 1]) and keys [CuSeqK[b], CuSeqK[b + 1]). SEQ_Q / SEQ_K are then the maximum
# lengths (they size the grid and the dropout counters, which are those of a padded (b, h, SEQ_Q,
# SEQ_K) batch), TOTAL_Q is the LSE row stride (LSE is (h, total_q)), and every offset argument
# (causal_offset, alibi_offset, left_offset) is relative: the kernel adds the sequence's own
# seqlen_k - seqlen_q. Query blocks past a sequence's end exit at once.
@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "causal_offset", "TOTAL_Q", "TOTAL_K"])
def _attn_fwd(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, causal_offset, qk_scale,
    Mask, stride_mb, stride_mh, stride_mm, stride_mn,
    Alibi, stride_ab, stride_ah, alibi_offset, softcap_in, left_offset,
    seed, rng_offset, drop_threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, SCALE_NEG: tl.constexpr,
    CuSeqQ=None, CuSeqK=None, TOTAL_Q=None, TOTAL_K=None,
    MASK_KIND: tl.constexpr = 0, HAS_ALIBI: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    WINDOW_LEFT: tl.constexpr = False, DROPOUT: tl.constexpr = False, VARLEN: tl.constexpr = False,
    LAZY_RESCALE: tl.constexpr = False,
    Bounds=None, stride_bb=None, stride_bh=None, stride_br=None, MASK_BOUNDS: tl.constexpr = False,
    USE_TMA: tl.constexpr = False, EXACT_PV: tl.constexpr = False, KD=None, VD=None,
):
    # 1-D grid (no 65535 limit on batch * heads); query blocks of one head are adjacent so
    # concurrently running programs share that head's K/V in L2 (block-major order, the longest blocks of all heads
    # first, lost 2-38 % causal on an H100 in the fortieth session: docs/perf-log.md)
    bh, pid_m = _grid_order(tl.program_id(0), NUM_M_BLOCKS, False)
    if CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m  # longest rows first: a better tail
    off_b = (bh // NUM_HEADS_Q).to(tl.int64)
    off_h = (bh % NUM_HEADS_Q).to(tl.int64)
    off_hk = off_h // GROUP
    desc_b = bh // NUM_HEADS_Q  # int32 coordinates of the K / V descriptors (USE_TMA)
    desc_h = bh % NUM_HEADS_Q // GROUP
    m0 = pid_m * BLOCK_M
    if VARLEN:
        q_start = tl.load(CuSeqQ + off_b)
        k_start = tl.load(CuSeqK + off_b)
        q_end = tl.load(CuSeqQ + off_b + 1)
        k_end = tl.load(CuSeqK + off_b + 1)
        seqlen_q = q_end - q_start
        seqlen_k = k_end - k_start
        if m0 >= seqlen_q:
            return
        if _varlen_invalid(CuSeqQ, CuSeqK, off_b, q_start, q_end, k_start, k_end, SEQ_Q, SEQ_K, TOTAL_Q, TOTAL_K):
            _nan_rows(O + off_h * stride_oh, q_start, m0, seqlen_q, TOTAL_Q, stride_om, stride_od, HEAD_DIM_V,
                      BLOCK_M, BLOCK_DV)
            _nan_rows(LSE + off_h * TOTAL_Q, q_start, m0, seqlen_q, TOTAL_Q, 1, 0, 1, BLOCK_M, 1)
            return
        shift = seqlen_k - seqlen_q
        causal_offset += shift
        if HAS_ALIBI:
            alibi_offset += shift
        if WINDOW_LEFT:
            left_offset += shift
        # The batch strides are 0: the sequence's first row is folded into the base pointers.
        Q += q_start.to(tl.int64) * stride_qm
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
        O += q_start.to(tl.int64) * stride_om
    else:
        seqlen_q = SEQ_Q
        seqlen_k = SEQ_K

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = _tile_ptrs(Q + off_b * stride_qb + off_h * stride_qh, m0, stride_qm, stride_qd, BLOCK_M, BLOCK_D)
    q = _load_rows(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    K_bh = K + off_b * stride_kb + off_hk * stride_kh
    V_bh = V + off_b * stride_vb + off_hk * stride_vh
    if MASK_KIND != 0:
        Mask_bh = Mask + off_b * stride_mb + off_h * stride_mh
    else:
        Mask_bh = Mask
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah).to(tl.float32) * LOG2E
    else:
        slope2 = 0.0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    n_full, hi = _kv_bounds(m0, seqlen_k, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    if MASK_BOUNDS:
        # The attn_mask's blocks for this tile (_mask_bounds.py): hidden outside [lo, hi), open in
        # [open_lo, open_hi); multiples of BLOCK_N but hi. The open range, where every row of the tile sees
        # every key (no band either), reads no mask; the keys on either side of it apply every mask.
        if WINDOW_LEFT:
            lo, open_lo = _window_lo(m0, seqlen_k, left_offset, BLOCK_M, BLOCK_N)
        else:
            lo = 0
            open_lo = 0
        lo, open_lo, open_hi, hi = _open_key_range(
            lo, open_lo, n_full, hi, Bounds + off_b * stride_bb + off_h * stride_bh + pid_m * stride_br,
            BLOCK_N, True)
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            open_lo, open_hi, offs_m, seqlen_q, seqlen_k, causal_offset, qk_scale,
            Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
            seed, rng_offset, bh, drop_threshold, SEQ_Q, SEQ_K,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, SCALE_NEG,
            0, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, LAZY_RESCALE, USE_TMA=USE_TMA, EXACT_PV=EXACT_PV,
            KD=KD, VD=VD, desc_b=desc_b, desc_h=desc_h)
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            lo, hi - (open_hi - open_lo), offs_m, seqlen_q, seqlen_k, causal_offset, qk_scale,
            Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
            seed, rng_offset, bh, drop_threshold, SEQ_Q, SEQ_K,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, SCALE_NEG,
            MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, LAZY_RESCALE,
            open_lo, open_hi - open_lo, True, USE_TMA, EXACT_PV, KD=KD, VD=VD, desc_b=desc_b,
            desc_h=desc_h)
    elif WINDOW_LEFT:
        # Keys before lo are left of every row's window; from full_lo on, left of no row's.
        lo, full_lo = _window_lo(m0, seqlen_k, left_offset, BLOCK_M, BLOCK_N)
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            lo, tl.minimum(full_lo, hi), offs_m, seqlen_q, seqlen_k, causal_offset, qk_scale,
            Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
            seed, rng_offset, bh, drop_threshold, SEQ_Q, SEQ_K,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, SCALE_NEG,
            MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, LAZY_RESCALE, USE_TMA=USE_TMA, EXACT_PV=EXACT_PV,
            KD=KD, VD=VD, desc_b=desc_b, desc_h=desc_h)
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            full_lo, n_full, offs_m, seqlen_q, seqlen_k, causal_offset, qk_scale,
            Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
            seed, rng_offset, bh, drop_threshold, SEQ_Q, SEQ_K,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, SCALE_NEG,
            MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, LAZY_RESCALE, USE_TMA=USE_TMA, EXACT_PV=EXACT_PV,
            KD=KD, VD=VD, desc_b=desc_b, desc_h=desc_h)
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            tl.maximum(full_lo, n_full), hi, offs_m, seqlen_q, seqlen_k, causal_offset, qk_scale,
            Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
            seed, rng_offset, bh, drop_threshold, SEQ_Q, SEQ_K,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, SCALE_NEG,
            MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, LAZY_RESCALE, USE_TMA=USE_TMA, EXACT_PV=EXACT_PV,
            KD=KD, VD=VD, desc_b=desc_b, desc_h=desc_h)
    else:
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            0, n_full, offs_m, seqlen_q, seqlen_k, causal_offset, qk_scale,
            Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
            seed, rng_offset, bh, drop_threshold, SEQ_Q, SEQ_K,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, SCALE_NEG,
            MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, LAZY_RESCALE, USE_TMA=USE_TMA, EXACT_PV=EXACT_PV,
            KD=KD, VD=VD, desc_b=desc_b, desc_h=desc_h)
        acc, l_i, m_i = _fwd_kv_loop(
            acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
            n_full, hi, offs_m, seqlen_q, seqlen_k, causal_offset, qk_scale,
            Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
            seed, rng_offset, bh, drop_threshold, SEQ_Q, SEQ_K,
            HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, SCALE_NEG,
            MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, LAZY_RESCALE, USE_TMA=USE_TMA, EXACT_PV=EXACT_PV,
            KD=KD, VD=VD, desc_b=desc_b, desc_h=desc_h)

    # Rows that saw no key (l = 0) output 0 with LSE = -inf, as PyTorch's math backend does.
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    if DROPOUT:
        inv_l = inv_l * dropout_scale
    out = acc * inv_l[:, None]

    row_ok = offs_m < seqlen_q
    if VARLEN:
        tl.store(LSE + off_h * TOTAL_Q + q_start + offs_m, lse, mask=row_ok)
    else:
        tl.store(LSE + bh.to(tl.int64) * SEQ_Q + offs_m, lse, mask=row_ok)
    o_ptrs = _tile_ptrs(O + off_b * stride_ob + off_h * stride_oh, m0, stride_om, stride_od, BLOCK_M, BLOCK_DV)
    if HEAD_DIM_V == BLOCK_DV:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))



def flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, bottom_right: bool,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, rng: tuple[int, int] | None = None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on (b, h, s, d) tensors of any strides; returns (out, lse).

    out is (b, hq, sq, dv) in the input dtype, lse the fp32 natural-log sum-exp (b, hq, sq).
    Both are allocated here unless given (out: any strides; lse: contiguous), e.g. to match another
    op's output contract. Inputs must already be validated (dtype, head dims, GQA ratio, devices).

    Optional features (see _features.kernel_features): attn_mask (bool, True = attend, or additive;
    any shape broadcastable to (b, hq, sq, sk), read with stride 0 on broadcast dims), dropout_p with
    rng = (seed, offset), window = (left, right) (FlashAttention-2 semantics), softcap (> 0: scores
    become softcap * tanh(scale * qk / softcap)), alibi_slopes (fp32 (hq,) or (b, hq)). The LSE is
    that of the scores before dropout.
    """
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = new_attention_output(q, dv) if out is None else out
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device) if lse is None else lse
    _launch.poison(out, lse)
    if out.numel() == 0:
        return out, lse
    if sk == 0:  # nothing to attend to: every row is fully masked
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    plain = plain_call(attn_mask, dropout_p, window, softcap, alibi_slopes)
    # d = 129-192 on 128 + 64 columns instead of 256, 65-96 on 64 + 32 instead of 128 (ahead of the
    # warp-specialized kernel, which pads 96 to 128)
    split = split_eligible(q, k, v, out, scale, plain, causal)
    if (not split and ws_eligible(q, k, v, out, scale, causal, plain, bottom_right)
            and flash_fwd_ws(q, k, v, scale, out, lse, causal, bottom_right)):
        return out, lse
    feat = kernel_features(q, k, scale, causal, bottom_right, attn_mask, dropout_p, rng, window, softcap,
                           alibi_slopes)
    if split:
        flash_fwd_split(q, k, v, scale, feat.causal_offset if causal else None, out, lse)
        return out, lse
    features = tile_class(feat, attn_mask, b, hq, sq, sk, d)
    exact_pv = _exact_pv(q, out)
    cfg = fwd_exact_pv_config(q) if exact_pv else fwd_config(q, d, dv, feat.causal, sk, features=features)
    if cfg.tma and not tma_ok(k, v):
        cfg = fwd_without_tma(cfg, feat.causal, d, dv, features)
    num_m_blocks = cdiv(sq, cfg.block_m)
    block_d, block_dv = tile_dims(d, dv)
    _launch.launch(_attn_fwd, grid_1d(num_m_blocks * b * hq), (
        q, k, v, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        hq, hq // hkv, sq, sk, num_m_blocks, feat.causal_offset, feat.qk_scale, *feat.args,
    ), dict(
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=feat.causal, SCALE_NEG=scale < 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **feat.constexprs,
        **({"LAZY_RESCALE": True} if cfg.lazy_rescale else {}),
        **({"USE_TMA": True, "KD": head_tiles(k, cfg.block_n, block_d), "VD": head_tiles(v, cfg.block_n, block_dv)}
           if cfg.tma else {}), **exact_pv,
        **_mask_bounds.launch_args(attn_mask, b, hq, sq, sk, d, cfg.block_m, cfg.block_n),
    ))
    return out, lse



def varlen_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, head, row, dim) strides of a packed (total, h, d) tensor for the VARLEN kernels:
    batch stride 0 (sequences are located through cu_seqlens), rows along dim 0."""
    return 0, t.stride(1), t.stride(0), t.stride(2)


def flash_fwd_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None, *,
    dropout_p: float = 0.0, rng: tuple[int, int] | None = None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on packed sequences (FlashAttention-2's varlen layout); returns (out, lse).

    q is (total_q, hq, d), k / v (total_k, hkv, d / dv), any strides; cu_seqlens_q / _k are int32
    (b + 1,) cumulative lengths on q's device, max_seqlen_q / _k Python ints bounding every length
    (they size the grid; nothing is read back from the device). Sequence i is queries
    [cu_seqlens_q[i], cu_seqlens_q[i + 1]) over keys [cu_seqlens_k[i], cu_seqlens_k[i + 1]); causal,
    window and ALiBi are aligned bottom-right per sequence (offset seqlen_k_i - seqlen_q_i).

    out is (total_q, hq, dv) in q's dtype, lse the fp32 natural-log sum-exp (hq, total_q) (FA2's
    varlen layout). A query with no visible key outputs 0 with LSE -inf. Dropout draws the mask of a
    padded (b, hq, max_seqlen_q, max_seqlen_k) batch (see dropout_keep_mask). Inputs must already be
    validated, but for cu_seqlens' values (on the device): a sequence whose boundaries are unusable (a start below 0
    or below the previous start, an end before its start or past the packed rows, a length above max_seqlen) reads
    nothing and gets NaN rows (_common._varlen_invalid); rows no sequence covers (before cu_seqlens_q[0], from
    cu_seqlens_q[-1] on) output 0 with LSE -inf (varlen_rows).
    """
    total_q, hq, d = q.shape
    total_k, hkv, dv = k.shape[0], k.shape[1], v.shape[2]
    b = cu_seqlens_q.shape[0] - 1
    out = q.new_empty((total_q, hq, dv)) if out is None else out
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device) if lse is None else lse
    _launch.poison(out, lse)
    if out.numel() == 0:
        return out, lse
    if total_k == 0 or b == 0:  # no key anywhere: every row is fully masked
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if max_seqlen_q <= 0:
        raise ValueError(f"max_seqlen_q={max_seqlen_q} with {total_q} query rows (it must bound every length)")
    # rows outside every sequence (padding past cu_seqlens_q[-1]): no visible key. Before the attention launch, so
    # that the NaN rows of an invalid sequence are never overwritten
    fill_rows_outside((out, cu_seqlens_q, 0.0), (lse.t(), cu_seqlens_q, float("-inf")))
    q4, k4 = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0)
    feat = kernel_features(q4, k4, scale, causal, True, None, dropout_p, rng, window, softcap, alibi_slopes, shift=0)
    exact_pv = _exact_pv(q, out)
    cfg = fwd_exact_pv_config(q) if exact_pv else fwd_config(q, d, dv, feat.causal, max_seqlen_k,
                                                             features=bool(feat.constexprs))
    if cfg.tma:  # packed sequences: pointer loads
        cfg = fwd_without_tma(cfg, feat.causal, d, dv)
    num_m_blocks = cdiv(max_seqlen_q, cfg.block_m)
    block_d, block_dv = tile_dims(d, dv)
    _launch.launch(_attn_fwd, grid_1d(num_m_blocks * b * hq), (
        q, k, v, out, lse,
        *varlen_strides(q), *varlen_strides(k), *varlen_strides(v), *varlen_strides(out),
        hq, hq // hkv, max_seqlen_q, max_seqlen_k, num_m_blocks, feat.causal_offset, feat.qk_scale,
        *feat.args,
    ), dict(
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=feat.causal, SCALE_NEG=scale < 0,
        CuSeqQ=cu_seqlens_q, CuSeqK=cu_seqlens_k, TOTAL_Q=total_q, TOTAL_K=total_k, VARLEN=True,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **feat.constexprs, **exact_pv,
    ))
    return out, lse


def _exact_pv(q: torch.Tensor, out: torch.Tensor) -> dict[str, bool]:
    """EXACT_PV for an fp32 output of 16-bit inputs (flash_bwd's recomputation of O for delta on small calls):
    P @ V then takes the fp32 probabilities the backward kernels recompute, not their 16-bit rounding, so that delta
    is sum_j P_ij dP_ij of those P (with the rounded ones, 1-query 2-key fp16 calls drew dQ / dK errors of 2-8x
    PyTorch's on about 1 % of seeds)."""
    return {"EXACT_PV": True} if out.dtype == torch.float32 and q.dtype != torch.float32 else {}


@triton.jit
def _dropout_mask_kernel(KEEP, seed, rng_offset, drop_threshold, NUM_HEADS_Q, SEQ_Q, SEQ_K,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bh = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    keep = _dropout_keep(seed, rng_offset, bh, rows, pid_n * BLOCK_N, SEQ_Q, SEQ_K, drop_threshold, BLOCK_N,
                         DROPOUT)
    ptrs = KEEP + (bh.to(tl.int64) * SEQ_Q + rows[:, None]) * SEQ_K + cols[None, :]
    tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < SEQ_Q) & (cols[None, :] < SEQ_K))


def dropout_keep_mask(b: int, hq: int, sq: int, sk: int, dropout_p: float, rng: tuple[int, int],
                      device: torch.device | str) -> torch.Tensor:
    """Test/debug helper: the (b, hq, sq, sk) bool keep-mask the kernels draw for this RNG state.

    It runs the same counter-based draw (_common._dropout_keep) as the forward and backward, so a
    reference can apply exactly the kernels' mask.
    """
    keep = torch.zeros((b, hq, sq, sk), dtype=torch.int8, device=device)
    if keep.numel() == 0:
        return keep.bool()
    grid = (cdiv(sq, 16), cdiv(sk, 16), b * hq)
    draw, threshold = dropout_draw(dropout_p)
    _dropout_mask_kernel[grid](keep, int(rng[0]), int(rng[1]), threshold, hq, sq, sk,
                               BLOCK_M=16, BLOCK_N=16, DROPOUT=draw, **_launch.COMPILE_OPTIONS)
    return keep.bool()


def dropout_keep_mask_varlen(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                             max_seqlen_k: int, hq: int, dropout_p: float, rng: tuple[int, int]) -> list[torch.Tensor]:
    """Test/debug helper: per sequence i, the (hq, seqlen_q_i, seqlen_k_i) bool keep-mask the varlen
    kernels draw (the top-left corner of sequence i's slice of a padded (b, hq, max_seqlen_q,
    max_seqlen_k) mask). Reads the lengths back to the host."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    keep = dropout_keep_mask(len(cq) - 1, hq, max_seqlen_q, max_seqlen_k, dropout_p, rng, cu_seqlens_q.device)
    return [keep[i, :, :cq[i + 1] - cq[i], :ck[i + 1] - ck[i]] for i in range(len(cq) - 1)]
