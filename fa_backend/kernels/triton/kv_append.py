"""New keys and values written into a KV cache (in place), keys rotated on the way (fused rotary).

One launch appends both: new key i of batch b is rotated at position cache_seqlens[b] + i and written
at cache row cache_seqlens[b] + i, new value i is copied to the same row. The destination is a
contiguous-by-batch cache (optionally indexed through cache_batch_idx) or a paged cache (num_pages,
page_size, h, d) addressed through block_table. Rotary is computed in fp32 and rounded once; both
GPT-J (interleaved pairs) and GPT-NeoX (half-split) styles are supported, with a rotary dim that may be
smaller than the head dim (the remaining columns are copied). `_rotate` is shared with the decode
kernel, which rotates the queries the same way while loading them.

The lengths and indices are on the device (the host cannot check them without a sync). A batch entry whose offset
is negative or leaves no room for its new rows (offset + seqlen_new > the rows a cache entry or a block-table row
holds), or whose cache_batch_idx is outside the cache's batch, writes nothing; a row whose page index lies outside
the cache's pages is not written. The decode kernel outputs NaN for such entries (decode.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._common import _bool_block
from ._launch import grid_1d, pad_head_dim


@triton.jit
def _rotate(x, rows, row_ok, offs_d, pos, COS, SIN, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """x (R, BLOCK_D), loaded from row pointers `rows` (unit column stride), rotated at positions pos (R,)
    over its first ROTARY_DIM columns in fp32 and returned in x's dtype. cos/sin: contiguous
    (seqlen_ro, ROTARY_DIM / 2)."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    if INTERLEAVED:  # pairs (2t, 2t + 1)
        partner = offs_d ^ 1
        t = offs_d // 2
        sign = tl.where((offs_d % 2) == 0, -1.0, 1.0)
    else:  # pairs (t, t + rotary_dim / 2)
        first = offs_d < HALF
        partner = tl.where(first, offs_d + HALF, offs_d - HALF)
        t = tl.where(first, offs_d, offs_d - HALF)
        sign = tl.where(first, -1.0, 1.0)
    in_rot = offs_d < ROTARY_DIM
    rot_mask = row_ok[:, None] & in_rot[None, :]
    x2 = tl.load(rows[:, None] + partner[None, :], mask=rot_mask, other=0.0).to(tl.float32)
    cs = pos.to(tl.int64)[:, None] * HALF + t[None, :]
    cos = tl.load(COS + cs, mask=rot_mask, other=1.0)
    sin = tl.load(SIN + cs, mask=rot_mask, other=0.0)
    xf = x.to(tl.float32)
    rotated = xf * cos.to(tl.float32) + sign[None, :] * x2 * sin.to(tl.float32)
    return tl.where(in_rot[None, :], rotated, xf).to(x.dtype)


@triton.jit(do_not_specialize=["SEQ", "SEQ_BASE", "CAPACITY", "NUM_CACHE"])
def _append_kv(
    K, V, K_CACHE, V_CACHE, SEQ_OFF, BATCH_IDX, BLOCK_TABLE, COS, SIN,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_bt,
    SEQ, SEQ_BASE, CAPACITY, NUM_CACHE,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    # Program = (batch, block of BLOCK_S rows, head); heads innermost so one batch's rows are adjacent.
    # SEQ_OFF (b,) int32 or None (then every offset is SEQ_BASE); BATCH_IDX, BLOCK_TABLE, COS/SIN may be
    # None. The last dim of every tensor is contiguous. CAPACITY: rows per cache entry (paged: block-table columns
    # x PAGE_SIZE); NUM_CACHE: the caches' dim 0 (batch entries or pages).
    pid = tl.program_id(0)
    off_h = pid % NUM_HEADS
    rest = pid // NUM_HEADS
    num_s_blocks = tl.cdiv(SEQ, BLOCK_S)
    sb = rest % num_s_blocks
    off_b = rest // num_s_blocks
    offs_s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    seq_off = SEQ_BASE
    if SEQ_OFF is not None:
        seq_off += tl.load(SEQ_OFF + off_b)
    dst_row = seq_off + offs_s
    # rows of an entry without room (or with a negative offset) are not written (module docstring)
    row_ok = (offs_s < SEQ) & _bool_block((seq_off >= 0) & (seq_off + SEQ <= CAPACITY), BLOCK_S)
    if PAGE_SIZE > 0:  # paged cache: (num_pages, page_size, h, d)
        page = tl.load(BLOCK_TABLE + off_b.to(tl.int64) * stride_bt + dst_row // PAGE_SIZE, mask=row_ok, other=0)
        page = page.to(tl.int64)
        row_ok = row_ok & (page >= 0) & (page < NUM_CACHE)
        in_page = (dst_row % PAGE_SIZE).to(tl.int64)
        kc_rows = K_CACHE + page * stride_kcb + in_page * stride_kcs
        vc_rows = V_CACHE + page * stride_vcb + in_page * stride_vcs
    else:
        dst_b = off_b.to(tl.int64)
        if BATCH_IDX is not None:
            dst_b = tl.load(BATCH_IDX + off_b).to(tl.int64)
            row_ok = row_ok & _bool_block((dst_b >= 0) & (dst_b < NUM_CACHE), BLOCK_S)
        kc_rows = K_CACHE + dst_b * stride_kcb + dst_row.to(tl.int64) * stride_kcs
        vc_rows = V_CACHE + dst_b * stride_vcb + dst_row.to(tl.int64) * stride_vcs
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)

    k_rows = K + off_b.to(tl.int64) * stride_kb + off_h * stride_kh + offs_s.to(tl.int64) * stride_ks
    k = tl.load(k_rows[:, None] + offs_d[None, :], mask=io_mask, other=0.0)
    if ROTARY_DIM > 0:
        k = _rotate(k, k_rows, row_ok, offs_d, dst_row, COS, SIN, ROTARY_DIM, INTERLEAVED)
    v_rows = V + off_b.to(tl.int64) * stride_vb + off_h * stride_vh + offs_s.to(tl.int64) * stride_vs
    v = tl.load(v_rows[:, None] + offs_d[None, :], mask=io_mask, other=0.0)

    tl.store(kc_rows[:, None] + off_h * stride_kch + offs_d[None, :], k.to(K_CACHE.dtype.element_ty), mask=io_mask)
    tl.store(vc_rows[:, None] + off_h * stride_vch + offs_d[None, :], v.to(V_CACHE.dtype.element_ty), mask=io_mask)


def append_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_off: torch.Tensor | int,
    *, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, interleaved: bool = True,
    batch_idx: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
) -> None:
    """k_cache[dst(b, i)] = rotary(k[b, i], position seq_off[b] + i), v_cache[dst(b, i)] = v[b, i] for
    k, v (b, s, h, d); one launch.

    dst(b, i) is row seq_off[b] + i of cache batch batch_idx[b] (or b), or of the page
    block_table[b, row // page_size] when block_table is given (caches (pages, page_size, h, d)).
    seq_off: (b,) int32 or one int for every batch entry. cos/sin: contiguous (seqlen_ro, rotary_dim / 2);
    None copies without rotation. Inputs are validated by callers (unit last-dim strides).
    """
    b, s, h, d = k.shape
    if k.numel() == 0:
        return
    block_s = 16
    seq_t, seq_base = (None, int(seq_off)) if isinstance(seq_off, int) else (seq_off, 0)
    kb, ks, kh, _ = k.stride()
    vb, vs, vh, _ = v.stride()
    kcb, kcs, kch, _ = k_cache.stride()
    vcb, vcs, vch, _ = v_cache.stride()
    _launch.launch(_append_kv, grid_1d(b * -(-s // block_s) * h), (
        k, v, k_cache, v_cache, seq_t, batch_idx, block_table, cos, sin,
        kb, ks, kh, vb, vs, vh, kcb, kcs, kch, vcb, vcs, vch, 0 if block_table is None else block_table.stride(0),
        s, seq_base, k_cache.shape[1] * (1 if block_table is None else block_table.shape[1]), k_cache.shape[0],
    ), {"NUM_HEADS": h, "HEAD_DIM": d, "BLOCK_D": pad_head_dim(d), "BLOCK_S": block_s,
        "ROTARY_DIM": 0 if cos is None else 2 * cos.shape[1], "INTERLEAVED": interleaved,
        "PAGE_SIZE": 0 if block_table is None else k_cache.shape[1], "num_warps": 4})
