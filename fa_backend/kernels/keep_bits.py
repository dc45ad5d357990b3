"""Saved dropout keep bits: their layout and memory budget (no GPU code; the Triton kernel that fills them and the
unpacker are in kernels/triton/keep_bits.py, the CuTe forward that saves them and the backward that reads them in
kernels/cute/_dropout.py).

A dropout forward on the CuTe kernels that will be differentiated saves its keep decisions, one bit per score, for the
CuTe backward, which then loads them instead of drawing them again. The mask is the Triton kernels'
(triton/_common._dropout_keep, DROP_HALVES): key j = 32a + 8w + 2p + h of query row i of head bh reads half h of
word w of the Philox-4x32 draw at counter (bh * seqlen_q + i) * 4 * ceil(seqlen_k / 32) + 4a + p + rng_offset, so
one draw decides eight keys, and its eight decisions make one byte here.

The buffer is a sequence of tiles of KEEP_ROWS queries x KEEP_KEYS keys (the backward's step x its CTA's keys),
KEEP_TILE_BYTES each: tile (bh, R, C) at ((bh * ceil(seqlen_q / KEEP_ROWS) + R) * ceil(seqlen_k / KEEP_KEYS) + C) *
KEEP_TILE_BYTES. Within a tile the draw of tile row i, 32-key block a and p is byte keep_byte(a, p, i): the 16 bytes
at 16 g belong to the backward's drawing thread g = 16 a + 4 p + (i % 8) // 2, one byte per row of the 16 it serves,
so that thread loads its step's bits with one 16-byte read. Bit keep_bit(w, h) of the byte keeps key 32a + 8w + 2p +
h: each of the four words that thread assembles for the MMA threads (two bits per query) then takes two neighbouring
bits of each byte. Rows past seqlen_q and keys past seqlen_k of the last tiles hold draws of their own (unread); a
causal forward writes zeros in the tiles it does not visit.

Where all the bits would exceed the budget, every `period`-th row of tiles is saved (period 2 or 4: KEEP_PERIODS):
tile (bh, R, C) with R % period == 0 sits at R // period among ceil(ceil(seqlen_q / KEEP_ROWS) / period) saved rows
of tiles, and the backward draws the other rows' bits again. Its drawing warps then load one step's bits and draw the
next ones': the draws of the steps in between run while the MMA warpgroups take the loaded ones, so that half the
bits (16k tokens at d=128 under the default budget) were meant to buy most of the saved bits' speed. The period
follows from the buffer's size (keep_period_of): two periods with buffers of one size save the same tiles (row 0's).

A causal call saves only the key tiles its rows can see (the causal layout, `causal_offset`: seqlen_k - seqlen_q
bottom-right, 0 top-left; None without a causal mask): row of tiles R holds keep_row_width(R) tiles, those up to the
last key that the queries of R and of the next row of tiles see (the forward's 128-query tiles visit that many for
their first 64 rows, so its stores stay inside their row), and rows follow each other (keep_row_start: a closed
form, which the CuTe kernels compute too). About half the bytes of the full layout: a 16k-token causal call at d=128
saves every row's bits within the budget.
"""

from __future__ import annotations

KEEP_ROWS, KEEP_KEYS = 64, 128
KEEP_TILE_BYTES = KEEP_ROWS * KEEP_KEYS // 8

# Memory: the bits are saved only while they take at most KEEP_BITS_BUDGET times the bytes of q, k, v and out together
# (1.05: every row of tiles up to 8k tokens at d=128 with as many keys as queries and heads of K as of Q, 16k causal,
# whose diagonal tiles make its bits 1.016x; every second row at 16k, 32k causal: 1.004x); 0 turns saving off (every
# backward then draws the mask again). Read at each call (ops/cute_flash.save_keep_bits, dispatch/preference.py).
KEEP_BITS_BUDGET = 1.05
# Saved rows of tiles: all (1), every second (2) or fourth (4); the smallest period within the budget is taken.
# Powers of two only: then buffers of one size from two periods save the same tiles, and the size names the period.
KEEP_PERIODS = (1, 2, 4)


def causal_offset(seqlen_q: int, seqlen_k: int, is_causal: bool, bottom_right: bool) -> int | None:
    """The causal layout's diagonal shift (key index minus query index on the diagonal), or None without a causal
    mask."""
    if not is_causal:
        return None
    return seqlen_k - seqlen_q if bottom_right else 0


def keep_row_blocks(seqlen_q: int, period: int = 1) -> int:
    """Saved rows of tiles per head: every period-th of the ceil(seqlen_q / KEEP_ROWS)."""
    return -(-(-(-seqlen_q // KEEP_ROWS)) // period)


class _PyOps:
    """The integer operations of the layout's closed forms for Python ints (dsl_ops: the same for DSL integers)."""
    max, min = max, min

    @staticmethod
    def floordiv(x, k: int):
        return x // k


def _dsl_floordiv(x, k: int, select):
    """floor(x / k) for a DSL integer x and k > 0 by divisions of non-negative numbers only. With the DSL's signed
    // in their place, the kernels wrote past the buffer in exactly the cases that divide a negative number (the
    causal layout's bottom-right rows that see no key, its period-4 series): it truncated there."""
    if type(x) is int:  # a constant of the trace: Python's floor division
        return x // k
    return select(x >= 0, x // k, -((k - 1 - x) // k))


def dsl_ops(max_fn, min_fn, select):
    """The layout's operations on DSL integers (the DSL's max, min and select), for the CuTe kernels."""
    ops = type("_DslOps", (), {})()
    ops.max, ops.min = max_fn, min_fn
    ops.floordiv = lambda x, k: _dsl_floordiv(x, k, select)
    return ops


def keep_row_width(row_block, seqlen_k, causal_offset=None, ops=_PyOps):
    """Key tiles that row of tiles `row_block` holds (ints, or DSL integers with ops=dsl_ops(...)): all
    ceil(seqlen_k / KEEP_KEYS), or in the causal layout those up to the last key that its queries and the next row
    of tiles' see."""
    keys = (seqlen_k + KEEP_KEYS - 1) // KEEP_KEYS
    if causal_offset is None:
        return keys
    last = ops.floordiv(KEEP_ROWS * row_block + 2 * KEEP_ROWS - 1 + causal_offset, KEEP_KEYS) + 1
    return ops.min(ops.max(last, 0), keys)


def _series(count, step: int, first, width, ops=_PyOps):
    """sum(clamp(first + step * i, 0, width) for i in range(count)), count >= 0, in closed form."""
    i0 = ops.min(ops.max(-ops.floordiv(first - 1, step), 0), count)  # the first term above 0
    i1 = ops.min(ops.max(-ops.floordiv(first - width, step), i0), count)  # the first term at width
    return step * (i1 * (i1 - 1) - i0 * (i0 - 1)) // 2 + first * (i1 - i0) + width * (count - i1)


def keep_row_start(row_block, seqlen_k, period: int = 1, causal_offset=None, ops=_PyOps):
    """Tiles of one head's saved rows before saved row of tiles `row_block` (a multiple of period; ints, or DSL
    integers with ops=dsl_ops(...))."""
    keys = (seqlen_k + KEEP_KEYS - 1) // KEEP_KEYS
    if causal_offset is None:
        return row_block // period * keys
    # with KEEP_KEYS = 2 * KEEP_ROWS, row 2j holds clamp(j + even, 0, keys) tiles and row 2j + 1 clamp(j + odd, 0,
    # keys); every period-th row (period even) clamp(period // 2 * i + even, 0, keys)
    c = 2 * KEEP_ROWS - 1 + causal_offset + KEEP_KEYS
    even, odd = ops.floordiv(c, KEEP_KEYS), ops.floordiv(c + KEEP_ROWS, KEEP_KEYS)
    if period == 1:
        return _series((row_block + 1) // 2, 1, even, keys, ops) + _series(row_block // 2, 1, odd, keys, ops)
    return _series(row_block // period, period // 2, even, keys, ops)


def keep_head_tiles(seqlen_q: int, seqlen_k: int, period: int = 1, causal_offset: int | None = None) -> int:
    """Tiles of one head's saved keep bits."""
    rows = -(-seqlen_q // KEEP_ROWS)
    return keep_row_start(-(-rows // period) * period, seqlen_k, period, causal_offset)


def keep_bits_bytes(batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, period: int = 1,
                    causal_offset: int | None = None) -> int:
    """Bytes of the saved keep bits of one call: one bit per score of the saved tiles (whole tiles)."""
    return batch * heads_q * keep_head_tiles(seqlen_q, seqlen_k, period, causal_offset) * KEEP_TILE_BYTES


def keep_period(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                head_dim_v: int, itemsize: int, causal_offset: int | None = None) -> int:
    """The smallest period of KEEP_PERIODS whose saved bits are within KEEP_BITS_BUDGET times the call's q, k, v and
    out bytes; 0 where none is (the backward then draws every bit again)."""
    inputs = (batch * heads_q * seqlen_q * (head_dim + head_dim_v)
              + batch * heads_kv * seqlen_k * (head_dim + head_dim_v)) * itemsize
    for period in KEEP_PERIODS:
        if keep_bits_bytes(batch, heads_q, seqlen_q, seqlen_k, period, causal_offset) <= KEEP_BITS_BUDGET * inputs:
            return period
    return 0


def keep_bits_fit(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                  head_dim_v: int, itemsize: int, causal_offset: int | None = None) -> bool:
    """Whether some of a call's keep bits (keep_period) fit KEEP_BITS_BUDGET."""
    return keep_period(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v, itemsize,
                       causal_offset) > 0


def keep_period_of(nbytes: int, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int,
                   causal_offset: int | None = None) -> int:
    """The period of a buffer of saved keep bits of `nbytes` bytes for these shapes and layout (the smallest of
    KEEP_PERIODS whose size it is); 0 where none matches."""
    for period in KEEP_PERIODS:
        if keep_bits_bytes(batch, heads_q, seqlen_q, seqlen_k, period, causal_offset) == nbytes:
            return period
    return 0


def keep_byte(a, p, row):
    """Byte offset within a tile of the draw of tile row `row`, 32-key block a, p (ints, tensors or DSL integers)."""
    return 16 * (16 * a + 4 * p + row % 8 // 2) + 2 * (row // 8) + row % 2


def keep_bit(w, h):
    """Bit of a draw's byte that keeps its key 32a + 8w + 2p + h."""
    return 2 * (2 * (w // 2) + h) + w % 2
