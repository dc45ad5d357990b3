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
"""

from __future__ import annotations

KEEP_ROWS, KEEP_KEYS = 64, 128
KEEP_TILE_BYTES = KEEP_ROWS * KEEP_KEYS // 8

# Memory: the bits are saved only while they take at most KEEP_BITS_BUDGET times the bytes of q, k, v and out together
# (1.0: up to 8k tokens at d=128 with as many keys as queries and heads of K as of Q); 0 turns saving off (every
# backward then draws the mask again). Read at each call (ops/cute_flash.save_keep_bits, dispatch/preference.py).
KEEP_BITS_BUDGET = 1.0
# Saved rows of tiles: all (1), every second (2) or fourth (4); the smallest period within the budget is taken.
# Powers of two only: then buffers of one size from two periods save the same tiles, and the size names the period.
KEEP_PERIODS = (1, 2, 4)


def keep_row_blocks(seqlen_q: int, period: int = 1) -> int:
    """Saved rows of tiles per head: every period-th of the ceil(seqlen_q / KEEP_ROWS)."""
    return -(-(-(-seqlen_q // KEEP_ROWS)) // period)


def keep_bits_bytes(batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, period: int = 1) -> int:
    """Bytes of the saved keep bits of one call: one bit per score of the saved rows of tiles, whole tiles."""
    return batch * heads_q * keep_row_blocks(seqlen_q, period) * -(-seqlen_k // KEEP_KEYS) * KEEP_TILE_BYTES


def keep_period(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                head_dim_v: int, itemsize: int) -> int:
    """The smallest period of KEEP_PERIODS whose saved bits are within KEEP_BITS_BUDGET times the call's q, k, v and
    out bytes; 0 where none is (the backward then draws every bit again)."""
    inputs = (batch * heads_q * seqlen_q * (head_dim + head_dim_v)
              + batch * heads_kv * seqlen_k * (head_dim + head_dim_v)) * itemsize
    for period in KEEP_PERIODS:
        if keep_bits_bytes(batch, heads_q, seqlen_q, seqlen_k, period) <= KEEP_BITS_BUDGET * inputs:
            return period
    return 0


def keep_bits_fit(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                  head_dim_v: int, itemsize: int) -> bool:
    """Whether some of a call's keep bits (keep_period) fit KEEP_BITS_BUDGET."""
    return keep_period(batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, head_dim_v, itemsize) > 0


def keep_period_of(nbytes: int, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int) -> int:
    """The period of a buffer of saved keep bits of `nbytes` bytes for these shapes (the smallest of KEEP_PERIODS
    whose size it is); 0 where none matches."""
    for period in KEEP_PERIODS:
        if keep_bits_bytes(batch, heads_q, seqlen_q, seqlen_k, period) == nbytes:
            return period
    return 0


def keep_byte(a, p, row):
    """Byte offset within a tile of the draw of tile row `row`, 32-key block a, p (ints, tensors or DSL integers)."""
    return 16 * (16 * a + 4 * p + row % 8 // 2) + 2 * (row // 8) + row % 2


def keep_bit(w, h):
    """Bit of a draw's byte that keeps its key 32a + 8w + 2p + h."""
    return 2 * (2 * (w // 2) + h) + w % 2
