"""Dropout in the CuTe kernels: Philox-4x32-10 draws, the keep mask of one forward score tile, the backward's drawn
bits.

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
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from ..keep_bits import (KEEP_KEYS, KEEP_ROWS, KEEP_TILE_BYTES, dsl_ops, keep_bit, keep_byte, keep_row_start,
                         keep_row_width)

# Philox-4x32 constants (Salmon et al. 2011; triton.language.random's)
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
ROUNDS = 10
HALF_MASK = 0xFFFF


@dsl_user_op
def mul_wide_u32(a: Uint32, b: Uint32, *, loc=None, ip=None) -> Uint64:
    """The 64-bit product of two 32-bit words: one mul.wide.u32 (IMAD.WIDE.U32), whatever the surrounding code (from
    zero-extended 64-bit operands LLVM made one only in unrolled code; in a loop it widened the whole round to 64-bit
    multiplies, adds and xors)."""
    product = llvm.inline_asm(T.i64(), [Uint32(a).ir_value(loc=loc, ip=ip), Uint32(b).ir_value(loc=loc, ip=ip)],
                              "mul.wide.u32 $0, $1, $2;", "=l,r,r", has_side_effects=False, is_align_stack=False,
                              asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint64(product)


@dsl_user_op
def opaque_i64(x: Int64, *, loc=None, ip=None) -> Int64:
    """x through a PTX mov: LLVM can neither sink its computation into the loops that use it nor recompute it there
    (the causal layout's closed-form row start, computed once per tile)."""
    return Int64(llvm.inline_asm(T.i64(), [Int64(x).ir_value(loc=loc, ip=ip)], "mov.b64 $0, $1;", "=l,l",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def store_byte_if(ptr: cute.Pointer, value: Uint32, store: Int32, *, loc=None, ip=None) -> None:
    """*ptr (global) = value's low byte where store != 0: one predicated st.global.u8, never a branch. (With a
    period, LLVM turned `if row0 < select(saved, seqlen_q, 0)` around each byte store of the causal forward's loops
    into branches: 15-19 % slower on the H100, thirty-fourth session.)"""
    llvm.inline_asm(None, [ptr.toint(loc=loc, ip=ip).ir_value(), Uint32(value).ir_value(loc=loc, ip=ip),
                           Int32(store).ir_value(loc=loc, ip=ip)],
                    "{\n.reg .pred p;\nsetp.ne.s32 p, $2, 0;\n@p st.global.u8 [$0], $1;\n}", "l,r,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def philox4x32_lockstep(counters: list, k0: Uint32, k1: Uint32) -> list:
    """Philox-4x32-10 of each counter (c0, c1, 0, 0) in `counters` under the key (k0, k1): four uniform 32-bit words
    per counter, those of triton.language.randint4x for the 64-bit offset c0 + 2**32 c1 and a 64-bit seed
    k0 + 2**32 k1. Several counters run their rounds in lockstep: independent chains for the scheduler to
    interleave (one chain's multiplies wait on its previous round's)."""
    n = len(counters)
    c0, c1 = [c[0] for c in counters], [c[1] for c in counters]
    c2, c3 = [Uint32(0)] * n, [Uint32(0)] * n
    for _ in cutlass.range_constexpr(ROUNDS):
        # 32 x 32 -> 64-bit products: one mul.wide each gives both the high word (mixed in) and the low one
        pb = [mul_wide_u32(c2[i], Uint32(ROUND_B)) for i in range(n)]
        pa = [mul_wide_u32(c0[i], Uint32(ROUND_A)) for i in range(n)]
        c0 = [Uint32(pb[i] >> Uint64(32)) ^ c1[i] ^ k0 for i in range(n)]
        c2 = [Uint32(pa[i] >> Uint64(32)) ^ c3[i] ^ k1 for i in range(n)]
        c1 = [Uint32(pb[i]) for i in range(n)]
        c3 = [Uint32(pa[i]) for i in range(n)]
        k0 = k0 + Uint32(KEY_A)
        k1 = k1 + Uint32(KEY_B)
    return [(c0[i], c1[i], c2[i], c3[i]) for i in range(n)]


@cute.jit
def philox4x32(c0: Uint32, c1: Uint32, k0: Uint32, k1: Uint32) -> tuple[Uint32, Uint32, Uint32, Uint32]:
    """philox4x32_lockstep of one counter."""
    return philox4x32_lockstep([(c0, c1)], k0, k1)[0]


class DropoutState:
    """One consumer thread's dropout constants for one tile: the Philox key, the 16-bit threshold and the counter of
    its first draw in each of its two rows (key block 0, p = lane % 4), from which a key block's draws follow; with
    saved keep bits (see below) also their buffer, the address of its first row's first draw in key tile 0 and
    whether the tile's rows are within the buffer."""

    def __init__(self, k0: Uint32, k1: Uint32, threshold: Uint32, row_counters: cute.Tensor,
                 bits: cute.Pointer = None, bits_rows: cute.Pointer = None, bits_store=None,
                 store_predicated: bool = False):
        self.k0, self.k1, self.threshold, self.row_counters = k0, k1, threshold, row_counters
        self.threshold_high = threshold << Uint32(16)
        self.bits, self.bits_rows, self.bits_store = bits, bits_rows, bits_store
        self.store_predicated = store_predicated  # bits_store an Int32 for store_byte_if, else a Boolean for `if`


@cute.jit
def dropout_state(mRng: cute.Tensor, threshold: Int32, bh: Int32, seqlen_q: Int32, seqlen_k: Int32,
                  row_half0: Int32, row_half1: Int32, lane: Int32, bits: cute.Pointer = None,
                  row0: Int32 = None, period: cutlass.Constexpr = 1, causal_offset: Int32 = None) -> DropoutState:
    """The state for a thread whose rows are row_half0 / row_half1 (query indices) of head bh = batch * heads_q +
    head; mRng: (seed, rng_offset), int64 in global memory. bits (the keep-bits variant): the buffer the forward
    saves its keep decisions in for the backward, every period-th row of tiles (kernels/keep_bits.py; in the causal
    layout where causal_offset is given); row0: the consumer's first row, a multiple of KEEP_ROWS."""
    seed = Int64(mRng[0])
    offset = Int64(mRng[1])
    draws_per_row = Int64((seqlen_k + 31) // 32 * 4)
    counters = cute.make_rmem_tensor((2,), Int64)
    for half in cutlass.range_constexpr(2):
        row = row_half0 if half == 0 else row_half1
        counters[half] = (Int64(bh) * Int64(seqlen_q) + Int64(row)) * draws_per_row + offset + Int64(lane % 4)
    bits_rows, bits_store = None, None
    if cutlass.const_expr(bits is not None):
        # one address for both rows: row_half1 = row_half0 + 8 is keep_byte's + 2
        bits_rows = bits + opaque_i64(keep_tile(bh, row0 // KEEP_ROWS, Int32(0), seqlen_q, seqlen_k, period,
                                                causal_offset)) + Int64(keep_byte(0, lane % 4, row_half0 - row0))
        # a consumer's 64 rows past seqlen_q would be the next head's tile (a 128-row tile's second half)
        bits_store = row0 < seqlen_q
        if cutlass.const_expr(period > 1):  # nor are the rows of tiles between the saved ones stored
            bits_store = cutlass.select_(row0 // KEEP_ROWS % period == 0, cutlass.select_(bits_store, Int32(1),
                                                                                          Int32(0)), Int32(0))
    return DropoutState(Uint32(seed), Uint32(seed >> Int64(32)), Uint32(threshold), counters, bits, bits_rows,
                        bits_store, period > 1)


@cute.jit
def drop_scores(acc_s: cute.Tensor, tScS0: cute.Tensor, col0: Int32, state: DropoutState):
    """Zero the probabilities in acc_s (a wgmma score tile, after the row sums took them) of the keys dropout drops;
    with saved bits, also store each draw's keep byte. tScS0: the accumulator's coordinates for thread 0 (static;
    rows 0 / 8, keys 2p + {0, 1} + 8k less 2p); col0: the tile's first key, a multiple of 32 (of KEEP_KEYS with
    saved bits, whose key tile it is: the forward's 128-key blocks)."""
    n = cute.size(acc_s)
    block0 = Int64(col0 // 32 * 4)
    for half in cutlass.range_constexpr(2):
        for a in cutlass.range_constexpr(n // 16):  # 32-key blocks: 8 of the thread's values per row each
            counter = state.row_counters[half] + block0 + Int64(4 * a)
            words = philox4x32(Uint32(counter), Uint32(counter >> Int64(32)), state.k0, state.k1)
            byte = Uint32(0)
            for i in cutlass.range_constexpr(n):
                row, col = tScS0[i]
                if cutlass.const_expr(row // 8 % 2 == half and col // 32 == a):
                    word = words[col % 32 // 8]
                    # high half: word >= threshold << 16 iff word >> 16 >= threshold (no shift per key)
                    keep = (word >= state.threshold_high) if cutlass.const_expr(col % 2 == 1) else (
                        (word & Uint32(HALF_MASK)) >= state.threshold)
                    acc_s[i] = Float32(cutlass.select_(keep, acc_s[i], Float32(0.0)))
                    if cutlass.const_expr(state.bits is not None):
                        bit = Uint32(1 << keep_bit(col % 32 // 8, col % 2))
                        byte = byte | Uint32(cutlass.select_(keep, bit, Uint32(0)))
            if cutlass.const_expr(state.bits is not None):
                at = Int64(col0 // KEEP_KEYS) * Int64(KEEP_TILE_BYTES) + Int64(keep_byte(a, 0, 8 * half))
                if cutlass.const_expr(state.store_predicated):
                    store_byte_if(state.bits_rows + at, byte, state.bits_store)
                else:
                    dst = cute.make_tensor(state.bits_rows + at, cute.make_layout(1))
                    store = state.bits_store
                    if store:
                        dst[0] = cutlass.Uint8(byte)


# Saved keep bits (d=128 with gradients, within kernels/keep_bits.py's KEEP_BITS_BUDGET, its layout): the
# forward stores each draw's eight keep decisions as one byte (drop_scores), and the backward's drawing warps load a
# step's bytes instead of drawing them again (load_backward_bits; ten Philox rounds per draw in two warps set the
# backward's pace: sixteenth session).
@cute.jit
def keep_tile(bh: Int32, row_block: Int32, key_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
              period: cutlass.Constexpr = 1, causal_offset: Int32 = None) -> Int64:
    """Byte offset of tile (bh, row_block, key_block) in the saved bits (row_block % period == 0: a saved one; in
    the causal layout where causal_offset is given: key_block < keep_row_width)."""
    saved = ((seqlen_q + KEEP_ROWS - 1) // KEEP_ROWS + period - 1) // period
    ops = dsl_ops(cutlass.max, cutlass.min, cutlass.select_)
    head_tiles = keep_row_start(saved * period, seqlen_k, period, causal_offset, ops)
    start = keep_row_start(row_block, seqlen_k, period, causal_offset, ops)
    return (Int64(bh) * Int64(head_tiles) + Int64(start) + Int64(key_block)) * Int64(KEEP_TILE_BYTES)


@cute.jit
def zero_unvisited_keep_tiles(bits: cute.Pointer, bh: Int32, row0: Int32, seqlen_q: Int32, seqlen_k: Int32,
                              n_blocks: Int32, tid: Int32, period: cutlass.Constexpr = 1, causal_offset: Int32 = None):
    """A causal forward's consumer (thread tid of 128, rows row0 ... row0 + 63: one tile row of the saved bits):
    zeros in the tiles of its row that it did not visit (key blocks n_blocks ... keep_row_width - 1: in the causal
    layout at most one, the second 64 rows of a 128-query tile), 8 bytes a thread, so that the whole buffer is
    defined (the op's output; no backward step reads those tiles). Saved rows of tiles only (period). (The address
    from the bits' base again, not from dropout_state's: with that one used after the loops, ptxas built their keep
    bytes in 20 % more instructions.)"""
    limit = seqlen_q
    if cutlass.const_expr(period > 1):
        limit = cutlass.select_(row0 // KEEP_ROWS % period == 0, seqlen_q, Int32(0))
    if row0 < limit:
        tile = opaque_i64(keep_tile(bh, row0 // KEEP_ROWS, n_blocks, seqlen_q, seqlen_k, period, causal_offset))
        width = keep_row_width(row0 // KEEP_ROWS, seqlen_k, causal_offset,
                               dsl_ops(cutlass.max, cutlass.min, cutlass.select_))
        for _ in cutlass.range(n_blocks, width, unroll=1):
            dst = cute.make_tensor(cute.recast_ptr((bits + tile + Int64(8 * tid)).align(8), dtype=Uint64),
                                   cute.make_layout(1))
            dst[0] = Uint64(0)
            tile = tile + Int64(KEEP_TILE_BYTES)


# The backward (flash_bwd_ws): its S^T accumulators hold a thread's two keys r, r + 8 (rows) against queries
# 2 (lane % 4) + {0, 1} + 8k (columns), so a draw (one query, one 32-key block, one p) decides keys of four MMA
# threads, two bits each (lanes l and l + 4, whose keys differ in h; warps 2m and 2m + 1, in w). Drawing them in the
# MMA warpgroups would cost four times the forward's Philox work per score; instead two warps of the producer
# warpgroup draw each step's bits into shared memory (BITS_STAGES deep, full / empty mbarriers), one thread per such
# group of four MMA threads, and an MMA thread reads its bits with one load per step: bit 2q + j of its word w
# (q = 2k + c, the query's column index among its 2 * tile_m / 8 columns, j = 0 for key r, 1 for r + 8; word w
# holds bits 32w ... 32w + 31).
BITS_STAGES = 3  # the drawing warps up to two steps ahead of the MMA warpgroups (2: one)
# Draws go four at a time (philox4x32_lockstep): one draw per loop iteration left ptxas a single dependent chain (each
# round's multiplies wait on the last), and unrolling by 2 or 4 did not interleave them (the SASS kept one chain at a
# time)
BITS_WARPS = (2, 3)  # the producer warpgroup's warps that draw (0 loads Q / dO, 1 writes dQ)
MMA_THREADS = 256
DRAW_BARRIER = 4  # named barrier of a drawing warpgroup's 128 threads (draw_backward_bits' halves; the backward's 0-3
# are __syncthreads', the MMA warpgroups' and their epilogues')


def bits_words(tile_m: int) -> int:
    """32-bit words of keep bits per MMA thread and step: 2 keys x tile_m / 4 queries."""
    return tile_m // 64


@cute.jit
def draw_backward_bits(sBits: cute.Tensor, bars: cute.Pointer, mRng: cute.Tensor, threshold: Int32, gt: Int32,
                       key_block0: Int32, bh0: Int32, heads_step: Int32, seqlen_q: Int32, seqlen_k: Int32,
                       step: Int32, row0: Int32, tile_m: cutlass.Constexpr, halves: cutlass.Constexpr = 1,
                       chains: cutlass.Constexpr = 4):
    """Drawing thread gt (0 ... 64 halves - 1) of one step: the keep bits of its four MMA threads (see above) into stage
    step % BITS_STAGES of sBits ((stage, MMA thread, word) uint32), then an arrival on that stage's full barrier
    (bars: BITS_STAGES full barriers, then BITS_STAGES empty ones); waits for the stage to be empty first. key_block0:
    the CTA's first 32-key block; bh0 + heads_step: the step's head index batch * heads_q + head; row0: the step's
    first query row. halves (2): threads gt and gt + 64 each draw half of the group's queries into the same words,
    which the first half empties and all 128 drawing threads then wait for on named barrier DRAW_BARRIER before
    their ORs; chains: draws per loop iteration, their Philox rounds in lockstep (2 or 4)."""
    stage = step % BITS_STAGES
    if step >= BITS_STAGES:
        cute.arch.mbarrier_wait(bars + BITS_STAGES + stage, (step // BITS_STAGES - 1) % 2)
    half, group = 0, gt  # the whole group's queries (halves == 1: gt < 64)
    if cutlass.const_expr(halves > 1):
        half, group = gt // 64, gt % 64
    wg, m, lp = group // 32, (group % 32) // 16, group % 16
    lane0 = (lp // 4) * 8 + lp % 4  # the group's h = 0 lane; p = lane0 // 8
    seed = Int64(mRng[0])
    k0, k1 = Uint32(seed), Uint32(seed >> Int64(32))
    thr = Uint32(threshold)
    thr_high = thr << Uint32(16)
    per_row = Int64((seqlen_k + 31) // 32 * 4)
    base = ((Int64(bh0 + heads_step) * Int64(seqlen_q) + Int64(row0 + 2 * (lane0 % 4))) * per_row + Int64(mRng[1])
            + Int64(4 * (key_block0 + 2 * wg + m) + lp // 4))
    per_iteration = chains // 2  # query columns k per loop iteration (each draw decides both c of one k)
    iterations = 8 // per_iteration // halves  # of the word's 8 k, per drawing thread
    for w in cutlass.range_constexpr(bits_words(tile_m)):
        words_w = [sBits.iterator + cute.crd2idx((stage, wg * 128 + (2 * m + x) * 32 + lane0 + 4 * h, w), sBits.layout)
                   for x in range(2) for h in range(2)]  # (x: warp 2m + x, h: lane lane0 + 4h)
        if cutlass.const_expr(halves == 1):
            for i in cutlass.range_constexpr(4):
                cute.arch.atomic_and(words_w[i], Uint32(0))  # this step's word starts empty (ordered before the ORs)
        else:
            if half == 0:
                for i in cutlass.range_constexpr(4):
                    cute.arch.atomic_and(words_w[i], Uint32(0))
            cute.arch.barrier(barrier_id=DRAW_BARRIER, number_of_threads=64 * halves)  # emptied before any OR
        # each draw's bits go to shared memory at once (atomic ORs): no word of bits stays in registers, which the
        # drawing warps have few of (flash_bwd_ws.DRAW_REGS: the producer warpgroup's 56, 40 in the twenty-ninth
        # session, when 232 for the MMA warpgroups no longer made ptxas serialise their wgmmas; 240 beside more than
        # 24 exceeds the CTA's pool, and the MMA warpgroups' setmaxnreg.inc waited forever on the H200; DRAW_WG_REGS:
        # a drawing warpgroup's 40). With the bits in registers the kernel ran 4-6 % slower (sixteenth session).
        # `chains` draws at a time, queries 8k + c for k = kbase + g (g < chains / 2, c in {0, 1}; counters per_row
        # apart), their Philox rounds in lockstep: two at a time gave +3 % on the H200 at 24 registers, +7-9 % more
        # at 40; four need 56 (at 40 ptxas spilled 60 bytes) and gave +5-6 % more (thirtieth session)
        for it in cutlass.range(iterations, unroll=1):
            kbase = (half * iterations + it) * per_iteration
            counter = base + Int64(8 * (8 * w + kbase)) * per_row  # query 8 (8w + kbase) of the group's columns
            counters = [counter + Int64(8 * g + c) * per_row for g in range(per_iteration) for c in range(2)]
            draws = philox4x32_lockstep([(Uint32(x), Uint32(x >> Int64(32))) for x in counters], k0, k1)
            for x in cutlass.range_constexpr(2):
                for h in cutlass.range_constexpr(2):
                    # the iteration's bits of the word at compile-time positions, shifted once (a runtime shift
                    # per bit cost 16 instructions an iteration)
                    part = Uint32(0)
                    for g in cutlass.range_constexpr(per_iteration):
                        for c in cutlass.range_constexpr(2):  # query 8k + c, k = kbase + g: bit 2 qq + j, qq = 2k + c
                            for j in cutlass.range_constexpr(2):  # key r (word 2x) or r + 8 (word 2x + 1), half h
                                word = draws[2 * g + c][2 * x + j]
                                keep = (word >= thr_high) if h == 1 else ((word & Uint32(HALF_MASK)) >= thr)
                                part = part | Uint32(cutlass.select_(keep, Uint32(1 << (4 * g + 2 * c + j)),
                                                                     Uint32(0)))
                    cute.arch.atomic_or(words_w[2 * x + h], part << Uint32(4 * kbase))
    cute.arch.mbarrier_arrive(bars + stage)


@cute.jit
def load_backward_bits(sBits: cute.Tensor, bars: cute.Pointer, bits: cute.Pointer, tile: Int64, gt: Int32,
                       step: Int32, halves: cutlass.Constexpr = 1):
    """draw_backward_bits from the forward's saved bits (64-row steps): drawing thread gt's 16 bytes of the step's
    tile (byte offset `tile` in `bits`) into the words of its four MMA threads, plain stores (each thread owns its
    words whole), then the arrival on the stage's full barrier. The loads are issued before the wait for the stage.
    halves (2: a drawing warpgroup of 128 threads, whose steps between saved rows of tiles draw): threads gt and
    gt + 64 load the same bytes, the first stores them, both arrive."""
    stage = step % BITS_STAGES
    group = gt
    if cutlass.const_expr(halves > 1):
        group = gt % 64
    # 16-byte aligned (the buffer is; tiles and threads are 16-byte multiples): one vector load
    src = cute.make_tensor(cute.recast_ptr((bits + tile + Int64(16 * group)).align(16), dtype=Uint32),
                           cute.make_layout(4))
    loaded = src.load()
    regs = [loaded[i] for i in range(4)]  # bytes 4 i ... 4 i + 3 (queries q of the drawing thread) of word i
    if step >= BITS_STAGES:
        cute.arch.mbarrier_wait(bars + BITS_STAGES + stage, (step // BITS_STAGES - 1) % 2)
    wg, m, lp = group // 32, (group % 32) // 16, group % 16
    lane0 = (lp // 4) * 8 + lp % 4
    words = []
    for x in cutlass.range_constexpr(2):
        for h in cutlass.range_constexpr(2):
            # bits 2 q + j of the MMA thread's word: bits keep_bit(2 x + j, h) = s + j of byte q
            s = keep_bit(2 * x, h)
            word = Uint32(0)
            for i in cutlass.range_constexpr(4):
                v = (regs[i] >> Uint32(s)) & Uint32(0x03030303)  # two bits at 8 b of each byte b
                v = (v | (v >> Uint32(6))) & Uint32(0x000F000F)
                v = (v | (v >> Uint32(12))) & Uint32(0xFF)  # ... at 2 b
                word = word | (v << Uint32(8 * i))
            if cutlass.const_expr(halves == 1):
                sBits[stage, wg * 128 + (2 * m + x) * 32 + lane0 + 4 * h, 0] = word
            words.append(word)
    if cutlass.const_expr(halves > 1):
        if gt < 64:
            _store_words(sBits, stage, wg, m, lane0, words)
    cute.arch.mbarrier_arrive(bars + stage)


@cute.jit
def _store_words(sBits: cute.Tensor, stage: Int32, wg: Int32, m: Int32, lane0: Int32, words: list):
    """The four MMA threads' words (x, h order) of load_backward_bits into the stage."""
    for x in cutlass.range_constexpr(2):
        for h in cutlass.range_constexpr(2):
            sBits[stage, wg * 128 + (2 * m + x) * 32 + lane0 + 4 * h, 0] = words[2 * x + h]


@cute.jit
def read_backward_bits(sBits: cute.Tensor, bars: cute.Pointer, step: Int32, thread: Int32, bits: cute.Tensor):
    """MMA thread `thread` (0 ... 255): its keep bits of one step into `bits` (words), then the stage is released."""
    stage = step % BITS_STAGES
    cute.arch.mbarrier_wait(bars + stage, (step // BITS_STAGES) % 2)
    for w in cutlass.range_constexpr(cute.size(bits)):
        bits[w] = sBits[stage, thread, w]
    cute.arch.mbarrier_arrive(bars + BITS_STAGES + stage)


@cute.jit
def backward_keep(bits: cute.Tensor, row: int, col: int):
    """Whether the MMA thread keeps its S^T value at thread 0's coordinates (row: key 0 or 8, col: query 8k + c)."""
    pos = 2 * (2 * (col // 8) + col % 2) + row // 8 % 2
    return (bits[pos // 32] >> Uint32(pos % 32)) & Uint32(1) != Uint32(0)
