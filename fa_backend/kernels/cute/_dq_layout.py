"""The CuTe backward's chunked dQ accumulator (kernels/cute/flash_bwd.py) and its conversion to dQ.

The backward adds each (TILE_M query rows x d) dQ block into one chunk of an fp32 buffer (b, hq, m_blocks,
TILE_M * d) in the order of its wgmma accumulator fragments (conflict-free shared-memory stores, two bulk adds
per block). Position p = g * TILE_M * d / wgs + c8 * 512 + rh * 256 + w * 64 + lq * 8 + lr * 2 + e of a chunk
holds row 16 w + 8 rh + lq, column g * d / wgs + 8 c8 + 2 lr + e of the block (g the warpgroup, w the thread's
warp in it, lq / lr its lane // 4 and % 4, rh / e / c8 the accumulator's row half, column pair element and
column group: wgmma's m64nNk16 fp32 accumulator layout): split "columns". The warp-specialised kernel's other
tiles: "transposed" (80-row blocks, whose dQ GEMM computes the block's transpose: M = the warpgroup's d / wgs
columns, N = the queries): p = g * tile_m * d / wgs + c8 * 512 + rh * 256 + w * 64 + lq * 8 + lr * 2 + e holds
column g * d / wgs + 16 w + 8 rh + lq of row 8 c8 + 2 lr + e; "rows" (d=64's 128-row blocks, the warpgroups
splitting them by rows): the same p holds row 64 g + 16 w + 8 rh + lq, column 8 c8 + 2 lr + e.

`unchunk` is the reference reordering in PyTorch; `dq_from_chunks` is one Triton pass that reads each chunk
once and writes dQ = scale * dQacc in the inputs' dtype (b, hq, sq, d): the PyTorch route (reorder copy, scale,
cast) moved the buffer through memory three times. With delta from one Triton pass too, the backward went from
298 to 383 TFLOP/s at 2k tokens on the H200 (d=128, two warpgroups; docs/perf-log.md).

No DSL import here: both run (the Triton kernel under TRITON_INTERPRET=1) on the CPU machine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton import _launch

TILE_M = 64  # query rows per dQ block (flash_bwd.TILE_M)
THREADS = 128  # threads per warpgroup (flash_bwd.THREADS)
SPLITS = ("columns", "transposed", "rows")  # how the warpgroups share a block (module docstring)


def unchunk(chunks: torch.Tensor, sq: int, wgs: int = 1, tile_m: int = TILE_M, split: str = "columns") -> torch.Tensor:
    """(b, hq, m_blocks, tile_m * d) dQ chunks in the kernel's fragment order -> a (b, hq, sq, d) tensor."""
    b, hq, m_blocks, size = chunks.shape
    d = size // tile_m
    if split == "rows":  # g, c8, rh, w, lq, lr, e with (g, w, rh, lq) over the rows
        parts = chunks.view(b, hq, m_blocks, wgs, d // 8, 2, 4, 8, 4, 2)
        rows = parts.permute(0, 1, 2, 3, 6, 5, 7, 4, 8, 9)  # g, w, rh, lq, c8, lr, e
        return rows.reshape(b, hq, m_blocks * tile_m, d)[:, :, :sq]
    if split == "transposed":  # g, c8, rh, w, lq, lr, e with c8 over the rows, (w, rh, lq) over the warpgroup's columns
        parts = chunks.view(b, hq, m_blocks, wgs, tile_m // 8, 2, 4, 8, 4, 2)
        rows = parts.permute(0, 1, 2, 4, 8, 9, 3, 6, 5, 7)  # c8, lr, e, g, w, rh, lq
        return rows.reshape(b, hq, m_blocks * tile_m, d)[:, :, :sq]
    parts = chunks.view(b, hq, m_blocks, wgs, d // wgs // 8, 2, 4, 8, 4, 2)  # g, c8, rh, w, lq, lr, e
    rows = parts.permute(0, 1, 2, 6, 5, 7, 3, 4, 8, 9)  # w, rh, lq, g, c8, lr, e
    return rows.reshape(b, hq, m_blocks * tile_m, d)[:, :, :sq]


@triton.jit(do_not_specialize=["SEQ_Q", "NUM_M_BLOCKS"])
def _dq_from_chunks(
    CHUNKS, DQ, scale, stride_b, stride_h, stride_m, HEADS, SEQ_Q, NUM_M_BLOCKS,
    HEAD_DIM: tl.constexpr, WGS: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    m_block = pid % NUM_M_BLOCKS
    bh = pid // NUM_M_BLOCKS
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, BLOCK_D)[None, :]  # BLOCK_D: HEAD_DIM rounded up to a power of two (tl.arange), d = 96
    ok = (c < HEAD_DIM) & (r < TILE)  # BLOCK_M, BLOCK_D: TILE and HEAD_DIM rounded up to powers of two (tl.arange)
    cols = HEAD_DIM // WGS  # columns per warpgroup
    cc = c % cols
    # the fragment-order position of (r, c) in its chunk (module docstring); a gather within one chunk, while the
    # stores below are row-contiguous
    if SPLIT == 2:  # rows: warpgroup g holds rows [g * TILE / WGS, (g + 1) * TILE / WGS), every column
        rows_g = TILE // WGS
        rr = r % rows_g
        p = ((r // rows_g) * (rows_g * HEAD_DIM) + (c // 8) * 512 + ((rr // 8) % 2) * 256 + (rr // 16) * 64
             + (rr % 8) * 8 + ((c // 2) % 4) * 2 + c % 2)
    elif SPLIT == 1:  # transposed
        p = ((c // cols) * (TILE * cols) + (r // 8) * 512 + ((cc // 8) % 2) * 256 + (cc // 16) * 64 + (cc % 8) * 8
             + ((r // 2) % 4) * 2 + r % 2)
    else:
        p = ((c // cols) * (TILE * cols) + (cc // 8) * 512 + ((r // 8) % 2) * 256 + (r // 16) * 64 + (r % 8) * 8
             + ((cc // 2) % 4) * 2 + c % 2)
    acc = tl.load(CHUNKS + pid.to(tl.int64) * (TILE * HEAD_DIM) + p, mask=ok, other=0.0)
    rows = m_block * TILE + r
    b = bh // HEADS
    h = bh % HEADS
    dst = DQ + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows.to(tl.int64) * stride_m + c
    tl.store(dst, (acc * scale).to(DQ.dtype.element_ty), mask=(rows < SEQ_Q) & ok)


def dq_from_chunks(chunks: torch.Tensor, sq: int, scale: float, dtype: torch.dtype, wgs: int = 1,
                   tile_m: int = TILE_M, split: str = "columns") -> torch.Tensor:
    """dQ = scale * dQacc as a contiguous (b, hq, sq, d) tensor of `dtype`, from the chunked fp32 buffer of
    tile_m-row blocks that the warpgroups share by `split` (module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} (supported: {', '.join(SPLITS)})")
    b, hq, m_blocks, size = chunks.shape
    d = size // tile_m
    # a warpgroup's share: 8-column groups, 16-row atoms of M (transposed), or 64-row accumulators (rows)
    shares = {"columns": d % (8 * wgs) == 0, "transposed": d % (16 * wgs) == 0,
              "rows": tile_m == 64 * wgs and d % 8 == 0}[split]
    if not chunks.is_contiguous() or size % tile_m or not shares or tile_m % 8 or m_blocks * tile_m < sq:
        raise ValueError(f"dQ chunks {tuple(chunks.shape)} (contiguous: {chunks.is_contiguous()}) do not hold "
                         f"{sq} rows of {tile_m}-row blocks of a head dim that {wgs} warpgroup(s) split")
    dq = torch.empty((b, hq, sq, d), dtype=dtype, device=chunks.device)
    if dq.numel() == 0:
        return dq
    _launch.launch(_dq_from_chunks, _launch.grid_1d(b * hq * m_blocks), (
        chunks, dq, float(scale), *dq.stride()[:3], hq, sq, m_blocks,
    ), dict(HEAD_DIM=d, WGS=wgs, TILE=tile_m, SPLIT=SPLITS.index(split), BLOCK_M=triton.next_power_of_2(tile_m),
            BLOCK_D=triton.next_power_of_2(d), num_warps=8 if d > 64 else 4))
    return dq
