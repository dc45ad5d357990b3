"""Device helpers shared by the Triton forward and backward kernels."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): scores live in the log2 domain so exp2 is one MUFU op
LN2 = tl.constexpr(0.6931471805599453)
# Lazy rescale (forward, opt-in per tile config): the running max is moved only when it grows by more than
# this many log2 units (FlashAttention-4's threshold), so probabilities stay <= 2**8 (fp16 / bf16 safe).
RESCALE_LOG2 = tl.constexpr(8.0)


@triton.jit
def _grid_order(pid, NUM_BLOCKS, BLOCK_MAJOR: tl.constexpr):
    """(bh, block) of program pid in a 1-D grid of NUM_BLOCKS blocks per (batch, head): head-major (a head's blocks
    adjacent, so running programs share its K / V or Q / dO in L2) or, BLOCK_MAJOR, block-major (every head's
    block 0, then every block 1, ...: with causal masking the longest programs of all heads first and the shortest
    in the tail, FA3's LPT idea; the general dK / dV kernel's KEY_MAJOR is this order)."""
    if BLOCK_MAJOR:
        num_bh = tl.num_programs(0) // NUM_BLOCKS
        return pid % num_bh, pid // num_bh
    else:
        return pid // NUM_BLOCKS, pid % NUM_BLOCKS


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
def _q_bounds(n0, SEQ_Q, causal_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              ALIGN: tl.constexpr = 1):
    """Query range of key block [n0, n0 + BLOCK_N) (the dK / dV kernels' counterpart of _kv_bounds).

    Row i sees key j iff not CAUSAL or j <= i + causal_offset. Returns (m_lo, m_mid): rows below m_lo see none of
    the block, rows [m_lo, m_mid) its diagonal (masked), rows from m_mid on all of it; m_mid - m_lo is a multiple of
    BLOCK_M unless clipped at SEQ_Q. (0, 0) without CAUSAL. ALIGN: m_lo rounded down to a multiple of it (the rows
    added see none of the block: masked).
    """
    if CAUSAL:
        m_lo = tl.minimum(tl.maximum(n0 - causal_offset, 0), SEQ_Q)
        if ALIGN > 1:
            m_lo = m_lo // ALIGN * ALIGN
        diag_rows = tl.maximum(n0 + BLOCK_N - 1 - causal_offset - m_lo, 0)
        m_mid = tl.minimum(m_lo + tl.cdiv(diag_rows, BLOCK_M) * BLOCK_M, SEQ_Q)
    else:
        m_lo = 0
        m_mid = 0
    return m_lo, m_mid


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
def _ds_dot(ds, x, acc, EXACT_DS: tl.constexpr):
    """acc + ds @ x for the fp32 dS: dS rounded to x's dtype first (FlashAttention's product), or, EXACT_DS (calls
    small enough to be host-bound: flash_bwd.EXACT_DS_MAX_SCORES), dS as the sum of its rounding and the rounding of the
    remainder, two tensor-core products (twice x's mantissa bits of dS; an fp32 FMA product spilled 0.8-1.6 KB at
    d=128 on sm90)."""
    hi = ds.to(x.dtype)
    if EXACT_DS:
        lo = (ds - hi.to(tl.float32)).to(x.dtype)
        return tl.dot(lo, x, tl.dot(hi, x, acc))
    else:
        return tl.dot(hi, x, acc)


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


@triton.jit
def _bool_block(cond, N: tl.constexpr):
    """The scalar condition cond as an (N,) block of bools, to be and-ed into a block mask. Written `mask & cond`,
    Triton's interpreter splats the scalar comparison as int32 (the dtype of the values it compared), and Triton
    3.9's interpreter rejects int32 load and store masks; compiled, this is the same splat of an i1."""
    return tl.where(cond, tl.full([N], 1, tl.int1), False)


# ---------------------------------------------------------------------------------------------
# Optional score features (attn_mask, ALiBi, softcap, sliding window, dropout). Every one is
# gated by a constexpr at the call site: a launch without features compiles none of this.
# ---------------------------------------------------------------------------------------------

MASK_NONE = tl.constexpr(0)
MASK_BOOL = tl.constexpr(1)
MASK_ADD = tl.constexpr(2)
# The same two kinds for a mask whose query stride is 0 (a key-padding mask (b, 1, 1, sk), or one expanded
# from it): the tile reads one row of the mask and broadcasts it, instead of one byte per score.
MASK_BOOL_ROW = tl.constexpr(3)
MASK_ADD_ROW = tl.constexpr(4)
# A bool key mask packed 32 keys per int32 word (bit j % 32 of word j // 32: _mask_bounds.row_bits), for large
# calls: a tile reads BLOCK_N / 32 words instead of one byte per key and column of the thread.
MASK_BITS_ROW = tl.constexpr(5)


@triton.jit
def _tanh(x):
    """tanh from one exp2 (saturates to +-1 without inf/inf): 1 - 2 / (e^{2x} + 1)."""
    return 1.0 - 2.0 / (tl.math.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def _load_mask(qi, kj, col0, SEQ_Q, SEQ_K, Mask, stride_mm, stride_mn, MASK_KIND: tl.constexpr):
    """The attn_mask values of scores (qi, kj) (indices that broadcast to the score tile's shape, either
    orientation; kj in [col0, col0 + BLOCK) for the tile's first key col0, a multiple of min(BLOCK, 32)), for
    _score_mods: uint8 / int32 for a bool mask (0 = hidden; 1 outside the sequences, but 0 for the packed
    kind, whose words hide the keys past SEQ_K), fp32 for an additive one (0 outside). A row kind reads kj
    alone (one load per key, broadcast over queries); the packed kind reads the tile's words and extracts a
    bit per key.

    The kernels call this before the tile's QK^T dot. ptxas may still wait for byte loads only after the
    MMA, one after another when registers are short (seen at 249 registers on sm90): the packed kind has
    no per-key load."""
    if MASK_KIND == MASK_BITS_ROW:
        # Every thread reads the same few words (scalar loads, issued once per tile); no per-key load whose
        # result ptxas would have to keep in a register across the MMA (at 240+ registers it serialised the
        # byte loads of MASK_BOOL_ROW instead: one global round trip after another).
        BLOCK: tl.constexpr = kj.numel
        WORDS: tl.constexpr = (BLOCK + 31) // 32
        w0 = col0 // 32
        if BLOCK >= 32:
            rel = kj - col0  # col0 is a multiple of 32: the key's bit in the tile's words, loop invariant
        else:
            rel = kj - w0 * 32
        word = tl.load(Mask + w0 * stride_mn, mask=w0 * 32 < SEQ_K, other=0)
        for i in tl.static_range(1, WORDS):
            word_i = tl.load(Mask + (w0 + i) * stride_mn, mask=(w0 + i) * 32 < SEQ_K, other=0)
            word = tl.where(rel >= 32 * i, word_i, word)
        return (word >> (rel % 32)) & 1
    elif MASK_KIND == MASK_BOOL_ROW or MASK_KIND == MASK_ADD_ROW:
        return _mask_values_at(Mask + kj.to(tl.int64) * stride_mn, kj < SEQ_K, MASK_KIND - 2)
    elif MASK_KIND != MASK_NONE:
        in_bounds = (qi < SEQ_Q) & (kj < SEQ_K)
        return _mask_values_at(Mask + qi.to(tl.int64) * stride_mm + kj.to(tl.int64) * stride_mn, in_bounds,
                               MASK_KIND)
    else:
        return 0


@triton.jit
def _mask_values_at(ptrs, in_bounds, MASK_KIND: tl.constexpr):
    """attn_mask values at ptrs (MASK_BOOL: uint8, 1 outside in_bounds; MASK_ADD: fp32, 0 outside)."""
    if MASK_KIND == MASK_BOOL:
        return tl.load(ptrs, mask=in_bounds, other=1)
    else:
        return tl.load(ptrs, mask=in_bounds, other=0.0).to(tl.float32)


@triton.jit
def _masked_scores(s, mask_vals, MASK_KIND: tl.constexpr):
    """Scores s (log2 domain) with the attn_mask values applied: -inf where a bool mask is 0, plus log2(e) *
    an additive mask."""
    if MASK_KIND == MASK_BOOL or MASK_KIND == MASK_BOOL_ROW or MASK_KIND == MASK_BITS_ROW:
        return tl.where(mask_vals != 0, s, float("-inf"))
    elif MASK_KIND != MASK_NONE:
        return s + mask_vals * LOG2E
    else:
        return s


@triton.jit
def _score_mods(qk, qi, kj, qk_scale, softcap_in, mask_vals, slope2, alibi_offset,
                MASK_KIND: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain with the optional features; returns (s, t).

    qi / kj are query / key indices that broadcast to qk's shape (either orientation); mask_vals is
    _load_mask's result for them.
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
    return _masked_scores(s, mask_vals, MASK_KIND), t


# Dropout draws (the kernels' DROPOUT constexpr, chosen on the host by _features.dropout_draw):
DROP_WORDS = tl.constexpr(1)  # one 32-bit word per key, four keys per Philox-4x32 draw
DROP_HALVES = tl.constexpr(2)  # one 16-bit half-word per key, eight keys per draw (half the Philox work)


@triton.jit
def _dropout_keep(seed, rng_offset, bh, rows, col0, SEQ_Q, SEQ_K, drop_threshold, BLOCK_C: tl.constexpr,
                  DROPOUT: tl.constexpr):
    """Dropout keep-mask of query rows `rows` (1-D) x keys [col0, col0 + BLOCK_C) of head bh = batch *
    heads_q + head, shape (len(rows), BLOCK_C). col0 is a multiple of BLOCK_C, itself a multiple of 16
    (the kernels' key tiles are). Each key reads a fixed piece of a fixed Philox-4x32 draw, so the forward
    and both backward kernels regenerate the same mask whatever their tiling:
    - DROP_WORDS: key j of row i reads word j % 4 of the draw at counter (bh * SEQ_Q + i) * ceil(SEQ_K / 4)
      + j // 4 + rng_offset; kept iff it is >= drop_threshold = floor(p * 2**32).
    - DROP_HALVES: key j = 32a + 8w + 2p + h (h, p, w < 2, 4, 4) of row i reads half h (low 16 bits for 0)
      of word w of the draw at counter (bh * SEQ_Q + i) * 4 * ceil(SEQ_K / 32) + 4a + p + rng_offset; kept
      iff that half is >= drop_threshold = round(p * 2**16) (the host picks this only where p's rounding to
      a multiple of 2**-16 changes neither p nor 1 - p by more than 2**-13 of itself). A thread of an MMA
      accumulator holds keys 2p + {0, 1} + 8k of its rows for one p (sm80 / sm90 fragments): its keys come
      from its own draws, so the bits need no exchange between threads.
    """
    BLOCK_R: tl.constexpr = rows.shape[0]
    thr = tl.full([], drop_threshold, tl.int64).to(tl.uint32)  # an int64 argument when >= 2**31; 1 is a constexpr
    if DROPOUT == DROP_HALVES:
        A: tl.constexpr = (BLOCK_C + 31) // 32  # 32-key blocks of the tile (one for a 16-key tile)
        row_counter = ((bh.to(tl.int64) * SEQ_Q + rows.to(tl.int64)) * (((SEQ_K + 31) // 32) * 4)
                       + rng_offset)
        draws = tl.reshape((col0 // 32 + tl.arange(0, A))[:, None] * 4 + tl.arange(0, 4)[None, :], (A * 4,))
        r0, r1, r2, r3 = tl.randint4x(seed, row_counter[:, None] + draws[None, :])
        # _halves_keep(r) is (R, A, 4 [p], 2 [h]); the joins below add [x, y] for word w = 2x + y.
        keep = tl.join(tl.join(_halves_keep(tl.reshape(r0, (BLOCK_R, A, 4)), thr),
                               _halves_keep(tl.reshape(r2, (BLOCK_R, A, 4)), thr)),
                       tl.join(_halves_keep(tl.reshape(r1, (BLOCK_R, A, 4)), thr),
                               _halves_keep(tl.reshape(r3, (BLOCK_R, A, 4)), thr)))
        keep = tl.reshape(tl.permute(keep, (0, 1, 4, 5, 2, 3)), (BLOCK_R, A * 32))  # column 32a + 16x + 8y + 2p + h
        if BLOCK_C < 32:  # a 16-key tile: the half of its 32-key block at col0
            lo, hi = tl.split(tl.permute(tl.reshape(keep, (BLOCK_R, 2, 16)), (0, 2, 1)))
            keep = tl.where(col0 % 32 == 0, lo, hi)
        return keep
    else:
        groups = col0 // 4 + tl.arange(0, BLOCK_C // 4)
        row_counter = (bh.to(tl.int64) * SEQ_Q + rows.to(tl.int64)) * ((SEQ_K + 3) // 4) + rng_offset
        r0, r1, r2, r3 = tl.randint4x(seed, row_counter[:, None] + groups[None, :])
        # join(join(w0, w2), join(w1, w3)) is indexed [.., x, y] -> word 2x + y, which the row-major reshape puts
        # at column 2x + y of its group: column j reads word j % 4.
        keep = tl.join(tl.join(r0 >= thr, r2 >= thr), tl.join(r1 >= thr, r3 >= thr))
        return tl.reshape(keep, (BLOCK_R, BLOCK_C))


@triton.jit
def _halves_keep(word, thr):
    """(low 16 bits >= thr, high 16 bits >= thr) of a uint32 word, joined on a new last axis."""
    return tl.join((word & 0xFFFF) >= thr, (word >> 16) >= thr)


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


@triton.jit
def _open_key_range(lo, open_lo, open_hi, hi, b_ptr, BLOCK_N: tl.constexpr, MASK_BOUNDS: tl.constexpr):
    """A query tile's key ranges: every mask applies in [lo, open_lo) and [open_hi, hi), none in [open_lo,
    open_hi). Takes the band's ranges (multiples of BLOCK_N but hi) and, with MASK_BOUNDS, narrows them by the
    attn_mask's block bounds at b_ptr (kernels/triton/_mask_bounds.py: lo, open_lo, open_hi, hi of the tile).
    Returns lo <= open_lo <= open_hi <= hi where the ranges are not empty, all multiples of BLOCK_N but hi."""
    if MASK_BOUNDS:
        # (x // BLOCK_N) * BLOCK_N changes no value but tells the compiler that loop starts are multiples of
        # BLOCK_N: from a start of unknown alignment the K/V tile loads lose their 16-byte vectors (sm90: 700+
        # bytes of register spills at 128 x 64 tiles).
        lo = tl.maximum(lo, (tl.load(b_ptr) // BLOCK_N) * BLOCK_N)
        open_lo = tl.maximum(open_lo, (tl.load(b_ptr + 1) // BLOCK_N) * BLOCK_N)
        open_hi = tl.minimum(open_hi, (tl.load(b_ptr + 2) // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(hi, tl.load(b_ptr + 3))
    hi_blocks = (hi // BLOCK_N) * BLOCK_N
    open_lo = tl.minimum(tl.maximum(open_lo, lo), hi_blocks)
    open_hi = tl.maximum(tl.minimum(open_hi, hi_blocks), open_lo)
    return lo, open_lo, open_hi, hi


@triton.jit
def _tile_store(T, row0, n_rows, stride_row, col0, HEAD_DIM: tl.constexpr, x, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr):
    """Store the fp32 tile x into rows [row0, row0 + BLOCK_R) and columns [col0, col0 + BLOCK_C) of T (unit column
    stride), in T's dtype, dropping rows past n_rows and columns past HEAD_DIM."""
    rows = row0 + tl.arange(0, BLOCK_R)
    cols = col0 + tl.arange(0, BLOCK_C)
    ptrs = T + rows[:, None].to(tl.int64) * stride_row + cols[None, :]
    tl.store(ptrs, x.to(T.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM))


@triton.jit
def _varlen_invalid(CuSeqQ, CuSeqK, off_b, q_start, q_end, k_start, k_end, SEQ_Q, SEQ_K, TOTAL_Q, TOTAL_K):
    """Whether packed sequence off_b's boundaries are unusable (cu_seqlens live on the device, so the host cannot
    check them): a start below 0 or below the previous sequence's start, an end before its start or past the packed
    rows, or a length above max_seqlen (SEQ_Q / SEQ_K: the grid and the dropout counters assume it bounds every
    length). The kernels then read nothing of the sequence and write NaN over its rows (_nan_rows)."""
    bad = (q_start < 0) | (q_end < q_start) | (q_end > TOTAL_Q) | (q_end - q_start > SEQ_Q)
    bad = bad | (k_start < 0) | (k_end < k_start) | (k_end > TOTAL_K) | (k_end - k_start > SEQ_K)
    prev = tl.maximum(off_b - 1, 0)  # a sequence before one of negative length overlaps it: both are flagged
    return bad | ((off_b > 0) & ((tl.load(CuSeqQ + prev) > q_start) | (tl.load(CuSeqK + prev) > k_start)))


@triton.jit
def _nan_rows(T, start, row0, n_rows, total, stride_row, stride_col, N_COLS: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_C: tl.constexpr):
    """NaN into packed rows start + row0 + [0, BLOCK_R) of T (rows of an invalid sequence: _varlen_invalid), only
    those before start + n_rows and inside [0, total), over N_COLS columns (1: a row vector such as the LSE)."""
    # 16 rows per step (a loop, not unrolled): a small tile of 64-bit addresses on this cold path (sm90 compile:
    # the d=128 varlen forward spills 84 bytes with or without the chunking, all of it outside the key loops)
    CHUNK: tl.constexpr = 16 if BLOCK_R > 16 else BLOCK_R
    cols = tl.arange(0, BLOCK_C)
    nan = tl.full([CHUNK, BLOCK_C], float("nan"), dtype=tl.float32).to(T.dtype.element_ty)
    for r0 in range(row0, row0 + BLOCK_R, CHUNK):
        rows = start + r0 + tl.arange(0, CHUNK)
        ok = (r0 + tl.arange(0, CHUNK) < n_rows) & (rows >= 0) & (rows < total)
        ptrs = T + rows.to(tl.int64)[:, None] * stride_row + cols[None, :] * stride_col
        tl.store(ptrs, nan, mask=ok[:, None] & (cols[None, :] < N_COLS))
