"""FlashAttention forward in Triton: exact attention with an fp32 online softmax.

One program computes BLOCK_M query rows of one (batch, head) and streams the keys and values
of that head's KV head (GQA: query head h reads KV head h // GROUP, nothing is repeated in
memory). Scores are kept in the log2 domain (scale * log2(e) folded into one multiplier), so
each probability costs one exp2. The key loop runs in two stages: blocks that every row of the
tile sees completely (no mask arithmetic), then the blocks on the causal diagonal or at the end
of the key sequence, which are masked.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .._layout import new_attention_output
from . import _launch
from ._common import LN2, _kv_bounds, _load_rows, _tile_ptrs
from ._configs import fwd_config
from ._launch import grid_1d, tile_dims

_LOG2E = 1.0 / math.log(2.0)


@triton.jit
def _fwd_kv_loop(
    acc, l_i, m_i, q, K, V,
    stride_kn, stride_kd, stride_vn, stride_vd,
    start, end, offs_m, SEQ_K, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, SCALE_NEG: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_ptrs = _tile_ptrs(K, start, stride_kn, stride_kd, BLOCK_N, BLOCK_D)
    v_ptrs = _tile_ptrs(V, start, stride_vn, stride_vd, BLOCK_N, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(k_ptrs, cols, SEQ_K, offs_d, HEAD_DIM, MASKED, HEAD_DIM != BLOCK_D)
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            keep = cols[None, :] < SEQ_K
            if CAUSAL:
                keep = keep & (cols[None, :] <= offs_m[:, None] + causal_offset)
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key so far keeps m = -inf; shift by 0 instead to avoid inf - inf.
            m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        else:
            # max(s * c) = max(s) * c for c >= 0 (min for c < 0): one FMA per score below.
            if SCALE_NEG:
                m_ij = tl.maximum(m_i, tl.min(qk, 1) * qk_scale)
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_rows(v_ptrs, cols, SEQ_K, offs_dv, HEAD_DIM_V, MASKED, HEAD_DIM_V != BLOCK_DV)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


# Sequence-length arguments are not specialised (divisibility / == 1): a new length would
# otherwise compile a new kernel variant.
@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "causal_offset"])
def _attn_fwd(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, SCALE_NEG: tl.constexpr,
):
    # 1-D grid (no 65535 limit on batch * heads); query blocks of one head are adjacent so
    # concurrently running programs share that head's K/V in L2.
    pid = tl.program_id(0)
    pid_m = pid % NUM_M_BLOCKS
    bh = pid // NUM_M_BLOCKS
    if CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m  # longest rows first: a better tail
    off_b = (bh // NUM_HEADS_Q).to(tl.int64)
    off_h = (bh % NUM_HEADS_Q).to(tl.int64)
    off_hk = off_h // GROUP
    m0 = pid_m * BLOCK_M

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = _tile_ptrs(Q + off_b * stride_qb + off_h * stride_qh, m0, stride_qm, stride_qd, BLOCK_M, BLOCK_D)
    q = _load_rows(q_ptrs, offs_m, SEQ_Q, offs_d, HEAD_DIM, True, HEAD_DIM != BLOCK_D)
    K_bh = K + off_b * stride_kb + off_hk * stride_kh
    V_bh = V + off_b * stride_vb + off_hk * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    n_full, hi = _kv_bounds(m0, SEQ_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    acc, l_i, m_i = _fwd_kv_loop(
        acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
        0, n_full, offs_m, SEQ_K, causal_offset, qk_scale,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, SCALE_NEG)
    acc, l_i, m_i = _fwd_kv_loop(
        acc, l_i, m_i, q, K_bh, V_bh, stride_kn, stride_kd, stride_vn, stride_vd,
        n_full, hi, offs_m, SEQ_K, causal_offset, qk_scale,
        HEAD_DIM, HEAD_DIM_V, BLOCK_N, BLOCK_D, BLOCK_DV, True, CAUSAL, SCALE_NEG)

    # Rows that saw no key (l = 0) output 0 with LSE = -inf, as PyTorch's math backend does.
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    out = acc * inv_l[:, None]

    row_ok = offs_m < SEQ_Q
    tl.store(LSE + bh.to(tl.int64) * SEQ_Q + offs_m, lse, mask=row_ok)
    o_ptrs = _tile_ptrs(O + off_b * stride_ob + off_h * stride_oh, m0, stride_om, stride_od, BLOCK_M, BLOCK_DV)
    if HEAD_DIM_V == BLOCK_DV:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))


def flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, bottom_right: bool,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward on (b, h, s, d) tensors of any strides; returns (out, lse).

    out is (b, hq, sq, dv) in the input dtype, lse the fp32 natural-log sum-exp (b, hq, sq).
    Both are allocated here unless given (out: any strides; lse: contiguous), e.g. to match another
    op's output contract. Inputs must already be validated (dtype, head dims, GQA ratio, devices).
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
    cfg = fwd_config(q, d, dv, causal, sk)
    num_m_blocks = triton.cdiv(sq, cfg.block_m)
    causal_offset = sk - sq if bottom_right else 0
    block_d, block_dv = tile_dims(d, dv)
    _attn_fwd[grid_1d(num_m_blocks * b * hq)](
        q, k, v, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        hq, hq // hkv, sq, sk, num_m_blocks, causal_offset, scale * _LOG2E,
        HEAD_DIM=d, HEAD_DIM_V=dv, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=block_d, BLOCK_DV=block_dv, CAUSAL=causal, SCALE_NEG=scale < 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse
