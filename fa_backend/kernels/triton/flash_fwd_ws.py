"""Warp-specialized forward for plain non-causal calls on Hopper (Triton's automatic warp specialization).

With `tl.range(..., warp_specialize=True)`, 4 warps and TMA tiles, Triton 3.6 splits the key loop on sm90 into
a TMA producer partition and two consumer warpgroups of BLOCK_M / 2 query rows each at 232 registers
(FlashAttention-3's structure, without its ping-pong). What Triton 3.6's pass does not get right, found on an
H100 in the thirty-third session: the general forward (`flash_fwd._attn_fwd`) and any kernel with two specialized
loops fail the pass (a dominance assertion); a loop with an `if` on the tile index is left unspecialized; and a
vector built by `tl.arange` over the query rows reaches both consumer warpgroups as the first half's rows, so a
causal mask or a pointer store of the LSE puts the second half's rows wrong (the 128 x 64 tile returned NaNs
too; a dot outside the loop fails the pass, and a mask from TMA-loaded index tables is split wrong as
well: thirty-sixth session). So this kernel takes only non-causal plain calls (no mask, dropout, softcap, ALiBi or
window) at d=128 and d=96 (on 128-wide tiles), and from 4k keys d=64, GQA, any strides TMA accepts, and stores O
and the LSE by TMA (descriptor stores are split between the consumers correctly). Same contract as `_attn_fwd`: out
in q's dtype, LSE (natural log) contiguous (b, hq, sq). With PERSISTENT (on) calls with more key blocks than
stages run on `_attn_fwd_ws_persistent`, about one program per SM walking the tiles; d=64 only there.

CAUSAL_ENABLED (off: not yet run on a GPU since its fix, see below) also gives it causal calls in which every query
row sees a key: the rows' indices come from a 1-D TMA load of an index table at the tile's row coordinate (as Q's
rows and the LSE's, which the pass splits right, instead of `tl.arange`), the loop stops at the tile's last visible
key, and the mask is applied to every key block (an `if` on the block would leave the loop unspecialized).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _configs, _launch
from ..keep_bits import causal_offset
from ._common import LN2
from ._launch import cdiv, grid_1d, pad_head_dim
from ._tma import tma_ok
from ._ws import HAS_WS, _head_rows, index_table, launch_or_mark, platform_ok


@triton.jit
def _ws_loop(acc, l_i, m_i, q, k_desc, v_desc, END, SEQ_K, qk_scale, last_key, BLOCK_N: tl.constexpr,
             MASK_COLS: tl.constexpr, CAUSAL: tl.constexpr, WARP_SPEC: tl.constexpr, off_b=0, off_hk=0,
             HEADS_4D: tl.constexpr = False):
    """Fold keys [0, END) into (acc, l_i, m_i), hiding keys past SEQ_K (MASK_COLS: SEQ_K not a multiple of BLOCK_N;
    applied to every tile, since an `if` on the tile index leaves the loop unspecialized) or, CAUSAL, past each
    row's `last_key` (its last visible key, at most SEQ_K - 1: one compare for both). k_desc / v_desc: one head's
    rows, or (HEADS_4D) the whole (b, h, s, d) tensor, read at head (off_b, off_hk)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in tl.range(0, END, BLOCK_N, warp_specialize=WARP_SPEC):
        if HEADS_4D:
            k = k_desc.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, k_desc.block_shape[3])
        else:
            k = k_desc.load([start_n, 0])
        qk = tl.dot(q, tl.trans(k))
        if CAUSAL:
            qk = tl.where((start_n + offs_n)[None, :] <= last_key[:, None], qk, float("-inf"))
        elif MASK_COLS:
            qk = tl.where((start_n + offs_n)[None, :] < SEQ_K, qk, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if HEADS_4D:
            v = v_desc.load([off_b, off_hk, start_n, 0]).reshape(BLOCK_N, v_desc.block_shape[3])
        else:
            v = v_desc.load([start_n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _ws_tile(
    tile, Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_COLS: tl.constexpr,
    WARP_SPEC: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, ROWS, causal_offset,
    k_heads=None, v_heads=None, HEADS_4D: tl.constexpr = False, HEADS_FASTEST: tl.constexpr = False, NUM_BH=1,
):
    """Output tile `tile` (query block fastest, then head, then batch; HEADS_FASTEST: (batch, head) pair fastest of
    NUM_BH, query blocks last first): O's BLOCK_M rows and their LSE. K and V through per-tile descriptors, or
    (HEADS_4D) through k_heads / v_heads, `_heads_4d` descriptors of the whole tensors."""
    # qk_scale includes log2(e) and is > 0 (the host sends other scales to _attn_fwd); SEQ_K > 0, so every row
    # sees a key (causal: causal_offset >= 0, the host's condition). Query blocks of one head adjacent: their K / V
    # shared in L2; causal, the head's last (longest) query block first.
    if HEADS_FASTEST:  # (causal, persistent: the longest tiles of every head first)
        pid_m = NUM_M_BLOCKS - 1 - tile // NUM_BH
        bh = tile % NUM_BH
    else:
        pid_m = tile % NUM_M_BLOCKS
        if CAUSAL:
            pid_m = NUM_M_BLOCKS - 1 - pid_m
        bh = tile // NUM_M_BLOCKS
    off_b = (bh // NUM_HEADS_Q).to(tl.int64)
    off_h = (bh % NUM_HEADS_Q).to(tl.int64)
    off_hk = off_h // GROUP
    # Per-tile descriptors over this head's rows: rows past the sequence come zero-filled on loads and are
    # dropped on stores.
    q_desc = _head_rows(Q, off_b, off_h, stride_qb, stride_qh, stride_qm, SEQ_Q, HEAD_DIM, BLOCK_M, BLOCK_D)
    if HEADS_4D:
        k_desc, v_desc = k_heads, v_heads
    else:
        k_desc = _head_rows(K, off_b, off_hk, stride_kb, stride_kh, stride_kn, SEQ_K, HEAD_DIM, BLOCK_N, BLOCK_D)
        v_desc = _head_rows(V, off_b, off_hk, stride_vb, stride_vh, stride_vn, SEQ_K, HEAD_DIM, BLOCK_N, BLOCK_D)
    o_desc = _head_rows(O, off_b, off_h, stride_ob, stride_oh, stride_om, SEQ_Q, HEAD_DIM, BLOCK_M, BLOCK_D)
    lse_desc = tl.make_tensor_descriptor(LSE + bh.to(tl.int64) * SEQ_Q, shape=[SEQ_Q], strides=[1],
                                         block_shape=[BLOCK_M])
    m0 = pid_m * BLOCK_M
    q = q_desc.load([m0, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # BLOCK_D > HEAD_DIM (d=96 on 128-wide tiles): the padded columns load as zeros, add nothing to q.k, and
    # their O columns are dropped by the store.
    acc = tl.zeros([BLOCK_M, BLOCK_D if BLOCK_D else HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        # ROWS: int32 0, 1, ... (at least SEQ_Q of them, index_table), read by TMA so that each consumer gets its
        # own rows, at the tile's row coordinate m0 as Q's load and O's store: the pass offsets that coordinate for
        # the second consumer. (Read at a constant 0, the pass offset the constant, and with it the column
        # coordinate 0 of the O store: the second consumer stored its rows at columns 64-191, the forty-fifth
        # session's unwritten elements.)
        rows = tl.make_tensor_descriptor(ROWS, shape=[SEQ_Q], strides=[1], block_shape=[BLOCK_M]).load([m0])
        last_key = tl.minimum(rows + causal_offset, SEQ_K - 1)
        end = tl.minimum(SEQ_K, m0 + BLOCK_M + causal_offset)
    else:
        last_key = m_i  # (unused)
        end = SEQ_K
    if HEADS_4D:
        acc, l_i, m_i = _ws_loop(acc, l_i, m_i, q, k_desc, v_desc, end, SEQ_K, qk_scale, last_key, BLOCK_N,
                                 MASK_COLS, CAUSAL, WARP_SPEC, off_b.to(tl.int32), off_hk.to(tl.int32), True)
    else:
        acc, l_i, m_i = _ws_loop(acc, l_i, m_i, q, k_desc, v_desc, end, SEQ_K, qk_scale, last_key, BLOCK_N,
                                 MASK_COLS, CAUSAL, WARP_SPEC)
    lse_desc.store([m0], (m_i + tl.math.log2(l_i)) * LN2)
    o_desc.store([m0, 0], (acc / l_i[:, None]).to(O.dtype.element_ty))


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "TILE0", "NUM_BH"])
def _attn_fwd_ws(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_COLS: tl.constexpr,
    WARP_SPEC: tl.constexpr = True, BLOCK_D: tl.constexpr = 0,
    CAUSAL: tl.constexpr = False, ROWS=None, causal_offset=0,
    HEADS_FASTEST: tl.constexpr = False, TILE0=0, NUM_BH=1,
):
    # one program per output tile (tiles TILE0, TILE0 + 1, ...: the short causal tiles the persistent kernel leaves)
    _ws_tile(TILE0 + tl.program_id(0), Q, K, V, O, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
             stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, NUM_HEADS_Q, GROUP, SEQ_Q,
             SEQ_K, NUM_M_BLOCKS, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, MASK_COLS, WARP_SPEC, BLOCK_D, CAUSAL, ROWS,
             causal_offset, HEADS_FASTEST=HEADS_FASTEST, NUM_BH=NUM_BH)


@triton.jit
def _heads_4d(T, n_b, n_h, n_rows, stride_b, stride_h, stride_row, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """TMA descriptor over a whole (b, h, s, d) tensor with a unit last stride, read and written one head's
    BLOCK x BLOCK_D rows at a time: as `_head_rows`, rows past n_rows and columns past HEAD_DIM zero-filled on
    loads and dropped on stores."""
    return tl.make_tensor_descriptor(T, shape=[n_b, n_h, n_rows, HEAD_DIM], strides=[stride_b, stride_h, stride_row, 1],
                                     block_shape=[1, 1, BLOCK, BLOCK_D])


@triton.jit(do_not_specialize=["BATCH", "SEQ_Q", "SEQ_K", "NUM_M_BLOCKS", "NUM_TILES"])
def _attn_fwd_ws_persistent(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    BATCH, NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K, NUM_M_BLOCKS, NUM_TILES, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK_COLS: tl.constexpr,
    BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr = False, ROWS=None, causal_offset=0,
):
    # The same tiles and contract as `_attn_fwd_ws`; causal (CAUSAL_PERSISTENT), the tiles in `_ws_tile`'s
    # HEADS_FASTEST order, longest first, only the NUM_TILES that have more key blocks than stages (see below).
    # Program p takes tiles p, p + P, p + 2P, ... (P programs, about one per SM), so the tiles running at one time
    # stay adjacent (non-causal: K / V shared in L2; causal: tiles of equal length together). The tile
    # loop is the specialized one: the producer partition walks the tiles too, so it can load the next tile's Q, K
    # and V while the consumers finish this tile's last block and store it.
    # K and V are read through descriptors built once, over the whole tensors (4-D, one head's rows per box): a
    # per-tile descriptor would be rewritten in the producer's loop while the tile's last loads may still be in
    # flight (sm90 PTX: each partition rewrites its own descriptor slots, with nothing ordering the rewrite after
    # those loads). Q keeps a per-tile descriptor (Triton 3.8's pass splits a 4-D Q load between the consumers but
    # not its box): its load has landed before the tile's third key block is loaded, since that load waits for the
    # consumers to release the first block's stage (2 stages), so the host sends only calls with more key blocks than
    # that. O and the LSE keep per-tile descriptors too (the pass cannot split a 4-D store between the consumers:
    # "unsupported op type"); each consumer waits for a store's shared-memory reads (cp.async.bulk.wait_group.read 0)
    # before it rewrites them.
    k_desc = _heads_4d(K, BATCH, NUM_HEADS_Q // GROUP, SEQ_K, stride_kb, stride_kh, stride_kn, HEAD_DIM, BLOCK_N,
                       BLOCK_D)
    v_desc = _heads_4d(V, BATCH, NUM_HEADS_Q // GROUP, SEQ_K, stride_vb, stride_vh, stride_vn, HEAD_DIM, BLOCK_N,
                       BLOCK_D)
    for tile in tl.range(tl.program_id(0), NUM_TILES, tl.num_programs(0), warp_specialize=True):
        _ws_tile(tile, Q, K, V, O, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                 stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, NUM_HEADS_Q, GROUP, SEQ_Q, SEQ_K,
                 NUM_M_BLOCKS, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, MASK_COLS, False, BLOCK_D, CAUSAL, ROWS,
                 causal_offset, k_desc, v_desc, True, CAUSAL, BATCH * NUM_HEADS_Q)


# Tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) per head dim. 4 warps is what the pass specializes (the
# default partition becomes the producer, two 4-warp consumer partitions are added: 12 warps in all); 8
# leave the loop unspecialized. 128-key tiles: with 64 the specialized loop returned NaNs on an H100, and at
# d=64 three stages did too. d=96 runs 128-wide tiles (BLOCK_D; the general kernel pads it too).
WS_TILES: dict[int, tuple[int, int, int, int]] = {128: (128, 128, 4, 2), 96: (128, 128, 4, 2), 64: (128, 128, 4, 2)}
# Head dims that take this kernel only on its persistent form (non-causal, PERSISTENT on): at d=64 a program per
# tile is slower than `_attn_fwd` below 8k keys and within noise of it above (scripts/time_fwd_ws.py, H100, two runs
# in the thirty-third session, again in the fifty-fourth), the persistent kernel faster from 4k (below).
PERSISTENT_ONLY = frozenset({64})
# Shortest key length per head dim from which this kernel beat `_attn_fwd` (H100, bf16, non-causal): d=128 / 96
# 1.04x at 512 keys, 1.10-1.16x from 1k to 16k (per-tile kernel); d=64 on the persistent kernel, three runs of
# scripts/time_fwd_ws.py in the fifty-fourth session: 0.86 / 0.89-0.91 / 0.97-0.98x at 512 / 1k / 2k keys,
# 1.00-1.05 / 1.01-1.05x at 4k / 8k, 1.05-1.06x at 16k (two runs).
MIN_SEQ_K: dict[int, int] = {128: 512, 96: 512, 64: 4096}

# Off: every forward takes `_attn_fwd`. Tests and scripts switch it to compare both.
ENABLED = True
# Non-causal calls on `_attn_fwd_ws_persistent` (about one program per SM walking the tiles) instead of a program per
# tile. Written on the CPU in the fifty-third session for the short-sequence cells (a program of a 512-key call runs
# 4 key blocks, so its Q load, pipeline fill and O store are a large part of it, and nothing overlaps them with one
# program per SM); sm90 compile with Triton 3.6 and 3.8: 12 warps, setmaxnreg, 230 KB of shared memory
# (tests/kernels/triton/test_ws_compile.py). On an H100 (fifty-fourth session, `bash scripts/gpu_check.sh ws_persist`:
# its GPU tests passed, then scripts/time_fwd_ws.py --persistent, twice), TFLOP/s per-tile / persistent at d=128:
# 311 / 401-404 (512 keys), 417-419 / 479-489 (1k), 485-492 / 512-520 (2k), 521-532 / 534-540 (4k), within 1 % at
# 8k, 0.5 and 2.5 % slower at 16k (563 / 560, 559 / 545); cuDNN 494-611.
PERSISTENT = True
# Programs of the persistent kernel under the interpreter: fewer than the tiles of the tests' shapes, so that a
# program walks several tiles there.
INTERPRET_PROGRAMS = 3
# Causal calls too (where every query row sees a key: top-left, or bottom-right with sk >= sq). Off: not yet run on a
# GPU since the fix below. Written on the CPU in the forty-fourth session, after the thirty-sixth's two causal
# attempts (docs/perf-log.md) failed on the pass's row split; sm90 compile: the loop still specialized (12 warps,
# setmaxnreg, 197 KB of shared memory; tests/kernels/triton/test_ws_compile.py); its interpreter tests pass. On an
# H100 (forty-fifth session, `bash scripts/gpu_check.sh ws_causal`) every causal real-size GPU test failed with
# elements never written (timing then: at most 1.08x the general kernel). Cause, found in the fifty-fifth session in
# the pass's IR (MLIR_ENABLE_DUMP): the row table was read at the constant coordinate 0, the pass offset that
# constant by 64 for the second consumer, and the same constant was the column coordinate of its O store, which
# then wrote its rows at columns 64-191. The table is now read at the tile's row coordinate; the compile test
# checks every 2-D store's column coordinate.
CAUSAL_ENABLED = False
# With CAUSAL_ENABLED, causal calls on the persistent kernel (fifty-fifth session, CPU only: interpreter tests; off
# until it has run on a GPU): the tiles in one longest-first order over all heads, those that see at most as many
# key blocks as stages (the first query blocks of each head) left to a per-tile launch after it. A head dim in
# PERSISTENT_ONLY takes causal calls only this way (its short tiles a program each too).
CAUSAL_PERSISTENT = False
# Whether the interpreter (TRITON_INTERPRET=1, CPU tests) may take this kernel (off: the CPU suite keeps
# exercising `_attn_fwd` on plain calls); the interpreter ignores the specialization and runs the same math,
# so tests that turn it on check this kernel's bounds. MIN_SEQ_K does not apply there.
INTERPRET = False
_LOG2E = 1.4426950408889634
_HAS_WS = HAS_WS
# (head dim, dtype, causal, "persistent" or "persistent_causal") whose compile failed here: not tried again
_FAILED: set = set()


def ws_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float, causal: bool,
                plain: bool, bottom_right: bool = False) -> bool:
    """Whether `flash_fwd_ws` may run this call: plain (no mask, dropout, softcap, ALiBi, window) and not
    causal (with CAUSAL_ENABLED: causal where every query row sees a key), scale > 0, equal head dims in WS_TILES
    (those in PERSISTENT_ONLY on the persistent kernel only, causal with CAUSAL_PERSISTENT), at least the head dim's
    MIN_SEQ_K keys, fp16 / bf16 (out too), a query length that is a multiple of 4 (the LSE rows' TMA alignment), on
    sm90 (or the interpreter) with strides TMA accepts; and no forward tile pinned by `_configs.override`."""
    if not (ENABLED and _HAS_WS and plain and scale > 0 and (CAUSAL_ENABLED or not causal)) or \
            _configs._override.get("fwd"):
        return False  # (a forward tile pinned by _configs.override: tuning and tests of `_attn_fwd`)
    d, sq, sk = q.shape[-1], q.shape[2], k.shape[2]
    if causal and causal_offset(sq, sk, True, bottom_right) < 0:  # rows that see no key: the general kernel's zeros
        return False
    if d not in WS_TILES or v.shape[-1] != d or q.dtype not in (torch.float16, torch.bfloat16) or sq % 4 or not sk:
        return False
    if out.dtype != q.dtype:  # (flash_bwd's fp32 recomputation of O for small calls: the general kernel)
        return False
    if ((sk < MIN_SEQ_K.get(d, 0) and not _launch._INTERPRET) or (d, q.dtype, causal) in _FAILED
            or not platform_ok(q, INTERPRET)):
        return False  # (the cheap checks first: this runs on every plain forward, small ones included)
    if d in PERSISTENT_ONLY and not (_persistent(d, q.dtype, sk, causal) or _persistent_causal(d, q.dtype, causal)):
        return False
    return tma_ok(q, k, v, out)


def _tile(d: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a head dim's calls (a small tile under the interpreter)."""
    return (16, 16, 4, 1) if _launch._INTERPRET else WS_TILES[d]


def _persistent(d: int, dtype: torch.dtype, sk: int, causal: bool) -> bool:
    """Whether a call takes `_attn_fwd_ws_persistent`: non-causal, with PERSISTENT on, more key blocks than K / V
    stages (the kernel's per-tile Q descriptor relies on it, see there), and no failed compile of it here."""
    _, block_n, _, num_stages = _tile(d)
    return PERSISTENT and not causal and cdiv(sk, block_n) > num_stages and (d, dtype, "persistent") not in _FAILED


def _persistent_causal(d: int, dtype: torch.dtype, causal: bool) -> bool:
    """Whether a causal call's long tiles take `_attn_fwd_ws_persistent` (PERSISTENT and CAUSAL_PERSISTENT on, no
    failed compile of its causal form here); its short tiles take `_attn_fwd_ws`, at every head dim."""
    return causal and PERSISTENT and CAUSAL_PERSISTENT and (d, dtype, "persistent_causal") not in _FAILED


def _heads_strides(strides: tuple, b: int, hq: int, hkv: int, element_size: int) -> tuple:
    """The launch's strides with a 0 stride of a size-1 batch / head dim (which tma_ok passes; any value reads the
    same there) set to 16 bytes, a stride every TMA descriptor accepts."""
    unit = 16 // element_size
    sizes = (b, hq, None, b, hkv, None, b, hkv, None, b, hq, None)
    return tuple(unit if n == 1 and st == 0 else st for st, n in zip(strides, sizes))


def flash_fwd_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out: torch.Tensor,
                 lse: torch.Tensor, causal: bool = False, bottom_right: bool = False) -> bool:
    """Fill out (b, hq, sq, d) and lse (b, hq, sq, contiguous) as `flash_fwd` would, for a call `ws_eligible`
    accepted; False (nothing written) when the kernel does not compile with this Triton or lse is not a
    16-byte-aligned contiguous buffer."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if not lse.is_contiguous() or lse.data_ptr() % 16:  # a caller's LSE buffer that TMA cannot write by rows
        return False
    block_m, block_n, num_warps, num_stages = _tile(d)
    num_m_blocks = cdiv(sq, block_m)
    kwargs = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, MASK_COLS=sk % block_n != 0, num_warps=num_warps,
                  num_stages=num_stages, BLOCK_D=pad_head_dim(d))
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2))
    if _persistent(d, q.dtype, sk, causal):
        if _launch_persistent(q, k, v, out, lse, strides, num_m_blocks, num_m_blocks * b * hq, scale, kwargs,
                              "persistent"):
            return True
        if d in PERSISTENT_ONLY:  # (its compile failed: the general kernel)
            return False
    # (else a program per tile)
    args = (q, k, v, out, lse, *strides, hq, hq // hkv, sq, sk, num_m_blocks, scale * _LOG2E)
    if causal:
        offset = causal_offset(sq, sk, True, bottom_right)
        kwargs.update(CAUSAL=True, ROWS=index_table(q.device, sq), causal_offset=offset)
        if _persistent_causal(d, q.dtype, causal):
            # the tiles that see more key blocks than stages (the per-tile Q descriptor's condition, see the
            # kernel) on the persistent kernel, longest first across all heads; then the `short` first query blocks
            # of every head, a program per tile in the same order
            short = _short_blocks(sk, offset, block_m, block_n, num_stages, num_m_blocks)
            nbh = b * hq
            long_tiles = (num_m_blocks - short) * nbh
            if not long_tiles or _launch_persistent(q, k, v, out, lse, strides, num_m_blocks, long_tiles, scale,
                                                    kwargs, "persistent_causal"):
                return not short or launch_or_mark(_attn_fwd_ws, grid_1d(short * nbh), args, dict(
                    kwargs, HEADS_FASTEST=True, TILE0=long_tiles, NUM_BH=nbh), _FAILED, (d, q.dtype, causal))
            if d in PERSISTENT_ONLY:  # (its compile failed: the general kernel)
                return False
            # (its compile failed: every tile a program)
    return launch_or_mark(_attn_fwd_ws, grid_1d(num_m_blocks * b * hq), args, kwargs, _FAILED, (d, q.dtype, causal))


def _launch_persistent(q, k, v, out, lse, strides: tuple, num_m_blocks: int, tiles: int, scale: float, kwargs: dict,
                       form: str) -> bool:
    """`_attn_fwd_ws_persistent` over the first `tiles` tiles, about one program per SM; False (marked in _FAILED
    under `form`) when it does not build."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    programs = min(tiles, INTERPRET_PROGRAMS if _launch._INTERPRET else _launch.sm_count(q.device))
    return launch_or_mark(_attn_fwd_ws_persistent, grid_1d(programs), (
        q, k, v, out, lse, *_heads_strides(strides, b, hq, hkv, q.element_size()), b, hq, hq // hkv, sq, sk,
        num_m_blocks, tiles, scale * _LOG2E,
    ), kwargs, _FAILED, (d, q.dtype, form))


def _short_blocks(sk: int, offset: int, block_m: int, block_n: int, stages: int, num_m_blocks: int) -> int:
    """How many query blocks, from the first, see at most `stages` key blocks under a causal mask (query block i
    sees keys [0, min(sk, (i + 1) * block_m + offset)))."""
    if cdiv(sk, block_n) <= stages:
        return num_m_blocks
    return min(num_m_blocks, max(0, (stages * block_n - offset) // block_m))
