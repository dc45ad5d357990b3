"""Forward for head dims 129-192 on two column tiles (128 + 64) instead of one 256-wide tile, and 65-96 on 64 + 32
instead of 128.

Triton tiles are powers of two, so the general kernel (`flash_fwd._attn_fwd`) runs d=192 on 256-wide tiles and
spends a quarter of its tensor-core work and of its Q / K / V traffic on zero columns. Here Q, K and V are read by
TMA (host-side descriptors, `_tma.head_tiles`) as a 128-column and a 64-column tile (columns past the head dim come
zero-filled), S = Q K^T is the sum of two
dots and O is kept in two accumulators. Plain calls only (causal or not, GQA; no mask, dropout, softcap, ALiBi or
window), fp16 / bf16, a positive scale, strides TMA accepts; the rest go to `_attn_fwd`. Same contract as
`_attn_fwd`: out (b, hq, sq, dv) in its own dtype, LSE (natural log) contiguous (b, hq, sq); a row that sees no
key outputs 0 with LSE -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _configs, _launch
from ._features import _LOG2E
from ._common import LN2, _band_keep, _grid_order, _kv_bounds
from ._launch import cdiv, grid_1d
from ._tma import head_tiles, tma_ok

# Head-dim classes a split launch takes, keyed on the class's widest head dim: (first, second column tile). 129-192:
# 128 + 64 (the general kernel pads them to 256); 65-96: 64 + 32 (padded to 128 by the general and warp-specialized
# kernels; the default since the forty-first session, see MIN_SEQ_K).
SPLITS: dict[int, tuple[int, int]] = {192: (128, 64), 96: (64, 32)}
# Per class, the fewest keys (non-causal, causal) a call needs to take the split; shorter ones keep the other
# kernels. H100, forty-first session, d=96 (scripts/time_fwd_split.py, 128 x 64 x 8 x 3, TFLOP/s at 1k / 2k / 4k /
# 16k): non-causal 336 / 401 / 433 / 465 against the warp-specialized kernel's 321 / 373 / 397 / 415; causal
# 219 / 303 / 367 / 431 against the general kernel's 230 / 272 / 309 / 375 (shorter than 1k: not timed). Since the
# forty-eighth session's host descriptors the split runs causal 1k at 297-300 (H100; docs/perf-log.md), so causal
# calls take it from 1k keys too.
MIN_SEQ_K: dict[int, tuple[int, int]] = {96: (1024, 1024)}


def split_widths(d: int, dv: int, splits: dict[int, tuple[int, int]]) -> tuple[int, int, int] | None:
    """(class, first tile width, second tile width) of head dims d and dv in `splits`: both wider than the first tile
    and at most the class's widest; None otherwise."""
    for top, (width_a, width_b) in splits.items():
        if width_a < d <= top and width_a < dv <= top:
            return top, width_a, width_b
    return None


@triton.jit
def _split_loop(acc_a, acc_b, l_i, m_i, q_a, q_b, KA, KB, VA, VB, off_b, off_hk, start, end, offs_m, SEQ_K,
                causal_offset, qk_scale, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold keys [start, end) into (acc_a, acc_b, l_i, m_i); MASKED hides keys past SEQ_K and, CAUSAL, right of
    each row's diagonal."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        k_a = KA.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, D_A)
        k_b = KB.load([off_b, off_hk, start_n, D_A]).reshape(BLOCK_N, D_B)
        qk = tl.dot(q_b, tl.trans(k_b), tl.dot(q_a, tl.trans(k_a)))
        if MASKED:
            keep = _band_keep(offs_m[:, None], (start_n + offs_n)[None, :], SEQ_K, causal_offset, 0, CAUSAL, False)
            s = tl.where(keep, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # no visible key so far: avoid inf - inf
            p = tl.math.exp2(s - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0: max(s * c) = max(s) * c
            p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_a = VA.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, D_A)
        v_b = VB.load([off_b, off_hk, start_n, D_A]).reshape(BLOCK_N, D_B)
        p = p.to(v_a.dtype)
        acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
        acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
        m_i = m_ij
    return acc_a, acc_b, l_i, m_i


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "causal_offset"])
def _attn_fwd_split(
    QA, QB, KA, KB, VA, VB, OA, OB, LSE,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, causal_offset, qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_A: tl.constexpr, D_B: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_MAJOR: tl.constexpr = False,
):
    # Q, K, V and O by host descriptors (_tma.head_tiles), one per column tile: the first tile's columns at 0, the
    # second's at D_A; rows past the sequence and columns past the head dim come zero-filled (they add nothing to
    # q.k or to O) and are dropped on the store.
    bh, pid_m = _grid_order(tl.program_id(0), NUM_M_BLOCKS, BLOCK_MAJOR)
    if CAUSAL:
        pid_m = NUM_M_BLOCKS - 1 - pid_m  # longest rows first: a better tail
    off_b = bh // NUM_HEADS_Q
    off_h = bh % NUM_HEADS_Q
    off_hk = off_h // GROUP
    m0 = pid_m * BLOCK_M
    q_a = QA.load([off_b, off_h, m0, 0]).reshape(BLOCK_M, D_A)
    q_b = QB.load([off_b, off_h, m0, D_A]).reshape(BLOCK_M, D_B)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_M, D_A], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_M, D_B], dtype=tl.float32)
    n_full, hi = _kv_bounds(m0, SEQ_K, causal_offset, BLOCK_M, BLOCK_N, CAUSAL)
    acc_a, acc_b, l_i, m_i = _split_loop(acc_a, acc_b, l_i, m_i, q_a, q_b, KA, KB, VA, VB, off_b, off_hk, 0, n_full,
                                         offs_m, SEQ_K, causal_offset, qk_scale, BLOCK_N, D_A, D_B, False, CAUSAL)
    acc_a, acc_b, l_i, m_i = _split_loop(acc_a, acc_b, l_i, m_i, q_a, q_b, KA, KB, VA, VB, off_b, off_hk, n_full, hi,
                                         offs_m, SEQ_K, causal_offset, qk_scale, BLOCK_N, D_A, D_B, True, CAUSAL)
    # Rows that saw no key (l = 0: causal with more queries than keys, bottom-right) output 0 with LSE = -inf.
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(LSE + bh.to(tl.int64) * SEQ_Q + offs_m, lse, mask=offs_m < SEQ_Q)
    OA.store([off_b, off_h, m0, 0], (acc_a * inv_l[:, None]).to(OA.dtype).reshape(1, 1, BLOCK_M, D_A))
    OB.store([off_b, off_h, m0, D_A], (acc_b * inv_l[:, None]).to(OB.dtype).reshape(1, 1, BLOCK_M, D_B))


# (BLOCK_M, BLOCK_N, num_warps, num_stages). H100, d=192, scripts/time_fwd_split.py (TFLOP/s at 2k / 8k, non-causal;
# causal): 128 x 64 x 8 warps x 3 stages 408 / 480; 303 / 435 against two stages 341 / 398; 262 / 368, 128 x 32 x 3
# 328 / 384; 250 / 340, 64 x 64 x 4 x 2 270 / 311; 197 / 279 (general kernel 315 / 343; 256 / 325). 198 KB of shared
# memory, 179 registers, no spills (sm90 compile check). d=96 (forty-first session; 2k non-causal / causal): 128 x 64
# x 8 x 3 401-411 / 303, x 4 warps 376 / 303, 64 x 64 x 4 x 3 306 / 232, 128 x 128 x 8 x 2 274 / 201, x 3 stages
# 298 / 220; 123 registers, 99 KB, no spills.
TILES: dict[int, tuple[int, int, int, int]] = {192: (128, 64, 8, 3), 96: (128, 64, 8, 3)}
_INTERPRETER_TILE: tuple[int, int, int, int] | None = (16, 16, 4, 1)  # None: TILES' (a test's choice)

# Off: every call takes `_attn_fwd` (d = 129-192 on 256-wide tiles, 65-96 on 128-wide ones or the warp-specialized
# kernel). Tests and scripts switch it to compare both.
ENABLED = True
# The split classes (SPLITS' keys) whose causal launches run in block-major order (`_common._grid_order`, the longest
# query blocks of all heads first); scripts/time_fwd_split.py --block-major times both orders. H100, d=192 TFLOP/s
# head-major / block-major: fortieth session 305 / 309 at 2k, 436 / 444 at 8k; forty-first 304 / 310 at 2k, 379 / 388
# at 4k, 435 / 435 at 8k. d=96 (forty-first): 219 / 193 at 1k, 303 / 274-279 at 2k, 367 / 356 at 4k, 431 / 434 at 16k.
CAUSAL_BLOCK_MAJOR: frozenset = frozenset({192})


def split_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float,
                   plain: bool, causal: bool) -> bool:
    """Whether `flash_fwd_split` may run this call: plain (no mask, dropout, softcap, ALiBi, window; causal
    either way), scale > 0, both head dims in one class of SPLITS (129-192, 65-96) with at least the class's
    MIN_SEQ_K keys, fp16 / bf16 inputs and output of the same dtype, strides TMA accepts (sm90 or the interpreter),
    and no forward tile pinned by `_configs.override`."""
    if not (ENABLED and plain and scale > 0) or _configs._override.get("fwd"):
        return False
    widths = split_widths(q.shape[-1], v.shape[-1], SPLITS)
    if widths is None or k.shape[2] < MIN_SEQ_K.get(widths[0], (0, 0))[causal]:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or out.dtype != q.dtype or not k.shape[2]:
        return False
    return tma_ok(q, k, v, out)


def flash_fwd_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None,
                    out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fill out (b, hq, sq, dv) and lse (b, hq, sq, contiguous) as `flash_fwd` would, for a call `split_eligible`
    accepted; causal_offset None without a causal mask, else key j is visible to query i iff j <= i +
    causal_offset."""
    b, hq, sq, d = q.shape
    hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
    top, width_a, width_b = split_widths(d, dv, SPLITS)
    tile = _INTERPRETER_TILE if _launch._INTERPRET and _INTERPRETER_TILE else TILES[top]
    block_m, block_n, num_warps, num_stages = tile
    num_m_blocks = cdiv(sq, block_m)
    if not num_m_blocks * b * hq:
        return  # (a descriptor needs non-empty dims)
    _launch.launch(_attn_fwd_split, grid_1d(num_m_blocks * b * hq), (
        head_tiles(q, block_m, width_a), head_tiles(q, block_m, width_b), head_tiles(k, block_n, width_a),
        head_tiles(k, block_n, width_b), head_tiles(v, block_n, width_a), head_tiles(v, block_n, width_b),
        head_tiles(out, block_m, width_a), head_tiles(out, block_m, width_b), lse,
        hq, hq // hkv, sq, sk, num_m_blocks, causal_offset or 0, scale * _LOG2E,
    ), dict(BLOCK_M=block_m, BLOCK_N=block_n, D_A=width_a, D_B=width_b,
            CAUSAL=causal_offset is not None, num_warps=num_warps, num_stages=num_stages,
            **({"BLOCK_MAJOR": True} if causal_offset is not None and top in CAUSAL_BLOCK_MAJOR else {})))
