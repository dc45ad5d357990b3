"""Device-side pieces shared by the sm90 forward kernels (flash_fwd, flash_fwd_ws): the tensor views, score
masking, the online softmax step and the epilogue of one 64-row wgmma tile.

Accumulator convention (wgmma m64nNk16, fp32, one warpgroup): per thread, values of two rows (r and r + 8)
in groups of four; value i is in row half (i // 2) % 2, and the four threads of a quad share the rows.
Row maxima are kept in log2 units (scores times scale * log2(e)); the scale must be positive.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op, extract_mlir_values, new_from_mlir_values


def own_copy(mma: cute.TiledMma) -> cute.TiledMma:
    """A copy of an MMA for one branch of the kernel: its ACCUMULATE field is set inside the branch, and a set on an
    object defined outside a runtime branch leaves that object holding a value the branch defines (the IR then fails
    to verify: "operand does not dominate this use")."""
    return new_from_mlir_values(mma, extract_mlir_values(mma))


def select_i32(cond, a, b) -> Int32:
    """cutlass.select_ of two integers (Python ints or Int32) as Int32 (for _schedule's plain integer code)."""
    return cutlass.select_(cond, Int32(a), Int32(b))


class ForwardVariant:
    """Compile-time configuration (dtype, head_dim, causal and its alignment, head_dim_v: V's and O's head dim,
    head_dim where None) of one forward kernel variant."""

    def __init__(self, dtype: type, head_dim: int, causal: bool, bottom_right: bool, head_dim_v: int | None = None):
        self.dtype, self.head_dim = dtype, head_dim
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        self.causal, self.bottom_right = causal, bottom_right and causal


def make_tiled_mmas(dtype: type, tile_m: int, tile_n: int, head_dim: int,
                    head_dim_v: int | None = None) -> tuple[cute.TiledMma, cute.TiledMma]:
    """One warpgroup's wgmma for S = Q K^T (tile_m x tile_n, both operands from shared memory, K-major) and
    for O += P V (tile_m x head_dim_v (head_dim where None), P from registers, V MN-major). Call while tracing."""
    mma_qk = sm90.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, Float32, (1, 1, 1),
                                         (tile_m, tile_n))
    mma_pv = sm90.make_trivial_tiled_mma(dtype, dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32, (1, 1, 1),
                                         (tile_m, head_dim if head_dim_v is None else head_dim_v),
                                         a_source=warpgroup.OperandSource.RMEM)
    return mma_qk, mma_pv


@cute.jit
def sdpa_views(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor):
    """Views of SDPA-layout tensors in the TMA/MMA-friendly mode order: (s, d, h, b) for Q, K, O; (d, s, h, b)
    for V (the B operand of P V, contiguous along its N = d mode); (s, h, b) for the LSE."""
    q = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[2, 3, 1, 0]))
    k = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[2, 3, 1, 0]))
    v = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[3, 2, 1, 0]))
    o = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[2, 3, 1, 0]))
    lse = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
    return q, k, v, o, lse


def kept_elements(bound, minimum, maximum, elements: int):
    """How many of a row half's accumulator values (elements 0, 1, 2, ... in register order) lie left of column
    `bound` (counted from the thread's first column): element e sits at column 8 * (e // 2) + e % 2 (the wgmma
    accumulator's pairs, 8 columns apart), so the count is bound // 8 * 2 + min(bound % 8, 2), clamped to
    [0, elements]. Plain integer code: Python ints in tests, Int32 in the kernel (`minimum` / `maximum`: the caller's
    min and max)."""
    bound = maximum(bound, 0)
    return minimum(bound // 8 * 2 + minimum(bound % 8, 2), elements)


@dsl_user_op
def _shr_u32(value: Uint32, shift: Uint32, *, loc=None, ip=None) -> Uint32:
    """value >> shift as PTX's shr.u32, which gives 0 for shifts of 32 or more (LLVM's lshr would be poison)."""
    word = llvm.inline_asm(T.i32(), [Uint32(value).ir_value(loc=loc, ip=ip), Uint32(shift).ir_value(loc=loc, ip=ip)],
                           "shr.u32 $0, $1, $2;", "=r,r,r", has_side_effects=False, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(word)


@cute.jit
def mask_scores(acc_s: cute.Tensor, tScS: cute.Tensor, tScS0: cute.Tensor, row0: Int32, col0: Int32, seqlen_k: Int32,
                offset: Int32, causal: cutlass.Constexpr):
    """-inf for keys past seqlen_k (TMA zero-filled them) and, when causal, for keys after the diagonal: key j
    is visible to query row i when j < seqlen_k and j <= i + offset. (row0, col0): the tile's first row and key.
    tScS0: thread 0's coordinates (compile-time; a thread's are those plus its first value's, tScS[0]). Per row half
    the visible values are a prefix of the thread's values in register order (kept_elements): one mask word
    0xFFFFFFFF >> (32 - kept) per half, then per value a test of a compile-time bit and one select, which ptxas turns
    into R2P (eight predicates per instruction) and FSEL (FA4's form: 98 SASS instructions per masked 64-score block at
    d=64 against 132 with a compare per value, and 234 before that with a runtime column compared with both
    bounds)."""
    first_col = col0 + tScS[0][1]
    elements = cute.size(acc_s) // 2  # per row half
    for half in cutlass.range_constexpr(2):  # the accumulator's two rows per thread
        bound = seqlen_k - first_col  # columns (from this thread's first) at or past it are hidden
        if cutlass.const_expr(causal):
            bound = cutlass.min(bound, row0 + tScS[half * 2][0] + offset + 1 - first_col)
        kept = kept_elements(bound, cutlass.min, cutlass.max, elements)
        for chunk in cutlass.range_constexpr(cute.ceil_div(elements, 32)):
            # bit e of the chunk's word: element 32 * chunk + e is visible
            word = _shr_u32(Uint32(0xFFFFFFFF), Uint32(cutlass.max(32 * (chunk + 1) - kept, 0)))
            for e in cutlass.range_constexpr(32 * chunk, min(32 * (chunk + 1), elements)):
                i = half * 2 + (e // 2) * 4 + e % 2  # the value index of element e of this row half
                visible = cutlass.Boolean(word & (Uint32(1) << (e - 32 * chunk)))
                acc_s[i] = cutlass.select_(visible, acc_s[i], -Float32.inf)


@cute.jit
def load_key_words(mWords: cute.Tensor, block: Int32, words: cute.Tensor):
    """The key mask's words of one key block of 32 * size(words) keys into `words` (mWords: the row of this (head,
    batch), its mask words then its key bound (ops.cute_flash.key_words); bit j % 32 of word j // 32 is key j, 1 =
    attend; words past the mask words read 0, hiding their keys). Every thread loads the same words."""
    n = cute.size(words)
    for w in cutlass.range_constexpr(n):
        idx = block * n + w
        word = cutlass.Uint32(0)
        if idx < mWords.shape[0] - 1:
            word = cutlass.Uint32(mWords[idx])
        words[w] = word


@cute.jit
def mask_keys(acc_s: cute.Tensor, tScS0: cute.Tensor, words: cute.Tensor, lane: Int32):
    """-inf for the scores of keys the key mask hides (`words` from load_key_words). tScS0: the accumulator's
    coordinates for thread 0, static: value i's column is tScS0[i][1] + 2 * (lane % 4) (the wgmma accumulator's
    quad layout), so after one shift per word every test is at a compile-time bit, once per column for both row
    halves (values i and i + 2), and selects rather than branches (the lanes of a warp hold different keys). A
    block whose keys are all visible (the same words in every thread: a uniform branch) skips the tests."""
    n = cute.size(words)
    open_keys = words[0]
    for w in cutlass.range_constexpr(1, n):
        open_keys = open_keys & words[w]
    if open_keys != cutlass.Uint32(0xFFFFFFFF):
        shift = cutlass.Uint32((lane % 4) * 2)
        shifted = cute.make_rmem_tensor((n,), cutlass.Uint32)
        for w in cutlass.range_constexpr(n):
            shifted[w] = words[w] >> shift
        for g in cutlass.range_constexpr(cute.size(acc_s) // 4):
            for j in cutlass.range_constexpr(2):
                i = 4 * g + j  # row half 0; i + 2 is the same column in row half 1
                col = tScS0[i][1]
                hidden = (shifted[col // 32] >> cutlass.Uint32(col % 32)) & cutlass.Uint32(1) == cutlass.Uint32(0)
                acc_s[i] = Float32(cutlass.select_(hidden, -Float32.inf, acc_s[i]))
                acc_s[i + 2] = Float32(cutlass.select_(hidden, -Float32.inf, acc_s[i + 2]))


@cute.jit
def online_softmax(acc_s: cute.Tensor, acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                   scale_log2: Float32):
    """Scores in acc_s become unnormalised probabilities exp2(s * scale_log2 - max); acc_o is rescaled and the
    running row max and row sum (two row halves each) are updated."""
    alpha = cute.make_rmem_tensor((2,), Float32)
    softmax_scores(acc_s, row_max, row_sum, alpha, scale_log2)
    rescale_rows(acc_o, alpha)


@cute.jit
def softmax_scores(acc_s: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, alpha: cute.Tensor,
                   scale_log2: Float32):
    """online_softmax without touching O: alpha gets the factor (per row half) by which O must be rescaled,
    so that a P V GEMM still accumulating into O can run meanwhile."""
    for half in cutlass.range_constexpr(2):
        block_max = -Float32.inf
        for i in cutlass.range_constexpr(half * 2, cute.size(acc_s), 4):
            block_max = cute.arch.fmax(block_max, cute.arch.fmax(acc_s[i], acc_s[i + 1]))
        block_max = cute.arch.fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, offset=1))
        block_max = cute.arch.fmax(block_max, cute.arch.shuffle_sync_bfly(block_max, offset=2))
        new_max = cute.arch.fmax(row_max[half], block_max * scale_log2)  # scale > 0: max commutes with it
        base = new_max
        if new_max == -Float32.inf:  # nothing visible yet in this row: keep exp2 away from inf - inf
            base = Float32(0.0)
        alpha[half] = cute.math.exp2(row_max[half] - base, fastmath=True)
        row_max[half] = new_max
        block_sum = Float32(0.0)
        for i in cutlass.range_constexpr(half * 2, cute.size(acc_s), 4):
            for j in cutlass.range_constexpr(2):
                p = cute.math.exp2(acc_s[i + j] * scale_log2 - base, fastmath=True)
                acc_s[i + j] = p
                block_sum += p
        row_sum[half] = row_sum[half] * alpha[half] + block_sum


@dsl_user_op
def _packed_pair(lo: Float32, hi: Float32, ptx_type: str, *, loc=None, ip=None) -> Uint32:
    """(lo, hi) rounded to the 16-bit `ptx_type` and packed in one word (lo in the low half), as one PTX instruction
    the compiler keeps in program order with the wgmma issues (a side-effecting asm statement)."""
    word = llvm.inline_asm(T.i32(), [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
                           f"cvt.rn.{ptx_type}x2.f32 $0, $1, $2;", "=r,f,f", has_side_effects=True,
                           is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Uint32(word)


@cute.jit
def convert_in_place(acc_s: cute.Tensor, r_p: cute.Tensor, dtype: cutlass.Constexpr):
    """r_p = acc_s in `dtype` (bf16 or fp16), converted here and not later. With the plain conversion LLVM may sink it
    past the next S = Q K^T issue (it did in the three-consumer overlap forward with the TMA-store epilogue), which
    keeps the old fp32 scores alive beside the new accumulators: 64 more registers per thread, and ptxas spilled
    556 bytes in the loop."""
    words = cute.recast_tensor(r_p, Uint32)
    ptx_type = "bf16" if cutlass.const_expr(dtype == cutlass.BFloat16) else "f16"
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = _packed_pair(acc_s[2 * i], acc_s[2 * i + 1], ptx_type)


@cute.jit
def rescale_rows(acc_o: cute.Tensor, alpha: cute.Tensor):
    """acc_o's values of row half h times alpha[h]."""
    for half in cutlass.range_constexpr(2):
        for i in cutlass.range_constexpr(half * 2, cute.size(acc_o), 4):
            acc_o[i] = acc_o[i] * alpha[half]
            acc_o[i + 1] = acc_o[i + 1] * alpha[half]


@cute.jit
def finish_rows(acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, tOcO: cute.Tensor, mLSE: cute.Tensor,
                row0: Int32, seqlen_q: Int32, head: Int32, batch: Int32, lane: Int32, out_scale: Float32 = None):
    """acc_o becomes O / l (0 for a row that saw no key, l = 0) and the natural-log LSE of each row goes into mLSE
    (s, h, b) (-inf where l = 0), rows past seqlen_q skipped. row0: the tile's first query row; out_scale (dropout:
    1 / (1 - dropout_p)) multiplies O."""
    for half in cutlass.range_constexpr(2):
        total = row_sum[half]
        total += cute.arch.shuffle_sync_bfly(total, offset=1)
        total += cute.arch.shuffle_sync_bfly(total, offset=2)
        inv = Float32(0.0)
        lse = -Float32.inf
        if total > 0.0:
            # MUFU.RCP (relative error ~2^-23, total >= 1: its row's maximum contributes exp2(0)) instead of the
            # IEEE division, whose slow-path call cost about 50 SASS instructions per tile (FA4 does the same)
            inv = cute.arch.rcp_approx(total)
            if cutlass.const_expr(out_scale is not None):
                inv = inv * out_scale
            lse = (row_max[half] + cute.math.log2(total, fastmath=True)) * math.log(2.0)
        for i in cutlass.range_constexpr(half * 2, cute.size(acc_o), 4):
            acc_o[i] = acc_o[i] * inv
            acc_o[i + 1] = acc_o[i + 1] * inv
        row = row0 + tOcO[half * 2][0]
        if lane % 4 == 0 and row < seqlen_q:
            mLSE[row, head, batch] = lse


@cute.jit
def store_rows(acc_o: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, tOcO: cute.Tensor, gO: cute.Tensor,
               mLSE: cute.Tensor, row0: Int32, seqlen_q: Int32, head: Int32, batch: Int32, lane: Int32,
               out_scale: Float32 = None):
    """Epilogue of one 64-row tile from registers: finish_rows, then O into gO value by value (rows past seqlen_q
    skipped)."""
    finish_rows(acc_o, row_max, row_sum, tOcO, mLSE, row0, seqlen_q, head, batch, lane, out_scale)
    for i in cutlass.range(cute.size(acc_o), unroll_full=True):
        if row0 + tOcO[i][0] < seqlen_q:
            gO[tOcO[i]] = acc_o[i].to(gO.element_type)
