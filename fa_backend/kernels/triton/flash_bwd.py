"""FlashAttention backward in Triton, deterministic by construction (no atomics) by default.

Three launches:
1. preprocess: delta = rowsum(dO * O) in fp32 (O recomputed in fp32 for small calls: EXACT_DELTA_MAX_SCORES);
2. dK/dV: one program per (KV block, batch, KV head) walks every query block of every query
   head in its GQA group, so the group sum of dK/dV happens in registers;
3. dQ: one program per (query block, batch, query head) walks the key blocks.
dK/dV and dQ each recompute P (and dP) from the saved LSE instead of exchanging partial dQ
through atomics; every output element has a single writer, so results are bitwise
reproducible. A tile-config option (TileConfig.atomic_dq, dense layout) instead adds dQ from the
dK/dV kernel with fp32 atomics (5 GEMMs instead of 7) and converts it in a small last launch; it is
never used under torch.use_deterministic_algorithms.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ._common import (LOG2E, MASK_BITS_ROW, MASK_BOOL, MASK_BOOL_ROW, _band_keep, _dropout_keep, _ds_dot,
                      _grid_order, _kv_bounds, _load_lse_log2, _load_mask, _load_rows, _open_key_range, _q_bounds,
                      _nan_rows, _score_mods, _tile_ptrs, _varlen_invalid, _window_lo)
from ._configs import BWD_DKDV_WITHOUT_TMA, BwdConfig, bwd_config, bwd_config_varlen
from ._features import kernel_features, plain_call, tile_class
from . import _launch, _mask_bounds
from ._launch import cdiv, grid_1d, tile_dims
from ._tma import head_tiles, tma_ok as _tma_ok
from .flash_bwd_split import flash_bwd_split, split_bwd_eligible
from .flash_bwd_ws import bwd_dkdv_ws, dkdv_ws_eligible
from .flash_fwd import flash_fwd, flash_fwd_varlen, varlen_strides
from .varlen_rows import fill_rows_outside

# Small calls (at most this many scores per head: 256 x 256) take delta from an fp32 recomputation of O instead of
# the fp16 / bf16 output. delta_i = rowsum(dO_i * O_i) enters every dS_ij of row i; with the output rounded to 11
# or 8 bits it carries that rounding into dQ and dK. On large calls it averages out over many rows and keys
# (measured: within the 2x-PyTorch bar in every GPU test), but with a few rows and keys it decides the max
# error (seen at 11 x 7 and 2 x 36 scores, fp16: dK 2.1-2.3x PyTorch's error, 0.3-0.5x with O unrounded). There the
# extra forward costs microseconds.
EXACT_DELTA_MAX_SCORES = 256 * 256
# Calls with at most this many scores in all (batch x heads x sq x sk) take dS into the dQ and dK products unrounded
# (as two products, _ds_dot) instead of rounded to the inputs' dtype (FlashAttention's rounding): host-bound calls,
# where the extra products cost no visible time, and where that rounding alone put a gradient over 2x PyTorch's
# same-dtype error on rare draws (docs/perf-log.md, "Why tiny sharp-softmax gradient draws fail the 2x rule").
EXACT_DS_MAX_SCORES = 1 << 20


@triton.jit(do_not_specialize=["SEQ_Q", "NUM_M_BLOCKS"])
def _bwd_preprocess(
    O, DO, DLSE, DELTA,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    NUM_HEADS_Q, SEQ_Q, NUM_M_BLOCKS,
    HEAD_DIM_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    # delta_i = sum_j P_ij dP_ij = rowsum(dO * O). A gradient flowing into the LSE output adds
    # P_ij * dlse_i to dS_ij, which is the same as subtracting dlse_i from delta_i.
    pid = tl.program_id(0)
    pid_m = pid % NUM_M_BLOCKS
    bh = pid // NUM_M_BLOCKS
    off_b = (bh // NUM_HEADS_Q).to(tl.int64)
    off_h = (bh % NUM_HEADS_Q).to(tl.int64)
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o_ptrs = _tile_ptrs(O + off_b * stride_ob + off_h * stride_oh, m0, stride_om, stride_od, BLOCK_M, BLOCK_DV)
    do_ptrs = _tile_ptrs(DO + off_b * stride_dob + off_h * stride_doh, m0, stride_dom, stride_dod, BLOCK_M, BLOCK_DV)
    o = _load_rows(o_ptrs, rows, SEQ_Q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    do = _load_rows(do_ptrs, rows, SEQ_Q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_off = bh.to(tl.int64) * SEQ_Q + rows
    if HAS_DLSE:
        delta -= tl.load(DLSE + row_off, mask=rows < SEQ_Q, other=0.0)
    tl.store(DELTA + row_off, delta, mask=rows < SEQ_Q)


@triton.jit
def _bwd_dkdv_loop(
    dk, dv, k, v, Q, DO, LSE, DELTA,
    stride_qm, stride_qd, stride_dom, stride_dod,
    start, end, n0, SEQ_Q, causal_offset, qk_scale,
    SEQ_K, Mask, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
    seed, rng_offset, bh_q, drop_threshold, dropout_scale, DROP_SEQ_Q, DROP_SEQ_K,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr = True, WINDOW_LEFT: tl.constexpr = False,
    MASK_KIND: tl.constexpr = 0, HAS_ALIBI: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    DROPOUT: tl.constexpr = False, DQ_ACC=None, ATOMIC_DQ: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    EXACT_DS: tl.constexpr = False, QD=None, DOD=None, desc_b=0, desc_h=0,
):
    """Accumulate dK, dV of keys [n0, n0 + BLOCK_N) over query rows [start, end).

    Scores are computed transposed (keys x queries) so dV += P^T dO and dK += dS^T Q are plain
    dots. Key rows past SEQ_K hold zeros and produce values that are never stored. Query rows
    past SEQ_Q get LSE = +inf, hence P = 0. MASKED applies the causal / window band.
    ATOMIC_DQ: also add dS K, this block's share of dQ, into the fp32 (SEQ_Q, BLOCK_D) rows at DQ_ACC
    with atomics (one GEMM here instead of the dQ kernel's three; not bitwise reproducible); with USE_TMA
    the tile goes by one TMA bulk reduce-add (sm90 `cp.reduce.async.bulk.tensor ... add`, FA3's dQ path;
    rows past SEQ_Q are dropped by the copy) instead of one atomic per element. USE_TMA: 1 (or True) for the
    Q / dO loads, 2 for the loads and the dQ reduce (Triton's interpreter has no TMA reduce: 1 there); the loads
    through the host descriptors QD / DOD (_tma.head_tiles) at batch desc_b and head desc_h.
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = n0 + tl.arange(0, BLOCK_N)
    KEEP_ONLY: tl.constexpr = (MASK_KIND == MASK_BOOL or MASK_KIND == MASK_BOOL_ROW or MASK_KIND == MASK_BITS_ROW) \
        and not HAS_ALIBI and not SOFTCAP  # a bool attn_mask is the only score feature
    if not USE_TMA:
        q_ptrs = _tile_ptrs(Q, start, stride_qm, stride_qd, BLOCK_M, BLOCK_D)
        do_ptrs = _tile_ptrs(DO, start, stride_dom, stride_dod, BLOCK_M, BLOCK_DV)
    if ATOMIC_DQ and USE_TMA == 2:
        dq_desc = tl.make_tensor_descriptor(DQ_ACC, shape=[SEQ_Q, BLOCK_D], strides=[BLOCK_D, 1],
                                            block_shape=[BLOCK_M, BLOCK_D])
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        if USE_TMA:
            q = QD.load([desc_b, desc_h, start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        else:
            q = _load_rows(q_ptrs, rows, SEQ_Q, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
        lse = _load_lse_log2(LSE, rows, SEQ_Q)
        if KEEP_ONLY:  # a bool mask alone: masked after the exp2, so qk * scale - lse stays one FFMA
            keep_t = _load_mask(rows[None, :], cols[:, None], n0, SEQ_Q, SEQ_K, Mask, stride_mm, stride_mn,
                                MASK_KIND) != 0
            p_t = tl.where(keep_t, tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :]), 0.0)
        elif MASK_KIND != 0 or HAS_ALIBI or SOFTCAP:
            mask_vals = _load_mask(rows[None, :], cols[:, None], n0, SEQ_Q, SEQ_K, Mask, stride_mm, stride_mn,
                                   MASK_KIND)
            s_t, t_t = _score_mods(tl.dot(k, tl.trans(q)), rows[None, :], cols[:, None], qk_scale, softcap_in,
                                   mask_vals, slope2, alibi_offset, MASK_KIND, HAS_ALIBI, SOFTCAP)
            p_t = tl.math.exp2(s_t - lse[None, :])
        else:
            p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED and (CAUSAL or WINDOW_LEFT):  # MASKED alone (attn_mask bounds): no band
            if CAUSAL:
                if WINDOW_LEFT:
                    band = (cols[:, None] <= rows[None, :] + causal_offset) & (cols[:, None] >= rows[None, :] + left_offset)
                else:
                    band = cols[:, None] <= rows[None, :] + causal_offset
            else:
                band = cols[:, None] >= rows[None, :] + left_offset
            p_t = tl.where(band, p_t, 0.0)
        if USE_TMA:
            do = DOD.load([desc_b, desc_h, start_m, 0]).reshape(BLOCK_M, BLOCK_DV)
        else:
            do = _load_rows(do_ptrs, rows, SEQ_Q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
        if DROPOUT:
            # dV sees the dropped probabilities (rescaled once at the end); dP is masked and scaled.
            keep_t = tl.trans(_dropout_keep(seed, rng_offset, bh_q, rows, n0, DROP_SEQ_Q, DROP_SEQ_K, drop_threshold,
                                            BLOCK_N, DROPOUT))
            dv = tl.dot(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv)
        else:
            dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(DELTA + rows, mask=rows < SEQ_Q, other=0.0)
        dp_t = tl.dot(v, tl.trans(do))
        if DROPOUT:
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - t_t * t_t)
        dk = _ds_dot(ds_t, q, dk, EXACT_DS)
        if ATOMIC_DQ:
            # (BLOCK_M, BLOCK_D); padded columns of k are 0
            dq_part = _ds_dot(tl.trans(ds_t), k, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), EXACT_DS)
            if USE_TMA == 2:
                dq_desc.atomic_add([start_m, 0], dq_part)
            else:
                tl.atomic_add(DQ_ACC + rows[:, None].to(tl.int64) * BLOCK_D + offs_d[None, :], dq_part,
                              mask=rows[:, None] < SEQ_Q, sem="relaxed")
        if not USE_TMA:
            q_ptrs += BLOCK_M * stride_qm
            do_ptrs += BLOCK_M * stride_dom
    return dk, dv


# VARLEN: packed (total, h, d) tensors located through CuSeqQ / CuSeqK, SEQ_Q / SEQ_K the maximum
# lengths (dropout counters), TOTAL_Q the LSE / delta row stride, relative offsets (see _attn_fwd).
@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_N_BLOCKS", "causal_offset", "TOTAL_Q", "TOTAL_K"])
def _bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    NUM_HEADS_Q, NUM_HEADS_K, GROUP, SEQ_Q, SEQ_K, NUM_N_BLOCKS, causal_offset, qk_scale, sm_scale,
    Mask, stride_mb, stride_mh, stride_mm, stride_mn,
    Alibi, stride_ab, stride_ah, alibi_offset, softcap_in, left_offset,
    seed, rng_offset, drop_threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    CuSeqQ=None, CuSeqK=None, TOTAL_Q=None, TOTAL_K=None,
    MASK_KIND: tl.constexpr = 0, HAS_ALIBI: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    WINDOW_LEFT: tl.constexpr = False, DROPOUT: tl.constexpr = False, VARLEN: tl.constexpr = False,
    DQ_ACC=None, ATOMIC_DQ: tl.constexpr = False,
    Bounds=None, stride_bb=None, stride_bh=None, stride_br=None, MASK_BOUNDS: tl.constexpr = False,
    USE_TMA: tl.constexpr = False, KEY_MAJOR: tl.constexpr = False, EXACT_DS: tl.constexpr = False,
    QD=None, DOD=None,
):
    # KEY_MAJOR: key block outermost (every (batch, KV head)'s first key block, then every second one, ...): under
    # causal masking the first blocks see the most query rows, so the longest programs go first
    bh, pid_n = _grid_order(tl.program_id(0), NUM_N_BLOCKS, KEY_MAJOR)
    off_b = (bh // NUM_HEADS_K).to(tl.int64)
    off_hk = (bh % NUM_HEADS_K).to(tl.int64)
    n0 = pid_n * BLOCK_N
    if VARLEN:
        q_start = tl.load(CuSeqQ + off_b)
        k_start = tl.load(CuSeqK + off_b)
        q_end = tl.load(CuSeqQ + off_b + 1)
        k_end = tl.load(CuSeqK + off_b + 1)
        seqlen_q = q_end - q_start
        seqlen_k = k_end - k_start
        if n0 >= seqlen_k:
            return
        if _varlen_invalid(CuSeqQ, CuSeqK, off_b, q_start, q_end, k_start, k_end, SEQ_Q, SEQ_K, TOTAL_Q, TOTAL_K):
            _nan_rows(DK + off_hk * stride_dkh, k_start, n0, seqlen_k, TOTAL_K, stride_dkn, stride_dkd, HEAD_DIM,
                      BLOCK_N, BLOCK_D)
            _nan_rows(DV + off_hk * stride_dvh, k_start, n0, seqlen_k, TOTAL_K, stride_dvn, stride_dvd, HEAD_DIM_V,
                      BLOCK_N, BLOCK_DV)
            return
        shift = seqlen_k - seqlen_q
        causal_offset += shift
        if HAS_ALIBI:
            alibi_offset += shift
        if WINDOW_LEFT:
            left_offset += shift
        # The batch strides are 0: the sequence's first row is folded into the base pointers.
        Q += q_start.to(tl.int64) * stride_qm
        DO += q_start.to(tl.int64) * stride_dom
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
        DK += k_start.to(tl.int64) * stride_dkn
        DV += k_start.to(tl.int64) * stride_dvn
    else:
        seqlen_q = SEQ_Q
        seqlen_k = SEQ_K
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptrs = _tile_ptrs(K + off_b * stride_kb + off_hk * stride_kh, n0, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
    v_ptrs = _tile_ptrs(V + off_b * stride_vb + off_hk * stride_vh, n0, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
    k = _load_rows(k_ptrs, cols, seqlen_k, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    v = _load_rows(v_ptrs, cols, seqlen_k, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    m_lo, m_mid = _q_bounds(n0, seqlen_q, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    if WINDOW_LEFT:
        # Row i sees key j only if j >= i + left_offset: rows up to n0 - left_offset see the
        # whole block on that side, rows from n0 + BLOCK_N - left_offset on see none of it.
        m_hi = tl.minimum(tl.maximum(n0 + BLOCK_N - left_offset, 0), seqlen_q)
        full_end = tl.minimum(tl.maximum(n0 - left_offset + 1, 0), seqlen_q)
        if full_end >= seqlen_q:
            m_end = seqlen_q
        else:
            m_end = m_mid + (tl.maximum(full_end - m_mid, 0) // BLOCK_M) * BLOCK_M
        m_diag_end = tl.minimum(m_mid, m_hi)
    else:
        m_hi = seqlen_q
        m_end = seqlen_q
        m_diag_end = m_mid

    if MASK_KIND != 0:
        stride_mask_b = off_b * stride_mb
    else:
        stride_mask_b = 0
    desc_b = bh // NUM_HEADS_K  # int32 coordinates of the Q / dO descriptors (USE_TMA)
    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        desc_h = bh % NUM_HEADS_K * GROUP + g
        bh_q = off_b * NUM_HEADS_Q + off_h
        Q_h = Q + off_b * stride_qb + off_h * stride_qh
        DO_h = DO + off_b * stride_dob + off_h * stride_doh
        if VARLEN:
            LSE_h = LSE + off_h * TOTAL_Q + q_start
            DELTA_h = DELTA + off_h * TOTAL_Q + q_start
        else:
            LSE_h = LSE + bh_q * SEQ_Q
            DELTA_h = DELTA + bh_q * SEQ_Q
        if MASK_KIND != 0:
            Mask_h = Mask + stride_mask_b + off_h * stride_mh
        else:
            Mask_h = Mask
        if HAS_ALIBI:
            slope2 = tl.load(Alibi + off_b * stride_ab + off_h * stride_ah).to(tl.float32) * LOG2E
        else:
            slope2 = 0.0
        if ATOMIC_DQ:  # dense layout only: (b, hq, SEQ_Q, BLOCK_D) fp32
            DQ_ACC_h = DQ_ACC + bh_q.to(tl.int64) * SEQ_Q * BLOCK_D
        else:
            DQ_ACC_h = DQ_ACC
        # Three row ranges: every mask applies in the first and the last, none in the middle one (rows that see
        # the whole key block). Without bounds: the causal diagonal, the open rows, the window's left edge.
        if MASK_BOUNDS:
            # The attn_mask's bounds for this key block at b_ptr (_mask_bounds.py; lo, open_lo, open_hi, hi in
            # query positions: hidden rows outside [lo, hi), open ones in [open_lo, open_hi)), narrowed by the
            # band's m_lo / m_mid / m_end / m_hi. Each range's length is a multiple of BLOCK_M from its start
            # (the loops step BLOCK_M rows and must not overlap); rows a last step runs past hi see nothing.
            b_ptr = Bounds + off_b * stride_bb + off_h * stride_bh + pid_n * stride_br
            head_lo = tl.maximum(m_lo, tl.load(b_ptr))
            mid_lo = tl.maximum(m_mid, tl.load(b_ptr + 1))
            tail_hi = tl.minimum(m_hi, tl.load(b_ptr + 3))
            mid_hi = tl.minimum(tl.minimum(m_end, tl.load(b_ptr + 2)), tail_hi)
            mid_lo = head_lo + tl.cdiv(tl.maximum(tl.minimum(mid_lo, tail_hi) - head_lo, 0), BLOCK_M) * BLOCK_M
            mid_hi = mid_lo + (tl.maximum(mid_hi - mid_lo, 0) // BLOCK_M) * BLOCK_M
            head_hi = mid_lo
        else:
            head_lo, head_hi, mid_lo, mid_hi, tail_hi = m_lo, m_diag_end, m_mid, m_end, m_hi
        if CAUSAL or MASK_BOUNDS:
            dk, dv = _bwd_dkdv_loop(
                dk, dv, k, v, Q_h, DO_h, LSE_h, DELTA_h, stride_qm, stride_qd, stride_dom, stride_dod,
                head_lo, head_hi, n0, seqlen_q, causal_offset, qk_scale,
                seqlen_k, Mask_h, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
                seed, rng_offset, bh_q, drop_threshold, dropout_scale, SEQ_Q, SEQ_K,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, WINDOW_LEFT,
                MASK_KIND, HAS_ALIBI, SOFTCAP, DROPOUT, DQ_ACC_h, ATOMIC_DQ, USE_TMA, EXACT_DS,
                QD, DOD, desc_b, desc_h)
        dk, dv = _bwd_dkdv_loop(
            dk, dv, k, v, Q_h, DO_h, LSE_h, DELTA_h, stride_qm, stride_qd, stride_dom, stride_dod,
            mid_lo, mid_hi, n0, seqlen_q, causal_offset, qk_scale,
            seqlen_k, Mask_h, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
            seed, rng_offset, bh_q, drop_threshold, dropout_scale, SEQ_Q, SEQ_K,
            HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, WINDOW_LEFT,
            0 if MASK_BOUNDS else MASK_KIND, HAS_ALIBI, SOFTCAP, DROPOUT, DQ_ACC_h, ATOMIC_DQ, USE_TMA, EXACT_DS,
            QD, DOD, desc_b, desc_h)
        if WINDOW_LEFT or MASK_BOUNDS:
            dk, dv = _bwd_dkdv_loop(
                dk, dv, k, v, Q_h, DO_h, LSE_h, DELTA_h, stride_qm, stride_qd, stride_dom, stride_dod,
                mid_hi if MASK_BOUNDS else tl.maximum(m_end, m_mid), tail_hi, n0, seqlen_q, causal_offset, qk_scale,
                seqlen_k, Mask_h, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
                seed, rng_offset, bh_q, drop_threshold, dropout_scale, SEQ_Q, SEQ_K,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, WINDOW_LEFT,
                MASK_KIND, HAS_ALIBI, SOFTCAP, DROPOUT, DQ_ACC_h, ATOMIC_DQ, USE_TMA, EXACT_DS,
                QD, DOD, desc_b, desc_h)

    dk *= sm_scale
    if DROPOUT:
        dv *= dropout_scale
    col_ok = cols[:, None] < seqlen_k
    dk_ptrs = _tile_ptrs(DK + off_b * stride_dkb + off_hk * stride_dkh, n0, stride_dkn, stride_dkd, BLOCK_N, BLOCK_D)
    dv_ptrs = _tile_ptrs(DV + off_b * stride_dvb + off_hk * stride_dvh, n0, stride_dvn, stride_dvd, BLOCK_N, BLOCK_DV)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok & (offs_d[None, :] < HEAD_DIM))
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _bwd_dq_loop(
    dq, q, do, lse, delta, K, V,
    stride_kn, stride_kd, stride_vn, stride_vd,
    start, end, rows, SEQ_K, causal_offset, qk_scale,
    SEQ_Q, Mask, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
    seed, rng_offset, bh, drop_threshold, dropout_scale, DROP_SEQ_Q, DROP_SEQ_K,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr = 0, HAS_ALIBI: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    WINDOW_LEFT: tl.constexpr = False, DROPOUT: tl.constexpr = False, USE_TMA: tl.constexpr = False,
    EXACT_DS: tl.constexpr = False, KD=None, VD=None, desc_b=0, desc_h=0,
):
    """Accumulate dQ of one query block over keys [start, end). USE_TMA: K and V tiles by TMA through the host
    descriptors KD / VD at batch desc_b and KV head desc_h (keys past SEQ_K and padded head-dim columns
    zero-filled by the copy), as the dK/dV kernel reads Q and dO."""
    KEEP_ONLY: tl.constexpr = (MASK_KIND == MASK_BOOL or MASK_KIND == MASK_BOOL_ROW or MASK_KIND == MASK_BITS_ROW) \
        and not HAS_ALIBI and not SOFTCAP  # a bool attn_mask is the only score feature
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    if not USE_TMA:
        k_ptrs = _tile_ptrs(K, start, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
        v_ptrs = _tile_ptrs(V, start, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        if USE_TMA:
            k = KD.load([desc_b, desc_h, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
            v = VD.load([desc_b, desc_h, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        else:
            k = _load_rows(k_ptrs, cols, SEQ_K, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
            v = _load_rows(v_ptrs, cols, SEQ_K, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        if KEEP_ONLY:  # a bool mask alone: masked after the exp2, so qk * scale - lse stays one FFMA
            keep = _load_mask(rows[:, None], cols[None, :], start_n, SEQ_Q, SEQ_K, Mask, stride_mm, stride_mn,
                              MASK_KIND) != 0
            p = tl.where(keep, tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None]), 0.0)
        elif MASK_KIND != 0 or HAS_ALIBI or SOFTCAP:
            mask_vals = _load_mask(rows[:, None], cols[None, :], start_n, SEQ_Q, SEQ_K, Mask, stride_mm, stride_mn,
                                   MASK_KIND)
            s, t = _score_mods(tl.dot(q, tl.trans(k)), rows[:, None], cols[None, :], qk_scale, softcap_in,
                               mask_vals, slope2, alibi_offset, MASK_KIND, HAS_ALIBI, SOFTCAP)
            p = tl.math.exp2(s - lse[:, None])
        else:
            p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED and (CAUSAL or WINDOW_LEFT or MASK_KIND != MASK_BITS_ROW):  # packed row masks hide keys >= SEQ_K
            keep = _band_keep(rows[:, None], cols[None, :], SEQ_K, causal_offset, left_offset, CAUSAL, WINDOW_LEFT)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        if DROPOUT:
            keep_d = _dropout_keep(seed, rng_offset, bh, rows, start_n, DROP_SEQ_Q, DROP_SEQ_K, drop_threshold,
                                   BLOCK_N, DROPOUT)
            dp = tl.where(keep_d, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = _ds_dot(ds, k, dq, EXACT_DS)
        if not USE_TMA:
            k_ptrs += BLOCK_N * stride_kn
            v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "causal_offset", "TOTAL_Q", "TOTAL_K"])
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, causal_offset, qk_scale, sm_scale,
    Mask, stride_mb, stride_mh, stride_mm, stride_mn,
    Alibi, stride_ab, stride_ah, alibi_offset, softcap_in, left_offset,
    seed, rng_offset, drop_threshold, dropout_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
    CuSeqQ=None, CuSeqK=None, TOTAL_Q=None, TOTAL_K=None,
    MASK_KIND: tl.constexpr = 0, HAS_ALIBI: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
    WINDOW_LEFT: tl.constexpr = False, DROPOUT: tl.constexpr = False, VARLEN: tl.constexpr = False,
    Bounds=None, stride_bb=None, stride_bh=None, stride_br=None, MASK_BOUNDS: tl.constexpr = False,
    USE_TMA: tl.constexpr = False, EXACT_DS: tl.constexpr = False, KD=None, VD=None,
):
    pid = tl.program_id(0)
    pid_m = pid % NUM_M_BLOCKS
    bh = pid // NUM_M_BLOCKS
    desc_b = bh // NUM_HEADS_Q  # int32 coordinates of the K / V descriptors (USE_TMA)
    desc_h = bh % NUM_HEADS_Q // GROUP
    if CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m  # longest rows first
    off_b = (bh // NUM_HEADS_Q).to(tl.int64)
    off_h = (bh % NUM_HEADS_Q).to(tl.int64)
    off_hk = off_h // GROUP
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
            _nan_rows(DQ + off_h * stride_dqh, q_start, m0, seqlen_q, TOTAL_Q, stride_dqm, stride_dqd, HEAD_DIM,
                      BLOCK_M, BLOCK_D)
            return
        shift = seqlen_k - seqlen_q
        causal_offset += shift
        if HAS_ALIBI:
            alibi_offset += shift
        if WINDOW_LEFT:
            left_offset += shift
        # The batch strides are 0: the sequence's first row is folded into the base pointers.
        Q += q_start.to(tl.int64) * stride_qm
        DO += q_start.to(tl.int64) * stride_dom
        DQ += q_start.to(tl.int64) * stride_dqm
        K += k_start.to(tl.int64) * stride_kn
        V += k_start.to(tl.int64) * stride_vn
    else:
        seqlen_q = SEQ_Q
        seqlen_k = SEQ_K
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = _tile_ptrs(Q + off_b * stride_qb + off_h * stride_qh, m0, stride_qm, stride_qd, BLOCK_M, BLOCK_D)
    do_ptrs = _tile_ptrs(DO + off_b * stride_dob + off_h * stride_doh, m0, stride_dom, stride_dod, BLOCK_M, BLOCK_DV)
    q = _load_rows(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    do = _load_rows(do_ptrs, rows, seqlen_q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    if VARLEN:
        lse = _load_lse_log2(LSE + off_h * TOTAL_Q + q_start, rows, seqlen_q)
        delta = tl.load(DELTA + off_h * TOTAL_Q + q_start + rows, mask=rows < seqlen_q, other=0.0)
    else:
        lse = _load_lse_log2(LSE + bh.to(tl.int64) * SEQ_Q, rows, SEQ_Q)
        delta = tl.load(DELTA + bh.to(tl.int64) * SEQ_Q + rows, mask=rows < SEQ_Q, other=0.0)
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

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_full, hi = _kv_bounds(m0, seqlen_k, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    if WINDOW_LEFT or MASK_BOUNDS:
        # As in the forward: every mask applies in [lo, open_lo) and [open_hi, hi), none in between.
        if WINDOW_LEFT:
            lo, open_lo = _window_lo(m0, seqlen_k, left_offset, BLOCK_M, BLOCK_N)
        else:
            lo = 0
            open_lo = 0
        if MASK_BOUNDS:
            b_ptr = Bounds + off_b * stride_bb + off_h * stride_bh + pid_m * stride_br
        else:
            b_ptr = Bounds
        lo, open_lo, open_hi, hi = _open_key_range(lo, open_lo, n_full, hi, b_ptr, BLOCK_N, MASK_BOUNDS)
        dq = _bwd_dq_loop(dq, q, do, lse, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                          lo, open_lo, rows, seqlen_k, causal_offset, qk_scale,
                          seqlen_q, Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
                          seed, rng_offset, bh, drop_threshold, dropout_scale, SEQ_Q, SEQ_K,
                          HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL,
                          MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, USE_TMA, EXACT_DS,
                          KD, VD, desc_b, desc_h)
        dq = _bwd_dq_loop(dq, q, do, lse, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                          open_lo, open_hi, rows, seqlen_k, causal_offset, qk_scale,
                          seqlen_q, Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
                          seed, rng_offset, bh, drop_threshold, dropout_scale, SEQ_Q, SEQ_K,
                          HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL,
                          0 if MASK_BOUNDS else MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, USE_TMA, EXACT_DS,
                          KD, VD, desc_b, desc_h)
        dq = _bwd_dq_loop(dq, q, do, lse, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                          open_hi, hi, rows, seqlen_k, causal_offset, qk_scale,
                          seqlen_q, Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
                          seed, rng_offset, bh, drop_threshold, dropout_scale, SEQ_Q, SEQ_K,
                          HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL,
                          MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, USE_TMA, EXACT_DS,
                          KD, VD, desc_b, desc_h)
    else:
        dq = _bwd_dq_loop(dq, q, do, lse, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                          0, n_full, rows, seqlen_k, causal_offset, qk_scale,
                          seqlen_q, Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
                          seed, rng_offset, bh, drop_threshold, dropout_scale, SEQ_Q, SEQ_K,
                          HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL,
                          MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, USE_TMA, EXACT_DS,
                          KD, VD, desc_b, desc_h)
        dq = _bwd_dq_loop(dq, q, do, lse, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                          n_full, hi, rows, seqlen_k, causal_offset, qk_scale,
                          seqlen_q, Mask_bh, stride_mm, stride_mn, slope2, alibi_offset, softcap_in, left_offset,
                          seed, rng_offset, bh, drop_threshold, dropout_scale, SEQ_Q, SEQ_K,
                          HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL,
                          MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT, USE_TMA, EXACT_DS,
                          KD, VD, desc_b, desc_h)
    dq *= sm_scale
    dq_ptrs = _tile_ptrs(DQ + off_b * stride_dqb + off_h * stride_dqh, m0, stride_dqm, stride_dqd, BLOCK_M, BLOCK_D)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(rows[:, None] < seqlen_q) & (offs_d[None, :] < HEAD_DIM))


@triton.jit(do_not_specialize=["SEQ_Q", "NUM_M_BLOCKS"])
def _bwd_dq_convert(
    DQ_ACC, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, NUM_HEADS_Q, SEQ_Q, NUM_M_BLOCKS, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dQ = sm_scale * the fp32 rows the dK/dV kernel accumulated with atomics (ATOMIC_DQ), in dQ's dtype
    and strides."""
    pid = tl.program_id(0)
    pid_m = pid % NUM_M_BLOCKS
    bh = pid // NUM_M_BLOCKS
    off_b = (bh // NUM_HEADS_Q).to(tl.int64)
    off_h = (bh % NUM_HEADS_Q).to(tl.int64)
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(DQ_ACC + (bh.to(tl.int64) * SEQ_Q + rows)[:, None] * BLOCK_D + offs_d[None, :],
                  mask=rows[:, None] < SEQ_Q, other=0.0)
    dq_ptrs = _tile_ptrs(DQ + off_b * stride_dqb + off_h * stride_dqh, m0, stride_dqm, stride_dqd, BLOCK_M, BLOCK_D)
    tl.store(dq_ptrs, (acc * sm_scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM))


def _without_tma(cfg: BwdConfig, use_tma: bool, use_tma_dq: bool = False, width: int = 0) -> BwdConfig:
    """The tiles of a launch that cannot use TMA where they ask for it: a dK/dV tile with one stage (its pointer
    loads gain nothing from a second one, which costs registers: the table's choice before TMA), or the
    width's own pointer-load tile (_configs.BWD_DKDV_WITHOUT_TMA); a dQ tile with pointer loads."""
    if cfg.dkdv.tma and not use_tma:
        fallback = BWD_DKDV_WITHOUT_TMA.get(width)
        if fallback is None:
            fallback = dataclasses.replace(cfg.dkdv, num_stages=1, tma=False)
        cfg = dataclasses.replace(cfg, dkdv=fallback)
    if cfg.dq.tma and not use_tma_dq:
        cfg = dataclasses.replace(cfg, dq=dataclasses.replace(cfg.dq, tma=False))
    return cfg


def _dense_grad(dout: torch.Tensor) -> torch.Tensor:
    """dout itself, or a contiguous copy when it broadcasts (a zero stride over a dim of size > 1, e.g. the
    gradient of out.sum() in eager autograd) or its head dim is strided: Triton specialises a kernel on unit and
    16-divisible strides and TMA needs dense rows, so without the copy a broadcast dout would run other code
    (another reduction order in the delta pass, another tile) than the dense dout torch.compile passes for the
    same values, and the gradients would differ in the last bits."""
    if dout.stride(-1) != 1 or any(st == 0 and n > 1 for st, n in zip(dout.stride(), dout.shape)):
        return dout.contiguous()
    return dout


def bwd_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None = None,
              block_dv: int | None = None) -> torch.Tensor:
    """delta = rowsum(dO * O) - dlse in fp32, (b, hq, sq), for out / dout (b, hq, sq, dv) of any strides: the
    backward's preprocessing, one pass over O and dO (also used by the CuTe backward)."""
    b, hq, sq, dv_dim = out.shape
    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=out.device)
    if delta.numel() == 0:
        return delta
    pre_block = 64 if out.device.type == "cuda" else 16
    pre_blocks = cdiv(sq, pre_block)
    if dlse is not None:
        dlse = dlse.float().contiguous()  # (b, hq, sq) fp32: indexed like lse
    _launch.launch(_bwd_preprocess, grid_1d(pre_blocks * b * hq), (
        out, dout, dlse, delta, *out.stride(), *dout.stride(), hq, sq, pre_blocks,
    ), dict(
        HEAD_DIM_V=dv_dim, BLOCK_M=pre_block, BLOCK_DV=block_dv or tile_dims(dv_dim, dv_dim)[1],
        HAS_DLSE=dlse is not None,
    ))
    return delta


def _launch_dkdv(q, k, v, dout, lse, delta, dk, dv, feat, cfg, n_blocks, scale, attn_mask, atomic, use_tma, dq_acc,
                 exact_ds, block_d, block_dv):
    """The general dK / dV kernel (`_bwd_dkdv`) on a dense call (flash_bwd's arguments)."""
    b, hq, sq, d = q.shape
    hkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    _launch.launch(_bwd_dkdv, grid_1d(n_blocks * b * hkv), (
        q, k, v, dout, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        hq, hkv, hq // hkv, sq, sk, n_blocks, feat.causal_offset, feat.qk_scale, scale, *feat.args,
    ), dict(
        HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=cfg.dkdv.block_m, BLOCK_N=cfg.dkdv.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=feat.causal,
        num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages, **feat.constexprs,
        **({"DQ_ACC": dq_acc, "ATOMIC_DQ": True} if atomic else {}),
        **({"USE_TMA": 2 if atomic and not _launch._INTERPRET else True,
            "QD": head_tiles(q, cfg.dkdv.block_m, block_d), "DOD": head_tiles(dout, cfg.dkdv.block_m, block_dv)}
           if use_tma else {}),
        **({"KEY_MAJOR": True} if cfg.dkdv.key_major else {}), **exact_ds,
        **_mask_bounds.launch_args(attn_mask, b, hq, sq, sk, d, cfg.dkdv.block_m, cfg.dkdv.block_n, by_keys=True),
    ))


def flash_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool, bottom_right: bool,
    dlse: torch.Tensor | None = None, *,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, rng: tuple[int, int] | None = None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
    dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of flash_fwd; each has its input's shape, dtype and (dense) strides.

    dlse, the gradient flowing into the LSE output (fp32, (b, hq, sq)), is optional. The feature
    arguments must be those of the forward (the dropout mask is regenerated from rng). dq, dk, dv
    may be given (any strides, e.g. views of one packed gradient buffer); they are written in place.
    No mask gradient is computed.
    """
    b, hq, sq, d = q.shape
    hkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    dout = _dense_grad(dout)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    _launch.poison(dq, dk, dv)
    if sq == 0 or sk == 0 or b == 0 or hq == 0:
        # No query or no key: every gradient is zero (empty tensors stay empty).
        return dq.zero_(), dk.zero_(), dv.zero_()
    feat = kernel_features(q, k, scale, causal, bottom_right, attn_mask, dropout_p, rng, window, softcap,
                           alibi_slopes)
    features = tile_class(feat, attn_mask, b, hq, sq, sk, d)
    cfg = bwd_config(q, d, dv_dim, feat.causal, features=features, group=hq // hkv)
    block_d, block_dv = tile_dims(d, dv_dim)

    exact_ds = {"EXACT_DS": True} if b * hq * sq * sk <= EXACT_DS_MAX_SCORES else {}
    if sq * sk <= EXACT_DELTA_MAX_SCORES:
        out = flash_fwd(q, k, v, scale, causal, bottom_right, torch.empty(out.shape, dtype=torch.float32,
                        device=q.device), attn_mask=attn_mask, dropout_p=dropout_p, rng=rng, window=window,
                        softcap=softcap, alibi_slopes=alibi_slopes)[0]
    delta = bwd_delta(out, dout, dlse, block_dv)

    plain = plain_call(attn_mask, dropout_p, window, softcap, alibi_slopes)
    if split_bwd_eligible(q, k, v, dout, dq, dk, dv, lse, scale, plain):  # d = 129-192 on 128 + 64 columns
        flash_bwd_split(q, k, v, dout, lse, delta, dq, dk, dv, scale, feat.causal_offset if causal else None,
                        bool(exact_ds))
        return dq, dk, dv
    # dQ through atomics in the dK/dV kernel (a tile-config option): never under
    # torch.use_deterministic_algorithms, since the order of the fp32 additions varies from run to run
    atomic = cfg.dkdv.atomic_dq and not torch.are_deterministic_algorithms_enabled()
    use_tma = cfg.dkdv.tma and _tma_ok(q, dout)
    use_tma_dq = cfg.dq.tma and _tma_ok(k, v)
    cfg = _without_tma(cfg, use_tma, use_tma_dq, max(block_d, block_dv))
    dq_acc = torch.zeros((b, hq, sq, block_d), dtype=torch.float32, device=q.device) if atomic else None
    n_blocks = cdiv(sk, cfg.dkdv.block_n)
    # dK / dV by the warp-specialized kernel where it applies (flash_bwd_ws.py), else the general one; dQ below
    if not (not atomic and not exact_ds and lse.is_contiguous()
            and dkdv_ws_eligible(q, k, v, dout, dk, dv, scale, causal, plain, feat.causal_offset if causal else 0)
            and bwd_dkdv_ws(q, k, v, dout, lse, delta, dk, dv, scale, feat.causal_offset if causal else None)):
        _launch_dkdv(q, k, v, dout, lse, delta, dk, dv, feat, cfg, n_blocks, scale, attn_mask, atomic, use_tma,
                     dq_acc, exact_ds, block_d, block_dv)
    if atomic:
        convert_block = 64 if q.device.type == "cuda" else 16
        m_blocks = cdiv(sq, convert_block)
        _launch.launch(_bwd_dq_convert, grid_1d(m_blocks * b * hq), (
            dq_acc, dq, *dq.stride(), hq, sq, m_blocks, scale,
        ), dict(HEAD_DIM=d, BLOCK_M=convert_block, BLOCK_D=block_d))
        return dq, dk, dv

    m_blocks = cdiv(sq, cfg.dq.block_m)
    _launch.launch(_bwd_dq, grid_1d(m_blocks * b * hq), (
        q, k, v, dout, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        hq, hq // hkv, sq, sk, m_blocks, feat.causal_offset, feat.qk_scale, scale, *feat.args,
    ), dict(
        HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=feat.causal,
        num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages, **feat.constexprs,
        **({"USE_TMA": True, "KD": head_tiles(k, cfg.dq.block_n, block_d),
            "VD": head_tiles(v, cfg.dq.block_n, block_dv)} if use_tma_dq else {}), **exact_ds,
        **_mask_bounds.launch_args(attn_mask, b, hq, sq, sk, d, cfg.dq.block_m, cfg.dq.block_n),
    ))
    return dq, dk, dv


def flash_bwd_varlen(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    scale: float, causal: bool, dlse: torch.Tensor | None = None, *,
    dropout_p: float = 0.0, rng: tuple[int, int] | None = None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
    dq: torch.Tensor | None = None, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of flash_fwd_varlen (packed (total, h, d) tensors, lse (hq, total_q)).

    dlse (fp32 (hq, total_q)) is optional; the feature arguments must be the forward's. dq, dk, dv
    may be given (any strides, e.g. views of one packed gradient buffer); they are written in place.
    Deterministic: every gradient row has one writer (the dK/dV program of its key block).
    """
    total_q, hq, d = q.shape
    total_k, hkv, dv_dim = k.shape[0], k.shape[1], v.shape[2]
    b = cu_seqlens_q.shape[0] - 1
    dout = _dense_grad(dout)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    _launch.poison(dq, dk, dv)
    if total_q == 0 or total_k == 0 or b == 0 or hq == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    # rows outside every sequence change no output: gradient 0 (before the launches below, which write NaN over an
    # invalid sequence's rows)
    fill_rows_outside((dq, cu_seqlens_q, 0.0), (dk, cu_seqlens_k, 0.0), (dv, cu_seqlens_k, 0.0))
    q4, k4 = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0)
    feat = kernel_features(q4, k4, scale, causal, True, None, dropout_p, rng, window, softcap, alibi_slopes, shift=0)
    cfg = bwd_config_varlen(q, d, dv_dim, feat.causal, features=bool(feat.constexprs))
    cfg = _without_tma(cfg, False, False)  # packed sequences: pointer loads
    block_d, block_dv = tile_dims(d, dv_dim)

    # as in flash_bwd: dS unrounded in the products of host-bound calls (their scores at most b x hq x max_seqlen_q
    # x max_seqlen_k) and delta from an fp32 O
    exact_ds = {"EXACT_DS": True} if b * hq * max_seqlen_q * max_seqlen_k <= EXACT_DS_MAX_SCORES else {}
    if max_seqlen_q * max_seqlen_k <= EXACT_DELTA_MAX_SCORES:
        out = flash_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                               torch.empty(out.shape, dtype=torch.float32, device=q.device), dropout_p=dropout_p,
                               rng=rng, window=window, softcap=softcap, alibi_slopes=alibi_slopes)[0]
    # delta = rowsum(dO * O) needs no sequence structure: the dense preprocess on (1, hq, total_q, dv)
    # views writes it in the LSE's (hq, total_q) layout.
    o4, do4 = out.transpose(0, 1).unsqueeze(0), dout.transpose(0, 1).unsqueeze(0)
    delta = bwd_delta(o4, do4, None if dlse is None else dlse.view(1, hq, total_q), block_dv).view(hq, total_q)
    strides = (*varlen_strides(q), *varlen_strides(k), *varlen_strides(v), *varlen_strides(dout))
    varlen = dict(CuSeqQ=cu_seqlens_q, CuSeqK=cu_seqlens_k, TOTAL_Q=total_q, TOTAL_K=total_k, VARLEN=True)

    n_blocks = cdiv(max(max_seqlen_k, 1), cfg.dkdv.block_n)
    _launch.launch(_bwd_dkdv, grid_1d(n_blocks * b * hkv), (
        q, k, v, dout, lse, delta, dk, dv, *strides, *varlen_strides(dk), *varlen_strides(dv),
        hq, hkv, hq // hkv, max_seqlen_q, max_seqlen_k, n_blocks, feat.causal_offset, feat.qk_scale, scale,
        *feat.args,
    ), dict(
        HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=cfg.dkdv.block_m, BLOCK_N=cfg.dkdv.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=feat.causal, **varlen, **exact_ds,
        num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages, **feat.constexprs,
    ))

    m_blocks = cdiv(max(max_seqlen_q, 1), cfg.dq.block_m)
    _launch.launch(_bwd_dq, grid_1d(m_blocks * b * hq), (
        q, k, v, dout, lse, delta, dq, *strides, *varlen_strides(dq),
        hq, hq // hkv, max_seqlen_q, max_seqlen_k, m_blocks, feat.causal_offset, feat.qk_scale, scale, *feat.args,
    ), dict(
        HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=feat.causal, **varlen, **exact_ds,
        num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages, **feat.constexprs,
    ))
    return dq, dk, dv
