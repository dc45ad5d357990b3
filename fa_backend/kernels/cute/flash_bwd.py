"""FlashAttention backward for Hopper (sm90a) in the CuTe DSL (issue 7).

Its numerics test (tests/kernels/cute/test_flash_bwd_gpu.py) passes on the H200 for every variant below and for
the warp-specialised kernel (flash_bwd_ws.py) with 64, 80 (d=128) and 128 (d=64) query rows per step. The compile
test (test_flash_bwd_sm90_compile.py) runs in CI. The op fa_backend::cute_flash_fwd runs it as its backward
(ops/cute_flash.py): one warpgroup at d=96, the warp-specialised kernel at d=128 (64 rows) and d=64 (128 rows),
flash_bwd_wide's at d=192 / 256 (both MMA warpgroups on one 64-key tile, split by columns).

Key-block stationary as FlashAttention-2/3's backward, no warp specialisation. With wgs=2 (d=128, FA3's tile):
two warpgroups per CTA over 128 keys share the Q / dO stages, each with its own 64 keys for S^T, dP^T, dV, dK and
half of the dQ block's columns over all 128 keys: half the Q / dO loads and dQ adds per key; 240 registers, no
spills; 5-13 % faster than one warpgroup on the H200. With one:
- one CTA = one warpgroup (128 threads) = one block of TILE_N = 64 keys of one (batch, KV head); K and V are
  loaded once by TMA; the CTA walks the query heads of its GQA group and, per head, the query blocks of
  TILE_M = 64 rows that see the key block. Q and dO come by TMA into QDO_STAGES = 2 stages: warp 0 issues
  the next block's loads while the current block's last GEMM runs, and every thread of the first 64 loads the
  next block's LSE and delta rows into registers at the start of the step (to shared memory at its end);
- transposed scores, keys on the M mode: S^T = K Q^T and dP^T = V dO^T (wgmma, both operands in shared
  memory, K-major); P^T = exp2(S^T * scale * log2(e) - LSE * log2(e)) masked; dS^T = P^T (dP^T - delta);
- dV += P^T dO and dK += dS^T Q with P^T / dS^T from registers (the S^T accumulator's value order is the A
  operand's) and dO / Q as MN-major B operands: the same shared-memory tiles as the K-major ones, viewed
  transposed (a 128-byte-swizzled K-major tile is the canonical MN-major tile of its transpose);
- dQ: dS^T goes to shared memory, dQ_block = dS K (A = dS MN-major, B = K MN-major, again transposed
  views) is added into an fp32 buffer that the host zeroes and converts to dQ = scale * dQacc in the inputs'
  dtype. By default the block goes, in its accumulator's fragment order (conflict-free stores, _dq_slot), into
  the shared memory of the step's Q and dO stage (free once the GEMMs are done; 2 CTAs per SM still fit at
  d=128), and one lane adds it with two bulk reduce-adds (_bulk.py) into a buffer of per-block chunks in that
  order (_dq_layout.dq_from_chunks reorders, scales and casts it in one Triton pass); warp 0 waits for their reads
  before it loads that stage again.
  With dq_atomic=True (the first version) by one fp32 atomic add per value into a (b, hq, sq, d) buffer; with
  dq_buffer=True (opt-in, timed neutral at d=128) through its own buffer, one CTA barrier per step.
- dS^T reaches shared memory by stmatrix (four 8 x 8 matrices per instruction), from its accumulator-ordered registers.

Inputs: q, do (b, hq, sq, d); k, v (b, hkv, sk, d), SDPA's layout, head_dim contiguous, other strides
multiples of 8 elements (TMA); lse (b, hq, sq) the forward's natural-log LSE (fp32); delta (b, hq, sq) fp32,
rowsum(dO * O). Outputs: dk, dv (b, hkv, sk, d) in the inputs' dtype, dqacc fp32 (see dQ above). Causal:
top-left or bottom-right (key j visible to query i when j <= i + offset, offset = sk - sq for bottom-right).
The scale must be positive.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._compile_cache import CACHE, CompileKey, enable_dsl_disk_cache
from ._target import compile_options

enable_dsl_disk_cache()  # before the DSL's first compile in this process

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup  # noqa: E402
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp  # noqa: E402
from cutlass.cute.runtime import make_fake_stream  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from ..triton.flash_bwd import bwd_delta  # noqa: E402
from ._bulk import bulk_reduce_add_f32  # noqa: E402
from . import _dq_layout  # noqa: E402
from ._dq_layout import dq_from_chunks  # noqa: E402
from ._fwd_parts import ForwardVariant  # noqa: E402
from .flash_fwd import _DTYPES, _dynamic  # noqa: E402

KERNEL_NAME = "flash_bwd_sm90"
HEAD_DIMS = (64, 96, 128)
WIDE_HEAD_DIMS = (192, 256)  # flash_bwd_wide.py (warp_specialized=True only)
TILE_N = 64  # keys per warpgroup: its wgmma M
TILE_M = _dq_layout.TILE_M  # query rows per step (64)
THREADS = _dq_layout.THREADS  # per warpgroup (128)
QDO_STAGES = 2  # Q / dO / LSE / delta of the next query block load while this one is computed
WARPGROUPS = (1, 2)  # per CTA; 2 (128 keys, FA3's backward tile at d=128) needs head_dim 128
_LOG2E = math.log2(math.e)


@cute.jit
def _gemm(mma: cute.TiledMma, acc: cute.Tensor, t_a: cute.Tensor, t_b: cute.Tensor, accumulate: bool = False):
    """acc = A B (or acc += A B with `accumulate`) over the K blocks of the fragments (issued, not committed: the
    caller fences and commits)."""
    mma.set(warpgroup.Field.ACCUMULATE, accumulate)
    for kk in cutlass.range_constexpr(cute.size(t_a, mode=[2])):
        cute.gemm(mma, acc, t_a[None, None, kk], t_b[None, None, kk], acc)
        mma.set(warpgroup.Field.ACCUMULATE, True)


def _transposed(t: cute.Tensor) -> cute.Tensor:
    """The same (shared-memory) tensor with its first two modes swapped (a stage mode stays last)."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 0, *range(2, cute.rank(t.layout))]))


# The rows' LSE and delta by warp shuffles (FA4's shuffle_LSE; flash_bwd_ws's 80- and 128-row steps). In an S^T
# accumulator (m64nN: keys as rows) a thread's 2N / 8 query columns are 8k + 2 (lane % 4) + {0, 1}, k < N / 8, the
# same for the eight lanes of one lane % 4. Each lane holds the (LSE, delta) of up to four of them for the step
# instead: columns 8k + 2 (lane % 4) + {0, 1} with k in {2 (lane // 4), 2 (lane // 4) + 1} at 128 rows, in
# {lane // 4, lane // 4 + 8} at fewer, two 16-byte reads (sRows keeps a row's LSE and delta side by side), and every
# column's value comes from its holder by one shuffle: 8 registers a thread and no address per read, where reading
# per score cost ~180 IMAD and ~160 LDS / LDC per step at d=64, and 64 values held per thread did not fit beside the
# accumulators.
def _column_value(c: int, h: int) -> int:
    """The accumulator index of a thread's distinct query column c (of 2 * tile_m / 8) in row half h."""
    return (c % 2) + 2 * h + 4 * (c // 2)


def _shuffled_columns(held: cute.Tensor, which: int, tScS0: cute.Tensor, columns: int):
    """For each of a thread's distinct query columns in turn (a trace-time generator: each shuffle is emitted just
    before its column's use): the accumulator indices of its two values and statistic `which` of the column."""
    lane = cute.arch.lane_idx()
    for c in range(columns):
        pair = (_column_value(c, 0), _column_value(c, 1))
        yield pair, _shuffled_row(held, which, tScS0[pair[0]][1], lane, 4 * columns)  # 2 columns per 8 rows


@cute.jit
def _held_rows(sRows: cute.Tensor, stage: Int32, lane: Int32, rows: cutlass.Constexpr) -> cute.Tensor:
    """This lane's (LSE, delta) values of the step in sRows[:, :, stage] ((2, rows, stages) fp32, a row's two values
    adjacent; rows 128, or a multiple of 8 from 72 to 120): index 4 j + 2 c + w holds value w of row 8 k_j +
    2 (lane % 4) + c, k_j = 2 (lane // 4) + j at 128 rows, else lane // 4 + 8 j (a k_j past the rows reads the last
    two rows instead, which no shuffle asks of this lane)."""
    held = cute.make_rmem_tensor((8,), Float32)
    for j in cutlass.range_constexpr(2):
        row = 8 * (2 * (lane // 4) + j) + 2 * (lane % 4)
        if cutlass.const_expr(rows != 128):
            row = 8 * (lane // 4 + 8 * j) + 2 * (lane % 4)
            if cutlass.const_expr(j == 1):
                row = cutlass.min(row, Int32(rows - 2))  # in bounds: rows - 2 and rows - 1
        src = cute.make_tensor((sRows.iterator + cute.crd2idx((0, row, stage), sRows.layout)).align(16),
                               cute.make_layout(4))
        dst = cute.make_tensor(held.iterator + 4 * j, cute.make_layout(4))
        dst.store(src.load())
    return held


@cute.jit
def _shuffled_row(held: cute.Tensor, which: cutlass.Constexpr, column0: cutlass.Constexpr, lane: Int32,
                  rows: cutlass.Constexpr) -> Float32:
    """Value `which` (0: LSE, 1: delta) of the column thread 0 has at column0 (8k + c), for this lane's column
    8k + 2 (lane % 4) + c, shuffled from the lane that holds it (_held_rows)."""
    k, c = column0 // 8, column0 % 8
    if cutlass.const_expr(rows == 128):
        return cute.arch.shuffle_sync(held[4 * (k % 2) + 2 * c + which], (k // 2) * 4 + lane % 4)
    return cute.arch.shuffle_sync(held[4 * (k // 8) + 2 * c + which], (k % 8) * 4 + lane % 4)


class FlashBackwardSm90(ForwardVariant):
    """Compile-time configuration (dtype, head_dim, causal and its alignment) of one backward variant.
    dq_atomic: dQ by one atomic add per value instead of the shared-memory block and bulk reduce-adds.
    wgs: warpgroups per CTA, each with its own TILE_N keys; they share the Q / dO stages, and with 2 each computes
    half of the dQ block's columns over all 128 keys (FA3's split at d=128).
    dq_buffer: the dQ block goes through its own shared-memory buffer (not the stage's Q / dO memory) and dS through
    two alternating tiles, so that a step has one CTA barrier (dS) instead of three: each warpgroup hands its dQ
    part to its own bulk add behind barriers of its 128 threads, and step + 1's Q / dO load waits for no bulk
    read (bulk adds only)."""

    def __init__(self, dtype: type, head_dim: int, causal: bool, bottom_right: bool, dq_atomic: bool = False,
                 wgs: int = 1, dq_buffer: bool = False):
        super().__init__(dtype, head_dim, causal, bottom_right)
        self.dq_atomic = dq_atomic
        self.wgs = wgs
        self.dq_buffer = dq_buffer
        self.ds_tiles = wgs * (2 if dq_buffer else 1)  # dS tiles: one per warpgroup, twice with dq_buffer
        self.cta_warpgroups = wgs  # warpgroups launched per CTA
        # query rows per step; the warp-specialised kernel also takes FA4's 80 (d=128) and 128 (d=64), which change
        # how the warpgroups share the dQ block (dq_split)
        self.tile_m = TILE_M
        self.dq_transposed = False
        self.dq_rows = False
        self.smem_padding = 2 * 1024  # barriers and alignment
        self.key_mask = False  # the warp-specialised kernel's key-mask variant (FlashBackwardSm90WS)
        self.dropout = False  # its dropout variant
        self.deterministic = False  # its deterministic variant (dQ adds in key-block order, turn flags in mWords)
        self.key_tiles = wgs  # TILE_N-key tiles per CTA (one per warpgroup; flash_bwd_wide's share one)
        self.tma_store = False  # the warp-specialised kernel's dK / dV through sK / sV and TMA stores

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQacc: cute.Tensor, scale_log2: Float32,
                 scale: Float32, stream: Any, mWords: cute.Tensor = None, mRng: cute.Tensor = None,
                 drop_threshold=None, drop_scale=None,  # dropout variants' (Int32, Float32)
                 mBits: cute.Tensor = None):  # keep_bits variants: the forward's saved keep bits
        d = self.head_dim
        wgs = self.wgs
        q, k, v, do, dk, dv, dqacc, lse, delta, words = self._views(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mdQacc,
                                                                   mWords)

        tm = self.tile_m
        # S^T, dP^T (keys x queries, both operands K-major in shared memory)
        mma_ss = sm90.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                             (1, 1, 1), (TILE_N, tm))
        # dV, dK (keys x d): P^T / dS^T from registers, dO / Q MN-major
        mma_rs = sm90.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN, Float32,
                                             (1, 1, 1), (TILE_N, d), a_source=warpgroup.OperandSource.RMEM)
        # dQ block (queries x d / wgs columns) = dS K: both operands MN-major in shared memory (dq_transposed: the
        # block's transpose, d / wgs columns x queries = K^T dS^T, the same operands as A and B)
        mma_dq = sm90.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
                                             (1, 1, 1), self._dq_tile())
        # K and V: A operands (M = keys, K = d), one tile per warpgroup; Q and dO: B operands (N = queries, K = d),
        # QDO_STAGES deep; dS: A (M = queries, K = keys), queries contiguous, one tile per warpgroup (dq_transposed:
        # B, N = queries, the same mode order)
        sK_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_N, tm, d), self.dtype, wgs)
        sQ_layout = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_N, tm, d), self.dtype, QDO_STAGES)
        if cutlass.const_expr(self.dq_transposed):
            sdS_layout = sm90.make_smem_layout_b(LayoutEnum.COL_MAJOR, (d // wgs, tm, TILE_N), self.dtype,
                                                 self.ds_tiles)
        else:
            sdS_layout = sm90.make_smem_layout_a(LayoutEnum.COL_MAJOR, (tm, d, TILE_N), self.dtype, self.ds_tiles)
        tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_q, tma_tensor_q, tma_do, tma_tensor_do = self._tma_atoms(
            k, v, q, do, sK_layout, sQ_layout)
        # K, V, the Q and dO stages, dS, the LSE and delta stages, alignment padding and barriers: 107 KB at
        # d=128 with one warpgroup (two CTAs per SM), 147 KB with two (dq_buffer: + 32 KB of dQ block, + 16 KB of dS)
        smem_bytes = (2 * (2 * TILE_N * wgs + 2 * QDO_STAGES * tm) * d + 2 * tm * TILE_N * self.ds_tiles
                      + 2 * 4 * QDO_STAGES * tm + self.smem_padding + (4 * tm * d if self.dq_buffer else 0))
        # the warp-specialised kernel's optional arguments, in its signature's order: the key-mask words (or turn
        # flags), the dropout RNG state, threshold and scale, then dK's and dV's TMA store atoms (tma_store, whose
        # kernel gets their TMA tensors in place of dk and dv)
        optional = ()
        if cutlass.const_expr(self.key_mask or self.deterministic):
            optional = (words,)
        if cutlass.const_expr(self.dropout):
            optional = (words, mRng, drop_threshold, drop_scale)
        if cutlass.const_expr(self.tma_store):
            store = cpasync.CopyBulkTensorTileS2GOp()
            one_k = cute.slice_(sK_layout, (None, None, 0))
            tma_dk, dk = cpasync.make_tiled_tma_atom(store, dk, one_k, (TILE_N, d))
            tma_dv, dv = cpasync.make_tiled_tma_atom(store, dv, one_k, (TILE_N, self.head_dim_v))
            optional = optional + (None,) * (4 - len(optional)) + (tma_dk, tma_dv)
        if cutlass.const_expr(getattr(self, "keep_bits", False)):
            optional = optional + (None,) * (6 - len(optional)) + (mBits,)
        kernel_args = (tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_q, tma_tensor_q, tma_do, tma_tensor_do,
                       lse, delta, dk, dv, dqacc, scale_log2, scale, mma_ss, mma_rs, mma_dq,
                       sK_layout, sQ_layout, sdS_layout, *optional)
        self.kernel(*kernel_args).launch(
            grid=(cute.ceil_div(k.shape[0], TILE_N * wgs), k.shape[2], k.shape[3]),
            block=(THREADS * self.cta_warpgroups, 1, 1), smem=smem_bytes, stream=stream,
            # warp-specialised: ptxas needs one CTA per SM stated to know the entry register count that setmaxnreg
            # changes (else C7508 at d=64, "setmaxnreg ignored")
            min_blocks_per_mp=1 if self.cta_warpgroups > self.wgs else 0)

    def _views(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
               mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQacc: cute.Tensor,
               mWords: cute.Tensor = None) -> tuple:
        """The kernels' views of the (b, h, s, ...) arguments: (s, d, h, b) for q, k, v, do, dk, dv and the dQ
        accumulator (the TMA / MMA mode order), (s, h, b) for the per-row LSE and delta, (n, h, b) for the key-mask
        words or the turn flags (None where the variant takes neither)."""
        sdhb = [2, 3, 1, 0]
        q, k, v, do, dk, dv, dqacc = (cute.make_tensor(t.iterator, cute.select(t.layout, mode=sdhb))
                                      for t in (mQ, mK, mV, mdO, mdK, mdV, mdQacc))
        lse = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
        delta = cute.make_tensor(mDelta.iterator, cute.select(mDelta.layout, mode=[2, 1, 0]))
        words = None
        if self.key_mask or self.deterministic:
            words = cute.make_tensor(mWords.iterator, cute.select(mWords.layout, mode=[2, 1, 0]))
        return q, k, v, do, dk, dv, dqacc, lse, delta, words

    def _tma_atoms(self, k: cute.Tensor, v: cute.Tensor, q: cute.Tensor, do: cute.Tensor,
                   sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
                   sV_layout: cute.ComposedLayout = None, sdO_layout: cute.ComposedLayout = None) -> tuple:
        """TMA load atoms and their tensors for K, V (one TILE_N-key tile of sK_layout, sV_layout for V where given)
        and Q, dO (one stage of sQ_layout, sdO_layout for dO where given), from (s, d, h, b) views; V and dO have
        head_dim_v columns."""
        d, dv, tm = self.head_dim, self.head_dim_v, self.tile_m
        load = cpasync.CopyBulkTensorTileG2SOp()
        one_k = cute.slice_(sK_layout, (None, None, 0))
        one_v = one_k if sV_layout is None else cute.slice_(sV_layout, (None, None, 0))
        one_stage = cute.slice_(sQ_layout, (None, None, 0))
        one_do = one_stage if sdO_layout is None else cute.slice_(sdO_layout, (None, None, 0))
        return (*cpasync.make_tiled_tma_atom(load, k, one_k, (TILE_N, d)),
                *cpasync.make_tiled_tma_atom(load, v, one_v, (TILE_N, dv)),
                *cpasync.make_tiled_tma_atom(load, q, one_stage, (tm, d)),
                *cpasync.make_tiled_tma_atom(load, do, one_do, (tm, dv)))

    @cute.kernel
    def kernel(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor, mLSE: cute.Tensor,
               mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQacc: cute.Tensor, scale_log2: Float32,
               scale: Float32, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, mma_dq: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout):
        d = self.head_dim
        wgs = self.wgs
        tidx, _, _ = cute.arch.thread_idx()
        # this thread's warpgroup (its keys and dQ columns) and its index in it; compile-time 0 / tidx with one
        wg, wt = 0, tidx
        if cutlass.const_expr(wgs > 1):
            wg, wt = cute.arch.make_warp_uniform(tidx // THREADS), tidx % THREADS
        n_block, head_kv, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]
        key0 = n_block * TILE_N * wgs + wg * TILE_N  # this warpgroup's first key

        smem = SmemAllocator()
        bar_kv = smem.allocate_array(cutlass.Int64, 1)  # K and V have landed
        bar_q = smem.allocate_array(cutlass.Int64, QDO_STAGES)  # Q and dO of a stage have landed
        # 1024-byte alignment: the swizzle pattern of the wgmma operand layouts repeats every 1024 bytes
        sK = smem.allocate_tensor(self.dtype, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sV = smem.allocate_tensor(self.dtype, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        # the Q stages then the dO stages in one allocation: after a block's dQ GEMM its Q and dO stage (two
        # regions of TILE_M * d / 2 fp32 values) hold the dQ block on its way to the bulk adds
        stage_bytes = TILE_M * d * self.dtype.width // 8
        qdo = smem.allocate(2 * QDO_STAGES * stage_bytes, byte_alignment=1024)
        sQ = cute.make_tensor(cute.recast_ptr(qdo, sQ_layout.inner, dtype=self.dtype), sQ_layout.outer)
        sdO = cute.make_tensor(cute.recast_ptr(qdo + QDO_STAGES * stage_bytes, sQ_layout.inner, dtype=self.dtype),
                               sQ_layout.outer)
        sdQ = cute.make_tensor(cute.recast_ptr(qdo, dtype=Float32), cute.make_layout(2 * QDO_STAGES * stage_bytes // 4))
        sdS = smem.allocate_tensor(self.dtype, sdS_layout.outer, byte_alignment=1024, swizzle=sdS_layout.inner)
        if cutlass.const_expr(self.dq_buffer):  # the dQ block in its chunk's order (_dq_slot), warpgroup g's part g
            sdQ = smem.allocate_tensor(Float32, cute.make_layout(TILE_M * d), byte_alignment=128)
        # each query row's (LSE in log2 units, delta) side by side: one 64-bit load gives a score both
        sRows = smem.allocate_tensor(Float32, cute.make_layout((2, TILE_M, QDO_STAGES)), byte_alignment=16)
        if tidx == 0:
            cute.arch.mbarrier_init(bar_kv, 1)
            for s in cutlass.range_constexpr(QDO_STAGES):
                cute.arch.mbarrier_init(bar_q + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # warp 0 issues the loads (the DSL wraps each TMA copy in elect.sync) and the dQ bulk adds
        producer_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        # dq_buffer: the first warp of each warpgroup issues that warpgroup's bulk adds
        adder_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % (THREADS // 32) == 0
        # the LSE / delta rows of a query block: loaded by the first TILE_M threads of the last warpgroup (with two,
        # not the one whose warp 0 also issues the TMA loads and bulk adds: less for the other to wait for at barriers)
        row_t = tidx - (wgs - 1) * THREADS
        row_loader = (row_t >= 0) & (row_t < TILE_M)
        if producer_warp:
            self._load_kv(tma_k, mK, tma_v, mV, sK, sV, bar_kv, n_block, head_kv, batch)

        f = self._fragments(mma_ss, mma_rs, mma_dq, sK, sV, sQ, sdO, sdS, wg, wt)
        tSrK, tSrV, tSrQ, tSrdO, tVrdOt, tKrQt, tQrdS, tQrKt, tScS, tKcK, tQcQ, a_layout, store_ds, tDSsdS = f
        acc_s, acc_dp, acc_dk, acc_dv, acc_dq = self._accumulators(tScS, tKcK, tQcQ)
        offset, m_start, n_m, steps = self._query_blocks(seqlen_q, seqlen_k, n_block, group)
        if steps > 0:  # step 0's loads into stage 0
            if producer_warp:
                self._load_qdo(tma_q, mQ, tma_do, mdO, sQ, sdO, bar_q, head_kv * group, m_start, batch, 0)
            if row_loader:
                row_lse, row_delta = self._rows(mLSE, mDelta, head_kv * group, m_start * TILE_M + row_t, batch)
                sRows[0, row_t, 0] = self._lse_log2(row_lse)
                sRows[1, row_t, 0] = row_delta
        cute.arch.sync_threads()
        cute.arch.mbarrier_wait(bar_kv, 0)
        mma_rs.set(warpgroup.Field.ACCUMULATE, True)
        for step in cutlass.range(steps, unroll=1):
            stage = step % QDO_STAGES
            head = head_kv * group + step // n_m
            m_block = m_start + step % n_m
            row0 = m_block * TILE_M
            # step + 1's LSE and delta rows go to registers now, to shared memory at the end of the step
            next_lse = -Float32.inf
            next_delta = Float32(0.0)
            next_head = head_kv * group + (step + 1) // n_m
            next_m = m_start + (step + 1) % n_m
            if step + 1 < steps:
                if row_loader:
                    next_lse, next_delta = self._rows(mLSE, mDelta, next_head, next_m * TILE_M + row_t, batch)
            cute.arch.mbarrier_wait(bar_q + stage, (step // QDO_STAGES) % 2)

            self._scores(mma_ss, acc_s, acc_dp, tSrK, tSrV, tSrQ, tSrdO, stage)

            self._probabilities(acc_s, acc_dp, tScS, sRows, stage, scale_log2, key0, seqlen_k, row0, offset)
            r_ds = self._grad_gemms(mma_rs, acc_s, acc_dp, acc_dk, acc_dv, a_layout, tVrdOt, tKrQt, stage)

            # dS to shared memory (the dQ GEMM's A operand, every warpgroup's tile), visible to the async proxy.
            # dq_buffer: the step's pair of dS tiles alternates, and step + 1's LSE and delta rows are published by
            # this step's one barrier (their slot's last readers, step - 1's softmax, passed step - 1's barrier)
            ds_tile0 = 0
            if cutlass.const_expr(self.dq_buffer):
                ds_tile0 = (step % 2) * wgs
                if row_loader:
                    sRows[0, row_t, 1 - stage] = self._lse_log2(next_lse)
                    sRows[1, row_t, 1 - stage] = next_delta
            cute.copy(store_ds, store_ds.get_slice(wt).retile(r_ds), tDSsdS[None, None, None, ds_tile0 + wg])
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # dQ block (this warpgroup's columns) = dS K over every key tile; after the wait every GEMM of this step
            # is done with Q and dO
            warpgroup.fence()
            for j in cutlass.range_constexpr(wgs):
                _gemm(mma_dq, acc_dq, tQrdS[None, None, None, ds_tile0 + j], tQrKt[j], accumulate=j > 0)
            warpgroup.commit_group()
            # step + 1's Q and dO into the other stage, free since the end of step - 1 once the bulk adds of
            # step - 1 have read it: issued this late so that waiting for those reads never stalls the GEMMs.
            # dq_buffer: free once every warpgroup's step - 1 GEMMs are done, which the barrier above follows
            if step + 1 < steps:
                if producer_warp:
                    if cutlass.const_expr(not self.dq_atomic and not self.dq_buffer):
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                    self._load_qdo(tma_q, mQ, tma_do, mdO, sQ, sdO, bar_q, next_head, next_m, batch, 1 - stage)
            warpgroup.wait_group(0)
            gdQ = mdQacc[None, None, head, batch]  # dq_atomic: (sq, d) rows; else (blocks, TILE_M * d) chunks
            if cutlass.const_expr(self.dq_buffer):
                # this warpgroup's part of the block, once its previous bulk add has read the buffer: the adder
                # lane waits for that read, a barrier of the warpgroup's threads, the stores, a second barrier, and
                # the adder lane adds the part (a contiguous run of the block's chunk)
                part = TILE_M * d // wgs
                if adder_warp:
                    if cute.arch.lane_idx() == 0:
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=1 + wg, number_of_threads=THREADS)
                for i in cutlass.range(cute.size(acc_dq), unroll_full=True):
                    sdQ[self._dq_slot(wt, i, stage, wg)] = acc_dq[i]
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=1 + wg, number_of_threads=THREADS)
                if adder_warp:
                    if cute.arch.lane_idx() == 0:
                        chunk = gdQ.iterator + cute.crd2idx((m_block, 0), gdQ.layout)
                        bulk_reduce_add_f32(sdQ.iterator + wg * part, chunk + wg * part, 4 * part)
                        cute.arch.cp_async_bulk_commit_group()
            elif cutlass.const_expr(self.dq_atomic):
                for i in cutlass.range(cute.size(acc_dq), unroll_full=True):
                    row = row0 + tQcQ[i][0]
                    if row < seqlen_q:
                        col = wg * (d // wgs) + tQcQ[i][1]
                        cute.arch.atomic_add(gdQ.iterator + cute.crd2idx((row, col), gdQ.layout), acc_dq[i])
            else:
                if cutlass.const_expr(wgs > 1):
                    # this warpgroup's dQ half overwrites the stage's Q (or dO), which the other warpgroup's dK / dV
                    # GEMMs read and only that warpgroup's wait_group(0) retires: a barrier after both waits. It
                    # and the next one also publish step + 1's LSE and delta rows (stored first) and put every
                    # dQ GEMM's dS reads before step + 1's dS stores, which is all the end-of-step barrier did
                    if row_loader:
                        sRows[0, row_t, 1 - stage] = self._lse_log2(next_lse)
                        sRows[1, row_t, 1 - stage] = next_delta
                    cute.arch.sync_threads()
                # the block in fragment order (_dq_slot) into this stage's Q and dO memory, then one lane adds
                # each half (a contiguous run of the chunked dQ buffer) with one bulk reduce-add
                for i in cutlass.range(cute.size(acc_dq), unroll_full=True):
                    sdQ[self._dq_slot(wt, i, stage, wg)] = acc_dq[i]
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
                if producer_warp:
                    if cute.arch.lane_idx() == 0:
                        half = TILE_M * d // 2
                        chunk = gdQ.iterator + cute.crd2idx((m_block, 0), gdQ.layout)
                        for region in cutlass.range_constexpr(2):
                            bulk_reduce_add_f32(sdQ.iterator + region * QDO_STAGES * half + stage * half,
                                                chunk + region * half, 4 * half)
                        cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr((wgs == 1 or self.dq_atomic) and not self.dq_buffer):  # else done above
                if row_loader:
                    sRows[0, row_t, 1 - stage] = self._lse_log2(next_lse)
                    sRows[1, row_t, 1 - stage] = next_delta
                cute.arch.sync_threads()  # every warp is done with this stage and dS before they are written again

        if cutlass.const_expr(self.dq_buffer):
            if adder_warp:  # shared memory must outlive the last bulk adds' reads
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        elif cutlass.const_expr(not self.dq_atomic):
            if producer_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        self._store_dkdv(mdK, mdV, acc_dk, acc_dv, tKcK, scale, key0, seqlen_k, n_block * wgs + wg, head_kv, batch)

    @cute.jit
    def _fragments(self, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, mma_dq: cute.TiledMma, sK: cute.Tensor,
                   sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sdS: cute.Tensor, wg: Int32, wt: Int32):
        """Warpgroup wg's thread wt's views of the shared-memory operands of the five GEMMs, the coordinates of its
        accumulator values, the A-operand layout of P^T / dS^T in registers, and the stmatrix copy of dS^T with its
        destination (..., dS tile)."""
        d = self.head_dim
        wgs = self.wgs
        tm = self.tile_m
        thr_ss, thr_rs, thr_dq = mma_ss.get_slice(wt), mma_rs.get_slice(wt), mma_dq.get_slice(wt)
        tSrK = mma_ss.make_fragment_A(thr_ss.partition_A(sK[None, None, wg]))
        tSrV = mma_ss.make_fragment_A(thr_ss.partition_A(sV[None, None, wg]))
        tSrQ = mma_ss.make_fragment_B(thr_ss.partition_B(sQ))  # (..., stage)
        tSrdO = mma_ss.make_fragment_B(thr_ss.partition_B(sdO))
        tVrdOt = mma_rs.make_fragment_B(thr_rs.partition_B(_transposed(sdO)))  # dO as (d, queries, stage)
        tKrQt = mma_rs.make_fragment_B(thr_rs.partition_B(_transposed(sQ)))  # Q as (d, queries, stage)
        # K as (this warpgroup's d / wgs columns, keys) of each key tile (with 2 warpgroups: one 64-column swizzle
        # atom of the 128-column tile, itself a canonical tile): the dQ GEMM's B (dq_transposed: A); dS as
        # (queries, keys, dS tile): its A (dq_transposed: B)
        k_parts = [_transposed(cute.local_tile(sK[None, None, j], (TILE_N, d // wgs), (0, wg))) for j in range(wgs)]
        ds_dq = sdS  # the dQ GEMM's view of the dS tiles
        if cutlass.const_expr(self.dq_rows):  # all of K's columns; this warpgroup's rows of dS (tm / wgs of them)
            k_parts = [_transposed(sK[None, None, j]) for j in range(wgs)]
            ds_dq = cute.local_tile(sdS, (tm // wgs, TILE_N), (wg, 0, None))
        if cutlass.const_expr(self.dq_transposed):
            tQrdS = mma_dq.make_fragment_B(thr_dq.partition_B(ds_dq))
            tQrKt = [mma_dq.make_fragment_A(thr_dq.partition_A(t)) for t in k_parts]
        else:
            tQrdS = mma_dq.make_fragment_A(thr_dq.partition_A(ds_dq))
            tQrKt = [mma_dq.make_fragment_B(thr_dq.partition_B(t)) for t in k_parts]
        # (key, query) of every S^T value this thread holds; (key, d) of dK / dV; (query, column) of its dQ values
        # (dq_transposed: (column, query))
        tScS = thr_ss.partition_C(cute.make_identity_tensor((TILE_N, tm)))
        tKcK = thr_rs.partition_C(cute.make_identity_tensor((TILE_N, d)))
        tQcQ = thr_dq.partition_C(cute.make_identity_tensor(self._dq_tile()))
        a_layout = mma_rs.make_fragment_A(thr_rs.partition_shape_A((TILE_N, tm))).layout
        # dS^T from its accumulator-ordered registers into the (key, query) view of the dS tiles with stmatrix:
        # queries are the tile's contiguous mode and the accumulator's N mode, so each 8 x 8 matrix row is 16
        # contiguous bytes (no transpose); 4 instructions per thread instead of 32 scalar 16-bit stores (Nsight
        # Compute, d=128, two warpgroups: 35 bank conflicts per warp and step, mostly theirs)
        store_ds = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), self.dtype), mma_ss)
        tDSsdS = store_ds.get_slice(wt).partition_D(_transposed(sdS))  # (..., dS tile)
        return tSrK, tSrV, tSrQ, tSrdO, tVrdOt, tKrQt, tQrdS, tQrKt, tScS, tKcK, tQcQ, a_layout, store_ds, tDSsdS

    def _dq_tile(self) -> tuple[int, int]:
        """(M, N) of a warpgroup's dQ GEMM: (tile_m, d / wgs) by columns, (d / wgs, tile_m) transposed,
        (tile_m / wgs, d) by rows."""
        d, tm, wgs = self.head_dim, self.tile_m, self.wgs
        return (d // wgs, tm) if self.dq_transposed else ((tm // wgs, d) if self.dq_rows else (tm, d // wgs))

    @cute.jit
    def _accumulators(self, tScS: cute.Tensor, tKcK: cute.Tensor, tQcQ: cute.Tensor, tVcV: cute.Tensor = None):
        """fp32 accumulators (S^T, dP^T, dK, dV, the dQ block) shaped as their coordinate tensors (dV as tVcV where
        given, else as dK); dK and dV zeroed."""
        acc_s = cute.make_rmem_tensor(tScS.shape, Float32)
        acc_dp = cute.make_rmem_tensor(tScS.shape, Float32)
        acc_dk = cute.make_rmem_tensor(tKcK.shape, Float32)
        acc_dv = cute.make_rmem_tensor((tKcK if tVcV is None else tVcV).shape, Float32)
        acc_dq = cute.make_rmem_tensor(tQcQ.shape, Float32)
        acc_dk.fill(0.0)
        acc_dv.fill(0.0)
        return acc_s, acc_dp, acc_dk, acc_dv, acc_dq

    @cute.jit
    def _load_kv(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor, sK: cute.Tensor,
                 sV: cute.Tensor, bar_kv: cute.Pointer, n_block: Int32, head_kv: Int32, batch: Int32):
        """The producer warp: K and V of the CTA's key tiles, by TMA on bar_kv."""
        d, dv = self.head_dim, self.head_dim_v
        one_cta = cute.make_layout(1)
        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE_N, d), (None, 0))  # (TILE_N, d, key tiles)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (TILE_N, dv), (None, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        tiles = self.key_tiles
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar_kv, tiles * TILE_N * (d + dv) * self.dtype.width // 8)
        for j in cutlass.range_constexpr(tiles):
            cute.copy(tma_k, tKgK[None, n_block * tiles + j], tKsK[None, j], tma_bar_ptr=bar_kv)
            cute.copy(tma_v, tVgV[None, n_block * tiles + j], tVsV[None, j], tma_bar_ptr=bar_kv)

    @cute.jit
    def _query_blocks(self, seqlen_q: Int32, seqlen_k: Int32, n_block: Int32, group: Int32):
        """(causal offset, first query block, query blocks per head, steps) of the CTA's key block n_block: its steps
        walk (query head of the GQA group, query block), query blocks fastest, from the first block that sees the
        CTA's first key (causal: key j is seen by queries i >= j - offset)."""
        offset = seqlen_k - seqlen_q if cutlass.const_expr(self.bottom_right) else 0
        m_blocks = cute.ceil_div(seqlen_q, self.tile_m)
        m_start = 0
        if cutlass.const_expr(self.causal):
            m_start = cutlass.min(cutlass.max(n_block * TILE_N * self.key_tiles - offset, 0) // self.tile_m, m_blocks)
        n_m = m_blocks - m_start
        return offset, m_start, n_m, group * n_m

    @cute.jit
    def _scores(self, mma_ss: cute.TiledMma, acc_s: cute.Tensor, acc_dp: cute.Tensor, tSrK: cute.Tensor,
                tSrV: cute.Tensor, tSrQ: cute.Tensor, tSrdO: cute.Tensor, stage: Int32):
        """S^T = K Q^T and dP^T = V dO^T of this warpgroup's keys on a Q / dO stage, issued and waited for."""
        warpgroup.fence()
        _gemm(mma_ss, acc_s, tSrK, tSrQ[None, None, None, stage])
        _gemm(mma_ss, acc_dp, tSrV, tSrdO[None, None, None, stage])
        warpgroup.commit_group()
        warpgroup.wait_group(0)

    @cute.jit
    def _visible(self, key: Int32, qi: Int32, seqlen_k: Int32, row0: Int32, offset: Int32):
        """Whether query row0 + qi sees key: the key exists and, when causal, is not after the diagonal."""
        visible = key < seqlen_k
        if cutlass.const_expr(self.causal):
            visible = visible & (key <= row0 + qi + offset)
        return visible

    @cute.jit
    def _probabilities(self, acc_s: cute.Tensor, acc_dp: cute.Tensor, tScS: cute.Tensor, sRows: cute.Tensor,
                       stage: Int32, scale_log2: Float32, key0: Int32, seqlen_k: Int32, row0: Int32, offset: Int32):
        """In place: acc_s := P^T = exp2(S^T * scale * log2(e) - LSE * log2(e)), masked (keys past seqlen_k, and
        after the diagonal when causal), and acc_dp := dS^T = P^T (dP^T - delta); sRows[:, :, stage]: the step's
        (LSE in log2 units, delta) rows."""
        for i in cutlass.range(cute.size(acc_s), unroll_full=True):
            qi = tScS[i][1]
            visible = self._visible(key0 + tScS[i][0], qi, seqlen_k, row0, offset)
            rows = sRows[None, qi, stage].load()  # (LSE in log2 units, delta) of query qi
            row_lse, row_delta = rows[0], rows[1]
            p = Float32(0.0)
            if visible:
                p = cute.math.exp2(acc_s[i] * scale_log2 - row_lse, fastmath=True)
            acc_s[i] = p
            acc_dp[i] = p * (acc_dp[i] - row_delta)

    @cute.jit
    def _p_only(self, acc_s: cute.Tensor, tScS: cute.Tensor, sRows: cute.Tensor, stage: Int32, scale_log2: Float32,
                key0: Int32, seqlen_k: Int32, row0: Int32, offset: Int32, keep: cute.Tensor = None,
                branch_free: cutlass.Constexpr = False, tScS0: cute.Tensor = None,
                column_reads: cutlass.Constexpr = False, held: cute.Tensor = None):
        """In place: acc_s := P^T, masked, as _probabilities does (for a caller whose dP^T is still in flight);
        `keep` (key-mask variants, from _key_keep): per row half of the thread's two key rows, the key bound that
        replaces seqlen_k in the visibility test (seqlen_k, or 0 for a hidden key), so that the code is the unmasked
        one with a register for a uniform value. (A key term in the exp2, a select to -inf before it, or a test per
        score made ptxas keep the exp2's branch as a real one per score, BSSY / BRA / BSYNC with the LSE address
        recomputed each time, or serialise the wgmmas for registers, C7512: the key-mask backward ran 21-35 %
        slower than without a mask on the H200.) `branch_free`: the exp2 of every score, then a select (flash_bwd_wide:
        there ptxas kept the exp2 under `if visible` as a real branch per score, while the d=128 kernel's is
        if-converted and the unconditional form made ptxas serialise its wgmmas for registers). `column_reads`
        (flash_bwd_ws's 64-row steps, with tScS0, in FA4's order: dS^T before dV is issued): hidden scores to -inf and
        every exp2 unpredicated, the LSE read once per column of the thread (_column_rows): no address recomputed
        per score, and no C7512 in that order. `held` (flash_bwd_ws's 80- and 128-row steps, with tScS0:
        _held_rows): the same unpredicated form, each column's LSE taken by a warp shuffle from the lane that holds
        it."""
        first_q = None
        if cutlass.const_expr(tScS0 is not None):
            # per row half (one key each): the first query column, counted from this thread's first, that sees the key
            # (a value's column is thread 0's, a compile-time constant, plus tScS[0]'s): one compare per score
            first_q = cute.make_rmem_tensor((2,), Int32)
            for h in cutlass.range_constexpr(2):
                row_key = key0 + tScS[h * 2][0]
                key_bound = seqlen_k
                if cutlass.const_expr(keep is not None):
                    key_bound = keep[h]
                first = Int32(0)
                if cutlass.const_expr(self.causal):
                    first = row_key - row0 - offset - tScS[0][1]
                first_q[h] = cutlass.select_(row_key < key_bound, first, Int32(1 << 30))
        lse_cols = None
        if cutlass.const_expr(column_reads):
            lse_cols = self._column_rows(sRows, 0, stage, tScS, tScS0, cute.size(acc_s) // 2)
        if cutlass.const_expr(held is not None):
            for pair, lse in _shuffled_columns(held, 0, tScS0, cute.size(acc_s) // 2):
                for i in pair:
                    # hidden scores to -inf, then the exp2, as with column_reads
                    visible = tScS0[i][1] >= first_q[(i // 2) % 2]
                    x = acc_s[i] * scale_log2 - lse
                    acc_s[i] = cute.math.exp2(cutlass.select_(visible, x, -Float32.inf), fastmath=True)
        else:
            for i in cutlass.range(cute.size(acc_s), unroll_full=True):
                qi = tScS[i][1]
                if cutlass.const_expr(column_reads):
                    # hidden scores to -inf, then the exp2 (LSE +inf for a row without keys: 0 either way)
                    visible = tScS0[i][1] >= first_q[(i // 2) % 2]
                    x = acc_s[i] * scale_log2 - lse_cols[(i % 2) + 2 * (i // 4)]
                    acc_s[i] = cute.math.exp2(cutlass.select_(visible, x, -Float32.inf), fastmath=True)
                else:
                    if cutlass.const_expr(tScS0 is not None):
                        visible = tScS0[i][1] >= first_q[(i // 2) % 2]
                    else:
                        limit = seqlen_k
                        if cutlass.const_expr(keep is not None):
                            limit = keep[(i // 2) % 2]  # value i is in row half (i // 2) % 2
                        visible = self._visible(key0 + tScS[i][0], qi, limit, row0, offset)
                    if cutlass.const_expr(branch_free):
                        p = cute.math.exp2(acc_s[i] * scale_log2 - sRows[0, qi, stage], fastmath=True)
                        acc_s[i] = cutlass.select_(visible, p, Float32(0.0))
                    else:
                        p = Float32(0.0)
                        if visible:
                            p = cute.math.exp2(acc_s[i] * scale_log2 - sRows[0, qi, stage], fastmath=True)
                        acc_s[i] = p

    @cute.jit
    def _key_keep(self, words: cute.Tensor, tScS: cute.Tensor, key0: Int32, seqlen_k: Int32, keep: cute.Tensor):
        """keep[h] := seqlen_k if the key mask row `words` (a (head, batch); bit j % 32 of word j // 32 is key j)
        attends to this thread's key row of row half h, else 0 (keys past the mask words too): _p_only's bound."""
        for h in cutlass.range_constexpr(2):
            key = key0 + tScS[h * 2][0]
            word = cutlass.Uint32(0)
            if key // 32 < words.shape[0] - 1:  # the row's last word is its key bound
                word = cutlass.Uint32(words[key // 32])
            attend = (word >> cutlass.Uint32(key % 32)) & cutlass.Uint32(1) != cutlass.Uint32(0)
            keep[h] = Int32(cutlass.select_(attend, seqlen_k, Int32(0)))

    @cute.jit
    def _ds_only(self, acc_s: cute.Tensor, acc_dp: cute.Tensor, tScS: cute.Tensor, sRows: cute.Tensor, stage: Int32,
                 tScS0: cute.Tensor = None, dp_scale: Float32 = None, held: cute.Tensor = None):
        """In place: acc_dp := dS^T = P^T (dP^T - delta) from _p_only's P^T, or P^T (dp_scale dP^T - delta) given
        dp_scale (dropout's 1 / (1 - p)). tScS0 (thread 0's coordinates): delta read once per distinct column, from
        one base address (_column_rows), or with `held` by one warp shuffle per column (_held_rows)."""
        if cutlass.const_expr(held is not None):
            for pair, delta in _shuffled_columns(held, 1, tScS0, cute.size(acc_s) // 2):
                for i in pair:
                    dp = acc_dp[i] if cutlass.const_expr(dp_scale is None) else acc_dp[i] * dp_scale
                    acc_dp[i] = acc_s[i] * (dp - delta)
        elif cutlass.const_expr(tScS0 is not None):
            delta = self._column_rows(sRows, 1, stage, tScS, tScS0, cute.size(acc_s) // 2)
            for i in cutlass.range_constexpr(cute.size(acc_s)):
                dp = acc_dp[i] if cutlass.const_expr(dp_scale is None) else acc_dp[i] * dp_scale
                acc_dp[i] = acc_s[i] * (dp - delta[(i % 2) + 2 * (i // 4)])
        else:
            for i in cutlass.range(cute.size(acc_s), unroll_full=True):
                dp = acc_dp[i] if cutlass.const_expr(dp_scale is None) else acc_dp[i] * dp_scale
                acc_dp[i] = acc_s[i] * (dp - sRows[1, tScS[i][1], stage])

    @cute.jit
    def _column_rows(self, sRows: cute.Tensor, which: cutlass.Constexpr, stage: Int32, tScS: cute.Tensor,
                     tScS0: cute.Tensor, columns: cutlass.Constexpr) -> cute.Tensor:
        """The step's LSE (which=0) or delta (1) of each of this thread's distinct query columns (an accumulator's
        values i and i + 2 share theirs: column c is value (c % 2) + 4 * (c // 2)), read from one base address plus
        compile-time offsets (thread 0's columns)."""
        row = cute.domain_offset((tScS[0][1],), sRows[which, None, stage])
        values = cute.make_rmem_tensor((columns,), Float32)
        if cutlass.const_expr(cute.size(sRows.layout.stride[1]) == 1 and sRows.layout.stride[1] == 1):
            # one plane per statistic (flash_bwd_ws's 64-row steps; rows at a scalar stride of 1): columns
            # 8k + 2 (lane % 4) + {0, 1} are adjacent, one 8-byte read each (FA4 reads its LSE so: 8 reads a step
            # instead of 16)
            for k in cutlass.range_constexpr(columns // 2):
                src = cute.make_tensor((row.iterator + tScS0[4 * k][1]).align(8), cute.make_layout(2))
                cute.make_tensor(values.iterator + 2 * k, cute.make_layout(2)).store(src.load())
        else:
            for c in cutlass.range_constexpr(columns):
                values[c] = row[tScS0[(c % 2) + 4 * (c // 2)][1]]
        return values

    @cute.jit
    def _grad_gemms(self, mma_rs: cute.TiledMma, acc_s: cute.Tensor, acc_dp: cute.Tensor, acc_dk: cute.Tensor,
                    acc_dv: cute.Tensor, a_layout: cute.Layout, tVrdOt: cute.Tensor, tKrQt: cute.Tensor,
                    stage: Int32) -> cute.Tensor:
        """Issue dV += P^T dO and dK += dS^T Q (one committed wgmma group, P^T / dS^T rounded to the inputs' dtype
        in registers); returns dS^T in registers."""
        r_p = cute.make_rmem_tensor(acc_s.shape, self.dtype)
        r_p.store(acc_s.load().to(self.dtype))
        r_ds = cute.make_rmem_tensor(acc_dp.shape, self.dtype)
        r_ds.store(acc_dp.load().to(self.dtype))
        t_p = cute.make_tensor(r_p.iterator, a_layout)
        t_ds = cute.make_tensor(r_ds.iterator, a_layout)
        warpgroup.fence()
        for kk in cutlass.range_constexpr(cute.size(t_p, mode=[2])):
            cute.gemm(mma_rs, acc_dv, t_p[None, None, kk], tVrdOt[None, None, kk, stage], acc_dv)
        for kk in cutlass.range_constexpr(cute.size(t_ds, mode=[2])):
            cute.gemm(mma_rs, acc_dk, t_ds[None, None, kk], tKrQt[None, None, kk, stage], acc_dk)
        warpgroup.commit_group()
        return r_ds

    @cute.jit
    def _store_dkdv(self, mdK: cute.Tensor, mdV: cute.Tensor, acc_dk: cute.Tensor, acc_dv: cute.Tensor,
                    tKcK: cute.Tensor, scale: Float32, key0: Int32, seqlen_k: Int32, key_tile: Int32, head_kv: Int32,
                    batch: Int32, dv_scale: Float32 = None, tVcV: cute.Tensor = None):
        """The epilogue: dK = scale * sum dS^T Q and dV of this warpgroup's key tile, rows past seqlen_k skipped;
        dv_scale (dropout: 1 / (1 - p)) multiplies dV. tVcV: dV's (key, column) coordinates where they are not dK's
        (head_dim_v != head_dim)."""
        d = self.head_dim
        gdK = cute.local_tile(mdK[None, None, head_kv, batch], (TILE_N, d), (key_tile, 0))
        gdV = cute.local_tile(mdV[None, None, head_kv, batch], (TILE_N, self.head_dim_v), (key_tile, 0))
        if cutlass.const_expr(tVcV is not None):
            for i in cutlass.range(cute.size(acc_dk), unroll_full=True):
                if key0 + tKcK[i][0] < seqlen_k:
                    gdK[tKcK[i]] = (acc_dk[i] * scale).to(gdK.element_type)
            for i in cutlass.range(cute.size(acc_dv), unroll_full=True):
                if key0 + tVcV[i][0] < seqlen_k:
                    gdV[tVcV[i]] = acc_dv[i].to(gdV.element_type)
        else:
            for i in cutlass.range(cute.size(acc_dk), unroll_full=True):
                if key0 + tKcK[i][0] < seqlen_k:
                    gdK[tKcK[i]] = (acc_dk[i] * scale).to(gdK.element_type)
                    if cutlass.const_expr(dv_scale is not None):
                        gdV[tKcK[i]] = (acc_dv[i] * dv_scale).to(gdV.element_type)
                    else:
                        gdV[tKcK[i]] = acc_dv[i].to(gdV.element_type)

    @cute.jit
    def _load_qdo(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
                  sQ: cute.Tensor, sdO: cute.Tensor, bar_q: cute.Pointer, head: Int32, m_block: Int32, batch: Int32,
                  stage: Int32):
        """The producer warp: Q and dO of one query block into `stage`, on that stage's barrier."""
        d = self.head_dim
        one_cta = cute.make_layout(1)
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, d), (None, 0))  # (TILE_M, d, blocks)
        gdO = cute.local_tile(mdO[None, None, head, batch], (TILE_M, d), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tOsdO, tOgdO = cpasync.tma_partition(tma_do, 0, one_cta, cute.group_modes(sdO, 0, 2),
                                             cute.group_modes(gdO, 0, 2))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar_q + stage, 2 * TILE_M * d * self.dtype.width // 8)
        cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, stage], tma_bar_ptr=bar_q + stage)
        cute.copy(tma_do, tOgdO[None, m_block], tOsdO[None, stage], tma_bar_ptr=bar_q + stage)

    @cute.jit
    def _rows(self, mLSE: cute.Tensor, mDelta: cute.Tensor, head: Int32, row: Int32, batch: Int32):
        """(LSE, delta) of one query row as stored, (-inf, 0) past seqlen_q: loads only, used a step later (by
        _lse_log2), so that the loading warps do not wait for them at once (a compare on the loaded LSE made them
        wait a global-memory latency at the start of every step while the other warps waited for them at the
        next barrier)."""
        row_lse = -Float32.inf
        dlt = Float32(0.0)
        if row < mLSE.shape[0]:
            row_lse = mLSE[row, head, batch]
            dlt = mDelta[row, head, batch]
        return row_lse, dlt

    @cute.jit
    def _lse_log2(self, row_lse: Float32) -> Float32:
        """The LSE in log2 units; +inf for a row that saw no key (or is past seqlen_q), so that its P is 0."""
        lse_log2 = Float32.inf
        if row_lse != -Float32.inf:
            lse_log2 = row_lse * _LOG2E
        return lse_log2

    @cute.jit
    def _dq_slot(self, thread: Int32, i: int, stage: Int32, wg: Int32) -> Int32:
        """Where value i of a warpgroup thread's dQ accumulator goes in the fp32 view of the Q/dO stages: position
        p = wg * TILE_M * d / wgs + (i // 2) * 2 * THREADS + 2 * thread + i % 2 of the block's chunk (one warp's pair
        of values i, i + 1 fills 256 contiguous bytes: no bank conflict), the chunk's first half in the stage's Q
        region, the second in its dO region. The chunked dQ buffer holds each block in this order (_dq_layout undoes
        it on the host); with dq_buffer, position p of the dQ buffer."""
        d = self.head_dim
        half = TILE_M * d // 2  # fp32 values of one stage's Q (or dO) region
        p = wg * (self.tile_m * d // self.wgs) + (i // 2) * 2 * THREADS + 2 * thread + i % 2
        if cutlass.const_expr(self.dq_buffer):
            return p  # the buffer holds the chunk as it is
        if cutlass.const_expr(self.wgs == 1):
            region = p // half  # i is a compile-time index: so is the region
            return (region * QDO_STAGES + stage) * half + p % half
        # two warpgroups: each one's part is exactly one region
        return (wg * QDO_STAGES + stage) * half + p - wg * half


def dq_split(tile_m: int) -> str:
    """How the warpgroups share a tile_m-row dQ block (_dq_layout.SPLITS): by columns at 64 rows; as its transpose
    at 80 (not a multiple of wgmma's M); by rows at 128 (d=64)."""
    return "transposed" if tile_m % 64 else ("rows" if tile_m == 2 * TILE_M else "columns")


def compile_flash_bwd(dtype: torch.dtype, head_dim: int, causal: bool, bottom_right: bool = False,
                      arch: str = "sm_90a", dump_dir: str | None = None, dq_atomic: bool = False,
                      wgs: int = 1, pointer_args: bool = False, dq_buffer: bool = False,
                      warp_specialized: bool = False, tile_m: int = TILE_M, key_mask: bool = False,
                      deterministic: bool = False, dropout: bool = False, head_dim_v: int | None = None,
                      tma_store: bool | None = None, keep_bits: bool = False) -> Any:
    """Compile one variant for symbolic shapes and strides (any batch, heads, seqlens; hq % hkv == 0); `wgs`
    warpgroups per CTA (2 needs head_dim 128: each takes one 64-column half of the dQ block); `pointer_args`: the
    calling convention of _fast_call.PointerBackward; `dq_buffer`: FlashBackwardSm90's (not with dq_atomic);
    `warp_specialized`: flash_bwd_ws.FlashBackwardSm90WS (wgs=2), which also takes `tile_m` = 80 query rows per
    step at d=128 (the dQ GEMM then transposed) and 128 at d=64 (the warpgroups split dQ by rows); at d=192 / 256
    flash_bwd_wide.FlashBackwardSm90Wide (wgs=2, 64 rows, the only variant there); `key_mask`
    (warp_specialized only): the variant that also takes a bool key mask packed 32 keys per int32 word (b, hq,
    words) after the stream (as flash_fwd_ws's); `deterministic` (warp_specialized only, not with key_mask): the
    variant whose dQ adds to each query block happen in key-block order, taking its zeroed int32 turn flags (b, hq,
    query blocks) where the key-mask variant takes its words; `dropout` (warp_specialized at d=64 / 128 with 64 or
    128 query rows, no key mask, not deterministic; the pointer convention only, _fast_call.PointerBackwardDropout):
    the variant that drops with the forward's mask (kernels/cute/_dropout.py); `head_dim_v`: V's, dO's and dV's head
    dim where it differs from head_dim (flash_bwd_wide's HEAD_DIM_V_PAIRS, no dropout); `tma_store`
    (warp_specialized only; None: True there): dK and dV through shared memory and TMA stores (suffix "_tmastore");
    `keep_bits` (dropout at head_dim 128, 64 query rows): the keep bits the forward saved instead of drawn ones
    (_dropout: "Saved keep bits"; suffix "_keepbits"); a period of keep_bits.KEEP_PERIODS: those of every period-th
    row of tiles, the other steps' bits drawn (suffix "_keepbits2" ...).

    The compiled function takes (q, k, v, do, lse, delta, dk, dv, dqacc, scale * log2(e), scale, stream).
    Cached per variant in _compile_cache.CACHE (except with `dump_dir`, which always compiles).
    """
    wide = head_dim in WIDE_HEAD_DIMS  # flash_bwd_wide's kernel: warp-specialised, 64-row steps, nothing else
    if head_dim not in HEAD_DIMS and not wide:
        raise ValueError(f"head_dim={head_dim} (supported: {', '.join(map(str, HEAD_DIMS + WIDE_HEAD_DIMS))})")
    if wide and not (warp_specialized and wgs == 2 and tile_m == TILE_M and not dq_atomic and not dq_buffer):
        raise ValueError(f"head_dim={head_dim} needs warp_specialized=True, wgs=2, tile_m={TILE_M} and no dq_atomic "
                         f"or dq_buffer")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype} (supported: torch.float16, torch.bfloat16)")
    dim_v = head_dim if head_dim_v is None else head_dim_v
    if dim_v != head_dim:
        from .flash_bwd_wide import HEAD_DIM_V_PAIRS

        if (head_dim, dim_v) not in HEAD_DIM_V_PAIRS or dropout:
            raise ValueError(f"head_dim={head_dim} with head_dim_v={dim_v}{' and dropout' * dropout} (supported: equal, "
                             f"or (head_dim, head_dim_v) one of {sorted(HEAD_DIM_V_PAIRS)} without dropout)")
    if wgs not in WARPGROUPS or (wgs == 2 and head_dim != 128 and not (head_dim == 64 and tile_m == 128) and not wide):
        raise ValueError(f"wgs={wgs} with head_dim={head_dim} (supported: 1, or 2 with head_dim 128, or with 64 and "
                         f"tile_m=128)")
    if dq_buffer and dq_atomic:
        raise ValueError("dq_buffer=True needs the bulk-add dQ (dq_atomic=False)")
    if warp_specialized and (wgs != 2 or dq_atomic):
        raise ValueError("warp_specialized=True needs wgs=2 and the bulk-add dQ (dq_atomic=False)")
    if key_mask and not warp_specialized:
        raise ValueError("key_mask=True needs warp_specialized=True")
    if deterministic and (not warp_specialized or key_mask):
        raise ValueError("deterministic=True needs warp_specialized=True and no key mask")
    if dropout and (wide or not warp_specialized or key_mask or deterministic or tile_m != TILE_M or not pointer_args):
        raise ValueError(f"dropout=True needs warp_specialized=True at head_dim 64 or 128 with tile_m={TILE_M}, no key "
                         "mask, deterministic=False and pointer_args=True")
    if keep_bits and not (dropout and head_dim == 128 and tile_m == TILE_M):
        raise ValueError(f"keep_bits=True needs dropout=True at head_dim 128 with tile_m={TILE_M}")
    from ..keep_bits import KEEP_PERIODS

    if keep_bits not in (False, *KEEP_PERIODS):
        raise ValueError(f"keep_bits={keep_bits} (supported: False, True or a period of {KEEP_PERIODS})")
    if tma_store and not warp_specialized:
        raise ValueError("tma_store=True needs warp_specialized=True")
    if tma_store is None:
        tma_store = warp_specialized
    if tile_m != TILE_M and not (warp_specialized and (tile_m, head_dim) in ((80, 128), (128, 64))):
        raise ValueError(f"tile_m={tile_m} with head_dim={head_dim} (supported: {TILE_M}; with warp_specialized=True "
                         f"also 80 at head_dim 128 and 128 at head_dim 64)")

    def build() -> Any:
        example = torch.empty(1, 1, 8, head_dim, dtype=dtype)
        q, k, v, do, dk, dv = (_dynamic(example) for _ in range(6))
        rows = [_dynamic(torch.empty(1, 1, 8, dtype=torch.float32), align=4) for _ in range(2)]
        dqacc = _dynamic(torch.empty(1, 1, 8, head_dim, dtype=torch.float32))
        if wide:
            from .flash_bwd_wide import FlashBackwardSm90Wide

            kernel = (FlashBackwardSm90Wide(_DTYPES[dtype], head_dim, causal, bottom_right, key_mask, deterministic,
                                            tma_store=tma_store)
                      if dim_v == head_dim else
                      FlashBackwardSm90Wide(_DTYPES[dtype], head_dim, causal, bottom_right, key_mask, deterministic,
                                            head_dim_v=dim_v, tma_store=tma_store))
        elif warp_specialized:
            from .flash_bwd_ws import FlashBackwardSm90WS

            kernel = FlashBackwardSm90WS(_DTYPES[dtype], head_dim, causal, bottom_right, tile_m, key_mask,
                                         deterministic, dropout, tma_store, keep_bits)
        else:
            kernel = FlashBackwardSm90(_DTYPES[dtype], head_dim, causal, bottom_right, dq_atomic, wgs, dq_buffer)
        if pointer_args:
            from . import _fast_call

            side = key_mask or deterministic  # an int32 (b, hq, n) tensor after the stream
            if dropout:
                return cute.compile(_fast_call.PointerBackwardDropout(kernel),
                                    *_fast_call.backward_example_args(_DTYPES[dtype], dropout=True),
                                    make_fake_stream(), options=compile_options(arch, dump_dir))
            wrapper = _fast_call.PointerBackwardKeyMask if side else _fast_call.PointerBackward
            return cute.compile(wrapper(kernel), *_fast_call.backward_example_args(_DTYPES[dtype], side),
                                make_fake_stream(), options=compile_options(arch, dump_dir))
        words = (_dynamic(torch.empty(1, 1, 4, dtype=torch.int32), align=4),) if key_mask or deterministic else ()
        return cute.compile(kernel, q, k, v, do, *rows, dk, dv, dqacc, Float32(1.0), Float32(1.0),
                            make_fake_stream(), *words, options=compile_options(arch, dump_dir))

    if dump_dir is not None:
        return build()
    alignment = ("bottom_right" if bottom_right else "top_left") if causal else "none"
    name = (KERNEL_NAME + ("_atomic_dq" if dq_atomic else "") + ("_dq_buffer" if dq_buffer else "")
            + ("_ws" if warp_specialized else "") + ("_keymask" if key_mask else "")
            + ("_deterministic" if deterministic else "") + ("_dropout" if dropout else "")
            + ("" if not keep_bits else "_keepbits" if keep_bits == 1 else f"_keepbits{int(keep_bits)}")
            + ("_tmastore" if tma_store else "") + ("_ptrargs" if pointer_args else ""))
    key = CompileKey(name, dtype, head_dim, dim_v, causal, alignment, 0, (TILE_N * (1 if wide else wgs), tile_m), arch)
    return CACHE.get_or_compile(key, build)


def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, scale: float | None = None, causal: bool = False,
              bottom_right: bool = False, dq_atomic: bool = False, dlse: torch.Tensor | None = None,
              wgs: int = 1, dq_buffer: bool = False,
              warp_specialized: bool = False, tile_m: int = TILE_M,
              key_words: torch.Tensor | None = None, deterministic: bool = False,
              dropout: tuple | None = None,
              tma_store: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of attention on CUDA tensors q (b, hq, sq, d), k (b, hkv, sk, d), v (b, hkv, sk, dv;
    dv = d, or flash_bwd_wide's HEAD_DIM_V_PAIRS with warp_specialized and no dropout), given the
    forward's out and natural-log LSE (b, hq, sq). Inputs as flash_fwd takes them (checked the same way).
    dq_atomic: the variant that adds dQ with per-value atomics. dlse: the LSE's own gradient (b, hq, sq), when
    the forward's LSE was used: d lse_i / d s_ij = P_ij, so it enters as delta_i - dlse_i. wgs: warpgroups per CTA
    (2: 128 keys per CTA at head_dim 128; at 192 / 256 the two share 64 keys). dq_buffer: FlashBackwardSm90's
    one-barrier variant; warp_specialized: flash_bwd_ws's kernel (wgs=2; the op's at d=128), which also takes tile_m
    = 80 (d=128) and 128 (d=64), and flash_bwd_wide's at d=192 / 256 (the op's there). key_words: the forward's
    packed key mask (flash_fwd_ws.flash_fwd_ws; warp_specialized only). deterministic (warp_specialized, no
    key_words): the same bits on every run (dQ's fp32 adds in a fixed order). dropout (warp_specialized at d=64 /
    128 with tile_m=64, no key_words, not deterministic): the forward's (the (seed, offset) pair on q's device, the 16-bit keep
    threshold, 1 / (1 - dropout_p)), flash_fwd_ws.flash_fwd_ws's argument, optionally with the keep bits that forward
    saved as a fourth element (d=128, tile_m=64: the backward loads them instead of drawing them). tma_store (warp_specialized, where None
    means True): dK and dV through shared memory and TMA stores. The three gradients are contiguous whatever the inputs'
    strides."""
    from cuda.bindings import driver

    from .flash_fwd import _check_inputs, _check_key_words

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    from .flash_bwd_wide import HEAD_DIM_V_PAIRS

    _check_inputs(q, k, v, scale, head_dims=HEAD_DIMS + WIDE_HEAD_DIMS, head_dim_pairs=HEAD_DIM_V_PAIRS)
    if key_words is not None:
        _check_key_words(key_words, q, k)
    if dout.shape != (*q.shape[:3], v.shape[3]) or dout.dtype != q.dtype:
        raise ValueError(f"dout {tuple(dout.shape)} {dout.dtype} must match q {tuple(q.shape)} {q.dtype} with v's head "
                         f"dim {v.shape[3]}")
    if dout.stride(3) != 1 or any(s <= 0 or s % 8 for s in dout.stride()[:3]) or dout.data_ptr() % 16:
        dout = dout.contiguous()  # TMA's alignment rules, as for q
    from . import _fast_call

    fast = _fast_call.ENABLED or dropout is not None
    compiled = compile_flash_bwd(q.dtype, q.shape[-1], causal, bottom_right, dq_atomic=dq_atomic, wgs=wgs,
                                 pointer_args=fast, dq_buffer=dq_buffer, warp_specialized=warp_specialized,
                                 tile_m=tile_m, key_mask=key_words is not None, deterministic=deterministic,
                                 dropout=dropout is not None,
                                 head_dim_v=None if v.shape[3] == q.shape[3] else v.shape[3], tma_store=tma_store,
                                 keep_bits=0 if _keep_bits(dropout) is None else check_keep_bits(
                                     dropout[3], q, k, causal, bottom_right))
    delta = bwd_delta(out, dout, dlse)  # rowsum(dO * O) - dlse, (b, hq, sq): one Triton pass
    dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))  # as dq: contiguous
    b, hq, sq, d = q.shape
    m_blocks = -(-sq // tile_m)
    # dq_atomic: (b, hq, sq, d) rows; else one chunk of TILE_M * d values per query block, in the kernel's fragment
    # order (FlashBackwardSm90._dq_slot)
    dqacc = torch.zeros((b, hq, sq, d) if dq_atomic else (b, hq, m_blocks, tile_m * d), dtype=torch.float32,
                        device=q.device)
    stream = driver.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    lse = lse.detach().contiguous()  # the op saves its own outputs, which may require grad
    if deterministic:  # the turn flags, passed where a key-mask variant takes its words
        key_words = torch.zeros((b, hq, m_blocks), dtype=torch.int32, device=q.device)
    side = key_words is not None  # the key-mask words or the turn flags
    if dropout is not None:
        from .flash_fwd import _check_rng

        rng, threshold, drop_scale = dropout[:3]
        _check_rng(rng, q)
        bits = _keep_bits(dropout)
        if bits is not None:
            check_keep_bits(bits, q, k, causal, bottom_right)
        call = _fast_call.caller(compiled, _fast_call.backward_pointer_types(_DTYPES[q.dtype], dropout=True))
        tensors = (q, k, v, dout, lse, delta, dk, dv, dqacc)
        # the words pointer is unread (no key mask), the bits pointer unread without saved bits (q: any 16-byte
        # aligned address)
        call(tensors + (rng, rng, q if bits is None else bits),
             _fast_call.backward_scalars(*tensors, threshold=threshold),
             (scale * _LOG2E, scale, drop_scale), stream)
    elif fast:
        call = _fast_call.caller(compiled, _fast_call.backward_pointer_types(_DTYPES[q.dtype], side))
        tensors = (q, k, v, dout, lse, delta, dk, dv, dqacc)
        call(tensors + ((key_words,) if side else ()), _fast_call.backward_scalars(*tensors, words=key_words),
             (scale * _LOG2E, scale), stream)
    else:
        compiled(*(_dynamic(t.detach()) for t in (q, k, v, dout)), _dynamic(lse, align=4),
                 _dynamic(delta, align=4), _dynamic(dk), _dynamic(dv), _dynamic(dqacc),
                 Float32(scale * _LOG2E), Float32(scale), stream,
                 *((_dynamic(key_words.contiguous(), align=4),) if side else ()))  # compact: as flash_fwd._run
    if dq_atomic:
        return (dqacc * scale).to(q.dtype), dk, dv
    return dq_from_chunks(dqacc, sq, scale, q.dtype, wgs, tile_m, dq_split(tile_m)), dk, dv


class BackwardLaunch:
    """One call signature's backward, prepared (prepare_backward): a compiled pointer-convention variant with its
    integers and scales marshalled. Called with tensors of that signature (shapes, strides, dtypes, device; the
    caller keeps to it, and to 16-byte aligned data pointers of q, k, v and dout), it runs delta's pass, allocates
    dK, dV and dQ's zeroed accumulator, launches the kernel and dQ's conversion on the current stream: no checks,
    no compile-cache lookup, no marshalling but the tensors' addresses."""

    __slots__ = ("_fast", "_ints", "_floats", "_k_shape", "_v_shape", "_acc_shape", "_dq")

    def __init__(self, fast: Any, ints: tuple, floats: tuple, k_shape: tuple, v_shape: tuple, acc_shape: tuple,
                 dq: tuple):
        self._fast, self._ints, self._floats = fast, ints, floats
        self._k_shape, self._v_shape, self._acc_shape, self._dq = k_shape, v_shape, acc_shape, dq

    def __call__(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from cuda.bindings import driver

        device = q.device
        delta = bwd_delta(out, dout, dlse)
        dk = torch.empty(self._k_shape, dtype=k.dtype, device=device)
        dv = torch.empty(self._v_shape, dtype=v.dtype, device=device)
        dqacc = torch.zeros(self._acc_shape, dtype=torch.float32, device=device)
        self._fast((q, k, v, dout, lse, delta, dk, dv, dqacc), self._ints, self._floats,
                   driver.CUstream(torch.cuda.current_stream(device).cuda_stream))
        return dq_from_chunks(dqacc, *self._dq), dk, dv


def prepare_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, scale: float | None = None, causal: bool = False, bottom_right: bool = False,
                     wgs: int = 1, warp_specialized: bool = False, tile_m: int = TILE_M,
                     tma_store: bool | None = None) -> BackwardLaunch | None:
    """flash_bwd's checks (ValueError) and compile (CompileFailedError) for a call without key mask, dropout,
    determinism or per-value atomics, as a BackwardLaunch for every later call of the same signature; None where the
    call cannot take one (the pointer convention is off, dout or lse would need a copy first: flash_bwd then)."""
    from . import _fast_call
    from .flash_bwd_wide import HEAD_DIM_V_PAIRS
    from .flash_fwd import _check_inputs, _Contiguous

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _check_inputs(q, k, v, scale, head_dims=HEAD_DIMS + WIDE_HEAD_DIMS, head_dim_pairs=HEAD_DIM_V_PAIRS)
    if dout.shape != (*q.shape[:3], v.shape[3]) or dout.dtype != q.dtype:
        raise ValueError(f"dout {tuple(dout.shape)} {dout.dtype} must match q {tuple(q.shape)} {q.dtype} with v's head "
                         f"dim {v.shape[3]}")
    if not _fast_call.ENABLED or dout.stride(3) != 1 or any(s <= 0 or s % 8 for s in dout.stride()[:3]) \
            or dout.data_ptr() % 16 or not lse.is_contiguous() or lse.dtype != torch.float32 or lse.data_ptr() % 4:
        return None
    compiled = compile_flash_bwd(q.dtype, q.shape[-1], causal, bottom_right, wgs=wgs, pointer_args=True,
                                 warp_specialized=warp_specialized, tile_m=tile_m,
                                 head_dim_v=None if v.shape[3] == q.shape[3] else v.shape[3], tma_store=tma_store)
    b, hq, sq, d = q.shape
    acc_shape = (b, hq, -(-sq // tile_m), tile_m * d)
    delta, dk, dv, dqacc = (_Contiguous(shape) for shape in ((b, hq, sq), tuple(k.shape), tuple(v.shape), acc_shape))
    ints = _fast_call.backward_scalars(q, k, v, dout, lse, delta, dk, dv, dqacc)
    fast = _fast_call.caller(compiled, _fast_call.backward_pointer_types(_DTYPES[q.dtype]))
    return BackwardLaunch(fast, ints, (scale * _LOG2E, scale), tuple(k.shape), tuple(v.shape), acc_shape,
                          (sq, scale, q.dtype, wgs, tile_m, dq_split(tile_m)))


def _keep_bits(dropout: tuple | None) -> torch.Tensor | None:
    """The saved keep bits of a dropout argument (its optional fourth element), or None."""
    return dropout[3] if dropout is not None and len(dropout) > 3 else None


def check_keep_bits(bits: torch.Tensor, q: torch.Tensor, k: torch.Tensor, causal: bool = False,
                    bottom_right: bool = False) -> int:
    """The period of the saved keep bits `bits` of a call with these q and k (keep_bits.keep_period_of: its size is
    keep_bits.keep_bits_bytes of one of KEEP_PERIODS, in the causal layout for a causal call); ValueError unless
    they are uint8, contiguous, on q's device, 16-byte aligned and of such a size."""
    from ..keep_bits import causal_offset, keep_bits_bytes, keep_period_of

    diagonal = causal_offset(q.shape[2], k.shape[2], causal, bottom_right)
    period = keep_period_of(bits.numel(), q.shape[0], q.shape[1], q.shape[2], k.shape[2], diagonal)
    if (bits.dtype != torch.uint8 or bits.device != q.device or not bits.is_contiguous() or not period
            or bits.data_ptr() % 16):
        size = keep_bits_bytes(q.shape[0], q.shape[1], q.shape[2], k.shape[2], 1, diagonal)
        raise ValueError(f"keep bits must be uint8, contiguous, 16-byte aligned, on {q.device} and of "
                         f"keep_bits_bytes' size ({size} bytes, or that of every second or fourth row of tiles), got "
                         f"{bits.dtype} ({bits.numel()}) on {bits.device}")
    return period
