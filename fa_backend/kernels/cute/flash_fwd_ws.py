"""Warp-specialised FlashAttention forward for Hopper (sm90a) in the CuTe DSL: the FA3 structure.

It passes tests/kernels/cute/test_flash_fwd_ws_gpu.py on the H200 (2026-11-30), every variant; bf16 forward of the
fastest variant per head dim and causal mode (FASTEST, the `cute` backend's forward through the op
fa_backend::cute_flash_fwd, ops/cute_flash.py) at 0.90-1.15x of cuDNN (d=64 / 96 / 128, 2k / 8k tokens, 2026-12-01;
scripts/bench_cute.py, docs/benchmarks.md).

One CTA = one tile of TILE_M = 128 query rows of one (batch, head), 3 warpgroups (384 threads):
- warpgroup 0, the producer, gives registers back (setmaxnreg.dec to PRODUCER_REGS) and one warp of it
  issues the TMA loads: Q once (two 64-row halves on one mbarrier), then K and V of each key block into
  KV_STAGES-deep shared-memory rings, each guarded by full/empty mbarriers (PipelineTmaAsync);
- warpgroups 1 and 2, the consumers, take registers (setmaxnreg.inc to CONSUMER_REGS); each owns 64
  query rows: S = Q K^T with wgmma, online softmax in fp32 (log2 domain), O += P V with wgmma taking P
  from registers; a consumer frees a K (V) stage as soon as its S (O) GEMM is done with it.
Key blocks are visited last to first, so the blocks that need masking (the one past seqlen_k, those on
the causal diagonal) come first and the rest run without mask code; blocks above the diagonal are skipped.
With overlap=True (FA3's intra-warpgroup overlap) a consumer issues block j+1's S GEMM and block j's P V
GEMM together and runs block j+1's softmax while P V is in flight. With pingpong=True (overlap too; FA3's
warp scheduling) the consumers take turns issuing their GEMMs, round robin through one named barrier each, so
that one warpgroup's GEMMs run while the others compute their softmax. consumers=3: 192 query rows per CTA, four
warpgroups (FA3 / FA4's tile at d=64). With causal masking the query tiles run longest
first (the grid's last tiles first). persistent=True: at most PERSISTENT_CTAS CTAs, each walking tiles bid, bid +
grid, ... with two Q tiles in turn (the producer loads tile t + 1's Q, then its K / V, while the consumers run tile t;
a Q tile is handed back on its "free" barrier once the consumers' O store has read it; the K/V pipeline states and
ping-pong turns carry across tiles): passes the GPU tests, within 2 % of one CTA per tile at 2k and slower at 8k on
the H200 (docs/perf-log.md), so the op does not use it; not at d=256 or 192 / 128 (two Q tiles do not fit).
Epilogue: LSE (natural log, fp32) from registers; O / l in the input dtype through each consumer's Q stage
(stmatrix) and one TMA store per consumer (tma_store, the default; False: from registers, rows past seqlen_q
skipped); rows that see no key get O = 0 and LSE = -inf.

Inputs as flash_fwd (SDPA layout, any 16-byte aligned strides with a unit head_dim stride, GQA by
h // (hq // hkv), top-left or bottom-right causal), head dims 64, 96, 128 and (two consumers, 64-key blocks:
TILE_NS) 192 and 256, V and O with their own head dim for the pairs of HEAD_DIM_V_PAIRS (MLA's 192 / 128, on 128-key
blocks); optionally a packed bool key mask and dropout (the Triton kernels' mask, drawn by the consumers:
_dropout.py). Shared memory: about 164 KB at d = 128, 84 KB at d = 64, 148 / 196 KB at d = 192 / 256, 212 KB at
192 / 128.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch

from .flash_fwd import _compile_variant, _run  # noqa: I001 - first: sets the DSL cache before cutlass loads

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from ._dropout import KEEP_KEYS, drop_scores, dropout_state, zero_unvisited_keep_tiles  # noqa: E402
from ..keep_bits import KEEP_PERIODS, KEEP_ROWS  # noqa: E402
from ._fwd_parts import (  # noqa: E402
    ForwardVariant, convert_in_place, finish_rows, load_key_words, make_tiled_mmas, mask_keys, mask_scores,
    online_softmax, own_copy, rescale_rows, sdpa_views, select_i32, softmax_scores, store_rows)
from ._schedule import longest_first, section_size  # noqa: E402
from ._tma_store import converted, stmatrix_tile, tma_store_tile  # noqa: E402

KERNEL_NAME = "flash_fwd_sm90_ws"
WG_M = 64  # query rows per consumer warpgroup (the wgmma M)
CONSUMERS = 2
TILE_M = WG_M * CONSUMERS
TILE_N = 128  # key rows per block: S is 64 x 128 per consumer, 64 fp32 registers per thread
# head dims of this kernel and their key block where it is not TILE_N: at d=192 / 256 the Q tile and two K / V
# stages of 128 keys need 240 / 320 KB of shared memory; 64 keys need 144 / 192 KB (of 227), and the consumers'
# O accumulator takes 96 / 128 of their 240 registers
HEAD_DIMS = (64, 96, 128, 192, 256)
TILE_NS = {192: 64, 256: 64}
# (head_dim, head_dim_v) pairs with head_dim_v != head_dim: MLA's (192, 128) (DeepSeek-V2 / V3 prefill and training).
# K stages of 192 columns beside V stages of 128 leave room for 128-key blocks (SMEM_LIMIT), and O takes 64 registers as
# at d=128
HEAD_DIM_V_PAIRS = frozenset({(192, 128)})
KV_STAGES = 2
SMEM_LIMIT = 227 * 1024  # what one sm90 CTA may have
WG_THREADS = 128
THREADS = WG_THREADS * (1 + CONSUMERS)
# setmaxnreg: 384 threads start with 65536 / 384 = 170 registers each. The producer only walks TMA
# coordinates and barriers, so it keeps 24; the consumers hold S (64), O (d / 2) and P (32) in registers
# and take 240. 24 * 128 + 2 * 240 * 128 = 64512 <= 65536, the register file.
PRODUCER_REGS = 24
CONSUMER_REGS = 240
# Three consumers (192 query rows per CTA, FA3's tile at d <= 64): 24 * 128 + 3 * 160 * 128 = 64512 registers.
# (ptxas still compiles the kernel for 65536 / 512 = 128 registers per thread: see FlashForwardSm90WS.)
CONSUMER_REGS_3 = 160
PINGPONG_BARRIER = 1  # named barriers 1 .. consumers (0 is __syncthreads'): one per consumer
# a consumer's O rows are in shared memory, for its TMA store: named barriers PINGPONG_BARRIER + consumers + consumer
# index (3 and 4 with two consumers, 4 to 6 with three)
PERSISTENT_CTAS = 132  # persistent variants: CTAs launched at most (one per SM of an H100 / H200, 1 CTA per SM)


def _smem_bytes(tile_m: int, tile_n: int, head_dim: int, head_dim_v: int, q_buffers: int = 1,
                kv_stages: int = KV_STAGES) -> int:
    """Shared memory of a 16-bit variant: q_buffers Q tiles (2 for persistent variants), kv_stages K and V stages,
    alignment padding and barriers."""
    return 2 * (q_buffers * tile_m * head_dim + kv_stages * tile_n * (head_dim + head_dim_v)) + 4 * 1024


def tile_n(head_dim: int, head_dim_v: int | None = None) -> int:
    """Keys per block: TILE_N, or 64 where the tiles of 128 keys would not fit in shared memory (TILE_NS)."""
    if head_dim_v is None or head_dim_v == head_dim:
        return TILE_NS.get(head_dim, TILE_N)
    return TILE_N if _smem_bytes(TILE_M, TILE_N, head_dim, head_dim_v) <= SMEM_LIMIT else 64


def _check_keep_bits(keep_bits: int, dropout: bool, key_mask: bool, head_dim: int, head_dim_v: int | None) -> None:
    """ValueError unless a keep_bits variant can save the bits: dropout without a key mask, on blocks as wide as the
    saved tiles (KEEP_KEYS keys, the backward's CTA), every keep_bits-th row of tiles (True: 1; KEEP_PERIODS)."""
    if keep_bits and not (dropout and not key_mask and tile_n(head_dim, head_dim_v) == KEEP_KEYS):
        raise ValueError(f"keep_bits=True needs dropout=True, no key mask and {KEEP_KEYS}-key blocks (head_dim "
                         f"{head_dim})")
    if keep_bits not in (False, *KEEP_PERIODS):
        raise ValueError(f"keep_bits={keep_bits} (supported: False, True or a period of {KEEP_PERIODS})")


def _keep_suffix(keep_bits: int) -> str:
    """A keep_bits variant's kernel-name suffix: _keepbits, with the period where it is not 1."""
    return "" if not keep_bits else "_keepbits" if keep_bits == 1 else f"_keepbits{int(keep_bits)}"


def _check_block_n(block_n: int | None, head_dim: int, head_dim_v: int | None, causal: bool, key_mask: bool,
                   dropout: bool, persistent: bool, consumers: int) -> None:
    """ValueError unless `block_n` (keys per block other than tile_n's) can run: a multiple of 16 (the P V wgmma's K)
    up to 256 (the S wgmma's N), without a causal mask, key mask or dropout (their block ranges, key words and keep
    bits are built on tile_n's 64 / 128-key blocks) or the persistent schedule, and K / V stages of that many keys
    within SMEM_LIMIT."""
    if block_n is None:
        return
    dv = head_dim if head_dim_v is None else head_dim_v
    if block_n % 16 or not 16 <= block_n <= 256:
        raise ValueError(f"block_n={block_n} (supported: a multiple of 16 up to 256)")
    if causal or key_mask or dropout or persistent:
        raise ValueError(f"block_n={block_n} with causal={causal}, key_mask={key_mask}, dropout={dropout}, "
                         f"persistent={persistent} (supported: none of them)")
    if _smem_bytes(WG_M * consumers, block_n, head_dim, dv) > SMEM_LIMIT:
        raise ValueError(f"block_n={block_n} at head_dim={head_dim}, head_dim_v={dv}: the K / V stages do not fit "
                         "in shared memory")


def _check_kv_stages(kv_stages: int | None, consumers: int, block_n: int | None, head_dim: int,
                     head_dim_v: int | None, persistent: bool) -> None:
    """ValueError unless `kv_stages` (K / V ring depth other than KV_STAGES) is 2 to 4 and its stages fit in shared
    memory beside the Q tile(s)."""
    if kv_stages is None:
        return
    dv = head_dim if head_dim_v is None else head_dim_v
    if kv_stages not in (2, 3, 4):
        raise ValueError(f"kv_stages={kv_stages} (supported: 2, 3 or 4)")
    n = block_n or tile_n(head_dim, dv)
    if _smem_bytes(WG_M * consumers, n, head_dim, dv, 2 if persistent else 1, kv_stages) > SMEM_LIMIT:
        raise ValueError(f"kv_stages={kv_stages} at head_dim={head_dim}, head_dim_v={dv} with {n}-key blocks: the "
                         "K / V stages do not fit in shared memory")


def _check_consumers(consumers: int, overlap: bool, pingpong: bool, persistent: bool = False,
                     head_dim: int = 128) -> None:
    if consumers not in (2, 3):
        raise ValueError(f"consumers={consumers} with overlap={overlap}, pingpong={pingpong}, persistent={persistent} "
                         "(supported: 2 or 3)")
    if consumers == 3 and head_dim > 128:  # 128 registers per thread cannot hold O (96-128 of them) and S
        raise ValueError(f"consumers=3 at head_dim={head_dim} (supported: head_dim <= 128)")


def _check_persistent(persistent: bool, consumers: int, head_dim: int, head_dim_v: int | None) -> None:
    """ValueError where a persistent variant's two Q tiles and the K / V stages exceed an sm90 CTA's shared memory
    (d=256, MLA's 192 / 128)."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if persistent and _smem_bytes(WG_M * consumers, tile_n(head_dim, dv), head_dim, dv, 2) > SMEM_LIMIT:
        raise ValueError(f"persistent=True at head_dim={head_dim}, head_dim_v={dv}: two Q tiles do not fit in "
                         "shared memory")


def _tma_store(tma_store: bool | None) -> bool:
    """Whether a variant stores O by TMA: `tma_store`, True where None (the default; a persistent variant stores
    through the Q tile of the tile it finishes while its producer loads the next tile's Q into the other one)."""
    return True if tma_store is None else tma_store


class FlashForwardSm90WS(ForwardVariant):
    """Compile-time configuration (dtype, head_dim, causal and its alignment) of one warp-specialised variant.

    overlap: intra-warpgroup overlap (FA3): each consumer issues block j+1's S = Q K^T and block j's
    O += P V back to back and runs block j+1's softmax while the P V GEMM is still in flight.
    pingpong (implies overlap): the consumers issue their GEMMs in turns, round robin (named barriers
    PINGPONG_BARRIER + consumer index, 256 threads each: the waiting consumer and the one handing over): consumer c
    waits on its own barrier before issuing and arrives on consumer (c + 1) % consumers' after; consumer 0 arrives on
    its own once at the start, so it goes first.
    consumers: 2 (128 query rows per CTA, 240 registers each) or 3 (192 rows, FA3 / FA4's tile at d <= 64, 160
    registers each). At d=64 every three-consumer variant (serial, overlap, ping-pong; causal, key mask) allocates
    without spills; the overlap ones only since the probabilities are converted in program order
    (_fwd_parts.convert_in_place: LLVM had sunk the conversion past the next S issue, 556 bytes of spills with the TMA
    store). At d=96 / 128 three consumers spill (128-1156 bytes), and with dropout 40 bytes.
    tma_store (the default): the epilogue writes a consumer's
    O rows in the input dtype into its own Q stage (stmatrix; no GEMM of that consumer reads Q any more) and one of
    its warps stores them with one TMA copy (rows past seqlen_q clipped by the copy), instead of 64 two-byte
    stores per thread at d=128 that each touch eight rows (False: that register epilogue; the TMA store is +7-19 % at
    2k, +0-7 % at 8k on the H200, docs/perf-log.md).
    """

    def __init__(self, dtype: type, head_dim: int, causal: bool, bottom_right: bool, overlap: bool = False,
                 pingpong: bool = False, consumers: int = CONSUMERS, persistent: bool = False,
                 key_mask: bool = False, dropout: bool = False, head_dim_v: int | None = None,
                 tma_store: bool | None = None, keep_bits: bool = False, block_n: int | None = None,
                 kv_stages: int | None = None):
        super().__init__(dtype, head_dim, causal, bottom_right, head_dim_v)
        _check_block_n(block_n, head_dim, head_dim_v, causal, key_mask, dropout, persistent, consumers)
        _check_kv_stages(kv_stages, consumers, block_n, head_dim, head_dim_v, persistent)
        self.kv_stages = kv_stages or KV_STAGES
        self.dropout = dropout
        # keep_bits: each draw's keep byte also goes to a buffer the backward reads (_dropout, "Saved keep bits")
        _check_keep_bits(keep_bits, dropout, key_mask, head_dim, head_dim_v)
        self.keep_bits = bool(keep_bits)
        self.keep_period = int(keep_bits)  # every keep_period-th row of tiles saved (kernels/keep_bits.py)
        self.tma_store = _tma_store(tma_store)
        _check_consumers(consumers, overlap, pingpong, persistent, head_dim)
        _check_persistent(persistent, consumers, head_dim, head_dim_v)
        self.persistent = persistent
        self.key_mask = key_mask
        self.overlap = overlap or pingpong
        self.pingpong = pingpong
        self.consumers = consumers
        self.tile_m = WG_M * consumers
        self.tile_n = block_n or tile_n(head_dim, self.head_dim_v)
        # the causal layout of the saved bits holds a row of tiles' key tiles up to what the next 64 queries see:
        # as many as a 128-query tile visits for its first 64 rows (kernels/keep_bits.keep_row_width)
        if keep_bits and causal and self.tile_m > 2 * KEEP_ROWS:
            raise ValueError(f"keep_bits=True with causal=True needs query tiles of at most {2 * KEEP_ROWS} rows "
                             f"(consumers={consumers})")
        # causal tiles longest first over the heads of an L2 section (_schedule) where it was measured faster than
        # each head's tiles in turn (H200, bf16, 2k / 8k tokens): d=128 two consumers (overlap +1 / +3 %) and d=64
        # three (ping-pong -1 / +4 %); not d=64 with two (overlap -5 / -5 %), other head dims not timed
        # (persistent CTAs walk that order with a static stride: each takes the longest tiles left in turn)
        self.longest_first = causal and (head_dim, consumers) in ((128, 2), (64, 3))
        # a consumer passes the key blocks its rows do not need (all, when they lie past seqlen_q; causal, those past
        # their diagonal: _consume_tile) where a tile spans more rows than a key block: three consumers on 128-key
        # blocks, 64-key blocks at d=192 / 256 (H200 A/B, 2k / 4k / 8k: d=64 causal +9 / +6 / +2 %, d=256 causal
        # +1-2 %, non-causal within 1 %). Two consumers on 128-key blocks have at most one such block (bottom-right)
        # and lost 1-5 % to the extra code (d=64 causal overlap -5 %, ping-pong -1 to -3 %): they keep the tile's range
        self.own_ranges = self.tile_m > self.tile_n
        # causal: the tiles' padding past seqlen_q (whole 64-row units: seqlen_q rounded up to 64 against the tiles'
        # rows) in the first tile, the shortest, instead of the last, the longest (_first_unit): at 2k / 4k / 8k
        # tokens three 64-row consumers leave one / two / one of the last tile's three idle, and a tile of 16-64
        # key blocks then runs on fewer consumers than its turns are built for
        self.lead_pad = self.own_ranges and causal and not dropout and not persistent
        # persistent: two Q tiles, so that the producer loads tile t + 1's Q (and then its K / V) while the consumers
        # run tile t and then store its O through tile t's own Q tile (handed back once the store has read it)
        self.q_buffers = 2 if persistent else 1
        self.threads = WG_THREADS * (1 + consumers)
        self.consumer_regs = CONSUMER_REGS if consumers == 2 else CONSUMER_REGS_3

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 scale_log2: Float32, stream: Any, mWords: cute.Tensor = None, mRng: cute.Tensor = None,
                 drop_threshold=None, drop_scale=None,  # Int32, Float32 with dropout (unannotated: None otherwise)
                 mBits: cute.Tensor = None):  # keep_bits: the saved bits' buffer (its first byte)
        d, dv = self.head_dim, self.head_dim_v
        q, k, v, o, lse = sdpa_views(mQ, mK, mV, mO, mLSE)
        words = None
        if cutlass.const_expr(self.key_mask):  # (b, hq, words) -> (words, h, b)
            words = cute.make_tensor(mWords.iterator, cute.select(mWords.layout, mode=[2, 1, 0]))
        mma_qk, mma_pv = make_tiled_mmas(self.dtype, WG_M, self.tile_n, d, dv)
        # staged smem layouts: Q has one stage per consumer (its 64 rows) and Q tile, K and V kv_stages each
        sQ_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (WG_M, self.tile_n, d), self.dtype,
                                            self.consumers * self.q_buffers)
        sK_layout = sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (WG_M, self.tile_n, d), self.dtype,
                                            self.kv_stages)
        sV_layout = sm90.make_smem_layout_b(LayoutEnum.COL_MAJOR, (WG_M, dv, self.tile_n), self.dtype,
                                            self.kv_stages)
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(load, q, cute.slice_(sQ_layout, (None, None, 0)), (WG_M, d))
        n = self.tile_n
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(load, k, cute.slice_(sK_layout, (None, None, 0)), (n, d))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(load, v, cute.slice_(sV_layout, (None, None, 0)), (dv, n))
        tma_o, tma_tensor_o, sO_layout = None, None, None
        if cutlass.const_expr(self.tma_store):  # one consumer's (64, dv) rows, laid out as a Q stage of dv columns
            sO_layout = sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (WG_M, n, dv), self.dtype, 1)
            tma_o, tma_tensor_o = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), o,
                                                              cute.slice_(sO_layout, (None, None, 0)), (WG_M, dv))
        smem_bytes = _smem_bytes(self.tile_m, n, d, dv, self.q_buffers, self.kv_stages)
        grid = (cute.ceil_div(q.shape[0], self.tile_m), q.shape[2], q.shape[3])
        if cutlass.const_expr(self.persistent):  # one CTA per SM, each walking tiles bid, bid + grid, ...
            grid = (cutlass.min(cute.ceil_div(q.shape[0], self.tile_m) * q.shape[2] * q.shape[3], PERSISTENT_CTAS),
                    1, 1)
        self.kernel(tma_q, tma_tensor_q, tma_k, tma_tensor_k, tma_v, tma_tensor_v, o, lse, scale_log2,
                    mma_qk, mma_pv, sQ_layout, sK_layout, sV_layout, words, mRng, drop_threshold, drop_scale,
                    tma_o, tma_tensor_o, sO_layout, mBits).launch(
            grid=grid, block=(self.threads, 1, 1), smem=smem_bytes, stream=stream, min_blocks_per_mp=1)

    @cute.jit
    def _block_range(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32,
                     key_row: cute.Tensor = None) -> tuple[Int32, Int32, Int32]:
        """(key blocks to visit, how many of them, counted from the last, need the mask, causal offset). key_row
        (key-mask variants): the tile's mask row, whose last word bounds the keys worth visiting (key padding)."""
        offset = seqlen_k - seqlen_q if cutlass.const_expr(self.bottom_right) else 0
        n_blocks = cute.ceil_div(seqlen_k, self.tile_n)
        if cutlass.const_expr(self.key_mask):  # no block past the row's last attended key
            n_blocks = cutlass.min(n_blocks, cute.ceil_div(key_row[key_row.shape[0] - 1], self.tile_n))
        # the last block is partial (1 block to mask) unless seqlen_k is a multiple of the block (0)
        n_masked = cute.ceil_div(seqlen_k % self.tile_n, self.tile_n)
        if cutlass.const_expr(self.lead_pad):
            first_row = self._first_unit(m_block, seqlen_q) * WG_M  # negative in a padded first tile
            n_blocks = cutlass.max(cutlass.min(n_blocks, cute.ceil_div(first_row + self.tile_m + offset,
                                                                       self.tile_n)), 0)
            n_masked = cutlass.max(n_blocks - cutlass.max((first_row + offset + 1) // self.tile_n, 0), n_masked)
        elif cutlass.const_expr(self.causal):
            # skip the blocks above the diagonal: no row of this tile sees their first key
            last_row = (m_block + 1) * self.tile_m + offset
            n_blocks = cutlass.max(cutlass.min(n_blocks, cute.ceil_div(last_row, self.tile_n)), 0)
            # blocks from the first one whose last key is past the tile's first row's diagonal need masking
            first_masked = cutlass.max((m_block * self.tile_m + offset + 1) // self.tile_n, 0)
            n_masked = cutlass.max(n_blocks - first_masked, n_masked)
        return n_blocks, cutlass.min(n_masked, n_blocks), offset

    @cute.jit
    def _unit(self, m_block: Int32, wg: Int32, row0: Int32) -> Int32:
        """The 64-row unit of O that consumer wg of query tile m_block stores, whose first row is row0 (>= 0)."""
        unit = m_block * self.consumers + wg
        if cutlass.const_expr(self.lead_pad):
            unit = row0 // WG_M
        return unit

    @cute.jit
    def _first_unit(self, m_block: Int32, seqlen_q: Int32) -> Int32:
        """The 64-row unit (of WG_M rows: one consumer's) where query tile m_block starts: m_block * consumers, less,
        where lead_pad, the tiles' units past ceil(seqlen_q / 64), so that the first tile holds the padding
        (negative rows, which no consumer computes) and the last ends at seqlen_q's unit."""
        unit = m_block * self.consumers
        if cutlass.const_expr(self.lead_pad):
            unit = unit - (cute.ceil_div(seqlen_q, self.tile_m) * self.consumers - cute.ceil_div(seqlen_q, WG_M))
        return unit

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32,
               mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, mWords: cute.Tensor, mRng: cute.Tensor,
               drop_threshold, drop_scale,  # Int32, Float32 for dropout variants, None otherwise (unannotated)
               tma_o: cute.CopyAtom, mO_tma: cute.Tensor, sO_layout: cute.ComposedLayout,  # tma_store, else None
               mBits: cute.Tensor):  # keep_bits, else None
        tidx, _, _ = cute.arch.thread_idx()
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        seqlen_k = mK.shape[0]

        smem = SmemAllocator()
        bar_q = smem.allocate_array(cutlass.Int64, self.q_buffers)  # Q has landed (per Q tile)
        bar_q_free = bar_q
        if cutlass.const_expr(self.persistent):
            # per Q tile: the consumers are done with it (their GEMMs, and with tma_store their O rows' store)
            bar_q_free = smem.allocate_array(cutlass.Int64, self.q_buffers)
        bars_k = smem.allocate_array(cutlass.Int64, 2 * self.kv_stages)  # full and empty barrier per K stage
        bars_v = smem.allocate_array(cutlass.Int64, 2 * self.kv_stages)
        # 1024-byte alignment: the 128B swizzle pattern of the wgmma operand layouts repeats every 1024 bytes
        raw_q = None
        if cutlass.const_expr(self.tma_store):  # the Q stages hold the O rows on their way out
            raw_q = smem.allocate(cute.cosize(sQ_layout.outer) * self.dtype.width // 8, byte_alignment=1024)
            sQ = cute.make_tensor(cute.recast_ptr(raw_q, sQ_layout.inner, dtype=self.dtype), sQ_layout.outer)
        else:
            sQ = smem.allocate_tensor(self.dtype, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sK = smem.allocate_tensor(self.dtype, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sV = smem.allocate_tensor(self.dtype, sV_layout.outer, byte_alignment=1024, swizzle=sV_layout.inner)

        # one elected producer lane arrives per stage (with the expected bytes); a stage is free again once
        # each of the 8 consumer warps has released it (the pipeline lets lane 0 of each warp arrive)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumers * WG_THREADS // 32)
        stage_bytes = self.tile_n * self.head_dim * self.dtype.width // 8
        pipe_k = pipeline.PipelineTmaAsync.create(num_stages=self.kv_stages, producer_group=producer,
                                                  consumer_group=consumers, tx_count=stage_bytes,
                                                  barrier_storage=bars_k, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(num_stages=self.kv_stages, producer_group=producer,
                                                  consumer_group=consumers,
                                                  tx_count=self.tile_n * self.head_dim_v * self.dtype.width // 8,
                                                  barrier_storage=bars_v, defer_sync=True)
        if tidx == 0:
            for b in cutlass.range_constexpr(self.q_buffers):
                cute.arch.mbarrier_init(bar_q + b, 1)
                if cutlass.const_expr(self.persistent):
                    # tma_store: one lane per consumer, once its O store has read the tile; else every consumer
                    # thread after its last GEMM
                    cute.arch.mbarrier_init(bar_q_free + b, self.consumers * (1 if self.tma_store else WG_THREADS))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()  # every barrier is initialised before anyone waits on it

        # tiles: one per CTA (grid = (query tiles, heads, batch)), or, persistent, tiles bid, bid + grid, ... of
        # the same order flattened (query tile fastest)
        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            # one whole warp produces: the DSL wraps each TMA copy and pipeline arrive in elect.sync over
            # all 32 lanes, which a single-thread branch would leave undefined
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
                state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
                state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.kv_stages)
                if cutlass.const_expr(self.persistent):
                    first, _, _ = cute.arch.block_idx()
                    step, _, _ = cute.arch.grid_dim()
                    for j in cutlass.range(first, self._n_tiles(mQ), step, unroll=1):
                        t = (j - first) // step  # this CTA's tile count; Q tile t % 2
                        if t >= 2:  # the consumers are done with tile t - 2, the last one in this Q tile
                            cute.arch.mbarrier_wait(bar_q_free + t % 2, (t // 2 - 1) % 2)
                        state_k, state_v = self._produce_tile(j, tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV,
                                                              bar_q + t % 2, pipe_k, pipe_v, state_k, state_v, mWords,
                                                              t % 2)
                else:
                    self._produce_tile(Int32(0), tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, bar_q, pipe_k, pipe_v,
                                       state_k, state_v, mWords, 0)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            wg = warpgroup_idx - 1
            state_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
            state_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.kv_stages)
            if cutlass.const_expr(self.pingpong):
                if wg == 0:  # consumer 0 takes the first turn; the turns then go round, across tiles too
                    cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER, number_of_threads=2 * WG_THREADS)
            args = (mma_qk, mma_pv, sQ, sK, sV, bar_q, bar_q_free, pipe_k, pipe_v, mO, mLSE, scale_log2, wg,
                    tidx % WG_THREADS, mWords, (mRng, drop_threshold, drop_scale, mBits),
                    (tma_o, mO_tma, sO_layout, raw_q))
            if cutlass.const_expr(self.persistent):
                first, _, _ = cute.arch.block_idx()
                step, _, _ = cute.arch.grid_dim()
                for j in cutlass.range(first, self._n_tiles(mQ), step, unroll=1):
                    t = (j - first) // step
                    state_k, state_v = self._consume_tile(j, t % 2, (t // 2) % 2, *args, mQ, seqlen_k, state_k,
                                                          state_v)
            else:
                self._consume_tile(Int32(0), 0, 0, *args, mQ, seqlen_k, state_k, state_v)

    @cute.jit
    def _n_tiles(self, mQ: cute.Tensor) -> Int32:
        """Query tiles times heads times batch."""
        return cute.ceil_div(mQ.shape[0], self.tile_m) * mQ.shape[2] * mQ.shape[3]

    @cute.jit
    def _produce_tile(self, j: Int32, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
                      tma_v: cute.CopyAtom, mV: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                      bar_q: cute.Pointer, pipe_k: Any, pipe_v: Any, state_k: Any, state_v: Any,
                      mWords: cute.Tensor, buf: Int32) -> tuple[Any, Any]:
        """The producer's loads of tile j (_tile) into Q tile `buf`, on its barrier bar_q; returns the advanced
        pipeline states."""
        m_block, head, batch = self._tile(j, mQ.shape[0], mQ, mK.shape[0])
        key_row = None
        if cutlass.const_expr(self.key_mask):
            key_row = mWords[None, head, batch]
        n_blocks, _, _ = self._block_range(m_block, mQ.shape[0], mK.shape[0], key_row)
        return self._produce(tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV, bar_q, pipe_k, pipe_v, m_block, head, batch,
                             n_blocks, state_k, state_v, buf)

    @cute.jit
    def _consume_tile(self, j: Int32, buf: Int32, q_phase: Int32, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, sQ: cute.Tensor,
                      sK: cute.Tensor, sV: cute.Tensor, bar_q: cute.Pointer, bar_q_free: cute.Pointer, pipe_k: Any,
                      pipe_v: Any, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32, wg: Int32, wg_tidx: Int32,
                      mWords: cute.Tensor, drop_args: tuple, store_args: tuple, mQ: cute.Tensor, seqlen_k: Int32,
                      state_k: Any, state_v: Any) -> tuple[Any, Any]:
        """One consumer warpgroup's work on tile j (_tile), whose Q is in Q tile `buf` (its barriers' phase q_phase);
        returns the advanced pipeline states."""
        m_block, head, batch = self._tile(j, mQ.shape[0], mQ, seqlen_k)
        key_row = None
        if cutlass.const_expr(self.key_mask):
            key_row = mWords[None, head, batch]
        n_blocks, n_masked, offset = self._block_range(m_block, mQ.shape[0], seqlen_k, key_row)
        if cutlass.const_expr(not self.own_ranges):
            state_k, state_v = self._consume(mma_qk, mma_pv, sQ, sK, sV, bar_q + buf, bar_q_free + buf, buf, q_phase,
                                             pipe_k, pipe_v, mO, mLSE, scale_log2, wg, wg_tidx, m_block, head, batch,
                                             seqlen_k, n_blocks, n_masked, offset, state_k, state_v, mWords,
                                             drop_args, store_args)
        else:
            row0 = m_block * self.tile_m + wg * WG_M
            rows = row0 < mQ.shape[0]  # the consumer's first row is before seqlen_q
            if cutlass.const_expr(self.lead_pad):  # and not in the first tile's padding
                row0 = (self._first_unit(m_block, mQ.shape[0]) + wg) * WG_M
                rows = cutlass.min(mQ.shape[0] - 1 - row0, row0) >= 0
            if rows:
                own, own_masked = n_blocks, n_masked
                if cutlass.const_expr(self.causal and not self.dropout):
                    own, own_masked = self._own_blocks(row0, seqlen_k, n_blocks, offset)
                    # the tile's blocks past this consumer's diagonal (visited first: the last block first) pass by
                    state_k, state_v = self._pass_blocks(n_blocks - own, pipe_k, pipe_v, wg, state_k, state_v)
                    if own == 0:  # n_blocks + 1 turns for every consumer; _consume takes own + 1 of them, or none
                        self._last_turn(n_blocks, wg)
                state_k, state_v = self._consume(mma_qk, mma_pv, sQ, sK, sV, bar_q + buf, bar_q_free + buf, buf,
                                                 q_phase, pipe_k, pipe_v, mO, mLSE, scale_log2, wg, wg_tidx, m_block,
                                                 head, batch, seqlen_k, own, own_masked, offset, state_k, state_v,
                                                 mWords, drop_args, store_args)
            else:  # no row in [0, seqlen_q) (the last query tile's tail, lead_pad: the first's): no GEMM, no store
                state_k, state_v = self._pass_blocks(n_blocks, pipe_k, pipe_v, wg, state_k, state_v)
                self._last_turn(n_blocks, wg)
                if cutlass.const_expr(self.persistent):
                    # hand the Q tile back once it has landed (the producer reloads it only after every consumer's
                    # arrival of this round): one arrival per consumer as _store_o's, or one per thread
                    cute.arch.mbarrier_wait(bar_q + buf, q_phase)
                    if cutlass.const_expr(self.tma_store):
                        if cute.arch.make_warp_uniform(wg_tidx // 32) == 0:
                            with cute.arch.elect_one():
                                cute.arch.mbarrier_arrive(bar_q_free + buf)
                    else:
                        cute.arch.mbarrier_arrive(bar_q_free + buf)
        return state_k, state_v

    @cute.jit
    def _own_blocks(self, row0: Int32, seqlen_k: Int32, n_blocks: Int32, offset: Int32) -> tuple[Int32, Int32]:
        """Causal: (key blocks, how many of them need the mask) of the tile's n_blocks (_block_range) up to the
        diagonal of the consumer whose rows start at row0: three 64-row consumers share a 192-row tile whose last
        row sees up to two 128-key blocks more than the first consumer's rows (5.5 % of the work at 2k). Dropout
        variants keep the tile's range (with their own, ptxas spilled 8 bytes of the causal d=256 variant)."""
        own = cutlass.max(cutlass.min(n_blocks, cute.ceil_div(row0 + WG_M + offset, self.tile_n)), 0)
        first_masked = cutlass.max((row0 + offset + 1) // self.tile_n, 0)
        partial = cute.ceil_div(seqlen_k % self.tile_n, self.tile_n)  # the partial last key block, as _block_range
        return own, cutlass.min(cutlass.max(own - first_masked, partial), own)

    @cute.jit
    def _last_turn(self, n_blocks: Int32, wg: Int32):
        """Pingpong: the turn of the last P V, passed by a consumer that visits none of the tile's n_blocks (every
        consumer takes n_blocks + 1 turns when n_blocks > 0)."""
        if cutlass.const_expr(self.pingpong):
            if n_blocks > 0:
                self._turn_begin(wg)
                self._turn_end(wg)

    @cute.jit
    def _pass_blocks(self, count: Int32, pipe_k: Any, pipe_v: Any, wg: Int32, state_k: Any,
                     state_v: Any) -> tuple[Any, Any]:
        """The next `count` key blocks without a GEMM: each one's K and V stage waited for and released (the
        producer counts every consumer warp's release) with one ping-pong turn passed, the turn the block's S would
        have taken. Returns the advanced pipeline states."""
        for _ in cutlass.range(count, unroll=1):
            pipe_k.consumer_wait(state_k)
            pipe_v.consumer_wait(state_v)
            self._turn_begin(wg)
            self._turn_end(wg)
            pipe_k.consumer_release(state_k)
            state_k.advance()
            pipe_v.consumer_release(state_v)
            state_v.advance()
        return state_k, state_v

    @cute.jit
    def _tile(self, j: Int32, seqlen_q: Int32, mQ: cute.Tensor, seqlen_k: Int32) -> tuple[Int32, Int32, Int32]:
        """(query tile, head, batch) of tile j: the CTA's block index, or, persistent, j of the flattened order
        (query tile fastest). Causal: the last query tiles (the most keys) first, over all heads of an L2 section
        (_schedule.longest_first, where self.longest_first; otherwise within each head)."""
        m_tiles = cute.ceil_div(seqlen_q, self.tile_m)
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.persistent):
            m_block = j % m_tiles
            head = (j // m_tiles) % mQ.shape[2]
            batch = j // (m_tiles * mQ.shape[2])
        if cutlass.const_expr(self.longest_first):
            # longest first over all heads (_schedule): the short tiles fill the tail instead of long ones of the
            # last heads running alone at the end
            heads = mQ.shape[2]
            pairs = heads * mQ.shape[3]
            # sections of heads whose K and V fit in L2 together
            section = section_size(seqlen_k, (self.head_dim + self.head_dim_v) * self.dtype.width // 8, cutlass.max,
                                   select_i32)
            m_block, pair = longest_first(m_block + m_tiles * (head + heads * batch), m_tiles, pairs, section,
                                          cutlass.min)
            head = pair % heads
            batch = pair // heads
        elif cutlass.const_expr(self.causal):  # each head's longest tile first
            m_block = m_tiles - 1 - m_block
        return m_block, head, batch

    @cute.jit
    def _produce(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
                 tma_v: cute.CopyAtom, mV: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                 bar_q: cute.Pointer, pipe_k: Any, pipe_v: Any, m_block: Int32, head: Int32, batch: Int32,
                 n_blocks: Int32, state_k: Any, state_v: Any, buf: Int32) -> tuple[Any, Any]:
        """The producer warp, one tile: Q's 64-row parts into Q tile `buf` on bar_q, then K and V of each key block,
        last block first. Returns the advanced pipeline states."""
        d = self.head_dim
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        one_cta = cute.make_layout(1)
        gQ = cute.local_tile(mQ[None, None, head, batch], (WG_M, d), (None, 0))  # (64, d, 64-row tiles)
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, d), (None, 0))  # (tile_n, d, blocks)
        # (dv, tile_n, blocks)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.head_dim_v, self.tile_n), (0, None))
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar_q, self.tile_m * d * self.dtype.width // 8)
        for half in cutlass.range_constexpr(self.consumers):
            unit = m_block * self.consumers + half
            if cutlass.const_expr(self.lead_pad):  # a unit of the first tile's padding loads unit 0 (never read)
                unit = cutlass.max(self._first_unit(m_block, mQ.shape[0]) + half, 0)
            cute.copy(tma_q, tQgQ[None, unit], tQsQ[None, buf * self.consumers + half], tma_bar_ptr=bar_q)
        for i in cutlass.range(n_blocks, unroll=1):
            n_block = n_blocks - 1 - i
            pipe_k.producer_acquire(state_k)  # waits until the consumers freed the stage, then expects its bytes
            cute.copy(tma_k, tKgK[None, n_block], tKsK[None, state_k.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(state_k))
            state_k.advance()
            pipe_v.producer_acquire(state_v)
            cute.copy(tma_v, tVgV[None, n_block], tVsV[None, state_v.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(state_v))
            state_v.advance()
        return state_k, state_v

    @cute.jit
    def _consume(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor,
                 sV: cute.Tensor, bar_q: cute.Pointer, bar_q_free: cute.Pointer, buf: Int32, q_phase: Int32, pipe_k: Any,
                 pipe_v: Any, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32, wg: Int32, wg_tidx: Int32,
                 m_block: Int32, head: Int32, batch: Int32, seqlen_k: Int32, n_blocks: Int32, n_masked: Int32,
                 offset: Int32, state_k: Any, state_v: Any, mWords: cute.Tensor,
                 drop_args: tuple, store_args: tuple) -> tuple[Any, Any]:
        """One consumer warpgroup, one tile: its 64 query rows (in Q tile `buf`, landed on bar_q; bar_q_free: the
        tile's barrier for the producer, persistent variants) against every visited key block, then the epilogue.
        drop_args: (the (seed, rng_offset) tensor, the 16-bit keep threshold, 1 / (1 - dropout_p), the saved keep
        bits' buffer or None) of dropout variants; store_args: (O's TMA store atom, its TMA tensor, O's shared-memory layout, the Q stages' bytes) of
        tma_store variants. Returns the advanced pipeline states."""
        dv = self.head_dim_v
        thr_qk, thr_pv = mma_qk.get_slice(wg_tidx), mma_pv.get_slice(wg_tidx)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, MMA_M, MMA_K, consumer)
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, MMA_N, MMA_K, stage)
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sV))
        # (row, col) within the 64-row tile of every accumulator value this thread holds
        tScS = thr_qk.partition_C(cute.make_identity_tensor((WG_M, self.tile_n)))
        key_row = None
        if cutlass.const_expr(self.key_mask):
            key_row = mWords[None, head, batch]
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((WG_M, dv)))
        acc_s = cute.make_rmem_tensor(tScS.shape, Float32)
        acc_o = cute.make_rmem_tensor(tOcO.shape, Float32)
        acc_o.fill(0.0)
        p_layout = mma_pv.make_fragment_A(thr_pv.partition_shape_A((WG_M, self.tile_n))).layout
        row_max = cute.make_rmem_tensor((2,), Float32)  # log2 units (scores times scale_log2)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(-math.inf)
        row_sum.fill(0.0)
        row0 = m_block * self.tile_m + wg * WG_M
        if cutlass.const_expr(self.lead_pad):
            row0 = (self._first_unit(m_block, mO.shape[0]) + wg) * WG_M

        drop, out_scale = None, None
        if cutlass.const_expr(self.dropout):
            mRng, drop_threshold, out_scale, mBits = drop_args
            bits = None
            if cutlass.const_expr(self.keep_bits):
                bits = mBits.iterator
            drop = dropout_state(mRng, drop_threshold, batch * mO.shape[2] + head, mO.shape[0], seqlen_k,
                                 row0 + tScS[0][0], row0 + tScS[2][0], wg_tidx % 32, bits, row0,
                                 self.keep_period, offset if cutlass.const_expr(self.causal) else None)
        r_p = cute.make_rmem_tensor(acc_s.shape, self.dtype)  # P in the input dtype, the A operand of P V
        t_p = cute.make_tensor(r_p.iterator, p_layout)  # the S accumulator's value order is the A operand's
        cute.arch.mbarrier_wait(bar_q, q_phase)
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        blocks = self._blocks_overlapped if cutlass.const_expr(self.overlap) else self._blocks
        state_k, state_v = blocks(mma_qk, mma_pv, tSrQ[None, None, None, buf * self.consumers + wg], tSrK, tOrV, tScS, acc_s, acc_o, r_p, t_p,
                                  row_max, row_sum, pipe_k, pipe_v, row0, seqlen_k, offset, scale_log2, n_blocks,
                                  n_masked, wg, state_k, state_v, key_row, drop)
        if cutlass.const_expr(self.persistent and not self.tma_store):
            # every GEMM that reads Q has been waited for: the producer may load tile t + 2's Q while this warpgroup
            # stores its rows (tma_store: once their store has read the tile, _store_o)
            cute.arch.mbarrier_arrive(bar_q_free)
        if cutlass.const_expr(self.keep_bits and self.causal):  # the blocks past the diagonal: their tiles zeroed
            zero_unvisited_keep_tiles(mBits.iterator, batch * mO.shape[2] + head, row0, mO.shape[0], seqlen_k,
                                      n_blocks, wg_tidx, self.keep_period, offset)

        if cutlass.const_expr(self.tma_store):
            finish_rows(acc_o, row_max, row_sum, tOcO, mLSE, row0, mO.shape[0], head, batch, wg_tidx % 32, out_scale)
            self._store_o(mma_pv, acc_o, store_args, m_block, head, batch, wg, wg_tidx, buf, bar_q_free, row0)
        else:
            gO = cute.local_tile(mO[None, None, head, batch], (WG_M, dv), (self._unit(m_block, wg, row0), 0))
            store_rows(acc_o, row_max, row_sum, tOcO, gO, mLSE, row0, mO.shape[0], head, batch, wg_tidx % 32,
                       out_scale)
        return state_k, state_v

    @cute.jit
    def _store_o(self, mma_pv: cute.TiledMma, acc_o: cute.Tensor, store_args: tuple, m_block: Int32, head: Int32,
                 batch: Int32, wg: Int32, wg_tidx: Int32, buf: Int32, bar_q_free: cute.Pointer, row0: Int32):
        """tma_store epilogue: consumer wg's finished O rows (acc_o, O / l; from row0) in the input
        dtype into its own stage of Q tile `buf` by stmatrix, then one TMA store of the 64 rows by its first warp,
        waited for until it has read them (the CTA must not exit, releasing the memory, before; persistent variants
        then hand the Q tile back to the producer: one arrival on bar_q_free)."""
        tma_o, mO_tma, sO_layout, raw_q = store_args
        r_o = converted(acc_o, self.dtype)
        # O's (64, dv) rows in the layout its TMA atom reads, one per Q stage (WG_M * d values apart: a static stride,
        # so the copies know the 1024-byte alignment of consumer wg's)
        stages = cute.append(cute.slice_(sO_layout.outer, (None, None, 0)),
                             cute.make_layout(self.consumers * self.q_buffers, stride=WG_M * self.head_dim))
        sO = cute.make_tensor(cute.recast_ptr(raw_q, sO_layout.inner, dtype=self.dtype), stages)[
            None, None, buf * self.consumers + wg]
        stmatrix_tile(mma_pv, r_o, sO, self.dtype, wg_tidx)
        cute.arch.fence_proxy("async.shared", space="cta")  # the stores are seen by the TMA unit (the async proxy)
        cute.arch.barrier(barrier_id=PINGPONG_BARRIER + self.consumers + wg, number_of_threads=WG_THREADS)
        if cute.arch.make_warp_uniform(wg_tidx // 32) == 0:
            gO = cute.local_tile(mO_tma[None, None, head, batch], (WG_M, self.head_dim_v), (None, 0))
            tma_store_tile(tma_o, sO, gO, self._unit(m_block, wg, row0))
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            if cutlass.const_expr(self.persistent):
                with cute.arch.elect_one():  # the lane that issued the store (elect.sync: the same leader)
                    cute.arch.mbarrier_arrive(bar_q_free)

    @cute.jit
    def _issue_pv(self, mma_pv: cute.TiledMma, acc_o: cute.Tensor, t_p: cute.Tensor, tOrV: cute.Tensor, stage: Int32):
        """Issue (and commit, without waiting) O += P V on V stage `stage`."""
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(t_p, mode=[2])):
            cute.gemm(mma_pv, acc_o, t_p[None, None, k], tOrV[None, None, k, stage], acc_o)
        warpgroup.commit_group()

    @cute.jit
    def _issue_qk(self, mma_qk: cute.TiledMma, tSrQ: cute.Tensor, tSrK: cute.Tensor, acc_s: cute.Tensor, stage: Int32):
        """Issue (and commit, without waiting) S = Q K^T on K stage `stage`."""
        mma_qk.set(warpgroup.Field.ACCUMULATE, False)
        warpgroup.fence()
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(mma_qk, acc_s, tSrQ[None, None, k], tSrK[None, None, k, stage], acc_s)
            mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def _scores(self, mma_qk: cute.TiledMma, tSrQ: cute.Tensor, tSrK: cute.Tensor, acc_s: cute.Tensor, pipe_k: Any,
                state_k: Any) -> Any:
        """S = Q K^T for the next K stage, waited for; the stage goes back to the producer at once. Returns the
        advanced K state."""
        pipe_k.consumer_wait(state_k)
        self._issue_qk(mma_qk, tSrQ, tSrK, acc_s, state_k.index)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(state_k)
        state_k.advance()
        return state_k

    @cute.jit
    def _values(self, mma_pv: cute.TiledMma, acc_o: cute.Tensor, t_p: cute.Tensor, tOrV: cute.Tensor, pipe_v: Any,
                state_v: Any) -> Any:
        """O += P V for the next V stage, waited for; the stage goes back to the producer. Returns the advanced
        V state."""
        pipe_v.consumer_wait(state_v)
        self._issue_pv(mma_pv, acc_o, t_p, tOrV, state_v.index)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(state_v)
        state_v.advance()
        return state_v

    @cute.jit
    def _turn_begin(self, wg: Int32):
        """Pingpong: wait for this consumer's turn to issue GEMMs (nothing without pingpong)."""
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=PINGPONG_BARRIER + wg, number_of_threads=2 * WG_THREADS)

    @cute.jit
    def _turn_end(self, wg: Int32):
        """Pingpong: hand the turn to the next consumer (nothing without pingpong)."""
        if cutlass.const_expr(self.pingpong):
            following = 1 - wg  # two consumers: the other one
            if cutlass.const_expr(self.consumers == 3):
                following = (wg + 1) % 3
            cute.arch.barrier_arrive(barrier_id=PINGPONG_BARRIER + following, number_of_threads=2 * WG_THREADS)

    @cute.jit
    def _key_mask_state(self, mma_qk: cute.TiledMma):
        """(registers for one block's key-mask words or None without a key mask, the S accumulator's static
        coordinates for thread 0)."""
        words = None
        if cutlass.const_expr(self.key_mask):
            words = cute.make_rmem_tensor((self.tile_n // 32,), cutlass.Uint32)
        return words, mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((WG_M, self.tile_n)))

    @cute.jit
    def _blocks(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                tOrV: cute.Tensor, tScS: cute.Tensor, acc_s: cute.Tensor, acc_o: cute.Tensor, r_p: cute.Tensor,
                t_p: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, pipe_k: Any, pipe_v: Any, row0: Int32,
                seqlen_k: Int32, offset: Int32, scale_log2: Float32, n_blocks: Int32, n_masked: Int32, wg: Int32,
                state_k: Any, state_v: Any, key_row: cute.Tensor, drop: Any) -> tuple[Any, Any]:
        """The key-block loop of one consumer, last block first, each GEMM waited for before the next step.
        Returns the advanced pipeline states."""
        words, tScS0 = self._key_mask_state(mma_qk)
        for i in cutlass.range(n_blocks, unroll=1):
            if cutlass.const_expr(self.key_mask):  # loads in flight during the GEMM
                load_key_words(key_row, n_blocks - 1 - i, words)
            state_k = self._scores(mma_qk, tSrQ, tSrK, acc_s, pipe_k, state_k)
            if cutlass.const_expr(self.key_mask):
                mask_keys(acc_s, tScS0, words, cute.arch.lane_idx())
            if i < n_masked:  # only the blocks on the diagonal and the partial last block pay for masking
                mask_scores(acc_s, tScS, tScS0, row0, (n_blocks - 1 - i) * self.tile_n, seqlen_k, offset, self.causal)
            online_softmax(acc_s, acc_o, row_max, row_sum, scale_log2)
            if cutlass.const_expr(self.dropout):  # after the row sums: the normaliser keeps every probability
                drop_scores(acc_s, tScS0, (n_blocks - 1 - i) * self.tile_n, drop)
            r_p.store(acc_s.load().to(self.dtype))
            state_v = self._values(mma_pv, acc_o, t_p, tOrV, pipe_v, state_v)
        return state_k, state_v

    @cute.jit
    def _blocks_overlapped(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                           tOrV: cute.Tensor, tScS: cute.Tensor, acc_s: cute.Tensor, acc_o: cute.Tensor,
                           r_p: cute.Tensor, t_p: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                           pipe_k: Any, pipe_v: Any, row0: Int32, seqlen_k: Int32, offset: Int32, scale_log2: Float32,
                           n_blocks: Int32, n_masked: Int32, wg: Int32, state_k: Any, state_v: Any,
                           key_row: cute.Tensor, drop: Any) -> tuple[Any, Any]:
        """_blocks with intra-warpgroup overlap: S of block i is computed while P V of block i - 1 runs; O is
        rescaled only once that GEMM is done (alpha waits in registers). With pingpong, every GEMM issue (the
        first S, each S + P V pair, the last P V: n_blocks + 1 turns per consumer) takes a turn (consumer 0's first
        turn is handed to it once, before the first tile). Returns the advanced pipeline states."""
        alpha = cute.make_rmem_tensor((2,), Float32)
        words, tScS0 = self._key_mask_state(mma_qk)
        if n_blocks > 0:
            if cutlass.const_expr(self.key_mask):
                load_key_words(key_row, n_blocks - 1, words)
            pipe_k.consumer_wait(state_k)
            self._turn_begin(wg)
            self._issue_qk(mma_qk, tSrQ, tSrK, acc_s, state_k.index)
            self._turn_end(wg)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(state_k)
            state_k.advance()
            if cutlass.const_expr(self.key_mask):
                mask_keys(acc_s, tScS0, words, cute.arch.lane_idx())
            if n_masked > 0:
                mask_scores(acc_s, tScS, tScS0, row0, (n_blocks - 1) * self.tile_n, seqlen_k, offset, self.causal)
            softmax_scores(acc_s, row_max, row_sum, alpha, scale_log2)  # O is still zero: no rescale
            if cutlass.const_expr(self.dropout):
                drop_scores(acc_s, tScS0, (n_blocks - 1) * self.tile_n, drop)
            convert_in_place(acc_s, r_p, self.dtype)
            # causal: the blocks that need the mask (the diagonal's, the partial last one) in one loop, the rest in
            # another without the mask's branch (FA4's structure: per unmasked block 14 SASS instructions fewer at
            # d=64, 7 at d=128, where ptxas now also waits for P V after the row maxima instead of before them); each
            # loop has its own copy of the S MMA, whose ACCUMULATE field it sets
            args = (mma_pv, tSrQ, tSrK, tOrV, tScS, acc_s, acc_o, r_p, t_p, row_max, row_sum, alpha, words, tScS0,
                    pipe_k, pipe_v, row0, seqlen_k, offset, scale_log2, n_blocks, wg, key_row, drop)
            first_unmasked = 1
            if cutlass.const_expr(self.causal):  # without it only the first (the partial last) block is masked
                first_unmasked = cutlass.max(n_masked, 1)
                mma_qk_masked = own_copy(mma_qk)
                for i in cutlass.range(1, first_unmasked, unroll=1):
                    state_k, state_v = self._overlapped_block(mma_qk_masked, *args, i, True, state_k, state_v)
            for i in cutlass.range(first_unmasked, n_blocks, unroll=1):
                state_k, state_v = self._overlapped_block(mma_qk, *args, i, False, state_k, state_v)
            pipe_v.consumer_wait(state_v)
            self._turn_begin(wg)
            self._issue_pv(mma_pv, acc_o, t_p, tOrV, state_v.index)
            self._turn_end(wg)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(state_v)
            state_v.advance()
        return state_k, state_v

    @cute.jit
    def _overlapped_block(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, tSrQ: cute.Tensor, tSrK: cute.Tensor,
                          tOrV: cute.Tensor, tScS: cute.Tensor, acc_s: cute.Tensor, acc_o: cute.Tensor,
                          r_p: cute.Tensor, t_p: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                          alpha: cute.Tensor, words: cute.Tensor, tScS0: cute.Tensor, pipe_k: Any, pipe_v: Any,
                          row0: Int32, seqlen_k: Int32, offset: Int32, scale_log2: Float32, n_blocks: Int32,
                          wg: Int32, key_row: cute.Tensor, drop: Any, i: Int32, masked: cutlass.Constexpr,
                          state_k: Any, state_v: Any) -> tuple[Any, Any]:
        """Block i (counted from the last key block) of _blocks_overlapped after the first: S of it issued with
        P V of block i - 1, softmax (with the causal / seqlen mask where `masked`) while P V runs, then O rescaled.
        Returns the advanced pipeline states."""
        n_block = n_blocks - 1 - i
        if cutlass.const_expr(self.key_mask):  # in flight during the GEMMs
            load_key_words(key_row, n_block, words)
        pipe_k.consumer_wait(state_k)
        if cutlass.const_expr(self.pingpong):  # both stages ready before the turn: it only issues
            pipe_v.consumer_wait(state_v)
        self._turn_begin(wg)
        self._issue_qk(mma_qk, tSrQ, tSrK, acc_s, state_k.index)
        if cutlass.const_expr(not self.pingpong):
            pipe_v.consumer_wait(state_v)
        self._issue_pv(mma_pv, acc_o, t_p, tOrV, state_v.index)
        self._turn_end(wg)
        warpgroup.wait_group(1)  # S is ready; P V (the newest group) may still run
        pipe_k.consumer_release(state_k)
        state_k.advance()
        if cutlass.const_expr(self.key_mask):
            mask_keys(acc_s, tScS0, words, cute.arch.lane_idx())
        if cutlass.const_expr(masked):
            mask_scores(acc_s, tScS, tScS0, row0, n_block * self.tile_n, seqlen_k, offset, self.causal)
        softmax_scores(acc_s, row_max, row_sum, alpha, scale_log2)
        if cutlass.const_expr(self.dropout):  # the draws run while P V is in flight
            drop_scores(acc_s, tScS0, n_block * self.tile_n, drop)
        warpgroup.wait_group(0)  # P V is done: r_p and O are free
        pipe_v.consumer_release(state_v)
        state_v.advance()
        rescale_rows(acc_o, alpha)
        convert_in_place(acc_s, r_p, self.dtype)
        return state_k, state_v


def compile_flash_fwd_ws(dtype: torch.dtype, head_dim: int, causal: bool, bottom_right: bool = False,
                         arch: str = "sm_90a", dump_dir: str | None = None, overlap: bool = False,
                         pingpong: bool = False, consumers: int = CONSUMERS, pointer_args: bool = False,
                         persistent: bool = False, key_mask: bool = False, dropout: bool = False,
                         head_dim_v: int | None = None, tma_store: bool | None = None, keep_bits: bool = False,
                         block_n: int | None = None, kv_stages: int | None = None) -> Any:
    """Compile one warp-specialised variant for symbolic shapes and strides (any batch, heads, seqlens;
    hq % hkv == 0). The compiled function takes (q, k, v, o, lse, scale * log2(e), stream), as
    flash_fwd.compile_flash_fwd's. Cached per variant in _compile_cache.CACHE under its own kernel name
    (except with `dump_dir`, which always compiles, to write the PTX and cubin). `overlap`: the
    intra-warpgroup overlap variant (FlashForwardSm90WS), cached as KERNEL_NAME + "_overlap"; `pingpong`: overlap
    with the consumers' turns (KERNEL_NAME + "_pingpong"); `consumers`: 3 for 192-row tiles (its own tile key);
    `pointer_args`: the _fast_call.PointerForward calling convention; `persistent`: at most PERSISTENT_CTAS CTAs,
    each walking the tiles (suffix "_persistent"); `key_mask`: the variant that also takes a bool key mask packed
    32 keys per int32 word, (b, hq, words) with broadcast strides (suffix "_keymask"; the last argument before
    the scale); `dropout`: the variant that also drops scores (_dropout: 16-bit Philox draws, the Triton kernels'
    mask), pointer convention only (_fast_call.PointerForwardDropout; suffix "_dropout"); `head_dim_v`: V's and O's
    head dim where it differs from head_dim ((head_dim, head_dim_v) in HEAD_DIM_V_PAIRS; the cache key's dv);
    `tma_store`: O through shared memory and one TMA store per consumer (suffix "_tmastore"; None: True, the
    default); `keep_bits` (dropout, 128-key blocks): the variant that also saves its keep decisions for
    the backward (_dropout, "Saved keep bits"; suffix "_keepbits"), or with a period of KEEP_PERIODS those of
    every period-th row of tiles (kernels/keep_bits.py; suffix "_keepbits2" ...); `block_n`: keys per block where not
    tile_n's (non-causal, no key mask or dropout: _check_block_n; the cache key's tile); `kv_stages`: the K / V
    rings' depth where not KV_STAGES (_check_kv_stages; the cache key's tile)."""
    # before the cache: a bad request is not a build failure
    _check_consumers(consumers, overlap, pingpong, persistent, head_dim)
    _check_keep_bits(keep_bits, dropout, key_mask, head_dim, head_dim_v)
    _check_persistent(persistent, consumers, head_dim, head_dim_v)
    _check_block_n(block_n, head_dim, head_dim_v, causal, key_mask, dropout, persistent, consumers)
    _check_kv_stages(kv_stages, consumers, block_n, head_dim, head_dim_v, persistent)
    tma_store = _tma_store(tma_store)
    name, tile = _name_and_tile(overlap, pingpong, consumers, persistent, key_mask, head_dim, dropout, head_dim_v,
                                tma_store, keep_bits, block_n, kv_stages)
    return _compile_variant(functools.partial(FlashForwardSm90WS, overlap=overlap, pingpong=pingpong,
                                              consumers=consumers, persistent=persistent, key_mask=key_mask,
                                              dropout=dropout, tma_store=tma_store, keep_bits=keep_bits,
                                              block_n=block_n, kv_stages=kv_stages),
                            name, tile, dtype, head_dim, causal, bottom_right, arch, dump_dir, pointer_args,
                            key_mask=key_mask, head_dims=HEAD_DIMS, dropout=dropout, head_dim_v=head_dim_v,
                            head_dim_pairs=HEAD_DIM_V_PAIRS)


def _name_and_tile(overlap: bool, pingpong: bool, consumers: int, persistent: bool = False,
                   key_mask: bool = False, head_dim: int = 128, dropout: bool = False,
                   head_dim_v: int | None = None, tma_store: bool = False,
                   keep_bits: bool = False, block_n: int | None = None,
                   kv_stages: int | None = None) -> tuple[str, tuple[int, ...]]:
    """The kernel name and tile (query rows, keys per block, K / V stages) of a variant in its compile-cache key."""
    suffix = (("_pingpong" if pingpong else "_overlap" if overlap else "") + ("_persistent" if persistent else "")
              + ("_keymask" if key_mask else "") + ("_dropout" if dropout else "") + _keep_suffix(keep_bits)
              + ("_tmastore" if tma_store else ""))
    return KERNEL_NAME + suffix, (WG_M * consumers, block_n or tile_n(head_dim, head_dim_v), kv_stages or KV_STAGES)


# The fastest variant per (head_dim, causal) on the H200, the one the op runs (scripts/bench_cute.py, bf16, medians of
# three interleaved rounds per cell, TFLOP/s at s = 2k / 8k; history in docs/perf-log.md). Nineteenth session
# (2026-12-01, with the probabilities converted in program order): d=128 overlap 599 / 648 non-causal, 487 / 588
# causal, ahead of ping-pong (592 / 632, 476 / 561) in every round of every cell (they had tied within the spread
# before); d=64 three consumers in round-robin ping-pong 462 / 524 non-causal, 353 / 463 causal, ahead of three
# overlapped consumers (433 / 494, 339 / 443), three serial ones (439 / 477, 342 / 446) and two consumers in every
# round.
FASTEST: dict[tuple[int, bool], dict[str, Any]] = {
    (128, False): dict(overlap=True), (128, True): dict(overlap=True),
    (64, False): dict(consumers=3, pingpong=True), (64, True): dict(consumers=3, pingpong=True),
    # d=96: overlap, at s = 2k / 8k 471 / 538 TFLOP/s non-causal (ping-pong 456 / 493) and 361 / 483 causal (ping-pong
    # 359 / 482); three consumers spill at d=96 (ptxas: 128 registers for 512 threads)
    (96, False): dict(overlap=True), (96, True): dict(overlap=True),
    # d=192 / 256 (64-key blocks), one run (2026-12-01, s = 2k / 8k): ping-pong 531 / 625 and 393 / 536 (causal) at
    # d=192 (overlap 506 / 591, 382 / 526), 572 / 661 at d=256 (overlap 556 / 645); causal d=256 overlap 403 / 526
    # (ping-pong 380 / 508); twenty-fifth session, two rounds each of two trees in one process (s = 2k / 4k / 8k,
    # docs/benchmarks/h200_cute_fwd_own_ranges_ab.json), causal d=256 ping-pong 534-536 / 572-578 / 608-610 against
    # overlap 508-518 / 534-543 / 570-573: ping-pong now
    (192, False): dict(pingpong=True), (192, True): dict(pingpong=True),
    (256, False): dict(pingpong=True), (256, True): dict(pingpong=True)}
# dropout variants where FASTEST's does not fit: d=64's three serial consumers (128 registers a thread) spill 16-20
# bytes with the Philox draws (sm_90a compile check); two ping-pong consumers (240 registers) do not, and overlap the
# draws of one consumer with the other's GEMMs
DROPOUT_FASTEST: dict[tuple[int, bool], dict[str, Any]] = {(64, False): dict(pingpong=True),
                                                         (64, True): dict(pingpong=True)}


# (head_dim, head_dim_v, causal) -> the variant for HEAD_DIM_V_PAIRS (128-key blocks, O of 64 registers: d=128's
# choice until timed)
HEAD_DIM_V_FASTEST: dict[tuple[int, int, bool], dict[str, Any]] = {
    (192, 128, False): dict(pingpong=True), (192, 128, True): dict(overlap=True)}


def fastest_kwargs(head_dim: int, causal: bool, dropout: bool = False,
                   head_dim_v: int | None = None) -> dict[str, Any]:
    """flash_fwd_ws's keywords of the variant flash_fwd_fastest runs (FASTEST; DROPOUT_FASTEST where it differs for
    dropout variants; HEAD_DIM_V_FASTEST where head_dim_v differs from head_dim)."""
    if head_dim_v is not None and head_dim_v != head_dim:
        return HEAD_DIM_V_FASTEST[head_dim, head_dim_v, causal]
    if dropout and (head_dim, causal) in DROPOUT_FASTEST:
        return DROPOUT_FASTEST[head_dim, causal]
    return FASTEST[head_dim, causal]


def fastest_variant_key(dtype: torch.dtype, head_dim: int, causal: bool, bottom_right: bool, key_mask: bool = False,
                        dropout: bool = False, head_dim_v: int | None = None):
    """The compile-cache key of the variant flash_fwd_fastest runs for these (what the dispatcher asks about), in
    the calling convention it compiles now (_fast_call.ENABLED: the pointer one; dropout variants always)."""
    from . import _fast_call
    from .flash_fwd import variant_key

    kw = fastest_kwargs(head_dim, causal, dropout, head_dim_v)
    name, tile = _name_and_tile(kw.get("overlap", False), kw.get("pingpong", False), kw.get("consumers", CONSUMERS),
                                kw.get("persistent", False), key_mask, head_dim, dropout, head_dim_v,
                                _tma_store(kw.get("tma_store")))
    pointers = _fast_call.ENABLED or dropout
    return variant_key(name + ("_ptrargs" if pointers else ""), tile, dtype, head_dim, causal, bottom_right,
                       head_dim_v=head_dim_v)


def flash_fwd_fastest(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                      causal: bool = False, bottom_right: bool = False, key_words: torch.Tensor | None = None,
                      dropout: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_fwd_ws with the fastest variant for q's and v's head dims and `causal` (fastest_kwargs)."""
    kw = _fastest_for(q, v, causal, dropout is not None)
    return flash_fwd_ws(q, k, v, scale, causal, bottom_right, key_words=key_words, dropout=dropout, **kw)


def _fastest_for(q: torch.Tensor, v: torch.Tensor, causal: bool, dropout: bool) -> dict[str, Any]:
    """fastest_kwargs for these tensors' head dims, or {} (the default variant) for head dims it does not know."""
    known = q.dim() == 4 and v.dim() == 4 and ((q.shape[-1], bool(causal)) in FASTEST if v.shape[-1] == q.shape[-1]
                                               else (q.shape[-1], v.shape[-1], bool(causal)) in HEAD_DIM_V_FASTEST)
    return fastest_kwargs(q.shape[-1], bool(causal), dropout, v.shape[-1]) if known else {}


def prepare_fastest(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    causal: bool = False, bottom_right: bool = False) -> Any:
    """flash_fwd_fastest's call without key mask or dropout prepared for its signature (flash_fwd.prepare_forward:
    ValueError, CompileFailedError), or None where the pointer convention is off (_fast_call.ENABLED)."""
    from . import _fast_call
    from .flash_fwd import prepare_forward

    if not _fast_call.ENABLED:
        return None
    kw = _fastest_for(q, v, causal, False)
    return prepare_forward(_compile_fn(**kw), q, k, v, scale, causal, bottom_right, HEAD_DIMS, HEAD_DIM_V_PAIRS)


def _compile_fn(overlap: bool = False, pingpong: bool = False, consumers: int = CONSUMERS, persistent: bool = False,
                key_mask: bool = False, dropout: bool = False, tma_store: bool | None = None,
                keep_bits: bool = False, block_n: int | None = None, kv_stages: int | None = None) -> Any:
    """compile_flash_fwd_ws for one variant, as _run takes it."""
    return functools.partial(compile_flash_fwd_ws, overlap=overlap, pingpong=pingpong, consumers=consumers,
                             persistent=persistent, key_mask=key_mask, dropout=dropout, tma_store=tma_store,
                             keep_bits=keep_bits, block_n=block_n, kv_stages=kv_stages)


def flash_fwd_ws(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, causal: bool = False,
                 bottom_right: bool = False, overlap: bool = False, pingpong: bool = False,
                 consumers: int = CONSUMERS, persistent: bool = False, key_words: torch.Tensor | None = None,
                 dropout: tuple | None = None, tma_store: bool | None = None,
                 block_n: int | None = None, kv_stages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the warp-specialised kernel on CUDA tensors q (b, hq, sq, d), k (b, hkv, sk, d), v (b, hkv, sk, dv) (dv =
    d, or (d, dv) in HEAD_DIM_V_PAIRS): returns out (b, hq, sq, dv) in q's dtype and the fp32 natural-log LSE
    (b, hq, sq). Same input checks (ValueError,
    flash_fwd._check_inputs) and calling convention as flash_fwd.flash_fwd. `overlap`: the intra-warpgroup overlap variant;
    `pingpong`: overlap plus the consumers' turns; `consumers`: 2 or 3 consumer warpgroups; `persistent`: at
    most PERSISTENT_CTAS CTAs walking the tiles; `key_words`: a bool key mask packed 32 keys per int32 word (bit
    j % 32 of word j // 32 of row (batch, head), 1 = attend), (b, hq, ceil(seqlen_k / 32)) with any strides
    (0 where broadcast: _mask_bounds.row_bits' words expanded): the key-mask variant; `dropout`: (the (seed,
    rng_offset) int64 pair on q's device, the 16-bit keep threshold round(dropout_p * 2**16), 1 / (1 - dropout_p)):
    the dropout variant, whose mask is the Triton kernels' for that RNG state (_dropout), with a fourth element, a
    uint8 buffer of keep_bits.keep_bits_bytes (128-key blocks; of any of its periods, which the size names), the
    variant that also saves the mask there for the backward (flash_bwd.flash_bwd's dropout argument with it); `tma_store`: O through
    shared memory and a TMA store (None: the default, True; False: from registers); `block_n`: keys per block where
    not tile_n's (non-causal calls without key mask or dropout; ValueError otherwise); `kv_stages`: the K / V
    rings' depth where not KV_STAGES (2 to 4, within shared memory; ValueError otherwise)."""
    keep = 0  # the saved bits' period, from the buffer's size
    if dropout is not None and len(dropout) > 3:
        from .flash_bwd import check_keep_bits

        keep = check_keep_bits(dropout[3], q, k, causal, bottom_right)
    return _run(_compile_fn(overlap, pingpong, consumers, persistent, key_words is not None, dropout is not None,
                            tma_store, keep, block_n, kv_stages),
                q, k, v, scale, causal, bottom_right, key_words, HEAD_DIMS, dropout, HEAD_DIM_V_PAIRS)
