"""Dropout in the CuTe forward: Philox-4x32-10 draws and the keep mask of one wgmma score tile.

The mask is the Triton kernels' (kernels/triton/_common._dropout_keep, DROP_HALVES), bit for bit, so a CuTe
forward and a Triton backward (or the test-only `dropout_keep_mask`) drop the same scores: key j = 32a + 8w + 2p + h
(h < 2, p < 4, w < 4) of query row i of head bh = batch * heads_q + head reads half h (the low 16 bits for h = 0) of
word w of the Philox-4x32-10 draw at counter (bh * seqlen_q + i) * 4 * ceil(seqlen_k / 32) + 4a + p + rng_offset
(64 bits: the counter's low and high words, then two zero words; key: the seed's low and high words), and is kept
iff that half is >= the 16-bit threshold round(dropout_p * 2**16). Only 16-bit draws are implemented here: the host
sends other dropout_p (32-bit draws, kernels/triton/_features.dropout_draw) to the Triton kernels.

In a wgmma accumulator (kernels/cute/_fwd_parts: values of rows r and r + 8, keys 2p + {0, 1} + 8k with p = lane % 4)
a thread's keys of one 32-key block all come from one draw per row, so the 8 keys a draw decides are all its own:
two draws per row and 32-key block, no exchange between threads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32, Uint64

# Philox-4x32 constants (Salmon et al. 2011; triton.language.random's)
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
HALF_MASK = 0xFFFF


@cute.jit
def philox4x32(c0: Uint32, c1: Uint32, k0: Uint32, k1: Uint32) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """Philox-4x32-10 of the counter (c0, c1, 0, 0) under the key (k0, k1): four uniform 32-bit words, those of
    triton.language.randint4x for the 64-bit offset c0 + 2**32 c1 and a 64-bit seed k0 + 2**32 k1."""
    c2, c3 = Uint32(0), Uint32(0)
    for _ in cutlass.range_constexpr(ROUNDS):
        # 32 x 32 -> 64-bit products: one mul.wide each gives both the high word (mixed in) and the low one
        pb = Uint64(c2) * Uint64(ROUND_B)
        pa = Uint64(c0) * Uint64(ROUND_A)
        c0 = Uint32(pb >> Uint64(32)) ^ c1 ^ k0
        c2 = Uint32(pa >> Uint64(32)) ^ c3 ^ k1
        c1 = Uint32(pb)
        c3 = Uint32(pa)
        k0 = k0 + Uint32(KEY_A)
        k1 = k1 + Uint32(KEY_B)
    return c0, c1, c2, c3


class DropoutState:
    """One consumer thread's dropout constants for one tile: the Philox key, the 16-bit threshold and the counter of
    its first draw in each of its two rows (key block 0, p = lane % 4), from which a key block's draws follow."""

    def __init__(self, k0: Uint32, k1: Uint32, threshold: Uint32, row_counters: cute.Tensor):
        self.k0, self.k1, self.threshold, self.row_counters = k0, k1, threshold, row_counters
        self.threshold_high = threshold << Uint32(16)


@cute.jit
def dropout_state(mRng: cute.Tensor, threshold: Int32, bh: Int32, seqlen_q: Int32, seqlen_k: Int32,
                  row_half0: Int32, row_half1: Int32, lane: Int32) -> DropoutState:
    """The state for a thread whose rows are row_half0 / row_half1 (query indices) of head bh = batch * heads_q +
    head; mRng: (seed, rng_offset), int64 in global memory."""
    seed = Int64(mRng[0])
    offset = Int64(mRng[1])
    draws_per_row = Int64((seqlen_k + 31) // 32 * 4)
    counters = cute.make_rmem_tensor((2,), Int64)
    for half in cutlass.range_constexpr(2):
        row = row_half0 if half == 0 else row_half1
        counters[half] = (Int64(bh) * Int64(seqlen_q) + Int64(row)) * draws_per_row + offset + Int64(lane % 4)
    return DropoutState(Uint32(seed), Uint32(seed >> Int64(32)), Uint32(threshold), counters)


@cute.jit
def drop_scores(acc_s: cute.Tensor, tScS0: cute.Tensor, col0: Int32, state: DropoutState):
    """Zero the probabilities in acc_s (a wgmma score tile, after the row sums took them) of the keys dropout drops.
    tScS0: the accumulator's coordinates for thread 0 (static; rows 0 / 8, keys 2p + {0, 1} + 8k less 2p); col0: the
    tile's first key, a multiple of 32."""
    n = cute.size(acc_s)
    block0 = Int64(col0 // 32 * 4)
    for half in cutlass.range_constexpr(2):
        for a in cutlass.range_constexpr(n // 16):  # 32-key blocks: 8 of the thread's values per row each
            counter = state.row_counters[half] + block0 + Int64(4 * a)
            words = philox4x32(Uint32(counter), Uint32(counter >> Int64(32)), state.k0, state.k1)
            for i in cutlass.range_constexpr(n):
                row, col = tScS0[i]
                if cutlass.const_expr(row // 8 % 2 == half and col // 32 == a):
                    word = words[col % 32 // 8]
                    # high half: word >= threshold << 16 iff word >> 16 >= threshold (no shift per key)
                    keep = (word >= state.threshold_high) if cutlass.const_expr(col % 2 == 1) else (
                        (word & Uint32(HALF_MASK)) >= state.threshold)
                    acc_s[i] = Float32(cutlass.select_(keep, acc_s[i], Float32(0.0)))

