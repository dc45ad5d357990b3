"""Device helpers shared by the Triton forward and backward kernels."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores live in the log2 domain so exp2 is one MUFU op
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _kv_bounds(m0, SEQ_K, causal_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Key range seen by query rows [m0, m0 + BLOCK_M).

    Row i attends key j iff j < SEQ_K and (not CAUSAL or j <= i + causal_offset).
    Returns (n_full, hi): keys [0, n_full) are visible to every row of the block, so those
    blocks need no mask; keys [n_full, hi) need one; keys >= hi are never visible.
    n_full is a multiple of BLOCK_N so the masked loop starts on a block boundary.
    """
    if CAUSAL:
        hi = tl.minimum(SEQ_K, m0 + BLOCK_M + causal_offset)
        visible = tl.minimum(SEQ_K, m0 + 1 + causal_offset)
    else:
        hi = SEQ_K
        visible = SEQ_K
    n_full = (tl.maximum(visible, 0) // BLOCK_N) * BLOCK_N
    return n_full, tl.maximum(hi, 0)


@triton.jit
def _load_rows(ptrs, rows, n_rows, cols, n_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a 2-D tile, masking rows >= n_rows and/or columns >= n_cols (zero fill)."""
    if MASK_ROWS:
        if MASK_COLS:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if MASK_COLS:
            return tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _load_lse_log2(LSE_ptr, rows, n_rows):
    """Row LSE (natural log, as stored by the forward) converted to log2 units for exp2.

    Rows past the end and fully masked rows (LSE = -inf) become +inf so that
    exp2(s - lse) = 0 for them: their probabilities and gradients are exactly zero.
    """
    lse = tl.load(LSE_ptr + rows, mask=rows < n_rows, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)


@triton.jit
def _tile_ptrs(base, row0, stride_row, stride_col, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """Pointers to the BLOCK_R x BLOCK_C tile whose first row is `row0` (offset taken in 64 bits)."""
    return (base + tl.cast(row0, tl.int64) * stride_row
            + tl.arange(0, BLOCK_R)[:, None] * stride_row + tl.arange(0, BLOCK_C)[None, :] * stride_col)
