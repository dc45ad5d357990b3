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
"""

from __future__ import annotations

KEEP_ROWS, KEEP_KEYS = 64, 128
KEEP_TILE_BYTES = KEEP_ROWS * KEEP_KEYS // 8

# Memory: the bits are saved only while they take at most KEEP_BITS_BUDGET times the bytes of q, k, v and out together
# (1.0: up to 8k tokens at d=128 with as many keys as queries and heads of K as of Q); 0 turns saving off (every
# backward then draws the mask again). Read at each call (ops/cute_flash.save_keep_bits, dispatch/preference.py).
KEEP_BITS_BUDGET = 1.0


def keep_bits_bytes(batch: int, heads_q: int, seqlen_q: int, seqlen_k: int) -> int:
    """Bytes of the saved keep bits of one call: one bit per score, rounded up to whole tiles."""
    return batch * heads_q * -(-seqlen_q // KEEP_ROWS) * -(-seqlen_k // KEEP_KEYS) * KEEP_TILE_BYTES


def keep_bits_fit(batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                  head_dim_v: int, itemsize: int) -> bool:
    """Whether a call's keep bits are within KEEP_BITS_BUDGET times its q, k, v and out bytes."""
    inputs = (batch * heads_q * seqlen_q * (head_dim + head_dim_v)
              + batch * heads_kv * seqlen_k * (head_dim + head_dim_v)) * itemsize
    return keep_bits_bytes(batch, heads_q, seqlen_q, seqlen_k) <= KEEP_BITS_BUDGET * inputs


def keep_byte(a, p, row):
    """Byte offset within a tile of the draw of tile row `row`, 32-key block a, p (ints, tensors or DSL integers)."""
    return 16 * (16 * a + 4 * p + row % 8 // 2) + 2 * (row // 8) + row % 2


def keep_bit(w, h):
    """Bit of a draw's byte that keeps its key 32a + 8w + 2p + h."""
    return 2 * (2 * (w // 2) + h) + w % 2
