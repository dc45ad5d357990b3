"""Warp-specialized dK / dV kernel for plain non-causal MHA backwards on Hopper (Triton's automatic warp
specialization; see flash_fwd_ws.py for what Triton 3.6's pass gets wrong, which shapes what this kernel does).

Key-block stationary as `flash_bwd._bwd_dkdv`: a program holds BLOCK_N keys (split between the two consumer
warpgroups: the dots' M dimension) and walks every query block; K / V / Q / dO by TMA, dK / dV stored by TMA (a
pointer store over the key rows would hit the pass's row-index fault), LSE and delta read per query block by
pointer over the query axis (the dots' N dimension, not split). No mask / dropout / softcap / ALiBi / window. dQ
stays with the general kernel. GQA_ENABLED (off: not yet run on a GPU) also gives it GQA calls: a program per key /
value head walks its group's query heads' blocks in one flattened loop.

CAUSAL_ENABLED (off: not yet run on a GPU; fifty-fifth session) also gives it causal calls in which every query row
sees a key: the keys' indices come from a TMA load of an index table at the key block's row coordinate (as the
forward's rows: the pass splits that load between the consumers, not a `tl.arange` over the keys), the query loop
starts at the first block that sees the key block, and the mask is applied on every step (an `if` on the step
would leave the loop unspecialized).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _configs, _launch
from ._launch import cdiv, grid_1d, pad_head_dim
from ._tma import tma_ok
from ._common import LOG2E
from ._ws import HAS_WS as _HAS_WS, _head_rows, index_table, launch_or_mark, platform_ok


@triton.jit
def _probs_t(k, q, LSE_h, rows, keys, SEQ_Q, qk_scale, causal_offset, CAUSAL: tl.constexpr):
    """P^T of the key block against one query block; LSE_h: the query head's rows of the (b, hq, sq) LSE."""
    lse = tl.load(LSE_h + rows, mask=rows < SEQ_Q, other=float("inf")) * LOG2E
    p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])
    if CAUSAL:
        p_t = tl.where(keys[:, None] <= rows[None, :] + causal_offset, p_t, 0.0)
    return p_t


@triton.jit
def _dkdv_update(dk, dv, v, q, do, p_t, DELTA_h, rows, SEQ_Q):
    """The query block's contribution to the key block's dK (unscaled) and dV."""
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    delta = tl.load(DELTA_h + rows, mask=rows < SEQ_Q, other=0.0)
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _heads_rows(T, off_b, stride_b, stride_h, stride_row, n_heads, n_rows, HEAD_DIM: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """TMA descriptor over every head of batch off_b of a (b, h, s, d) tensor, read one head's BLOCK x BLOCK_D rows
    at a time ([head, row, 0]; rows past n_rows and columns past HEAD_DIM zero-filled)."""
    return tl.make_tensor_descriptor(T + off_b * stride_b, shape=[n_heads, n_rows, HEAD_DIM],
                                     strides=[stride_h, stride_row, 1], block_shape=[1, BLOCK, BLOCK_D])


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_N_BLOCKS"])
def _bwd_dkdv_ws(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    NUM_HEADS, SEQ_Q, SEQ_K, NUM_N_BLOCKS, qk_scale, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr = True,
    BLOCK_D: tl.constexpr = 0, CAUSAL: tl.constexpr = False, KEYS=None, causal_offset=0, GROUP: tl.constexpr = 1,
):
    # A program per (batch, key / value head, key block); NUM_HEADS: the key / value heads. GROUP > 1 (GQA): the
    # group's query heads' blocks in one flattened loop (a loop over the heads around the specialized one would be a
    # second loop, which the pass does not build), Q / dO through descriptors over all the batch's heads.
    pid = tl.program_id(0)
    pid_n = pid % NUM_N_BLOCKS
    bh = pid // NUM_N_BLOCKS
    off_b = (bh // NUM_HEADS).to(tl.int64)
    off_hk = (bh % NUM_HEADS).to(tl.int64)
    WIDTH: tl.constexpr = BLOCK_D if BLOCK_D else HEAD_DIM
    num_heads_q = NUM_HEADS * GROUP
    if GROUP == 1:
        q_desc = _head_rows(Q, off_b, off_hk, stride_qb, stride_qh, stride_qm, SEQ_Q, HEAD_DIM, BLOCK_M, BLOCK_D)
        do_desc = _head_rows(DO, off_b, off_hk, stride_dob, stride_doh, stride_dom, SEQ_Q, HEAD_DIM, BLOCK_M,
                             BLOCK_D)
    else:
        q_desc = _heads_rows(Q, off_b, stride_qb, stride_qh, stride_qm, num_heads_q, SEQ_Q, HEAD_DIM, BLOCK_M, WIDTH)
        do_desc = _heads_rows(DO, off_b, stride_dob, stride_doh, stride_dom, num_heads_q, SEQ_Q, HEAD_DIM, BLOCK_M,
                              WIDTH)
    k_desc = _head_rows(K, off_b, off_hk, stride_kb, stride_kh, stride_kn, SEQ_K, HEAD_DIM, BLOCK_N, BLOCK_D)
    v_desc = _head_rows(V, off_b, off_hk, stride_vb, stride_vh, stride_vn, SEQ_K, HEAD_DIM, BLOCK_N, BLOCK_D)
    dk_desc = _head_rows(DK, off_b, off_hk, stride_dkb, stride_dkh, stride_dkn, SEQ_K, HEAD_DIM, BLOCK_N, BLOCK_D)
    dv_desc = _head_rows(DV, off_b, off_hk, stride_dvb, stride_dvh, stride_dvn, SEQ_K, HEAD_DIM, BLOCK_N, BLOCK_D)
    n0 = pid_n * BLOCK_N
    k = k_desc.load([n0, 0])
    v = v_desc.load([n0, 0])
    # BLOCK_D > HEAD_DIM (d=96 on 128-wide tiles): the padded columns load as zeros, so they add nothing to the
    # scores and stay zero in dK / dV, whose stores drop them.
    dk = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, WIDTH], dtype=tl.float32)
    offs_m = tl.arange(0, BLOCK_M)
    if CAUSAL:
        # KEYS: int32 0, 1, ... (at least SEQ_K, index_table) read at n0, K's row coordinate: each consumer its keys.
        # Query i sees key j <= i + causal_offset (>= 0: every query row sees a key); the first query block that
        # sees key n0 is the first step, and a key block no query sees runs none (dK = dV = 0).
        keys = tl.make_tensor_descriptor(KEYS, shape=[SEQ_K], strides=[1], block_shape=[BLOCK_N]).load([n0])
        m_start = tl.maximum(n0 - causal_offset, 0) // BLOCK_M * BLOCK_M
    else:
        keys = offs_m  # (unused)
        m_start = 0
    if GROUP == 1:
        bh_q = bh.to(tl.int64) * SEQ_Q
        for start_m in tl.range(m_start, SEQ_Q, BLOCK_M, warp_specialize=WARP_SPEC):
            rows = start_m + offs_m
            q = q_desc.load([start_m, 0])
            p_t = _probs_t(k, q, LSE + bh_q, rows, keys, SEQ_Q, qk_scale, causal_offset, CAUSAL)
            do = do_desc.load([start_m, 0])
            dk, dv = _dkdv_update(dk, dv, v, q, do, p_t, DELTA + bh_q, rows, SEQ_Q)
    else:
        steps = tl.maximum(SEQ_Q - m_start + BLOCK_M - 1, 0) // BLOCK_M  # query blocks per head
        for it in tl.range(0, GROUP * steps, warp_specialize=WARP_SPEC):
            g = it // steps
            start_m = m_start + (it - g * steps) * BLOCK_M
            off_h = off_hk * GROUP + g
            rows = start_m + offs_m
            bh_q = (off_b * num_heads_q + off_h) * SEQ_Q
            q = q_desc.load([off_h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, WIDTH)
            p_t = _probs_t(k, q, LSE + bh_q, rows, keys, SEQ_Q, qk_scale, causal_offset, CAUSAL)
            do = do_desc.load([off_h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, WIDTH)
            dk, dv = _dkdv_update(dk, dv, v, q, do, p_t, DELTA + bh_q, rows, SEQ_Q)
    dk_desc.store([n0, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    dv_desc.store([n0, 0], dv.to(DV.dtype.element_ty))


# (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim: FA3's d=128 backward tile (64 queries a step, 128 keys,
# 64 per consumer warpgroup); 4 warps is what the pass specializes.
# d=96 on 128-wide tiles (H100, scripts/time_bwd_ws.py --dims 96, whole backward at 2k / 4k / 8k / 16k): 278 / 298 /
# 306 / 307 TFLOP/s against the general kernel's 265 / 285 / 289 / 283 (1.00 / 1.09 / 1.03 / 1.01x SDPA-flash).
# d=64 (sm90 compile: 168 registers, no spills, 82 KB; 128-query steps fail Triton 3.6's warp-specialization pass):
# H100, scripts/time_bwd_ws.py --dims 64 --tile 64,128,4,2, WS / general at 1k / 2k / 4k / 8k / 16k: 250 / 259,
# 294 / 283, 316 / 297, 327 / 304, 333 / 307 TFLOP/s, so from 2k keys on (MIN_SEQ_K); GPU tests passed (thirty-ninth
# session, H100).
WS_TILES: dict[int, tuple[int, int, int, int]] = {128: (64, 128, 4, 2), 96: (64, 128, 4, 2), 64: (64, 128, 4, 2)}
# Timed tiles not yet through the GPU's 2x-rule tests (test_ws_dkdv_real_size enables them; a head dim moves to
# WS_TILES once they pass). None now.
CANDIDATE_TILES: dict[int, tuple[int, int, int, int]] = {}
# Fewest keys at which a head dim takes this kernel (below it the general kernel was faster).
MIN_SEQ_K: dict[int, int] = {64: 2048}
ENABLED = True
# Causal calls too (where every query row sees a key). Off: written on the CPU in the fifty-fifth session (sm90
# compile: still specialized, tests/kernels/triton/test_ws_compile.py; interpreter tests pass), not yet run on a GPU.
CAUSAL_ENABLED = False
# GQA calls too (the group's query heads in one loop). Off: written on the CPU in the fifty-fifth session, not yet
# run on a GPU (GQA calls take the general kernel's key-major programs).
GQA_ENABLED = False
INTERPRET = False  # as flash_fwd_ws.INTERPRET: tests turn it on under the interpreter
_FAILED: set = set()  # (head dim, dtype, causal, GQA) whose compile failed here: not tried again
_LOG2E = 1.4426950408889634


def dkdv_ws_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, dk: torch.Tensor,
                     dv: torch.Tensor, scale: float, causal: bool, plain: bool, causal_offset: int = 0) -> bool:
    """Whether `bwd_dkdv_ws` may compute this backward's dK / dV: plain, non-causal (with CAUSAL_ENABLED: causal
    with causal_offset >= 0, every query row seeing a key), MHA (with GQA_ENABLED: GQA too), equal head dims in
    WS_TILES with at least MIN_SEQ_K keys, fp16 / bf16, scale > 0, on sm90 (or the interpreter with INTERPRET) with
    strides TMA accepts, no tile pinned by `_configs.override`."""
    if not (ENABLED and _HAS_WS and plain and scale > 0) or _configs._override.get("bwd"):
        return False
    if causal and not (CAUSAL_ENABLED and causal_offset >= 0):
        return False
    d = q.shape[-1]
    group = q.shape[1] // k.shape[1]
    if d not in WS_TILES or v.shape[-1] != d or (group > 1 and not GQA_ENABLED) or (d, q.dtype, causal, group > 1) \
            in _FAILED:
        return False
    if k.shape[2] < MIN_SEQ_K.get(d, 0):
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or not platform_ok(q, INTERPRET) or not (
            q.dtype == k.dtype == dout.dtype == dk.dtype == dv.dtype):
        return False
    return tma_ok(q, k, v, dout, dk, dv)


def bwd_dkdv_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse: torch.Tensor,
                delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, scale: float,
                causal_offset: int | None = None) -> bool:
    """Write dk, dv for a call `dkdv_ws_eligible` accepted (lse, delta: fp32 contiguous (b, h, sq); causal_offset:
    a causal call's, None without a mask); False (nothing written) when the kernel does not compile with this
    Triton."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    block_m, block_n, num_warps, num_stages = (16, 16, 4, 1) if _launch._INTERPRET else WS_TILES[d]
    n_blocks = cdiv(sk, block_n)
    causal_kw = {} if causal_offset is None else dict(CAUSAL=True, KEYS=index_table(q.device, sk),
                                                       causal_offset=causal_offset)
    return launch_or_mark(_bwd_dkdv_ws, grid_1d(n_blocks * b * hkv), (
        q, k, v, dout, lse, delta, dk, dv,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *dout.stride()[:3], *dk.stride()[:3],
        *dv.stride()[:3], hkv, sq, sk, n_blocks, scale * _LOG2E, scale,
    ), dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
            BLOCK_D=pad_head_dim(d), GROUP=hq // hkv, **causal_kw), _FAILED,
        (d, q.dtype, causal_offset is not None, hq > hkv))
