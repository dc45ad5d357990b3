"""Rows copied into a KV cache (in place) with an optional fused rotary embedding.

One kernel serves three uses of FlashAttention's KV-cache step:
  * new keys: rotated at positions cache_seqlens[b] + i and written at cache row cache_seqlens[b] + i;
  * new values: the same rows, no rotation;
  * the queries: rotated at positions cache_seqlens[b] + i (or cache_seqlens[b] for every row) into a
    fresh (b, s, h, d) tensor.
The destination is a contiguous-by-batch cache (optionally indexed through cache_batch_idx) or a
paged cache (num_pages, page_size, h, d) addressed through block_table. Rotary is computed in fp32
and rounded once; both GPT-J (interleaved pairs) and GPT-NeoX (half-split) styles are supported,
with a rotary dim that may be smaller than the head dim (the remaining columns are copied).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import grid_1d, pad_head_dim


@triton.jit(do_not_specialize=["SEQ", "NUM_S_BLOCKS"])
def _rotary_copy(
    X, Y, SEQ_OFF, BATCH_IDX, BLOCK_TABLE, COS, SIN,
    stride_xb, stride_xs, stride_xh, stride_xd,
    stride_yb, stride_ys, stride_yh, stride_yd,
    stride_bt, stride_cos, stride_sin,
    NUM_HEADS, SEQ, NUM_S_BLOCKS,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, POS_STEP: tl.constexpr,
    DST_AT_SEQLEN: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, PAGE_SIZE: tl.constexpr,
):
    # Program = (batch, head, block of BLOCK_S rows); heads innermost so one batch's rows are adjacent.
    pid = tl.program_id(0)
    off_h = pid % NUM_HEADS
    rest = pid // NUM_HEADS
    sb = rest % NUM_S_BLOCKS
    off_b = rest // NUM_S_BLOCKS
    offs_s = sb * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_s < SEQ
    io_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)

    x_rows = X + off_b.to(tl.int64) * stride_xb + off_h * stride_xh + offs_s[:, None].to(tl.int64) * stride_xs
    x = tl.load(x_rows + offs_d[None, :] * stride_xd, mask=io_mask, other=0.0)
    seq_off = tl.load(SEQ_OFF + off_b)

    if ROTARY_DIM > 0:
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
        x2 = tl.load(x_rows + partner[None, :] * stride_xd, mask=rot_mask, other=0.0).to(tl.float32)
        pos = seq_off + offs_s * POS_STEP
        cos = tl.load(COS + pos[:, None].to(tl.int64) * stride_cos + t[None, :], mask=rot_mask, other=1.0)
        sin = tl.load(SIN + pos[:, None].to(tl.int64) * stride_sin + t[None, :], mask=rot_mask, other=0.0)
        xf = x.to(tl.float32)
        rotated = xf * cos.to(tl.float32) + sign[None, :] * x2 * sin.to(tl.float32)
        x = tl.where(in_rot[None, :], rotated, xf).to(Y.dtype.element_ty)
    else:
        x = x.to(Y.dtype.element_ty)

    if DST_AT_SEQLEN:
        dst_row = seq_off + offs_s
    else:
        dst_row = offs_s
    if PAGE_SIZE > 0:  # paged cache: Y is (num_pages, page_size, h, d)
        page = tl.load(BLOCK_TABLE + off_b.to(tl.int64) * stride_bt + dst_row // PAGE_SIZE, mask=row_ok, other=0)
        y_rows = Y + page.to(tl.int64)[:, None] * stride_yb + (dst_row % PAGE_SIZE)[:, None].to(tl.int64) * stride_ys
    else:
        if HAS_BATCH_IDX:
            dst_b = tl.load(BATCH_IDX + off_b).to(tl.int64)
        else:
            dst_b = off_b.to(tl.int64)
        y_rows = Y + dst_b * stride_yb + dst_row[:, None].to(tl.int64) * stride_ys
    tl.store(y_rows + off_h * stride_yh + offs_d[None, :] * stride_yd, x, mask=io_mask)


def rotary_copy(
    x: torch.Tensor, y: torch.Tensor, seq_off: torch.Tensor, *,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, interleaved: bool = True,
    pos_step: int = 1, dst_at_seqlen: bool = True, batch_idx: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> None:
    """y[dst(b, i)] = rotary(x[b, i], position seq_off[b] + i * pos_step) for x (b, s, h, d).

    dst(b, i) is row seq_off[b] + i (dst_at_seqlen) or i of y's batch batch_idx[b] (or b), or of the
    page block_table[b, row // page_size] when block_table is given (y: (pages, page_size, h, d)).
    cos/sin: (seqlen_ro, rotary_dim / 2); None copies without rotation. Inputs are validated by callers.
    """
    b, s, h, d = x.shape
    if x.numel() == 0:
        return
    block_s = 16
    num_s_blocks = triton.cdiv(s, block_s)
    rotary_dim = 0 if cos is None else 2 * cos.shape[1]
    dummy = seq_off
    page_size = 0 if block_table is None else y.shape[1]
    _rotary_copy[grid_1d(b * num_s_blocks * h)](
        x, y, seq_off,
        dummy if batch_idx is None else batch_idx,
        dummy if block_table is None else block_table,
        x if cos is None else cos, x if sin is None else sin,
        *x.stride(), *y.stride(),
        0 if block_table is None else block_table.stride(0),
        0 if cos is None else cos.stride(0), 0 if sin is None else sin.stride(0),
        h, s, num_s_blocks,
        HEAD_DIM=d, BLOCK_D=pad_head_dim(d), BLOCK_S=block_s,
        ROTARY_DIM=rotary_dim, INTERLEAVED=interleaved, POS_STEP=pos_step,
        DST_AT_SEQLEN=dst_at_seqlen, HAS_BATCH_IDX=batch_idx is not None, PAGE_SIZE=page_size,
        num_warps=4,
    )
