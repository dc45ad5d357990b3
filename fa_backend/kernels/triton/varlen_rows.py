"""Packed rows outside every sequence: filled, so that no output or gradient of a varlen call is left unwritten.

A packed batch may hold more rows than its sequences cover: rows before cu_seqlens[0] or from cu_seqlens[-1] on
(static-shape padding for torch.compile or CUDA graphs, sequence-parallel round-up, `pad_to_multiple_of`). No
attention program owns those rows. Left as allocated (torch.empty), their gradients would feed whatever the caching
allocator held, NaN included, into the layers below: FlashAttention-2 and -3 do that
(Dao-AILab/flash-attention#1228). Their exact values are known: such a query row sees no key (output 0, LSE -inf,
as for any row without a visible key), and a row outside the sequences changes no output (gradient 0).

cu_seqlens stay on the device (reading them back would cost a sync), so the bounds are read by the kernel; a launch
over a fully covered batch only reads two integers per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._launch import cdiv

BLOCK_R = 64  # rows per program: 1k programs for 64k packed rows, each reading cu_seqlens[0] and [-1] only
SUB_R, BLOCK_C = 16, 128  # one store: 16 rows x 128 (head x dim) columns, 16 elements per thread of 4 warps


@triton.jit
def _fill_tensor(T, CuSeq, N_SEQ, TOTAL, stride_r, stride_h, stride_d, H, D, FILL,
                 BLOCK_R: tl.constexpr, SUB_R: tl.constexpr, BLOCK_C: tl.constexpr):
    start = tl.program_id(0) * BLOCK_R
    first = tl.load(CuSeq)
    last = tl.load(CuSeq + N_SEQ)
    end = tl.minimum(start + BLOCK_R, TOTAL)
    if (start < TOTAL) & ((start < first) | (end > last)):  # the block holds a row outside [first, last)
        value = (tl.zeros((SUB_R, BLOCK_C), dtype=tl.float32) + FILL).to(T.dtype.element_ty)
        for r0 in tl.static_range(0, BLOCK_R, SUB_R):
            rows = start + r0 + tl.arange(0, SUB_R)
            outside = (rows < TOTAL) & ((rows < first) | (rows >= last))
            row_off = rows.to(tl.int64)[:, None] * stride_r
            for c0 in range(0, H * D, BLOCK_C):
                cols = c0 + tl.arange(0, BLOCK_C)
                col_off = (cols // D).to(tl.int64)[None, :] * stride_h + (cols % D).to(tl.int64)[None, :] * stride_d
                tl.store(T + row_off + col_off, value, mask=outside[:, None] & (cols < H * D)[None, :])


@triton.jit
def _fill_rows_outside(
    T0, Cu0, N0, TOTAL0, sr0, sh0, sd0, H0, D0, FILL0,
    T1, Cu1, N1, TOTAL1, sr1, sh1, sd1, H1, D1, FILL1,
    T2, Cu2, N2, TOTAL2, sr2, sh2, sd2, H2, D2, FILL2,
    N_TENSORS: tl.constexpr, BLOCK_R: tl.constexpr, SUB_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # up to three tensors per launch (a forward's out and LSE, a backward's dQ, dK and dV): one launch's host cost
    _fill_tensor(T0, Cu0, N0, TOTAL0, sr0, sh0, sd0, H0, D0, FILL0, BLOCK_R, SUB_R, BLOCK_C)
    if N_TENSORS > 1:
        _fill_tensor(T1, Cu1, N1, TOTAL1, sr1, sh1, sd1, H1, D1, FILL1, BLOCK_R, SUB_R, BLOCK_C)
    if N_TENSORS > 2:
        _fill_tensor(T2, Cu2, N2, TOTAL2, sr2, sh2, sd2, H2, D2, FILL2, BLOCK_R, SUB_R, BLOCK_C)


def fill_rows_outside(*fills: tuple[torch.Tensor, torch.Tensor, float]) -> None:
    """For each (t, cu_seqlens, value), sets to value, in place, the rows of the packed tensor t ((total, h) or
    (total, h, d), any strides) that lie before cu_seqlens[0] or from cu_seqlens[-1] on; rows inside are not
    touched. At most three tensors, in one launch."""
    fills = tuple(f for f in fills if f[0].numel() > 0 and f[1].numel() > 0)
    if not fills:
        return
    if len(fills) > 3:
        raise ValueError(f"fill_rows_outside: at most 3 tensors per launch, got {len(fills)}")
    args = []
    for t, cu, value in fills + (fills[0],) * (3 - len(fills)):  # unused slots repeat the first (not read)
        view = t if t.dim() == 3 else t.unsqueeze(-1)
        args += [view, cu, cu.numel() - 1, view.shape[0], *view.stride(), view.shape[1], view.shape[2], float(value)]
    rows = max(t.shape[0] for t, _, _ in fills)
    _launch.launch(_fill_rows_outside, _launch.grid_1d(cdiv(rows, BLOCK_R)), tuple(args),
                   dict(N_TENSORS=len(fills), BLOCK_R=BLOCK_R, SUB_R=SUB_R, BLOCK_C=BLOCK_C, num_warps=4))
