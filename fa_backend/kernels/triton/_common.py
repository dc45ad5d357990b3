"""Device helpers shared by the Triton forward and backward kernels."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores live in the log2 domain so exp2 is one MUFU op
LN2 = tl.constexpr(0.6931471805599453)
# Lazy rescale (forward, opt-in per tile config): the running max is moved only when it grows by more than
# this many log2 units (FlashAttention-4's threshold), so probabilities stay <= 2**8 (fp16 / bf16 safe).
RESCALE_LOG2 = tl.constexpr(8.0)


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


# ---------------------------------------------------------------------------------------------
# Optional score features (attn_mask, ALiBi, softcap, sliding window, dropout). Every one is
# gated by a constexpr at the call site: a launch without features compiles none of this.
# ---------------------------------------------------------------------------------------------

MASK_NONE = tl.constexpr(0)
MASK_BOOL = tl.constexpr(1)
MASK_ADD = tl.constexpr(2)


@triton.jit
def _tanh(x):
    """tanh from one exp2 (saturates to +-1 without inf/inf): 1 - 2 / (e^{2x} + 1)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _score_mods(qk, qi, kj, SEQ_Q, SEQ_K, qk_scale, softcap_in, Mask, stride_mm, stride_mn, slope2, alibi_offset,
                MASK_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain with the optional features; returns (s, t).

    qi / kj are query / key indices that broadcast to qk's shape (either orientation).
    s = log2(e) * (softcap(scale * qk) + alibi + additive mask), -inf where a bool mask is False.
    With SOFTCAP, qk_scale is softcap * log2(e), softcap_in is scale / softcap and t = tanh(qk *
    softcap_in) (its derivative 1 - t^2 is needed by the backward); otherwise t is qk.
    """
    if SOFTCAP:
        t = _tanh(qk * softcap_in)
        s = t * qk_scale
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:
        # FlashAttention-2: bias = -slope * |i + seqlen_k - seqlen_q - j| (slope2 = slope * log2(e)).
        s -= slope2 * tl.abs((qi + alibi_offset - kj).to(tl.float32))
    if MASK_KIND != MASK_NONE:
        in_bounds = (qi < SEQ_Q) & (kj < SEQ_K)
        s = _apply_mask(s, Mask + qi.to(tl.int64) * stride_mm + kj.to(tl.int64) * stride_mn, in_bounds, MASK_KIND)
    return s, t


@triton.jit
def _apply_mask(s, ptrs, in_bounds, MASK_KIND: tl.constexpr):
    """Scores s (log2 domain) with an attn_mask read at ptrs: -inf where a bool mask (uint8) is 0, or plus
    log2(e) * an additive mask (read in fp32). Elements outside in_bounds are not read and change nothing."""
    if MASK_KIND == MASK_BOOL:
        m = tl.load(ptrs, mask=in_bounds, other=1)
        s = tl.where(m != 0, s, float("-inf"))
    else:
        s += tl.load(ptrs, mask=in_bounds, other=0.0).to(tl.float32) * LOG2E
    return s


@triton.jit
def _dropout_keep(seed, rng_offset, bh, qi, kj, SEQ_Q, SEQ_K, dropout_p):
    """Keep-mask of dropout: one Philox draw per (batch * heads_q + head, row, column).

    The counter is the element's linear index in (b, hq, sq, sk) plus rng_offset (64 bits), so the
    forward and both backward kernels regenerate the same mask whatever their tiling.
    """
    offs = (bh.to(tl.int64) * SEQ_Q + qi.to(tl.int64)) * SEQ_K + kj.to(tl.int64) + rng_offset
    return tl.rand(seed, offs) >= dropout_p


@triton.jit
def _band_keep(qi, kj, SEQ_K, causal_offset, left_offset, CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr):
    """Key j visible to query i: j < SEQ_K, j <= i + causal_offset (CAUSAL), j >= i + left_offset."""
    keep = kj < SEQ_K
    if CAUSAL:
        keep = keep & (kj <= qi + causal_offset)
    if WINDOW_LEFT:
        keep = keep & (kj >= qi + left_offset)
    return keep


@triton.jit
def _window_lo(m0, SEQ_K, left_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Left edge of the key range of query rows [m0, m0 + BLOCK_M) under a sliding window.

    Row i sees keys j >= i + left_offset. Returns (lo, full_lo), multiples of BLOCK_N: keys
    before lo are outside every row's window (skipped), keys from full_lo on are inside every
    row's window on the left side (no left mask needed there).
    """
    lo = (tl.minimum(tl.maximum(m0 + left_offset, 0), SEQ_K) // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(tl.maximum(m0 + BLOCK_M - 1 + left_offset, 0), BLOCK_N) * BLOCK_N
    return lo, tl.maximum(full_lo, lo)
