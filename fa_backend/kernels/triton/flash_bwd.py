"""FlashAttention backward in Triton, deterministic by construction (no atomics).

Three launches:
1. preprocess: delta = rowsum(dO * O) in fp32;
2. dK/dV: one program per (KV block, batch, KV head) walks every query block of every query
   head in its GQA group, so the group sum of dK/dV happens in registers;
3. dQ: one program per (query block, batch, query head) walks the key blocks.
dK/dV and dQ each recompute P (and dP) from the saved LSE instead of exchanging partial dQ
through atomics; every output element has a single writer, so results are bitwise
reproducible.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _launch
from ._common import _kv_bounds, _load_lse_log2, _load_rows, _tile_ptrs
from ._configs import bwd_config
from ._launch import grid_1d, tile_dims

_LOG2E = 1.0 / math.log(2.0)


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
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Accumulate dK, dV of keys [n0, n0 + BLOCK_N) over query rows [start, end).

    Scores are computed transposed (keys x queries) so dV += P^T dO and dK += dS^T Q are plain
    dots. Key rows past SEQ_K hold zeros and produce values that are never stored. Query rows
    past SEQ_Q get LSE = +inf, hence P = 0.
    """
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    cols = n0 + tl.arange(0, BLOCK_N)
    q_ptrs = _tile_ptrs(Q, start, stride_qm, stride_qd, BLOCK_M, BLOCK_D)
    do_ptrs = _tile_ptrs(DO, start, stride_dom, stride_dod, BLOCK_M, BLOCK_DV)
    for start_m in range(start, end, BLOCK_M):
        rows = start_m + offs_m
        q = _load_rows(q_ptrs, rows, SEQ_Q, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
        lse = _load_lse_log2(LSE, rows, SEQ_Q)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
        if MASKED:
            p_t = tl.where(cols[:, None] <= rows[None, :] + causal_offset, p_t, 0.0)
        do = _load_rows(do_ptrs, rows, SEQ_Q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(DELTA + rows, mask=rows < SEQ_Q, other=0.0)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk)
        q_ptrs += BLOCK_M * stride_qm
        do_ptrs += BLOCK_M * stride_dom
    return dk, dv


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_N_BLOCKS", "causal_offset"])
def _bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    NUM_HEADS_Q, NUM_HEADS_K, GROUP, SEQ_Q, SEQ_K, NUM_N_BLOCKS, causal_offset, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid % NUM_N_BLOCKS
    bh = pid // NUM_N_BLOCKS
    off_b = (bh // NUM_HEADS_K).to(tl.int64)
    off_hk = (bh % NUM_HEADS_K).to(tl.int64)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptrs = _tile_ptrs(K + off_b * stride_kb + off_hk * stride_kh, n0, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
    v_ptrs = _tile_ptrs(V + off_b * stride_vb + off_hk * stride_vh, n0, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
    k = _load_rows(k_ptrs, cols, SEQ_K, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    v = _load_rows(v_ptrs, cols, SEQ_K, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    if CAUSAL:
        # Query row i sees key j iff j <= i + causal_offset: rows below n0 - causal_offset see
        # none of this block; rows from n0 + BLOCK_N - 1 - causal_offset on see all of it.
        m_lo = tl.minimum(tl.maximum(n0 - causal_offset, 0), SEQ_Q)
        diag_rows = tl.maximum(n0 + BLOCK_N - 1 - causal_offset - m_lo, 0)
        m_mid = tl.minimum(m_lo + tl.cdiv(diag_rows, BLOCK_M) * BLOCK_M, SEQ_Q)
    else:
        m_lo = 0
        m_mid = 0

    for g in range(GROUP):
        off_h = off_hk * GROUP + g
        bh_q = off_b * NUM_HEADS_Q + off_h
        Q_h = Q + off_b * stride_qb + off_h * stride_qh
        DO_h = DO + off_b * stride_dob + off_h * stride_doh
        LSE_h = LSE + bh_q * SEQ_Q
        DELTA_h = DELTA + bh_q * SEQ_Q
        if CAUSAL:
            dk, dv = _bwd_dkdv_loop(
                dk, dv, k, v, Q_h, DO_h, LSE_h, DELTA_h, stride_qm, stride_qd, stride_dom, stride_dod,
                m_lo, m_mid, n0, SEQ_Q, causal_offset, qk_scale,
                HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, True)
        dk, dv = _bwd_dkdv_loop(
            dk, dv, k, v, Q_h, DO_h, LSE_h, DELTA_h, stride_qm, stride_qd, stride_dom, stride_dod,
            m_mid, SEQ_Q, n0, SEQ_Q, causal_offset, qk_scale,
            HEAD_DIM, HEAD_DIM_V, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, False)

    dk *= sm_scale
    col_ok = cols[:, None] < SEQ_K
    dk_ptrs = _tile_ptrs(DK + off_b * stride_dkb + off_hk * stride_dkh, n0, stride_dkn, stride_dkd, BLOCK_N, BLOCK_D)
    dv_ptrs = _tile_ptrs(DV + off_b * stride_dvb + off_hk * stride_dvh, n0, stride_dvn, stride_dvd, BLOCK_N, BLOCK_DV)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=col_ok & (offs_d[None, :] < HEAD_DIM))
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=col_ok & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _bwd_dq_loop(
    dq, q, do, lse, delta, K, V,
    stride_kn, stride_kd, stride_vn, stride_vd,
    start, end, rows, SEQ_K, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Accumulate dQ of one query block over keys [start, end)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptrs = _tile_ptrs(K, start, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
    v_ptrs = _tile_ptrs(V, start, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_ptrs, cols, SEQ_K, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        v = _load_rows(v_ptrs, cols, SEQ_K, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
        if MASKED:
            keep = cols[None, :] < SEQ_K
            if CAUSAL:
                keep = keep & (cols[None, :] <= rows[:, None] + causal_offset)
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "causal_offset"])
def _bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, causal_offset, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = pid % NUM_M_BLOCKS
    bh = pid // NUM_M_BLOCKS
    if CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m  # longest rows first
    off_b = (bh // NUM_HEADS_Q).to(tl.int64)
    off_h = (bh % NUM_HEADS_Q).to(tl.int64)
    off_hk = off_h // GROUP
    m0 = pid_m * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = _tile_ptrs(Q + off_b * stride_qb + off_h * stride_qh, m0, stride_qm, stride_qd, BLOCK_M, BLOCK_D)
    do_ptrs = _tile_ptrs(DO + off_b * stride_dob + off_h * stride_doh, m0, stride_dom, stride_dod, BLOCK_M, BLOCK_DV)
    q = _load_rows(q_ptrs, rows, SEQ_Q, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    do = _load_rows(do_ptrs, rows, SEQ_Q, offs_dv, HEAD_DIM_V, True, HEAD_DIM_V != BLOCK_DV)
    lse = _load_lse_log2(LSE + bh.to(tl.int64) * SEQ_Q, rows, SEQ_Q)
    delta = tl.load(DELTA + bh.to(tl.int64) * SEQ_Q + rows, mask=rows < SEQ_Q, other=0.0)
    K_bh = K + off_b * stride_kb + off_hk * stride_kh
    V_bh = V + off_b * stride_vb + off_hk * stride_vh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_full, hi = _kv_bounds(m0, SEQ_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    dq = _bwd_dq_loop(dq, q, do, lse, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                      0, n_full, rows, SEQ_K, causal_offset, qk_scale,
                      HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL)
    dq = _bwd_dq_loop(dq, q, do, lse, delta, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
                      n_full, hi, rows, SEQ_K, causal_offset, qk_scale,
                      HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL)
    dq *= sm_scale
    dq_ptrs = _tile_ptrs(DQ + off_b * stride_dqb + off_h * stride_dqh, m0, stride_dqm, stride_dqd, BLOCK_M, BLOCK_D)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=(rows[:, None] < SEQ_Q) & (offs_d[None, :] < HEAD_DIM))


def flash_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool, bottom_right: bool,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of flash_fwd; each has its input's shape, dtype and (dense) strides.

    dlse, the gradient flowing into the LSE output (fp32, (b, hq, sq)), is optional.
    """
    b, hq, sq, d = q.shape
    hkv, sk, dv_dim = k.shape[1], k.shape[2], v.shape[3]
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    _launch.poison(dq, dk, dv)
    if sq == 0 or sk == 0 or b == 0 or hq == 0:
        # No query or no key: every gradient is zero (empty tensors stay empty).
        return dq.zero_(), dk.zero_(), dv.zero_()
    cfg = bwd_config(q, d, dv_dim, causal)
    block_d, block_dv = tile_dims(d, dv_dim)
    causal_offset = sk - sq if bottom_right else 0
    qk_scale = scale * _LOG2E

    delta = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    pre_block = 64 if q.device.type == "cuda" else 16
    pre_blocks = triton.cdiv(sq, pre_block)
    if dlse is not None:
        dlse = dlse.contiguous()  # (b, hq, sq) fp32: indexed like lse
    _bwd_preprocess[grid_1d(pre_blocks * b * hq)](
        out, dout, dlse, delta, *out.stride(), *dout.stride(), hq, sq, pre_blocks,
        HEAD_DIM_V=dv_dim, BLOCK_M=pre_block, BLOCK_DV=block_dv, HAS_DLSE=dlse is not None,
    )

    n_blocks = triton.cdiv(sk, cfg.dkdv.block_n)
    _bwd_dkdv[grid_1d(n_blocks * b * hkv)](
        q, k, v, dout, lse, delta, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        hq, hkv, hq // hkv, sq, sk, n_blocks, causal_offset, qk_scale, scale,
        HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=cfg.dkdv.block_m, BLOCK_N=cfg.dkdv.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=causal,
        num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages,
    )

    m_blocks = triton.cdiv(sq, cfg.dq.block_m)
    _bwd_dq[grid_1d(m_blocks * b * hq)](
        q, k, v, dout, lse, delta, dq,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dq.stride(),
        hq, hq // hkv, sq, sk, m_blocks, causal_offset, qk_scale, scale,
        HEAD_DIM=d, HEAD_DIM_V=dv_dim, BLOCK_M=cfg.dq.block_m, BLOCK_N=cfg.dq.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=causal,
        num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages,
    )
    return dq, dk, dv
