"""Warp-specialised FlashAttention backward for Hopper (sm90a) in the CuTe DSL (issue 7): FA3's backward layout.

The op's d=128 backward since the eleventh session (ops/cute_flash.BACKWARD_VARIANTS): 6-7 % faster than two
warpgroups without the producer on the H200, and its steps wait for each GEMM only where its result is read
(FA3's order, +0-3 %; docs/perf-log.md). flash_bwd.flash_bwd(..., warp_specialized=True) runs it, with tile_m=80
(d=128, opt-in) or 128 (d=64: the op's d=64 backward since the twelfth session, +5-9 % over one warpgroup) for
FA4's tiles (docs/cute.md); tests/kernels/cute/test_flash_bwd_gpu.py checks its numerics on an H200.

The math, the tiles and the shared-memory operands are FlashBackwardSm90's with two warpgroups (d=128: 128 keys per
CTA, each MMA warpgroup 64 keys and half of the dQ block's columns) and its dq_buffer layout (the dQ block in its
own buffer, dS in two alternating tiles). What moves out of the MMA warpgroups is everything that is not MMA work:
- warpgroup 0, the producer (setmaxnreg 24): its warp 0 loads K and V once and then Q and dO of every step into a
  QDO_STAGES-deep full/empty pipeline (cutlass.pipeline.PipelineTmaAsync), waiting for a stage only until both MMA
  warpgroups have released it; its warp 1 writes dQ: it waits for the block (an mbarrier every MMA thread arrives
  on), adds it to the chunked fp32 buffer with one bulk reduce-add, waits for that read and arrives on a second
  mbarrier that frees the buffer;
- dropout variant (d=128, 64-row steps, in the `column_reads` form): a fourth warpgroup (DRAW_WARPGROUP, 512
  threads) draws each step's keep bits into shared memory (_dropout.draw_backward_bits), or warps 2 and 3 of the
  producer warpgroup load the forward's saved ones (load_backward_bits), which the MMA warpgroups read once per
  step; where every second or fourth row of tiles was saved (keep_bits=2 or 4, kernels/keep_bits.py) the drawing
  warpgroup loads those steps' bits and draws the others'; without dropout at 64-row steps, and beside a drawing
  warpgroup, (rows_by_producer) warps 2 and 3 load each step's LSE / delta rows into a 2-stage full/empty ring
  instead of the MMA warpgroups (+2.5-4 % causal on the H200, twenty-ninth session);
- warpgroups 1 and 2, the MMA warpgroups (setmaxnreg 240, 224 in the drawing dropout variant: DRAW_WG_REGS; ptxas
  allocates the code after setmaxnreg.inc with that budget: docs/cute.md), synchronise with each other once per
  step (a named barrier of their 256 threads after the dS stores, which also publishes step + 1's LSE / delta rows
  where they load them) and with the producer warpgroup only through mbarriers;
- epilogue (tma_store, the default): once both MMA warpgroups are past their last GEMM (each one's dQ GEMMs read
  both key tiles), each writes its dK and dV in the input dtype into its own K and V tiles (stmatrix) and its first
  warp stores them with one TMA copy each (-2 to +14 % on the H200, eighteenth session; tma_store=False: from
  registers, value by value).
"""

from __future__ import annotations

from ._compile_cache import enable_dsl_disk_cache

enable_dsl_disk_cache()  # before the DSL's first compile in this process

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

from ._bulk import add_release_i32, bulk_reduce_add_f32, fence_proxy_async_global, load_acquire_i32  # noqa: E402
from ._fwd_parts import own_copy  # noqa: E402
from ._dropout import (  # noqa: E402
    BITS_STAGES, BITS_WARPS, MMA_THREADS, backward_keep, bits_words, draw_backward_bits, keep_tile, load_backward_bits,
    read_backward_bits)
from ._fwd_parts import select_i32  # noqa: E402
from ._schedule import longest_first, section_size  # noqa: E402
from ._tma_store import converted, stmatrix_tile, tma_store_tile  # noqa: E402
from .flash_bwd import (  # noqa: E402
    QDO_STAGES, THREADS, TILE_M, TILE_N, FlashBackwardSm90, _gemm, _held_rows, dq_split)

TILES_M = (TILE_M, 80, 128)  # query rows per step: 64, or FA4's 80 at d=128 (the dQ GEMM transposed), 128 at d=64

PRODUCER_REGS = 24
MMA_REGS = 240  # 24 * 128 + 2 * 240 * 128 = 64512: the pool of 384 threads launched with 168 registers each
# the dropout variant that draws its bits: 56 * 128 + 2 * 224 * 128 = 64512. H200: drawn +7-9 % at 2k / 16k with two
# Philox chains at 40 / 232 registers (twenty-ninth session; that split cost the variants without dropout 12 % and left
# the saved-bits one level), +5-6 % more with four chains, which need 56 (40 spilled 60 bytes; thirtieth); ptxas
# keeps the MMA warpgroups' wgmmas asynchronous at 224
DRAW_REGS = (56, 224)
# DRAW_WARPGROUP: the drawing variant draws in a warpgroup of its own (512 threads), one warp on each of the SM's four
# schedulers (the producer's warps 2-3 sat on two of them), two threads per group of four MMA threads, each half of
# the group's queries (_dropout.draw_backward_bits' halves), two Philox chains a thread: the producer warpgroup 24
# registers, the drawing one 40, the MMA ones 224: (24 + 40 + 2 * 224) * 128 = 65536, the 512 threads' pool
# (thirty-first session, H200 A/B against the producer's warps drawing, two alternated processes each: drawn backward
# +16 / +15 % non-causal at 2k / 16k, +10 / +13 % causal, which then runs in block order: self.longest_first; its
# 51 backward dropout GPU tests passed)
DRAW_WARPGROUP = True
DRAW_WG_REGS = (PRODUCER_REGS, 40, 224)
DRAW_WG_CHAINS = 2
# the drawing warpgroup's variants with rows_by_producer (thirty-fourth session, A/B on the H100: see docs/perf-log.md)
ROWS_BESIDE_DRAWS = True
# the keep-bits variant (every row saved) with rows_by_producer: its bit-loading warps 2-3 load each step's rows too
# (_draw_bits; sm_90a step loop 670 -> 590 SASS instructions non-causal, 719 -> 634 causal). Thirty-fifth session,
# H100, A/B in alternated processes (ab_cute.sh, time_keep_bits.py --periods 1, two rounds): saved-bits backward
# +5.5 / +4.2 / +3.4 % non-causal at 2k / 4k / 16k, +2.5 / +2.3 / +7.3 % causal; its controls -1.9 to +1.3 %
ROWS_BESIDE_LOADS = True
MMA_BARRIER = 1  # named barrier of the two MMA warpgroups (0 is __syncthreads')
ROW_WARPS = (2, 3)  # rows_by_producer: the producer warpgroup's warps that load the rows (0 loads Q / dO, 1 writes dQ)
ROW_STAGES = 2  # sRows' stages
EPILOGUE_BARRIER = 2  # named barriers 2 and 3: an MMA warpgroup's dK / dV rows are in shared memory (tma_store)




class FlashBackwardSm90WS(FlashBackwardSm90):
    """The warp-specialised variant of FlashBackwardSm90 (two MMA warpgroups, dQ by bulk adds): head_dim 128 with
    64 or 80 query rows per step, head_dim 64 with 128."""

    def __init__(self, dtype: type, head_dim: int, causal: bool, bottom_right: bool, tile_m: int = TILE_M,
                 key_mask: bool = False, deterministic: bool = False, dropout: bool = False, tma_store: bool = True,
                 keep_bits: bool = False):
        super().__init__(dtype, head_dim, causal, bottom_right, dq_atomic=False, wgs=2, dq_buffer=True)
        # dK and dV of a warpgroup's keys in the input dtype into its K and V tiles (stmatrix), then one TMA store
        # each, instead of d / 2 two-byte stores per thread and gradient that each touch eight rows (+5-14 % at 2k on
        # the H200)
        self.tma_store = tma_store
        if key_mask and deterministic:
            raise ValueError("deterministic=True does not take a key mask (a CTA that skips its steps takes no turn)")
        # 64-row steps only: the 128-row form (d=64's tile) took the keep bits into neither dS nor dV until the
        # twenty-third session, spills 16-20 bytes, and has never run on a GPU (the op routes d=64 dropout elsewhere)
        if dropout and (key_mask or deterministic or tile_m != TILE_M):
            raise ValueError(f"dropout=True takes no key mask, no deterministic order and {TILE_M} query rows per step")
        # dropout: two producer warps draw each step's keep bits (_dropout.draw_backward_bits), the MMA warpgroups
        # drop P^T for dV and dP^T for dS with them; dV is scaled by 1 / (1 - p) in the epilogue
        self.dropout = dropout
        # keep_bits: the drawing warps load the forward's saved keep bits (_dropout.load_backward_bits) instead of
        # drawing them; 64-row steps (the saved tiles' rows)
        if keep_bits and not (dropout and tile_m == TILE_M):
            raise ValueError(f"keep_bits=True needs dropout=True and tile_m={TILE_M}")
        self.keep_bits = bool(keep_bits)
        # a period (kernels/keep_bits.py, 2 or 4): only every period-th row of tiles was saved; the drawing
        # warpgroup loads the steps of those and draws the others' bits
        self.keep_period = int(keep_bits)
        self.draws = dropout and self.keep_period != 1  # it draws (DRAW_REGS: in the producer's warps 2-3)
        self.draw_warpgroup = self.draws and DRAW_WARPGROUP  # or a warpgroup of its own (DRAW_WG_REGS)
        self.bits_halves = 2 if self.draw_warpgroup else 1
        # causal CTAs in _schedule's longest-first order, except the deterministic variant (its dQ turns assume every
        # key block of a head starts together) and the drawing warpgroup's: there its three remapped indices, live
        # through the MMA loop instead of re-read from the block index, cost ptxas a 4-byte spill at 224 registers
        # (sm_90a compile check), where the order gave the causal backward +1-3 % (twentieth session)
        # (nor the keep-bits variant whose bit-loading warps load the rows too: ptxas spilled 4 bytes in the producer's
        # code with the order's indices, outside the step loops; sm_90a compile check)
        self.longest_first = (causal and not deterministic and not self.draw_warpgroup
                              and not (dropout and int(keep_bits) == 1 and ROWS_BESIDE_LOADS))
        self.key_mask = key_mask  # a bool key mask, packed 32 keys per word, read per step (_key_keep)
        # dQ adds in key-block order: the side tensor (mWords) is then one int32 turn flag per (query block, head,
        # batch), zeroed by the caller (_write_dq)
        self.deterministic = deterministic
        # the producer warpgroup, then the MMA warpgroups (then the drawing warpgroup)
        self.cta_warpgroups = self.wgs + (2 if self.draw_warpgroup else 1)
        self.qdo_stages = QDO_STAGES  # Q / dO pipeline depth (flash_bwd_wide's may differ)
        self.tile_m = tile_m
        # 64-row steps (with dropout too, its keep selects after dP^T is waited for: 967 -> 735 SASS instructions per
        # step of the keep-bits variant, +7-10 % on the H200): P^T unpredicated (hidden scores to -inf, then every
        # exp2) with the LSE and delta read once per column from one base address. Predicated, ptxas recomputed each
        # read's address under its score's predicate and reloaded the scale from the constant bank (686 SASS
        # instructions per step and thread at d=128 against 546 so); unpredicated at d=64's 128-row steps it
        # serialised the wgmmas for registers (C7512)
        self.column_reads = tile_m == TILE_M
        # 80- and 128-row steps: the same unpredicated form, the LSE and delta by warp shuffles from 8 values a lane
        # holds per step (flash_bwd._held_rows), and FA4's order of the step's later half (P^T converted before dP^T
        # is waited for, dV issued after the dS^T stores, dQ then dK each behind one wait): 1508 -> 1172 SASS
        # instructions in the d=64 loop and 1324 -> 1167 at 80 rows, without their spills (20 and 12 bytes); the
        # unpredicated form in this kernel's own order, or the 80 rows' columns held in registers, made ptxas
        # serialise the wgmmas for registers (C7512)
        self.shuffle_rows = tile_m != TILE_M
        # 64-row steps without dropout: two producer warps (ROW_WARPS, idle there) load each step's LSE / delta rows
        # into sRows behind full / empty mbarriers (FA4 leaves them to its producer too), instead of the last MMA
        # warpgroup's first 64 threads loading, converting and storing them inside the step; with dropout where a
        # warpgroup of its own draws (draw_warpgroup: those producer warps are idle there too)
        self.rows_by_producer = self.column_reads and (not dropout or (self.draw_warpgroup and ROWS_BESIDE_DRAWS)
                                                       or (self.keep_period == 1 and ROWS_BESIDE_LOADS))
        self.dq_transposed = dq_split(tile_m) == "transposed"  # wgmma's M is 64: an 80-row block as its transpose
        self.dq_rows = dq_split(tile_m) == "rows"  # d=64: each MMA warpgroup 64 rows of the block, every column
        # 80-row steps: the barriers (56 bytes) and the first 1024-byte alignment only (every later allocation keeps
        # it): they need 231680 of the 232448 bytes an sm90 CTA may have (2048 bytes of padding failed to launch)
        if tile_m != TILE_M:
            self.smem_padding = 1024
        if dropout:  # the bits' stages and their full / empty barriers
            self.smem_padding += BITS_STAGES * MMA_THREADS * bits_words(tile_m) * 4 + 1024

    @cute.kernel
    def kernel(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor, mLSE: cute.Tensor,
               mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQacc: cute.Tensor, scale_log2: Float32,
               scale: Float32, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, mma_dq: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout,
               mWords: cute.Tensor = None, mRng: cute.Tensor = None, drop_threshold=None, drop_scale=None,
               tma_dk: cute.CopyAtom = None, tma_dv: cute.CopyAtom = None,  # tma_store: mdK / mdV are their tensors
               mBits: cute.Tensor = None):  # keep_bits: the forward's saved bits (their first byte)
        d = self.head_dim
        wgs = self.wgs
        tidx, _, _ = cute.arch.thread_idx()
        # 0: the producer warpgroup, 1 + wg: MMA warpgroup wg, 1 + wgs: the drawing warpgroup (draw_warpgroup)
        role = cute.arch.make_warp_uniform(tidx // THREADS)
        n_block, head_kv, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]
        if cutlass.const_expr(self.longest_first):
            n_block, head_kv, batch = self._longest_first(n_block, head_kv, batch, seqlen_q, group)

        smem = SmemAllocator()
        bar_kv = smem.allocate_array(cutlass.Int64, 1)  # K and V have landed
        bars_qdo = smem.allocate_array(cutlass.Int64, 2 * QDO_STAGES)  # full and empty barrier per Q / dO stage
        bar_dq = smem.allocate_array(cutlass.Int64, 2)  # 0: the dQ block is stored, 1: its bulk add has read it
        bars_rows = None
        if cutlass.const_expr(self.rows_by_producer):  # full, then empty, per sRows stage
            bars_rows = smem.allocate_array(cutlass.Int64, 2 * ROW_STAGES)
        # 1024-byte alignment: the swizzle pattern of the wgmma operand layouts repeats every 1024 bytes
        sK = smem.allocate_tensor(self.dtype, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sV = smem.allocate_tensor(self.dtype, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sQ = smem.allocate_tensor(self.dtype, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sdO = smem.allocate_tensor(self.dtype, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sdS = smem.allocate_tensor(self.dtype, sdS_layout.outer, byte_alignment=1024, swizzle=sdS_layout.inner)
        sdQ = smem.allocate_tensor(Float32, cute.make_layout(self.tile_m * d), byte_alignment=128)  # _dq_slot order
        # each query row's (LSE in log2 units, delta) side by side, for this step and the next
        # (LSE, delta) of a row side by side (the 80- / 128-row steps read both at once), or with column_reads one
        # plane per statistic (one 8-byte read per two adjacent rows of one: 16 reads a step instead of 32); not
        # with dropout where the MMA warpgroups load the rows (its causal builds then spilled 4 bytes), but with
        # dropout beside rows_by_producer (side by side, ptxas spilled 16-28 bytes in that MMA loop at 224)
        planes = self.column_reads and (not self.dropout or self.rows_by_producer)
        rows_layout = cute.make_layout((2, self.tile_m, 2)) if cutlass.const_expr(not planes) else \
            cute.make_layout((2, self.tile_m, 2), stride=(self.tile_m, 1, 2 * self.tile_m))
        sRows = smem.allocate_tensor(Float32, rows_layout, byte_alignment=16)
        drop = None  # dropout: (bits' barriers, bits, the (seed, offset) pair, threshold, 1 / (1 - p))
        if cutlass.const_expr(self.dropout):
            bars_bits = smem.allocate_array(cutlass.Int64, 2 * BITS_STAGES)  # full, then empty, per stage
            n_words = bits_words(self.tile_m)
            sBits = smem.allocate_tensor(cutlass.Uint32, cute.make_layout(
                (BITS_STAGES, MMA_THREADS, n_words), stride=(MMA_THREADS * n_words, n_words, 1)), byte_alignment=16)
            drop = (bars_bits, sBits, mRng, drop_threshold, drop_scale, mBits)

        # one elected producer lane arrives per stage (with the expected bytes); a stage is free again once each of
        # the MMA warps has released it (the pipeline lets lane 0 of each warp arrive)
        qdo_bytes = 2 * self.tile_m * d * self.dtype.width // 8
        pipe = pipeline.PipelineTmaAsync.create(
            num_stages=QDO_STAGES, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, wgs * THREADS // 32),
            tx_count=qdo_bytes, barrier_storage=bars_qdo, defer_sync=True)
        if tidx == 0:
            cute.arch.mbarrier_init(bar_kv, 1)
            cute.arch.mbarrier_init(bar_dq, wgs * THREADS)  # every MMA thread arrives once its dQ values are stored
            cute.arch.mbarrier_init(bar_dq + 1, 1)  # the dQ writer's lane, once the bulk add has read the block
            if cutlass.const_expr(self.rows_by_producer):
                for st in cutlass.range_constexpr(ROW_STAGES):
                    cute.arch.mbarrier_init(bars_rows + st, self.tile_m)  # every row-loading thread
                    cute.arch.mbarrier_init(bars_rows + ROW_STAGES + st, wgs * THREADS)  # every MMA thread
            if cutlass.const_expr(self.dropout):
                for st in cutlass.range_constexpr(BITS_STAGES):
                    cute.arch.mbarrier_init(drop[0] + st, 64 * self.bits_halves)  # every drawing thread
                    cute.arch.mbarrier_init(drop[0] + BITS_STAGES + st, MMA_THREADS)  # every MMA thread
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every barrier is initialised before anyone waits on it

        offset, m_start, n_m, steps = self._query_blocks(seqlen_q, seqlen_k, n_block, group)
        if cutlass.const_expr(self.key_mask):
            # no step where every query head of the group has its key bound (key padding) at or before the CTA's
            # first key: dK and dV stay 0 (every role reads the same bounds, so all agree on the steps)
            bound = Int32(0)
            for g in cutlass.range(group, unroll=1):
                row = mWords[None, head_kv * group + g, batch]
                bound = cutlass.max(bound, row[row.shape[0] - 1])
            if bound <= n_block * TILE_N * wgs:
                steps = 0
        producer_regs, mma_regs = (PRODUCER_REGS, MMA_REGS) if not self.draws else DRAW_REGS
        if cutlass.const_expr(self.draw_warpgroup):
            producer_regs, _, mma_regs = DRAW_WG_REGS
        if role == 0:
            cute.arch.setmaxregister_decrease(producer_regs)
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            # whole warps: the DSL wraps each TMA copy and pipeline arrive in elect.sync over all 32 lanes
            if warp == 0:
                self._produce(tma_k, mK, tma_v, mV, tma_q, mQ, tma_do, mdO, sK, sV, sQ, sdO, bar_kv, pipe, n_block,
                              head_kv, batch, group, m_start, n_m, steps)
            rows = (mLSE, mDelta, sRows, bars_rows)
            if cutlass.const_expr(self.rows_by_producer and not self._bits_in_row_warps()):
                if warp >= ROW_WARPS[0]:
                    self._load_rows(*rows, tidx - 32 * ROW_WARPS[0], head_kv, batch, group, m_start, n_m, steps)
            if warp == 1:
                self._write_dq(sdQ, mdQacc, bar_dq, head_kv, batch, group, m_start, n_m, steps, n_block, mWords)
            if cutlass.const_expr(self.dropout and not self.draw_warpgroup):
                if warp >= BITS_WARPS[0]:
                    self._draw_bits(drop, tidx - 32 * BITS_WARPS[0], n_block, head_kv, batch, group, mQ.shape[2],
                                    seqlen_q, seqlen_k, m_start, n_m, steps,
                                    rows if cutlass.const_expr(self._bits_in_row_warps()) else None)
        else:
            mma_args = (mma_regs, (mma_ss, mma_rs, mma_dq), (sK, sV, sQ, sdO, sdS, sdQ, sRows, bar_kv, bar_dq, pipe,
                        mLSE, mDelta, mdK, mdV, scale_log2, scale), role, tidx, (n_block, head_kv, batch, group,
                        seqlen_k, offset, m_start, n_m, steps, mWords, drop, (tma_dk, tma_dv), bars_rows))
            if cutlass.const_expr(self.draw_warpgroup):
                if role == wgs + 1:
                    cute.arch.setmaxregister_decrease(DRAW_WG_REGS[1])
                    self._draw_bits(drop, tidx - (wgs + 1) * THREADS, n_block, head_kv, batch, group, mQ.shape[2],
                                    seqlen_q, seqlen_k, m_start, n_m, steps)
                else:
                    self._mma_role(*mma_args)
            else:
                self._mma_role(*mma_args)

    @cute.jit
    def _mma_role(self, mma_regs: int, mmas: tuple, before: tuple, role: Int32, tidx: Int32, after: tuple):
        """MMA warpgroup role - 1: its registers raised to mma_regs, then _mma (arguments `before`, the warpgroup and
        its thread, `after`) on copies of the tiled MMAs made inside this branch (an mma.set on an object from
        outside a runtime branch fails IR verification)."""
        cute.arch.setmaxregister_increase(mma_regs)
        self._mma(*[own_copy(m) for m in mmas], *before, role - 1, tidx % THREADS, *after)

    @cute.jit
    def _longest_first(self, n_block: Int32, head_kv: Int32, batch: Int32, seqlen_q: Int32, group: Int32):
        """(key block, KV head, batch) of this CTA in the causal order of _schedule: the first key blocks (seen by the
        most queries) first over all heads of an L2 section. (Not for the deterministic variant, whose dQ turns
        assume every key block of a head starts together.)"""
        blocks, heads, batches = cute.arch.grid_dim()
        # a section's query rows: Q and dO in 16 bits, dQ in fp32, LSE and delta (a compile-time byte count per row)
        row_bytes = 2 * (self.head_dim + self.head_dim_v) + 4 * self.head_dim + 8
        section = section_size(seqlen_q * group, row_bytes, cutlass.max, select_i32)
        last_first, pair = longest_first(n_block + blocks * (head_kv + heads * batch), blocks, heads * batches,
                                         section, cutlass.min)
        return blocks - 1 - last_first, pair % heads, pair // heads

    def _bits_in_row_warps(self) -> bool:
        """Whether the producer's warps that load the bits (BITS_WARPS) load the rows too, step by step."""
        return self.rows_by_producer and self.dropout and not self.draw_warpgroup and BITS_WARPS == ROW_WARPS

    @cute.jit
    def _draw_bits(self, drop: tuple, gt: Int32, n_block: Int32, head_kv: Int32, batch: Int32, group: Int32,
                   heads_q: Int32, seqlen_q: Int32, seqlen_k: Int32, m_start: Int32, n_m: Int32, steps: Int32,
                   rows: tuple = None):
        """The dropout variant's drawing warps (thread gt of 64, or of 128 with draw_warpgroup): each step's keep
        bits for the MMA warpgroups; with `rows` (_load_rows' first arguments; _bits_in_row_warps) each step's LSE /
        delta rows after its bits."""
        bars, sBits, mRng, threshold, _, mBits = drop
        diagonal = None  # the saved bits' causal layout (kernels/keep_bits.py)
        if cutlass.const_expr(self.causal):
            diagonal = seqlen_k - seqlen_q if cutlass.const_expr(self.bottom_right) else Int32(0)
        for step in cutlass.range(steps, unroll=1):
            if cutlass.const_expr(self.keep_period == 1):
                tile = keep_tile(batch * heads_q + head_kv * group + step // n_m, self._m_block(m_start, n_m, step),
                                 n_block, seqlen_q, seqlen_k, 1, diagonal)
                load_backward_bits(sBits, bars, mBits.iterator, tile, gt, step)
                if cutlass.const_expr(rows is not None):
                    self._load_row_step(*rows, gt, head_kv, batch, group, m_start, n_m, step)
            elif cutlass.const_expr(self.keep_period > 1):
                m_block = self._m_block(m_start, n_m, step)
                if m_block % self.keep_period == 0:  # a saved row of tiles
                    tile = keep_tile(batch * heads_q + head_kv * group + step // n_m, m_block, n_block, seqlen_q,
                                     seqlen_k, self.keep_period, diagonal)
                    load_backward_bits(sBits, bars, mBits.iterator, tile, gt, step, self.bits_halves)
                else:
                    self._draw_step(drop, gt, n_block, head_kv, batch, group, heads_q, seqlen_q, seqlen_k, m_block,
                                    n_m, step)
            else:
                self._draw_step(drop, gt, n_block, head_kv, batch, group, heads_q, seqlen_q, seqlen_k,
                                self._m_block(m_start, n_m, step), n_m, step)

    @cute.jit
    def _draw_step(self, drop: tuple, gt: Int32, n_block: Int32, head_kv: Int32, batch: Int32, group: Int32,
                   heads_q: Int32, seqlen_q: Int32, seqlen_k: Int32, m_block: Int32, n_m: Int32, step: Int32):
        """One step's keep bits drawn (_dropout.draw_backward_bits) by drawing thread gt."""
        bars, sBits, mRng, threshold, _, _ = drop
        draw_backward_bits(sBits, bars, mRng, threshold, gt, n_block * (TILE_N * self.wgs // 32),
                           batch * heads_q + head_kv * group, step // n_m, seqlen_q, seqlen_k, step,
                           m_block * self.tile_m, self.tile_m, self.bits_halves,
                           DRAW_WG_CHAINS if self.draw_warpgroup else 4)

    @cute.jit
    def _m_block(self, m_start: Int32, n_m: Int32, step: Int32) -> Int32:
        """The query block of a step (every role walks the same order): ascending from the CTA's first block; in the
        deterministic causal variant descending from the last one, so that every CTA reaches a block at the same step
        (CTAs start together and the adds' turns go to key blocks in ascending order; ascending query blocks would
        have CTA k wait for CTA 0 to walk the 2k blocks before its own first one)."""
        if cutlass.const_expr(self.deterministic and self.causal):
            return m_start + n_m - 1 - step % n_m
        return m_start + step % n_m

    @cute.jit
    def _produce(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
                 tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor, sK: cute.Tensor,
                 sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, bar_kv: cute.Pointer, pipe: cutlass.Constexpr,
                 n_block: Int32, head_kv: Int32, batch: Int32, group: Int32, m_start: Int32, n_m: Int32,
                 steps: Int32):
        """The producer warp: K and V of the CTA's key tiles once, then Q and dO of each step into the pipeline."""
        d = self.head_dim
        self._load_kv(tma_k, mK, tma_v, mV, sK, sV, bar_kv, n_block, head_kv, batch)
        one_cta = cute.make_layout(1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.qdo_stages)
        for step in cutlass.range(steps, unroll=1):
            head = head_kv * group + step // n_m
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, d), (None, 0))  # (tile_m, d, blocks)
            gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.head_dim_v), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tOsdO, tOgdO = cpasync.tma_partition(tma_do, 0, one_cta, cute.group_modes(sdO, 0, 2),
                                                 cute.group_modes(gdO, 0, 2))
            pipe.producer_acquire(state)  # waits until both MMA warpgroups freed the stage, then expects its bytes
            m_block = self._m_block(m_start, n_m, step)
            cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))
            cute.copy(tma_do, tOgdO[None, m_block], tOsdO[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
            state.advance()

    @cute.jit
    def _write_dq(self, sdQ: cute.Tensor, mdQacc: cute.Tensor, bar_dq: cute.Pointer, head_kv: Int32, batch: Int32,
                  group: Int32, m_start: Int32, n_m: Int32, steps: Int32, n_block: Int32, mTurns: cute.Tensor = None):
        """The dQ writer warp: each step's block, once stored, added to its chunk of the fp32 buffer with one bulk
        reduce-add; the buffer is handed back once the add has read it.

        Deterministic: the adds to a query block's chunk happen in key-block order, so the fp32 sums, and dQ, are the
        same bits on every run. The CTAs that add to a block are key blocks 0, 1, ..., K (the first query block a
        CTA sees never decreases with its key block, _query_blocks), so the block's turn flag (mTurns, zeroed)
        counts the adds done and this CTA waits for it to equal its n_block; after its add has completed it adds 1.
        A CTA waits only for CTAs of lower index in the grid, launched before it: no deadlock (the reverse turn
        order could deadlock once a head's key blocks outnumber the CTAs resident at a time). Causal CTAs walk the
        query blocks last first (_m_block), so that they reach each block together."""
        d = self.head_dim
        for step in cutlass.range(steps, unroll=1):
            head = head_kv * group + step // n_m
            m_block = self._m_block(m_start, n_m, step)
            gdQ = mdQacc[None, None, head, batch]  # (blocks, tile_m * d) chunks
            cute.arch.mbarrier_wait(bar_dq, step % 2)
            if cute.arch.lane_idx() == 0:
                chunk = gdQ.iterator + cute.crd2idx((m_block, 0), gdQ.layout)
                turn = None
                if cutlass.const_expr(self.deterministic):
                    turn = self._take_turn(mTurns, m_block, head, batch, n_block)
                bulk_reduce_add_f32(sdQ.iterator, chunk, 4 * self.tile_m * d)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.mbarrier_arrive(bar_dq + 1)
                if cutlass.const_expr(self.deterministic):
                    self._pass_turn(turn)

    @cute.jit
    def _take_turn(self, mTurns: cute.Tensor, m_block: Int32, head: Int32, batch: Int32, n_block: Int32):
        """Deterministic variant, the writer's lane: wait until the query block's turn flag equals this CTA's key
        block (_write_dq); returns the flag's address."""
        turn = mTurns.iterator + cute.crd2idx((m_block, head, batch), mTurns.layout)
        while load_acquire_i32(turn) != n_block:
            pass
        fence_proxy_async_global()  # the earlier CTAs' adds are seen before this one is issued
        return turn

    @cute.jit
    def _pass_turn(self, turn: cute.Pointer):
        """Deterministic variant, after the writer's bulk adds were issued and committed: once they are complete in
        global memory, the turn goes to the next key block."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        fence_proxy_async_global()
        add_release_i32(turn, 1)

    @cute.jit
    def _mma(self, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, mma_dq: cute.TiledMma, sK: cute.Tensor,
             sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sdS: cute.Tensor, sdQ: cute.Tensor, sRows: cute.Tensor,
             bar_kv: cute.Pointer, bar_dq: cute.Pointer, pipe: cutlass.Constexpr, mLSE: cute.Tensor,
             mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, scale_log2: Float32, scale: Float32, wg: Int32,
             wt: Int32, n_block: Int32, head_kv: Int32, batch: Int32, group: Int32, seqlen_k: Int32, offset: Int32,
             m_start: Int32, n_m: Int32, steps: Int32, mWords: cute.Tensor = None, drop: tuple = None,
             tma_atoms: tuple = (None, None), bars_rows: cute.Pointer = None):
        """MMA warpgroup wg (thread wt of it): FlashBackwardSm90's step with two warpgroups, its loads, row copies and
        dQ adds left to the producer warpgroup. tma_atoms: dK's and dV's TMA store atoms (tma_store)."""
        wgs = self.wgs
        key0 = n_block * TILE_N * wgs + wg * TILE_N  # this warpgroup's first key
        f = self._fragments(mma_ss, mma_rs, mma_dq, sK, sV, sQ, sdO, sdS, wg, wt)
        tSrK, tSrV, tSrQ, tSrdO, tVrdOt, tKrQt, tQrdS, tQrKt, tScS, tKcK, tQcQ, a_layout, store_ds, tDSsdS = f
        acc_s, acc_dp, acc_dk, acc_dv, acc_dq = self._accumulators(tScS, tKcK, tQcQ)
        row_loader = self._first_rows(mLSE, mDelta, sRows, bar_kv, wg, wt, head_kv, batch, group, m_start, n_m, steps)
        mma_rs.set(warpgroup.Field.ACCUMULATE, True)
        self._mma_loop(mma_ss, mma_rs, mma_dq, f, acc_s, acc_dp, acc_dk, acc_dv, acc_dq, sdQ, sRows, bar_dq, pipe,
                       mLSE, mDelta, scale_log2, wt, key0, row_loader, head_kv, batch, group, seqlen_k, offset,
                       m_start, n_m, steps, wg, mWords, drop, bars_rows)
        dv_scale = drop[4] if cutlass.const_expr(self.dropout) else None  # 1 / (1 - p)
        if cutlass.const_expr(self.tma_store):
            self._store_dkdv_tma(mma_rs, sK, sV, mdK, mdV, tma_atoms, acc_dk, acc_dv, scale, dv_scale,
                                 n_block * wgs + wg, head_kv, batch, wg, wt)
        else:
            self._store_dkdv(mdK, mdV, acc_dk, acc_dv, tKcK, scale, key0, seqlen_k, n_block * wgs + wg, head_kv, batch,
                             dv_scale)

    @cute.jit
    def _store_dkdv_tma(self, mma_rs: cute.TiledMma, sK: cute.Tensor, sV: cute.Tensor, mdK: cute.Tensor,
                        mdV: cute.Tensor, tma_atoms: tuple, acc_dk: cute.Tensor, acc_dv: cute.Tensor, scale: Float32,
                        dv_scale: Float32, key_tile: Int32, head_kv: Int32, batch: Int32, wg: Int32, wt: Int32):
        """tma_store epilogue of MMA warpgroup wg: dK = scale * sum dS^T Q and dV (times dv_scale: dropout's
        1 / (1 - p)) in the input dtype into the warpgroup's own K and V tiles by stmatrix, then one TMA store each by
        its first warp (rows past seqlen_k clipped by the copy), waited for until they have read the tiles (the CTA
        must not exit, releasing the memory, before)."""
        tma_dk, tma_dv = tma_atoms
        # both warpgroups past their last GEMM: each one's dQ GEMMs read both key tiles of sK
        cute.arch.barrier(barrier_id=MMA_BARRIER, number_of_threads=self.wgs * THREADS)
        stmatrix_tile(mma_rs, converted(acc_dk, self.dtype, scale), sK[None, None, wg], self.dtype, wt)
        stmatrix_tile(mma_rs, converted(acc_dv, self.dtype, dv_scale), sV[None, None, wg], self.dtype, wt)
        cute.arch.fence_proxy("async.shared", space="cta")  # the stores are seen by the TMA unit (the async proxy)
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg, number_of_threads=THREADS)
        if cute.arch.make_warp_uniform(wt // 32) == 0:
            for tma, mG, sX in ((tma_dk, mdK, sK), (tma_dv, mdV, sV)):
                gX = cute.local_tile(mG[None, None, head_kv, batch], (TILE_N, self.head_dim), (None, 0))
                tma_store_tile(tma, sX[None, None, wg], gX, key_tile)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _first_rows(self, mLSE: cute.Tensor, mDelta: cute.Tensor, sRows: cute.Tensor, bar_kv: cute.Pointer, wg: Int32,
                    wt: Int32, head_kv: Int32, batch: Int32, group: Int32, m_start: Int32, n_m: Int32, steps: Int32):
        """The MMA warpgroups' prologue: the first step's LSE / delta rows into sRows (the last warpgroup's first
        tile_m threads, the row loaders, load them, and each later step's a step ahead), the MMA warpgroups' barrier,
        then the wait for K and V. Returns whether this thread is a row loader."""
        row_loader = (wg == self.wgs - 1) & (wt < self.tile_m)
        if cutlass.const_expr(self.rows_by_producer):
            row_loader = False  # the producer's ROW_WARPS load every step's rows (_load_rows)
        if steps > 0:
            if row_loader:
                row_lse, row_delta = self._rows(mLSE, mDelta, head_kv * group,
                                                self._m_block(m_start, n_m, 0) * self.tile_m + wt, batch)
                sRows[0, wt, 0] = self._lse_log2(row_lse)
                sRows[1, wt, 0] = row_delta
        cute.arch.barrier(barrier_id=MMA_BARRIER, number_of_threads=self.wgs * THREADS)
        cute.arch.mbarrier_wait(bar_kv, 0)
        return row_loader

    @cute.jit
    def _next_rows(self, mLSE: cute.Tensor, mDelta: cute.Tensor, row_loader, step: Int32, steps: Int32,
                   head_kv: Int32, group: Int32, m_start: Int32, n_m: Int32, wt: Int32, batch: Int32):
        """(LSE, delta) of row wt of step + 1's query block for a row loader ((-inf, 0) otherwise and after the
        last step): loaded now, stored a step later."""
        next_lse = -Float32.inf
        next_delta = Float32(0.0)
        if step + 1 < steps:
            if row_loader:
                next_lse, next_delta = self._rows(mLSE, mDelta, head_kv * group + (step + 1) // n_m,
                                                  self._m_block(m_start, n_m, step + 1) * self.tile_m + wt,
                                                  batch)
        return next_lse, next_delta

    @cute.jit
    def _load_rows(self, mLSE: cute.Tensor, mDelta: cute.Tensor, sRows: cute.Tensor, bars: cute.Pointer, gt: Int32,
                   head_kv: Int32, batch: Int32, group: Int32, m_start: Int32, n_m: Int32, steps: Int32):
        """rows_by_producer: row-loading thread gt (0 ... tile_m - 1) puts row gt's (LSE in log2 units, delta) of
        every step into sRows stage step % ROW_STAGES, once the MMA threads released it, then arrives on its full
        barrier; the global loads are issued before the wait."""
        for step in cutlass.range(steps, unroll=1):
            self._load_row_step(mLSE, mDelta, sRows, bars, gt, head_kv, batch, group, m_start, n_m, step)

    @cute.jit
    def _load_row_step(self, mLSE: cute.Tensor, mDelta: cute.Tensor, sRows: cute.Tensor, bars: cute.Pointer,
                       gt: Int32, head_kv: Int32, batch: Int32, group: Int32, m_start: Int32, n_m: Int32,
                       step: Int32):
        """_load_rows' work for one step."""
        stage = step % ROW_STAGES
        row_lse, row_delta = self._rows(mLSE, mDelta, head_kv * group + step // n_m,
                                        self._m_block(m_start, n_m, step) * self.tile_m + gt, batch)
        if step >= ROW_STAGES:
            cute.arch.mbarrier_wait(bars + ROW_STAGES + stage, (step // ROW_STAGES - 1) % 2)
        sRows[0, gt, stage] = self._lse_log2(row_lse)
        sRows[1, gt, stage] = row_delta
        cute.arch.mbarrier_arrive(bars + stage)

    @cute.jit
    def _issue_dv(self, mma_rs: cute.TiledMma, acc_dv: cute.Tensor, t_p: cute.Tensor, tVrdOt: cute.Tensor,
                  stage: Int32):
        """dV += P^T dO (P^T from registers) as one committed wgmma group."""
        warpgroup.fence()
        for kk in cutlass.range_constexpr(cute.size(t_p, mode=[2])):
            cute.gemm(mma_rs, acc_dv, t_p[None, None, kk], tVrdOt[None, None, kk, stage], acc_dv)
        warpgroup.commit_group()

    @cute.jit
    def _mma_loop(self, mma_ss: cute.TiledMma, mma_rs: cute.TiledMma, mma_dq: cute.TiledMma, f: cutlass.Constexpr,
                  acc_s: cute.Tensor, acc_dp: cute.Tensor, acc_dk: cute.Tensor, acc_dv: cute.Tensor,
                  acc_dq: cute.Tensor, sdQ: cute.Tensor, sRows: cute.Tensor, bar_dq: cute.Pointer,
                  pipe: cutlass.Constexpr, mLSE: cute.Tensor, mDelta: cute.Tensor, scale_log2: Float32, wt: Int32,
                  key0: Int32, row_loader, head_kv: Int32, batch: Int32, group: Int32, seqlen_k: Int32, offset: Int32,
                  m_start: Int32, n_m: Int32, steps: Int32, wg: Int32, mWords: cute.Tensor = None,
                  drop: tuple = None, bars_rows: cute.Pointer = None):
        """The MMA warpgroup's steps (FA4's order; wgmma groups retire in commit order): S^T | dP^T -> P^T (dP^T in
        flight) -> dS^T -> dV -> dS^T to shared memory -> dQ | dK -> the dQ block to shared memory, dK waited for at
        the end of its step (only then is the step's Q / dO stage released, dK's Q^T being its last reader).
        FA3's order (dV issued before dS^T is computed, step - 1's dK in flight into the next step) kept P^T or
        dS^T live beside the scores' accumulators, and ptxas serialised every wgmma for want of registers (C7512)
        with 80- and 128-row steps, and with 64 rows once the reads were unpredicated (column_reads). With 80 and 128
        rows (shuffle_rows) the later half is FA4's own: P^T converted while dP^T is in flight, dS^T to shared
        memory, then dV, dQ (dV waited for: with dV, dQ and dK in flight together ptxas spilled 104-132 bytes) and
        dK (dQ waited for). (No dropout there: its keep select on P^T comes after dS^T, 64-row steps only.)"""
        wgs = self.wgs
        tSrK, tSrV, tSrQ, tSrdO, tVrdOt, tKrQt, tQrdS, tQrKt, tScS, tKcK, tQcQ, a_layout, store_ds, tDSsdS = f
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QDO_STAGES)
        released = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, QDO_STAGES)
        r_p = cute.make_rmem_tensor(acc_s.shape, self.dtype)
        r_ds = cute.make_rmem_tensor(acc_dp.shape, self.dtype)
        t_p = cute.make_tensor(r_p.iterator, a_layout)
        t_ds = cute.make_tensor(r_ds.iterator, a_layout)
        bits = None
        # thread 0's (compile-time) coordinates: the visibility bounds' columns, and the keep bits' index with dropout
        tScS0 = mma_ss.get_slice(0).partition_C(cute.make_identity_tensor((TILE_N, self.tile_m)))
        if cutlass.const_expr(self.dropout):  # the step's keep bits
            bits = cute.make_rmem_tensor((bits_words(self.tile_m),), cutlass.Uint32)
        keep = None
        if cutlass.const_expr(self.key_mask):  # the first head's key-mask terms, out of the step loop
            keep = cute.make_rmem_tensor((2,), Int32)
            self._key_keep(mWords[None, head_kv * group, batch], tScS, key0, seqlen_k, keep)
        for step in cutlass.range(steps, unroll=1):
            rows = step % 2
            row0 = self._m_block(m_start, n_m, step) * self.tile_m
            next_lse, next_delta = Float32(0.0), Float32(0.0)
            if cutlass.const_expr(not self.rows_by_producer):
                next_lse, next_delta = self._next_rows(mLSE, mDelta, row_loader, step, steps, head_kv, group, m_start,
                                                       n_m, wt, batch)
            pipe.consumer_wait(state)
            stage = state.index

            warpgroup.fence()
            _gemm(mma_ss, acc_s, tSrK, tSrQ[None, None, None, stage])
            warpgroup.commit_group()
            _gemm(mma_ss, acc_dp, tSrV, tSrdO[None, None, None, stage])
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # S^T
            if cutlass.const_expr(self.dropout):
                read_backward_bits(drop[1], drop[0], step, wg * THREADS + wt, bits)
            if cutlass.const_expr(self.rows_by_producer):
                cute.arch.mbarrier_wait(bars_rows + rows, (step // ROW_STAGES) % 2)
            held = None
            if cutlass.const_expr(self.shuffle_rows):
                held = _held_rows(sRows, rows, cute.arch.lane_idx(), self.tile_m)
            self._p_only(acc_s, tScS, sRows, rows, scale_log2, key0, seqlen_k, row0, offset, keep, tScS0=tScS0,
                         column_reads=self.column_reads, held=held)
            if cutlass.const_expr(self.key_mask):
                # GQA: step + 1 starts the group's next query head (a uniform branch, once the key bounds are used;
                # at the step's start it changed how the step's LSE addresses compile, at its end it cost registers)
                if (step + 1) % n_m == 0 and step + 1 < steps:
                    self._key_keep(mWords[None, head_kv * group + (step + 1) // n_m, batch], tScS, key0, seqlen_k,
                                   keep)
            if cutlass.const_expr(self.shuffle_rows):
                r_p.store(acc_s.load().to(self.dtype))  # FA4's order: P^T for dV while dP^T is in flight
            warpgroup.wait_group(0)  # dP^T
            if cutlass.const_expr(self.dropout):
                # dS is the gradient of the undropped P^T, P^T (Z dP^T / (1 - p) - delta): the keep select here, the
                # scale in _ds_only's subtraction (one FFMA per score)
                for i in cutlass.range_constexpr(cute.size(acc_dp)):
                    acc_dp[i] = cutlass.select_(backward_keep(bits, *tScS0[i]), acc_dp[i], Float32(0.0))
            self._ds_only(acc_s, acc_dp, tScS, sRows, rows, tScS0 if self.column_reads or self.shuffle_rows else None,
                          dp_scale=drop[4] if self.dropout else None, held=held)
            if cutlass.const_expr(self.rows_by_producer):
                cute.arch.mbarrier_arrive(bars_rows + ROW_STAGES + rows)  # the step's last read of sRows
            if cutlass.const_expr(self.dropout):
                # dV takes the dropped P^T (scaled in the epilogue): selected in fp32, in place (P^T has no later
                # reader), so that the conversion packs pairs (a select per bf16 value cost a SEL, an F2FP and half
                # a PRMT more per score)
                for i in cutlass.range_constexpr(cute.size(acc_s)):
                    acc_s[i] = cutlass.select_(backward_keep(bits, *tScS0[i]), acc_s[i], Float32(0.0))
            if cutlass.const_expr(not self.shuffle_rows):
                r_p.store(acc_s.load().to(self.dtype))
            r_ds.store(acc_dp.load().to(self.dtype))
            if cutlass.const_expr(not self.shuffle_rows):
                self._issue_dv(mma_rs, acc_dv, t_p, tVrdOt, stage)

            # dS to this step's pair of dS tiles and step + 1's rows to the other slot, then the MMA warpgroups'
            # one barrier per step: both dS tiles are in (each warpgroup's dQ GEMM reads both), the rows are
            # published, and both warpgroups are past step - 1's dQ GEMM, the last reader of the tiles written next
            ds_tile0 = (step % 2) * wgs
            if cutlass.const_expr(not self.rows_by_producer):
                if row_loader:
                    sRows[0, wt, 1 - rows] = self._lse_log2(next_lse)
                    sRows[1, wt, 1 - rows] = next_delta
            cute.copy(store_ds, store_ds.get_slice(wt).retile(r_ds), tDSsdS[None, None, None, ds_tile0 + wg])
            if cutlass.const_expr(self.shuffle_rows):
                self._issue_dv(mma_rs, acc_dv, t_p, tVrdOt, stage)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=MMA_BARRIER, number_of_threads=wgs * THREADS)

            # dQ block (this warpgroup's columns) = dS K over both key tiles, then dK += dS^T Q
            warpgroup.fence()
            for j in cutlass.range_constexpr(wgs):
                if cutlass.const_expr(self.dq_transposed):  # dQ^T (this warpgroup's columns x queries) = K^T dS^T
                    _gemm(mma_dq, acc_dq, tQrKt[j], tQrdS[None, None, None, ds_tile0 + j], accumulate=j > 0)
                else:
                    _gemm(mma_dq, acc_dq, tQrdS[None, None, None, ds_tile0 + j], tQrKt[j], accumulate=j > 0)
            warpgroup.commit_group()
            if cutlass.const_expr(self.shuffle_rows):
                warpgroup.wait_group(1)  # dV: P^T's registers free before dK is in flight
            for kk in cutlass.range_constexpr(cute.size(t_ds, mode=[2])):
                cute.gemm(mma_rs, acc_dk, t_ds[None, None, kk], tKrQt[None, None, kk, stage], acc_dk)
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # dQ (and dV); dK runs on under the dQ store
            state.advance()

            # the block to the writer: once it has read step - 1's, this warpgroup's part, then the arrival
            if step > 0:
                cute.arch.mbarrier_wait(bar_dq + 1, (step - 1) % 2)
            for i in cutlass.range(cute.size(acc_dq), unroll_full=True):
                sdQ[self._dq_slot(wt, i, 0, wg)] = acc_dq[i]
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(bar_dq)
            warpgroup.wait_group(0)  # dK
            pipe.consumer_release(released)
            released.advance()
        warpgroup.wait_group(0)  # the last dK, before the epilogue reads acc_dk
