"""Warp-specialised FlashAttention backward for Hopper (sm90a) at head_dim 192 and 256, in the CuTe DSL (issue 7);
also with V (dO, dV) of another head dim for the pairs of HEAD_DIM_V_PAIRS (MLA's 192 / 128: see there).

flash_bwd.flash_bwd(..., warp_specialized=True) runs it at these head dims. The d = 64 / 128 kernel
(flash_bwd_ws.py) gives each MMA warpgroup its own 64 keys and every accumulator of them: dK and dV alone would
take 192 (d=192) or 256 (d=256) registers per thread there. Here the two MMA warpgroups share one tile of 64 keys
and split the work by columns (FA3's split at large head dims; the budget is in docs/cute.md):
- S^T = K Q^T and dP^T = V dO^T by query columns: warpgroup g takes queries [32 g, 32 g + 32) of the step's 64
  (m64n32 GEMMs, 16 + 16 accumulator registers), computes its half of P^T and dS^T and stores it (stmatrix) into
  shared-memory tiles of the whole 64 x 64 block;
- after one barrier of the two warpgroups, each runs dV += P^T dO, dK += dS^T Q and the dQ block = dS K for its
  half of the head dim's columns (d / 2: 96 or 128), all three with both operands in shared memory (P^T and dS^T
  are each warpgroup's A operand but computed by halves): 48 / 64 registers per accumulator;
- P^T branch-free (_p_only's branch_free), bool key masks as flash_bwd_ws takes them (a per-row key bound in the
  visibility test), GQA by walking the group's query heads, the deterministic variant's turn flags as flash_bwd_ws's;
- the P^T / dS^T tiles alternate between steps, so that one barrier per step orders their writes and reads;
- the dQ block goes to the producer warpgroup's dQ writer warp through the step's own Q / dO stage: once a
  warpgroup's dV and dK GEMMs are done, its column halves of that stage's Q and dO tiles (2 * 64 * d / 2 bf16 values)
  have no reader left and hold exactly its part of the fp32 block (64 * d / 2 values). The writer adds the parts with
  bulk reduce-adds into the chunked "columns" order that _dq_layout converts, and it (not the MMA warpgroups)
  releases the stage to the producer once the adds have read it. Without a dQ buffer of its own (64 KB at d=256) two
  Q / dO stages fit at d=256: with one stage, a step's loads start only when the step before it ends (d=256 ran at
  0.63-0.70x cuDNN so, 0.90-1.05x with two; d=192 with one stage 0.59-0.64x of two).
- epilogue (tma_store, the default): each warpgroup's column halves of dK and dV in the input dtype into the K and V
  tiles (stmatrix; nothing reads them after the last step), then one TMA store of each tile (+1-16 % on the H200,
  eighteenth session; tma_store=False: value by value from registers).
A warpgroup's column half must be whole swizzle atoms for the MN-major views (dO, Q, K as B operands): d=256 keeps
128-byte swizzling (64-column atoms), d=192 uses 64-byte swizzling (32-column atoms: 96 = 3 of them); the column
halves are then contiguous regions of a tile (the atoms tile the rows first).
Shared memory (bytes, bf16/fp16): K and V 2 * 64 * d * 2, Q and dO 2 * 64 * d * 2 per stage, P^T and dS^T 2 * 2 *
8 KB: 224 KB at d=256 with two Q / dO stages and at d=192 with three (QDO_STAGES; 227 KB is what an sm90 CTA may
have).
"""

from __future__ import annotations

from ._compile_cache import enable_dsl_disk_cache

enable_dsl_disk_cache()  # before the DSL's first compile in this process

from typing import Any  # noqa: E402

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup  # noqa: E402
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from ._bulk import bulk_reduce_add_f32  # noqa: E402
from ._tma_store import converted, stmatrix_tile, tma_store_tile  # noqa: E402
from .flash_bwd import THREADS, TILE_M, TILE_N, WIDE_HEAD_DIMS, _gemm, _transposed  # noqa: E402
from ._fwd_parts import own_copy  # noqa: E402
from .flash_bwd_ws import MMA_BARRIER, MMA_REGS, PRODUCER_REGS, FlashBackwardSm90WS  # noqa: E402

HEAD_DIMS = WIDE_HEAD_DIMS
PT_TILES = 2  # P^T / dS^T tiles alternate between steps: one barrier per step orders their writes and reads


# Q / dO pipeline depth: at d=192 three stages (a stage stays held until the dQ writer's adds have read the dQ parts
# in it: two gave 0.79-0.83x of the first version's separate dQ buffer on the H200, three 1.01-1.04x), at d=256 the
# two that fit (one: 0.63-0.70x cuDNN, two 0.90-1.05x)
QDO_STAGES = {192: 3, 256: 2}
# (head_dim, head_dim_v) with head_dim_v != head_dim: MLA's (192, 128). dV is 64 x dv / 2 per warpgroup, dP^T's K dim
# dv; a warpgroup's fp32 dQ part (64 x d / 2) no longer fits its column halves of the Q and dO tiles (64 x (d + dv) / 2
# 16-bit values): the rest (64 x (d - dv) / 4 fp32 values) goes through its own region per stage (three stages: 216 KB)
HEAD_DIM_V_PAIRS = frozenset({(192, 128)})


class FlashBackwardSm90Wide(FlashBackwardSm90WS):
    """The warp-specialised backward with both MMA warpgroups on one 64-key tile, split by columns (module
    docstring): head_dim 192 or 256, 64 query rows per step."""

    def __init__(self, dtype: type, head_dim: int, causal: bool, bottom_right: bool, key_mask: bool = False,
                 deterministic: bool = False, head_dim_v: int | None = None, tma_store: bool = True):
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim={head_dim} (supported: {', '.join(map(str, HEAD_DIMS))})")
        dv = head_dim if head_dim_v is None else head_dim_v
        if dv != head_dim and (head_dim, dv) not in HEAD_DIM_V_PAIRS:
            raise ValueError(f"head_dim={head_dim} with head_dim_v={dv} (supported: equal, or (head_dim, head_dim_v) "
                             f"one of {sorted(HEAD_DIM_V_PAIRS)})")
        # tma_store: each warpgroup's column halves of dK and dV into the K and V tiles (stmatrix), then one TMA store
        # of each whole tile
        super().__init__(dtype, head_dim, causal, bottom_right, TILE_M, key_mask=key_mask,
                         deterministic=deterministic, tma_store=tma_store)
        self.head_dim_v = dv
        self.rows_by_producer = False  # this kernel's own loop: its MMA warpgroups load the rows themselves
        self.key_tiles = 1  # one 64-key tile per CTA, shared by both MMA warpgroups
        self.qdo_stages = QDO_STAGES[head_dim]
        self.cols = head_dim // self.wgs  # each MMA warpgroup's columns of dK and the dQ block
        self.cols_v = dv // self.wgs  # and of dV
        self.smem_padding = 1024  # the barriers before the first 1024-byte-aligned tile

    def _pieces(self) -> tuple[int, int, int]:
        """fp32 values of the three pieces of a warpgroup's dQ part (64 x d / 2 values, _dq_slot's order): its column
        half of a Q tile, of a dO tile (both reread as fp32), and the rest in its region of the stage's extra dQ
        memory (0 with equal head dims)."""
        width = self.dtype.width // 8
        q_piece = self.tile_m * self.cols * width // 4
        do_piece = self.tile_m * self.cols_v * width // 4
        return q_piece, do_piece, self.tile_m * self.cols - q_piece - do_piece

    def _smem_bytes(self) -> int:
        d, dv, tm, width = self.head_dim, self.head_dim_v, self.tile_m, self.dtype.width // 8
        extra = 4 * self.wgs * self._pieces()[2] * self.qdo_stages
        return (width * (TILE_N + self.qdo_stages * tm) * (d + dv) + extra + 2 * PT_TILES * width * tm * TILE_N
                + 4 * 2 * tm * 2 + self.smem_padding)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQacc: cute.Tensor, scale_log2: Float32,
                 scale: Float32, stream: Any, mWords: cute.Tensor = None):
        d, d_v = self.head_dim, self.head_dim_v
        tm = self.tile_m
        q, k, v, do, dk, dv, dqacc, lse, delta, words = self._views(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mdQacc,
                                                                   mWords)

        # S^T, dP^T of a warpgroup's 32 queries (keys x queries, both operands K-major)
        mma_s = sm90.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.K, Float32,
                                            (1, 1, 1), (TILE_N, tm // self.wgs))
        # dK, dV of a warpgroup's columns (keys x d / 2, keys x dv / 2): P^T / dS^T K-major, Q / dO MN-major
        # (transposed views); dK's MMA serves dV with equal head dims (mma_dv None: no kernel parameter)
        mma_dk = sm90.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN,
                                             Float32, (1, 1, 1), (TILE_N, self.cols))
        mma_dv = None
        if cutlass.const_expr(d_v != d):
            mma_dv = sm90.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.K, OperandMajorMode.MN,
                                                 Float32, (1, 1, 1), (TILE_N, self.cols_v))
        # the dQ block's columns (queries x d / 2) = dS K: both MN-major
        mma_dq = sm90.make_trivial_tiled_mma(self.dtype, self.dtype, OperandMajorMode.MN, OperandMajorMode.MN,
                                             Float32, (1, 1, 1), (tm, self.cols))
        # K, V, Q, dO: rows of d contiguous values, swizzled in atoms that a warpgroup's column half is made of
        atom = sm90.make_smem_layout_atom(sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, self.cols),
                                          self.dtype)
        sK_layout = cute.tile_to_shape(atom, (TILE_N, d, 1), order=(0, 1, 2))
        sQ_layout = cute.tile_to_shape(atom, (tm, d, self.qdo_stages), order=(0, 1, 2))
        sV_layout, sdO_layout = sK_layout, sQ_layout
        if cutlass.const_expr(d_v != d):  # V and dO: atoms of their own warpgroup column halves
            atom_v = sm90.make_smem_layout_atom(sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype,
                                                                          self.cols_v), self.dtype)
            sV_layout = cute.tile_to_shape(atom_v, (TILE_N, d_v, 1), order=(0, 1, 2))
            sdO_layout = cute.tile_to_shape(atom_v, (tm, d_v, self.qdo_stages), order=(0, 1, 2))
        # P^T and dS^T: (queries, keys) tiles, queries contiguous (the dQ GEMM's MN-major A; transposed, the K-major
        # A of dV / dK)
        sP_layout = sm90.make_smem_layout_a(LayoutEnum.COL_MAJOR, (tm, d, TILE_N), self.dtype, PT_TILES)
        tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_q, tma_tensor_q, tma_do, tma_tensor_do = self._tma_atoms(
            k, v, q, do, sK_layout, sQ_layout, sV_layout, sdO_layout)
        tma_dk, tma_dv = None, None
        if cutlass.const_expr(self.tma_store):  # dK / dV: TMA store atoms of the key tile (dk, dv: their tensors)
            store = cpasync.CopyBulkTensorTileS2GOp()
            tma_dk, dk = cpasync.make_tiled_tma_atom(store, dk, cute.slice_(sK_layout, (None, None, 0)), (TILE_N, d))
            tma_dv, dv = cpasync.make_tiled_tma_atom(store, dv, cute.slice_(sV_layout, (None, None, 0)), (TILE_N, d_v))
        self.kernel(tma_k, tma_tensor_k, tma_v, tma_tensor_v, tma_q, tma_tensor_q, tma_do, tma_tensor_do, lse, delta,
                    dk, dv, dqacc, scale_log2, scale, mma_s, mma_dk, mma_dq, sK_layout, sQ_layout, sP_layout,
                    words, mma_dv, sV_layout, sdO_layout, tma_dk, tma_dv).launch(
            grid=(cute.ceil_div(k.shape[0], TILE_N), k.shape[2], k.shape[3]),
            block=(THREADS * self.cta_warpgroups, 1, 1), smem=self._smem_bytes(), stream=stream,
            min_blocks_per_mp=1)  # ptxas needs one CTA per SM stated for setmaxnreg (flash_bwd.__call__)

    @cute.kernel
    def kernel(self, tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor, mLSE: cute.Tensor,
               mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mdQacc: cute.Tensor, scale_log2: Float32,
               scale: Float32, mma_s: cute.TiledMma, mma_dk: cute.TiledMma, mma_dq: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               mWords: cute.Tensor, mma_dv: cute.TiledMma, sV_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, tma_dk: cute.CopyAtom, tma_dv: cute.CopyAtom):  # tma_store, else None
        d, d_v = self.head_dim, self.head_dim_v
        wgs = self.wgs
        stages = self.qdo_stages
        tidx, _, _ = cute.arch.thread_idx()
        role = cute.arch.make_warp_uniform(tidx // THREADS)  # 0: the producer warpgroup, 1 + wg: MMA warpgroup wg
        n_block, head_kv, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        group = mQ.shape[2] // mK.shape[2]

        smem = SmemAllocator()
        bar_kv = smem.allocate_array(cutlass.Int64, 1)
        bars_qdo = smem.allocate_array(cutlass.Int64, 2 * stages)
        bar_dq = smem.allocate_array(cutlass.Int64, stages)  # per stage: its dQ parts are stored
        sK = smem.allocate_tensor(self.dtype, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sV = smem.allocate_tensor(self.dtype, sV_layout.outer, byte_alignment=1024, swizzle=sV_layout.inner)
        # the Q and dO stages as raw bytes: the swizzled operand views, and the unswizzled fp32 views through which
        # the dQ parts reach the writer (module docstring)
        stage_bytes = self.tile_m * d * self.dtype.width // 8
        do_stage_bytes = self.tile_m * d_v * self.dtype.width // 8
        raw_q = smem.allocate(stages * stage_bytes, byte_alignment=1024)
        raw_do = smem.allocate(stages * do_stage_bytes, byte_alignment=1024)
        sQ = cute.make_tensor(cute.recast_ptr(raw_q, sQ_layout.inner, dtype=self.dtype), sQ_layout.outer)
        sdO = cute.make_tensor(cute.recast_ptr(raw_do, sdO_layout.inner, dtype=self.dtype), sdO_layout.outer)
        fQ = cute.make_tensor(cute.recast_ptr(raw_q, dtype=Float32), cute.make_layout(stages * stage_bytes // 4))
        fdO = cute.make_tensor(cute.recast_ptr(raw_do, dtype=Float32), cute.make_layout(stages * do_stage_bytes // 4))
        fX = None  # unequal head dims: the rest of each dQ part, per stage and warpgroup
        if cutlass.const_expr(d_v != d):
            x_floats = stages * wgs * self._pieces()[2]
            fX = cute.make_tensor(cute.recast_ptr(smem.allocate(4 * x_floats, byte_alignment=128), dtype=Float32),
                                  cute.make_layout(x_floats))
        sP = smem.allocate_tensor(self.dtype, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sdS = smem.allocate_tensor(self.dtype, sP_layout.outer, byte_alignment=1024, swizzle=sP_layout.inner)
        sRows = smem.allocate_tensor(Float32, cute.make_layout((2, self.tile_m, 2)), byte_alignment=16)

        # a stage is refilled once the dQ writer has released it (its adds have read the dQ parts stored there)
        pipe = pipeline.PipelineTmaAsync.create(
            num_stages=stages, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=stage_bytes + do_stage_bytes, barrier_storage=bars_qdo, defer_sync=True)
        if tidx == 0:
            cute.arch.mbarrier_init(bar_kv, 1)
            for s in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(bar_dq + s, wgs * THREADS)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        offset, m_start, n_m, steps = self._query_blocks(seqlen_q, seqlen_k, n_block, group)
        if cutlass.const_expr(self.key_mask):
            # no step where every query head of the group has its key bound at or before the CTA's first key (key
            # padding): dK and dV stay 0 (every role reads the same bounds)
            bound = Int32(0)
            for g in cutlass.range(group, unroll=1):
                row = mWords[None, head_kv * group + g, batch]
                bound = cutlass.max(bound, row[row.shape[0] - 1])
            if bound <= n_block * TILE_N:
                steps = 0
        if role == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            if warp == 0:
                self._produce(tma_k, mK, tma_v, mV, tma_q, mQ, tma_do, mdO, sK, sV, sQ, sdO, bar_kv, pipe, n_block,
                              head_kv, batch, group, m_start, n_m, steps)
            if warp == 1:
                self._write_dq_parts(fQ, fdO, mdQacc, bar_dq, pipe, head_kv, batch, group, m_start, n_m, steps,
                                     n_block, mWords, fX)
        else:
            cute.arch.setmaxregister_increase(MMA_REGS)
            own_dv = None  # equal head dims: dK's MMA serves dV
            if cutlass.const_expr(d_v != d):
                own_dv = own_copy(mma_dv)
            self._mma_wide(own_copy(mma_s), own_copy(mma_dk), own_copy(mma_dq), sK, sV, sQ, sdO, sP, sdS, fQ,
                           fdO, sRows, bar_kv, bar_dq, pipe, mLSE, mDelta, mdK, mdV, scale_log2, scale, role - 1,
                           tidx % THREADS, n_block, head_kv, batch, group, seqlen_k, offset, m_start, n_m, steps,
                           mWords, own_dv, fX, (tma_dk, tma_dv))

    @cute.jit
    def _write_dq_parts(self, fQ: cute.Tensor, fdO: cute.Tensor, mdQacc: cute.Tensor, bar_dq: cute.Pointer,
                        pipe: cutlass.Constexpr, head_kv: Int32, batch: Int32, group: Int32, m_start: Int32,
                        n_m: Int32, steps: Int32, n_block: Int32, mTurns: cute.Tensor = None, fX: cute.Tensor = None):
        """The dQ writer warp: once both MMA warpgroups stored a step's dQ parts in its stage, each part's pieces (its
        column half of the Q tile, then of the dO tile, then with unequal head dims its region of fX: _pieces) added
        to the chunk with bulk reduce-adds; once they have been read, the stage goes back to the producer.
        Deterministic: the turn flags of flash_bwd_ws._write_dq."""
        q_piece, do_piece, x_piece = self._pieces()
        width = self.dtype.width // 8
        q_stage = self.tile_m * self.head_dim * width // 4  # fp32 values of one stage of fQ, fdO, fX
        do_stage = self.tile_m * self.head_dim_v * width // 4
        x_stage = self.wgs * x_piece
        part = q_piece + do_piece + x_piece
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.qdo_stages)
        for step in cutlass.range(steps, unroll=1):
            head = head_kv * group + step // n_m
            m_block = self._m_block(m_start, n_m, step)
            gdQ = mdQacc[None, None, head, batch]  # (blocks, tile_m * d) chunks
            cute.arch.mbarrier_wait(bar_dq + state.index, state.phase)
            if cute.arch.lane_idx() == 0:
                chunk = gdQ.iterator + cute.crd2idx((m_block, 0), gdQ.layout)
                turn = None
                if cutlass.const_expr(self.deterministic):
                    turn = self._take_turn(mTurns, m_block, head, batch, n_block)
                for g in cutlass.range_constexpr(self.wgs):
                    bulk_reduce_add_f32(fQ.iterator + (state.index * q_stage + g * q_piece), chunk + g * part,
                                        4 * q_piece)
                    bulk_reduce_add_f32(fdO.iterator + (state.index * do_stage + g * do_piece),
                                        chunk + (g * part + q_piece), 4 * do_piece)
                    if cutlass.const_expr(x_piece > 0):
                        bulk_reduce_add_f32(fX.iterator + (state.index * x_stage + g * x_piece),
                                            chunk + (g * part + q_piece + do_piece), 4 * x_piece)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                pipe.consumer_release(state)  # lane 0 is the pipeline's signalling thread
                if cutlass.const_expr(self.deterministic):
                    self._pass_turn(turn)
            state.advance()

    @cute.jit
    def _wide_fragments(self, mma_s: cute.TiledMma, mma_kv: cute.TiledMma, mma_dq: cute.TiledMma, sK: cute.Tensor,
                        sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sP: cute.Tensor, sdS: cute.Tensor,
                        wg: Int32, wt: Int32, mma_dv: cute.TiledMma = None):
        """Warpgroup wg's thread wt's operand views of the five GEMMs (stage or tile mode last), the block
        coordinates of its S^T, dK and dV values, and the stmatrix copy of its P^T / dS^T half with both
        destinations. mma_kv: dK's MMA, and dV's unless mma_dv is given (unequal head dims)."""
        tm, cols = self.tile_m, self.cols
        half_q = tm // self.wgs
        mma_dv = mma_kv if mma_dv is None else mma_dv
        thr_s, thr_kv, thr_dq = mma_s.get_slice(wt), mma_kv.get_slice(wt), mma_dq.get_slice(wt)
        thr_dv = mma_dv.get_slice(wt)
        tSrK = mma_s.make_fragment_A(thr_s.partition_A(sK[None, None, 0]))
        tSrV = mma_s.make_fragment_A(thr_s.partition_A(sV[None, None, 0]))
        tSrQ = mma_s.make_fragment_B(thr_s.partition_B(cute.local_tile(sQ, (half_q, self.head_dim), (wg, 0, None))))
        tSrdO = mma_s.make_fragment_B(thr_s.partition_B(cute.local_tile(sdO, (half_q, self.head_dim_v),
                                                                        (wg, 0, None))))
        tVrP = mma_dv.make_fragment_A(thr_dv.partition_A(_transposed(sP)))  # (keys, queries, tile)
        tKrdS = mma_kv.make_fragment_A(thr_kv.partition_A(_transposed(sdS)))
        tVrdO = mma_dv.make_fragment_B(thr_dv.partition_B(cute.local_tile(_transposed(sdO), (self.cols_v, tm),
                                                                          (wg, 0, None))))
        tKrQ = mma_kv.make_fragment_B(thr_kv.partition_B(cute.local_tile(_transposed(sQ), (cols, tm), (wg, 0, None))))
        tQrdS = mma_dq.make_fragment_A(thr_dq.partition_A(sdS))  # (queries, keys, tile)
        tQrK = mma_dq.make_fragment_B(thr_dq.partition_B(cute.local_tile(_transposed(sK[None, None, 0]),
                                                                         (cols, TILE_N), (wg, 0))))
        tScS = thr_s.partition_C(cute.local_tile(cute.make_identity_tensor((TILE_N, tm)), (TILE_N, half_q), (0, wg)))
        tKcK = thr_kv.partition_C(cute.local_tile(cute.make_identity_tensor((TILE_N, self.head_dim)),
                                                  (TILE_N, cols), (0, wg)))
        tQcQ = thr_dq.partition_C(cute.make_identity_tensor((tm, cols)))
        tVcV = None  # dV's coordinates where they are not dK's
        if cutlass.const_expr(self.head_dim_v != self.head_dim):
            tVcV = thr_dv.partition_C(cute.local_tile(cute.make_identity_tensor((TILE_N, self.head_dim_v)),
                                                      (TILE_N, self.cols_v), (0, wg)))
        store = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), self.dtype), mma_s)
        tPsP = store.get_slice(wt).partition_D(cute.local_tile(_transposed(sP), (TILE_N, half_q), (0, wg, None)))
        tDSsdS = store.get_slice(wt).partition_D(cute.local_tile(_transposed(sdS), (TILE_N, half_q), (0, wg, None)))
        return (tSrK, tSrV, tSrQ, tSrdO, tVrP, tKrdS, tVrdO, tKrQ, tQrdS, tQrK, tScS, tKcK, tQcQ, store, tPsP, tDSsdS,
                tVcV)

    @cute.jit
    def _mma_wide(self, mma_s: cute.TiledMma, mma_kv: cute.TiledMma, mma_dq: cute.TiledMma, sK: cute.Tensor,
                  sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sP: cute.Tensor, sdS: cute.Tensor,
                  fQ: cute.Tensor, fdO: cute.Tensor, sRows: cute.Tensor, bar_kv: cute.Pointer, bar_dq: cute.Pointer,
                  pipe: cutlass.Constexpr, mLSE: cute.Tensor, mDelta: cute.Tensor, mdK: cute.Tensor,
                  mdV: cute.Tensor, scale_log2: Float32, scale: Float32, wg: Int32, wt: Int32, n_block: Int32,
                  head_kv: Int32, batch: Int32, group: Int32, seqlen_k: Int32, offset: Int32, m_start: Int32,
                  n_m: Int32, steps: Int32, mWords: cute.Tensor = None, mma_dv: cute.TiledMma = None,
                  fX: cute.Tensor = None, tma_atoms: tuple = (None, None)):
        """MMA warpgroup wg (thread wt of it): per step, its query half of S^T / dP^T / P^T / dS^T, one barrier,
        then its column half of dV, dK and the dQ block. Key masks as flash_bwd_ws: each thread's two key rows' bound
        (_key_keep) replaces seqlen_k in the visibility test. mma_kv: dK's MMA, and dV's unless mma_dv is given
        (unequal head dims, whose dQ parts also use fX). tma_atoms: dK's and dV's TMA store atoms (tma_store)."""
        wgs = self.wgs
        key0 = n_block * TILE_N
        f = self._wide_fragments(mma_s, mma_kv, mma_dq, sK, sV, sQ, sdO, sP, sdS, wg, wt, mma_dv)
        tSrK, tSrV, tSrQ, tSrdO, tVrP, tKrdS, tVrdO, tKrQ, tQrdS, tQrK, tScS, tKcK, tQcQ, store, tPsP, tDSsdS, tVcV = f
        acc_s, acc_dp, acc_dk, acc_dv, acc_dq = self._accumulators(tScS, tKcK, tQcQ, tVcV)
        row_loader = self._first_rows(mLSE, mDelta, sRows, bar_kv, wg, wt, head_kv, batch, group, m_start, n_m, steps)
        mma_kv.set(warpgroup.Field.ACCUMULATE, True)
        if cutlass.const_expr(mma_dv is not None):
            mma_dv.set(warpgroup.Field.ACCUMULATE, True)
        else:
            mma_dv = mma_kv

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.qdo_stages)
        r_p = cute.make_rmem_tensor(acc_s.shape, self.dtype)
        r_ds = cute.make_rmem_tensor(acc_dp.shape, self.dtype)
        thr_store = store.get_slice(wt)
        keep = None
        if cutlass.const_expr(self.key_mask):  # the first head's key bounds, out of the step loop
            keep = cute.make_rmem_tensor((2,), Int32)
            self._key_keep(mWords[None, head_kv * group, batch], tScS, key0, seqlen_k, keep)
        for step in cutlass.range(steps, unroll=1):
            rows = step % 2
            tile = step % PT_TILES
            row0 = self._m_block(m_start, n_m, step) * self.tile_m
            next_lse, next_delta = self._next_rows(mLSE, mDelta, row_loader, step, steps, head_kv, group, m_start,
                                                   n_m, wt, batch)
            pipe.consumer_wait(state)
            stage = state.index

            warpgroup.fence()
            _gemm(mma_s, acc_s, tSrK, tSrQ[None, None, None, stage])
            warpgroup.commit_group()
            _gemm(mma_s, acc_dp, tSrV, tSrdO[None, None, None, stage])
            warpgroup.commit_group()
            warpgroup.wait_group(1)  # S^T
            # branch-free: with the exp2 under `if visible` ptxas kept a real branch per score here (418 SASS lines
            # for the 16 exp2s at d=256, 90 without; +7-10 % on the H200)
            self._p_only(acc_s, tScS, sRows, rows, scale_log2, key0, seqlen_k, row0, offset, keep, branch_free=True)
            if cutlass.const_expr(self.key_mask):
                if (step + 1) % n_m == 0 and step + 1 < steps:  # GQA: step + 1 starts the group's next query head
                    self._key_keep(mWords[None, head_kv * group + (step + 1) // n_m, batch], tScS, key0, seqlen_k,
                                   keep)
            r_p.store(acc_s.load().to(self.dtype))
            cute.copy(store, thr_store.retile(r_p), tPsP[None, None, None, tile])
            warpgroup.wait_group(0)  # dP^T
            self._ds_only(acc_s, acc_dp, tScS, sRows, rows)
            r_ds.store(acc_dp.load().to(self.dtype))
            cute.copy(store, thr_store.retile(r_ds), tDSsdS[None, None, None, tile])
            if row_loader:
                sRows[0, wt, 1 - rows] = self._lse_log2(next_lse)
                sRows[1, wt, 1 - rows] = next_delta
            # both halves of P^T / dS^T in (and step + 1's rows published); both warpgroups are past step - 1's
            # GEMMs, the last readers of the other tile
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=MMA_BARRIER, number_of_threads=wgs * THREADS)

            warpgroup.fence()
            _gemm(mma_dq, acc_dq, tQrdS[None, None, None, tile], tQrK)
            warpgroup.commit_group()
            for kk in cutlass.range_constexpr(cute.size(tVrP, mode=[2])):
                cute.gemm(mma_dv, acc_dv, tVrP[None, None, kk, tile], tVrdO[None, None, kk, stage], acc_dv)
            warpgroup.commit_group()
            for kk in cutlass.range_constexpr(cute.size(tKrdS, mode=[2])):
                cute.gemm(mma_kv, acc_dk, tKrdS[None, None, kk, tile], tKrQ[None, None, kk, stage], acc_dk)
            warpgroup.commit_group()
            warpgroup.wait_group(0)  # dQ, dV and dK: this warpgroup's column halves of the stage are free

            # the dQ part into them (_dq_slot's order within the part: its first piece in the Q tile's columns, the
            # next in dO's, with unequal head dims the rest in fX: _pieces), then the arrival for the writer, which
            # releases the stage
            q_piece, do_piece, x_piece = self._pieces()
            width = self.dtype.width // 8
            base_q = stage * (self.tile_m * self.head_dim * width // 4) + wg * q_piece
            base_do = stage * (self.tile_m * self.head_dim_v * width // 4) + wg * do_piece
            base_x = (stage * wgs + wg) * x_piece
            for i in cutlass.range_constexpr(cute.size(acc_dq)):
                p = (i // 2) * 2 * THREADS + 2 * wt + i % 2
                if cutlass.const_expr((i // 2) * 2 * THREADS < q_piece):  # pieces are whole multiples of 2 * THREADS
                    fQ[base_q + p] = acc_dq[i]
                elif cutlass.const_expr((i // 2) * 2 * THREADS < q_piece + do_piece):
                    fdO[base_do + p - q_piece] = acc_dq[i]
                else:
                    fX[base_x + p - q_piece - do_piece] = acc_dq[i]
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(bar_dq + stage)
            state.advance()
        if cutlass.const_expr(self.tma_store):
            self._store_dkdv_halves(mma_kv, mma_dv, sK, sV, mdK, mdV, tma_atoms, acc_dk, acc_dv, scale, n_block,
                                    head_kv, batch, wg, wt)
        else:
            self._store_dkdv(mdK, mdV, acc_dk, acc_dv, tKcK, scale, key0, seqlen_k, n_block, head_kv, batch,
                             tVcV=tVcV)

    @cute.jit
    def _store_dkdv_halves(self, mma_kv: cute.TiledMma, mma_dv: cute.TiledMma, sK: cute.Tensor, sV: cute.Tensor,
                           mdK: cute.Tensor, mdV: cute.Tensor, tma_atoms: tuple, acc_dk: cute.Tensor,
                           acc_dv: cute.Tensor, scale: Float32, n_block: Int32, head_kv: Int32, batch: Int32,
                           wg: Int32, wt: Int32):
        """tma_store epilogue: warpgroup wg's column halves of dK = scale * sum dS^T Q and dV in the input dtype into
        the K and V tiles by stmatrix (a column half is whole swizzle atoms); once both halves are in, the first warp
        of warpgroup 0 stores each tile with one TMA copy (keys past seqlen_k clipped) and waits until it has read
        them (the CTA must not exit, releasing the memory, before)."""
        tma_dk, tma_dv = tma_atoms
        mma_dv = mma_kv if mma_dv is None else mma_dv
        wgs = self.wgs
        # both warpgroups past their last GEMM: each one's S^T and dP^T read all of K's and V's columns
        cute.arch.barrier(barrier_id=MMA_BARRIER, number_of_threads=wgs * THREADS)
        for mma, acc, sX, cols, factor in ((mma_kv, acc_dk, sK, self.cols, scale), (mma_dv, acc_dv, sV, self.cols_v,
                                                                                    None)):
            stmatrix_tile(mma, converted(acc, self.dtype, factor),
                          cute.local_tile(sX[None, None, 0], (TILE_N, cols), (0, wg)), self.dtype, wt)
        cute.arch.fence_proxy("async.shared", space="cta")  # the stores are seen by the TMA unit (the async proxy)
        cute.arch.barrier(barrier_id=MMA_BARRIER, number_of_threads=wgs * THREADS)
        if wg == 0:
            if cute.arch.make_warp_uniform(wt // 32) == 0:
                for tma, mG, sX, cols in ((tma_dk, mdK, sK, self.head_dim), (tma_dv, mdV, sV, self.head_dim_v)):
                    gX = cute.local_tile(mG[None, None, head_kv, batch], (TILE_N, cols), (None, 0))
                    tma_store_tile(tma, sX[None, None, 0], gX, n_block)
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)
