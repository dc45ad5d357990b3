"""Split-KV attention over a KV cache (FlashDecoding), contiguous or paged, and the split merge.

One program of `_decode_split` takes one (batch, KV head, query block, split): the query rows of
all `GROUP = hq / hkv` query heads that share the KV head are packed into the M dimension of the
tile (row r = g * seqlen_q + i: head hk * GROUP + g, query i), so each K/V tile is read once per KV
head, not once per query head; M is padded to at least 16 rows for tl.dot. The keys visible to
the block (cache length, causal / sliding window) are cut into NUM_SPLITS contiguous ranges of
whole BLOCK_N tiles, one per program, computed from the runtime lengths so that every split of a
short sequence still gets work. With one split the program writes the final output and LSE;
otherwise it writes an fp32 partial output (normalised by its own sum) and its log2 LSE, and the
last program of the (batch, KV head, query block) to finish (an arrival counter per block) combines
them with weights exp2(lse_s - max) (`_combine_rows`; `_merge_splits` is the same merge as a second
launch, used when FUSED_MERGE is off). Queries are rotated (rotary) while they are loaded, so a decode
step is one launch, plus one append launch when new keys are given (kv_append.py). A paged cache is read
in tiles that never cross a page when BLOCK_N divides the page size (one block-table load per tile,
issued a tile ahead).

Key j of batch b (0 <= j < seqlen_k[b]) is cache row leftpad[b] + j, seqlen_k = cache_seqlens[b]
+ seqlen_new - leftpad[b]. Scores: softcap * tanh(scale * q.k / softcap) (when softcap > 0) minus
alibi_slope * |i + seqlen_k - seqlen_q - j|; key j is visible to query i when j < seqlen_k and
i + seqlen_k - seqlen_q - WINDOW_LEFT <= j <= i + seqlen_k - seqlen_q + WINDOW_RIGHT (each bound
only when set; causal sets WINDOW_RIGHT = 0, SDPA's top-left causal WINDOW_RIGHT = seqlen_q - seqlen_k).
An optional attn_mask (SDPA's: bool, True = attend, or additive) is read per tile through its broadcast
strides, behind the MASK_KIND constexpr (without a mask the kernel compiles as before); the mask row of
packed row r is that of head hk * GROUP + g, query i. Rows that see no key output 0 with LSE -inf, as
PyTorch's math SDPA gives for fully masked rows.

Lengths and indices live on the device, so the host cannot check them without a sync. A batch entry whose
cache_seqlens is negative or leaves no room for the new rows (cache_seqlens + seqlen_new > CAPACITY, the rows a
cache entry or a block-table row holds), whose cache_leftpad is negative or past its rows, whose cache_batch_idx
is outside the cache's batch, or whose block-table pages in its key range lie outside the cache's pages, reads
nothing outside the tensors and outputs NaN (LSE NaN): an error signal rather than a silently wrong result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._common import LN2, LOG2E, _bool_block, _mask_values_at, _masked_scores
from ._features import expand_mask
from ._launch import grid_1d, interpreting, pad_head_dim
from .kv_append import _rotate

MAX_SPLITS = 128


@triton.jit(do_not_specialize=["SEQ_NEW", "SEQ_BASE", "WINDOW_LEFT", "WINDOW_RIGHT", "CAPACITY", "NUM_CACHE"])
def _decode_split(
    Q, K, V, O, LSE, WS,
    CACHE_SEQLENS, BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI, COS, SIN, MASK, COUNTERS,
    stride_qb, stride_qm, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_bt,
    stride_mb, stride_mh, stride_mm, stride_mn,
    SEQ_Q, SEQ_NEW, SEQ_BASE, qk_scale, softcap, WINDOW_LEFT, WINDOW_RIGHT, CAPACITY, NUM_CACHE,
    GROUP: tl.constexpr, NUM_HEADS_K: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGE_TILES: tl.constexpr, SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    ALIBI_PER_BATCH: tl.constexpr, ROTARY_DIM: tl.constexpr, ROTARY_INTERLEAVED: tl.constexpr,
    ROTARY_POS_STEP: tl.constexpr, MASK_KIND: tl.constexpr = 0, SPLITS_P2: tl.constexpr = 1,
    SPLIT_CHUNK: tl.constexpr = 1,
):
    # Optional inputs are None (compile-time) when absent: CACHE_SEQLENS (then every length is SEQ_BASE),
    # BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI, COS/SIN, LSE (not wanted), MASK and its strides (MASK_KIND 0),
    # COUNTERS (None: a split launch is merged by _merge_splits; else one zeroed int32 per (batch, KV head,
    # query block), the fused merge's arrival counters).
    # O is contiguous (b, sq, hq, d); the last dim of q and of the caches is contiguous (stride 1). The
    # mask is read through its (b, hq, sq, key) strides, 0 on broadcast dims; column j is key j.
    # CAPACITY: rows per cache entry (paged: block-table columns x PAGE_SIZE); NUM_CACHE: the caches' dim 0.
    NUM_HEADS_Q: tl.constexpr = GROUP * NUM_HEADS_K
    # Splits innermost: the programs reading one KV head's cache run side by side.
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    rest = pid // NUM_SPLITS
    num_m_blocks = tl.cdiv(GROUP * SEQ_Q, BLOCK_M)
    rest_tile = rest  # (batch, KV head, query block): the fused merge's arrival counter
    pid_m = rest % num_m_blocks
    rest = rest // num_m_blocks
    off_hk = rest % NUM_HEADS_K
    off_b = rest // NUM_HEADS_K

    # Packed rows: r = g * SEQ_Q + i.
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_r < GROUP * SEQ_Q
    g = offs_r // SEQ_Q
    qi = offs_r % SEQ_Q
    qh = off_hk * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    leftpad = 0
    if LEFTPAD is not None:
        leftpad = tl.load(LEFTPAD + off_b)
    cache_len = SEQ_BASE
    if CACHE_SEQLENS is not None:
        cache_len += tl.load(CACHE_SEQLENS + off_b)
    cb = off_b.to(tl.int64)
    if BATCH_IDX is not None:
        cb = tl.load(BATCH_IDX + off_b).to(tl.int64)
    # Invalid lengths / indices (module docstring) where the device holds them (an int length is the host's to
    # check): no keys are read (seqlen_k 0, queries rotated at 0) and the output is NaN.
    CHECKED: tl.constexpr = CACHE_SEQLENS is not None or LEFTPAD is not None or BATCH_IDX is not None \
        or PAGE_SIZE > 0
    if CHECKED:
        bad = (cache_len < 0) | (cache_len + SEQ_NEW > CAPACITY) | (leftpad < 0) | (leftpad > cache_len + SEQ_NEW)
        if BATCH_IDX is not None:
            bad = bad | (cb < 0) | (cb >= NUM_CACHE)
        cache_len = tl.where(bad, 0, cache_len)
    seqlen_k = cache_len + SEQ_NEW - leftpad
    if CHECKED:
        seqlen_k = tl.where(bad, 0, seqlen_k)
    shift = seqlen_k - SEQ_Q  # query i sits at key position i + shift (bottom-right alignment)

    # Key range [lo, hi) of the rows of this block.
    i_min = tl.min(tl.where(row_ok, qi, SEQ_Q), 0)
    i_max = tl.max(tl.where(row_ok, qi, -1), 0)
    hi = seqlen_k
    if HAS_RIGHT:
        hi = tl.minimum(hi, i_max + shift + WINDOW_RIGHT + 1)
    lo = 0
    if HAS_LEFT:
        lo = tl.maximum(lo, i_min + shift - WINDOW_LEFT)
    n_lo = lo // BLOCK_N
    n_hi = tl.maximum(tl.cdiv(hi, BLOCK_N), n_lo)
    per_split = tl.cdiv(n_hi - n_lo, NUM_SPLITS)
    start = (n_lo + split * per_split) * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, n_hi * BLOCK_N)

    q_rows = Q + off_b.to(tl.int64) * stride_qb + qh.to(tl.int64) * stride_qh + qi.to(tl.int64) * stride_qm
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if ROTARY_DIM > 0:  # rotated at cache_len + i * POS_STEP, rounded to q's dtype as a separate pass would
        q = _rotate(q, q_rows, row_ok, offs_d, cache_len + qi * ROTARY_POS_STEP, COS, SIN, ROTARY_DIM,
                    ROTARY_INTERLEAVED)

    if PAGE_SIZE > 0:
        k_base = K + off_hk * stride_kh
        v_base = V + off_hk * stride_vh
        page_base = BLOCK_TABLE + off_b.to(tl.int64) * stride_bt
    else:
        k_base = K + cb * stride_kb + off_hk * stride_kh
        v_base = V + cb * stride_vb + off_hk * stride_vh
    if ALIBI is not None:
        alibi_row = ALIBI
        if ALIBI_PER_BATCH:
            alibi_row = ALIBI + off_b * NUM_HEADS_Q
        slope = tl.load(alibi_row + qh, mask=row_ok, other=0.0) * LOG2E
    if MASK_KIND != 0:
        mask_rows = (MASK + off_b.to(tl.int64) * stride_mb + qh.to(tl.int64) * stride_mh
                     + qi.to(tl.int64) * stride_mm)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    kv_mask_d = d_ok[None, :]
    # Page indices are loaded one tile ahead: with the index load in the same iteration as the K/V loads
    # that depend on it, Triton 3.6 does not multi-buffer K/V (sm90 compile: ~39 KB smem instead of 70).
    if PAGE_SIZE > 0:
        if PAGE_TILES:
            page_next = tl.load(page_base + start // PAGE_SIZE, mask=start < end, other=0)
        else:
            page_next = tl.load(page_base + (leftpad + start + offs_n) // PAGE_SIZE,
                                mask=start + offs_n < seqlen_k, other=0)
    lost = offs_n < 0  # keys whose page index lies outside the cache (paged)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < seqlen_k
        # Row offsets of the tile in K and V (one page lookup per tile when a tile never crosses a page).
        if PAGE_SIZE > 0:
            # Tiles: n0 is a multiple of BLOCK_N, which divides PAGE_SIZE, and n0 < seqlen_k; one page.
            page = page_next.to(tl.int64)
            # a page index outside the cache: not read, and the output becomes NaN (after the loop)
            page_ok = (page >= 0) & (page < NUM_CACHE)
            nxt = n0 + BLOCK_N
            if PAGE_TILES:
                page_next = tl.load(page_base + nxt // PAGE_SIZE, mask=nxt < end, other=0)
                in_page = ((n0 % PAGE_SIZE) + offs_n).to(tl.int64)
            else:
                page_next = tl.load(page_base + (leftpad + nxt + offs_n) // PAGE_SIZE,
                                    mask=_bool_block(nxt < end, BLOCK_N) & (nxt + offs_n < seqlen_k), other=0)
                in_page = ((leftpad + cols) % PAGE_SIZE).to(tl.int64)
            if PAGE_TILES:  # one page index per tile: a scalar
                page_ok = _bool_block(page_ok, BLOCK_N)
            lost = lost | (col_ok & ~page_ok)
            col_ok = col_ok & page_ok
            k_off = page * stride_kb + in_page * stride_kn
            v_off = page * stride_vb + in_page * stride_vn
        else:
            rows_phys = (leftpad + cols).to(tl.int64)
            k_off = rows_phys * stride_kn
            v_off = rows_phys * stride_vn
        k = tl.load(k_base + k_off[:, None] + offs_d[None, :], mask=col_ok[:, None] & kv_mask_d, other=0.0)
        if MASK_KIND != 0:  # read before the dot: the load's latency overlaps it (_common._load_mask)
            mask_vals = _mask_values_at(mask_rows[:, None] + cols.to(tl.int64)[None, :] * stride_mn,
                                        row_ok[:, None] & col_ok[None, :], MASK_KIND)
        qk = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1); the log2 factor comes after.
            y2 = qk * (qk_scale / softcap * (2.0 * LOG2E))  # 2 y log2(e), y = scale * q.k / softcap
            s = (softcap * LOG2E) * (1.0 - 2.0 / (tl.math.exp2(y2) + 1.0))
        else:
            s = qk * (qk_scale * LOG2E)
        rel = cols[None, :] - (qi[:, None] + shift)  # key position minus query position
        if ALIBI is not None:
            s = s - slope[:, None] * tl.abs(rel).to(tl.float32)
        if MASK_KIND != 0:
            s = _masked_scores(s, mask_vals, MASK_KIND)
        keep = col_ok[None, :]
        if HAS_RIGHT:
            keep = keep & (rel <= WINDOW_RIGHT)
        if HAS_LEFT:
            keep = keep & (rel >= -WINDOW_LEFT)
        s = tl.where(keep, s, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_ij == float("-inf"), 0.0, m_ij)  # no visible key yet: avoid inf - inf
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_off[:, None] + offs_d[None, :], mask=col_ok[:, None] & kv_mask_d, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_ij

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    out = acc * inv_l[:, None]
    if PAGE_SIZE > 0:
        bad = bad | (tl.max(lost.to(tl.int32), 0) > 0)
    if CHECKED:
        out = tl.where(bad, float("nan"), out)
        lse2 = tl.where(bad, float("nan"), lse2)  # a NaN partial makes the merged row NaN too (_combine_rows)
    # Output row in (b, sq, hq) order: the rows of O and of the split workspace.
    o_row = (off_b * SEQ_Q + qi).to(tl.int64) * NUM_HEADS_Q + qh
    if NUM_SPLITS == 1:
        if LSE is not None:
            tl.store(LSE + (off_b * NUM_HEADS_Q + qh).to(tl.int64) * SEQ_Q + qi, lse2 * LN2, mask=row_ok)
        tl.store(O + o_row[:, None] * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        # Workspace row: NUM_SPLITS partial outputs (fp32, BLOCK_D each), then the splits' log2 LSEs.
        WS_ROW: tl.constexpr = NUM_SPLITS * BLOCK_D + (NUM_SPLITS + 15) // 16 * 16
        ws = WS + o_row * WS_ROW
        tl.store(ws + NUM_SPLITS * BLOCK_D + split, lse2, mask=row_ok)
        tl.store(ws[:, None] + split * BLOCK_D + offs_d[None, :], out, mask=row_ok[:, None])
        if COUNTERS is not None:
            # Fused merge: the last split of this (batch, KV head, query block) to arrive merges all of them,
            # which saves the merge launch (a few µs: most of a batch-1 decode step on a short cache). The
            # barrier puts every thread's partial before the arrival; the atomic (acq_rel, gpu scope, one
            # thread) publishes them and, for the last arrival, acquires the others'.
            tl.debug_barrier()
            arrived = tl.atomic_add(COUNTERS + rest_tile, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                tl.store(COUNTERS + rest_tile, 0)  # ready for the next launch (stream order separates them)
                merged, lse_m = _combine_rows(ws, row_ok, NUM_SPLITS, SPLITS_P2, BLOCK_D, SPLIT_CHUNK, True)
                if LSE is not None:
                    tl.store(LSE + (off_b * NUM_HEADS_Q + qh).to(tl.int64) * SEQ_Q + qi, lse_m, mask=row_ok)
                tl.store(O + o_row[:, None] * HEAD_DIM + offs_d[None, :], merged.to(O.dtype.element_ty),
                         mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_rows(ws, row_ok, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLIT_CHUNK: tl.constexpr, BYPASS_L1: tl.constexpr):
    """The merged output (fp32, (R, BLOCK_D)) and natural-log LSE of the workspace rows `ws` (pointers, (R,)):
    the splits' outputs weighted by exp2(lse_s - max). BYPASS_L1 reads through L2 only (partials written
    by other programs of the same launch)."""
    CACHE: tl.constexpr = ".cg" if BYPASS_L1 else ""
    splits = tl.arange(0, SPLITS_P2)
    ok = row_ok[:, None] & (splits[None, :] < NUM_SPLITS)
    lse = tl.load(ws[:, None] + NUM_SPLITS * BLOCK_D + splits[None, :], mask=ok, other=float("-inf"),
                  cache_modifier=CACHE)  # (R, SPLITS_P2), log2 units
    m = tl.max(lse, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.math.exp2(lse - m_safe[:, None]), 1)  # empty splits weigh 0
    empty = total == 0.0
    scale = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([ws.shape[0], BLOCK_D], dtype=tl.float32)
    # SPLIT_CHUNK partial outputs per (unrolled) step, loaded as one (R, SPLIT_CHUNK, BLOCK_D) tile: the
    # loads of a step are in flight together, where a loop of one split per step waits out one L2 latency
    # per split (~16 in a row at 16 splits, the size of the launch the fused merge saves).
    for c in tl.static_range(0, SPLITS_P2, SPLIT_CHUNK):
        idx = c + tl.arange(0, SPLIT_CHUNK)
        ok_c = row_ok[:, None] & (idx[None, :] < NUM_SPLITS)
        w_c = tl.math.exp2(tl.load(ws[:, None] + NUM_SPLITS * BLOCK_D + idx[None, :], mask=ok_c,
                                   other=float("-inf"), cache_modifier=CACHE) - m_safe[:, None])
        o_c = tl.load(ws[:, None, None] + idx[None, :, None] * BLOCK_D + offs_d[None, None, :],
                      mask=(ok_c & (w_c > 0.0))[:, :, None], other=0.0, cache_modifier=CACHE)
        acc += tl.sum(w_c[:, :, None] * o_c, 1)
    lse_out = tl.where(empty, float("-inf"), (m_safe + tl.math.log2(tl.where(empty, 1.0, total))) * LN2)
    return acc * scale[:, None], lse_out


@triton.jit
def _merge_splits(
    WS, O, LSE, N_ROWS, SEQ_Q,
    NUM_HEADS_Q: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Rows r (b, sq, hq order) of O: the splits' outputs weighted by exp2(lse_s - max); LSE may be None."""
    WS_ROW: tl.constexpr = NUM_SPLITS * BLOCK_D + (NUM_SPLITS + 15) // 16 * 16
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N_ROWS
    # One split per (unrolled) step: chunked (rows, chunk, BLOCK_D) tiles spill in this kernel (sm90 compile,
    # 16 splits: 3.6 KB of stack at chunks of 2 or 4; none at 1, 137 registers).
    out, lse_out = _combine_rows(WS + rows.to(tl.int64) * WS_ROW, row_ok, NUM_SPLITS, SPLITS_P2, BLOCK_D, 1, False)
    offs_d = tl.arange(0, BLOCK_D)
    if LSE is not None:
        off_h = rows % NUM_HEADS_Q
        t = rows // NUM_HEADS_Q
        tl.store(LSE + ((t // SEQ_Q) * NUM_HEADS_Q + off_h).to(tl.int64) * SEQ_Q + t % SEQ_Q, lse_out, mask=row_ok)
    tl.store(O + rows.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))



def decode_config(d: int, num_splits: int = 0) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for padded head dim d and the launch's number of splits (0: not
    known yet, the BLOCK_N the split heuristic counts tiles with). d <= 128 from scripts/tune_decode.py on
    the H200 (graph replays): with splits, 64-key tiles, 3 stages; one split (each program streams a whole
    cache): 128-key tiles, 8 warps, 3 stages, the only configuration within 1 % of cuDNN on all five
    unsplit shapes timed (b=64 / 8, hkv=32 / 8, 4k / 16k: 0.99-1.01x; 64 x 4 x 4 0.97-1.00x, 64 x 4 x 3
    0.87-1.02x)."""
    if interpreting():
        return 16, 4, 1
    if d <= 128:
        return (128, 8, 3) if num_splits == 1 else (64, 4, 3)
    return 32, 4, 2


def block_m_for(group: int, sq: int) -> int:
    """Rows of one tile: the packed GQA group x queries, at least 16 (tl.dot), at most 64."""
    return min(64, max(16, _next_pow2(group * sq)))


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()  # triton.next_power_of_2 without its per-call JIT dispatch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Split bounds measured with scripts/tune_decode.py on the H200 (bf16, d=128, CUDA-graph replays). With the
# merge as a second launch, 8 to 16 splits of at least 8 tiles each were best at batch 1, and 32 or 64 splits
# slower everywhere. With the merge fused into the decode launch, splits cost no launch and short caches want
# more of them: b=1, hkv=8, 1k cache: 16 splits of one tile 1.05x cuDNN against 2 splits 0.65x; 4k: 16 splits
# 1.15x against 8 splits 1.02x; hkv=32, 1k: 8 splits 1.07x (4: 1.11x), 2 splits 0.96x. 16 stays the cap
# (b=1, hkv=8, 32k: 16 and 32 splits within 1 %).
MAX_USEFUL_SPLITS = 16
MIN_TILES_PER_SPLIT = 1


def num_splits_heuristic(batch: int, heads_k: int, num_m_blocks: int, max_seqlen_k: int, block_n: int,
                         sm_count: int) -> int:
    """Splits from shapes only (no device values: CUDA-graph safe). One split when the (batch, KV head,
    query block) programs already fill the GPU or the cache is a few tiles; else enough splits for about
    one program per SM (rounded up to a power of two), at most MAX_USEFUL_SPLITS, each split at least
    MIN_TILES_PER_SPLIT tiles."""
    tiles = batch * heads_k * num_m_blocks
    n_blocks = _cdiv(max(max_seqlen_k, 1), block_n)
    if n_blocks <= 4 or tiles >= 0.8 * sm_count:
        return 1
    splits = min(_next_pow2(_cdiv(sm_count, tiles)), MAX_USEFUL_SPLITS, n_blocks // MIN_TILES_PER_SPLIT,
                 MAX_SPLITS)
    return max(1, splits)


def page_block_n(block_n: int, page_size: int) -> tuple[int, bool]:
    """(BLOCK_N, one page lookup per tile) for a paged cache: tiles that never cross a page when the page
    size allows one (BLOCK_N divides the page, at least 16 rows for tl.dot), else a per-row lookup."""
    if page_size % block_n == 0:
        return block_n, True
    if page_size >= 16 and page_size & (page_size - 1) == 0:  # 16 or 32 with 64-row tiles: smaller tiles
        return page_size, True
    return block_n, False


def split_chunk(rows: int, block_d: int, num_splits: int) -> int:
    """Partial outputs merged per step (a power of two): as many as keep the step's (rows, chunk, block_d)
    fp32 tile within 8192 elements, 64 registers per thread at 4 warps."""
    return max(1, min(_next_pow2(num_splits), 8192 // (rows * block_d)))


def ws_row_floats(num_splits: int, block_d: int) -> int:
    """fp32 elements per output row of the split workspace: the partial outputs, then the LSEs (the row
    padded to 16 floats). Must match WS_ROW in the kernels."""
    return num_splits * block_d + (num_splits + 15) // 16 * 16


# Split launches merge in their last-arriving program (one launch) instead of a second kernel. A module
# switch so that tests and scripts/tune_decode.py can time and check both.
FUSED_MERGE = True

# Arrival counters of the fused merge, per (device, stream): zeroed once, each launch leaves them at zero
# (the last arrival resets its counter), so launches in one stream's order can share them, and a CUDA
# graph captured with them replays correctly. Calls on different streams get different counters; two graphs
# captured on one stream share that stream's counters, so they must not be replayed concurrently.
_COUNTERS: dict = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters, reused by every fused-merge launch on the current
    stream of device."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, torch._C._cuda_getCurrentRawStream(index))
    else:
        key = (device.type, 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        # Under CUDA-graph capture this zeroing is captured too (a memset node) and the buffer comes from the
        # graph's pool; the cache keeps it alive, so the graph and later calls on that stream share it.
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


# Launch plans per shape key: grids, constexprs and the workspace size (the heuristics run once).
_PLANS: dict = {}


def _plan(key, b, sq, hq, hkv, d, max_seqlen_k, page_size, has_leftpad, num_splits, device):
    group = hq // hkv
    block_d = pad_head_dim(d)
    block_m = block_m_for(group, sq)
    num_m_blocks = _cdiv(group * sq, block_m)
    if num_splits <= 0:
        heuristic_n = decode_config(block_d)[0]  # the tile size the heuristic was tuned with
        if page_size:
            heuristic_n = page_block_n(heuristic_n, page_size)[0]
        num_splits = num_splits_heuristic(b, hkv, num_m_blocks, max_seqlen_k, heuristic_n, _launch.sm_count(device))
    num_splits = min(num_splits, MAX_SPLITS)
    block_n, num_warps, num_stages = decode_config(block_d, num_splits)
    page_tiles = False
    if page_size:
        cfg_n = block_n
        block_n, page_tiles = page_block_n(block_n, page_size)
        page_tiles = page_tiles and not has_leftpad  # a left pad shifts rows off the page grid
        if block_n < cfg_n and num_splits == 1:  # pages smaller than the unsplit tile: 64 x 4 x 4, as timed
            num_warps, num_stages = 4, 4
    n_rows = b * sq * hq
    consts = {"GROUP": group, "NUM_HEADS_K": hkv, "HEAD_DIM": d, "BLOCK_M": block_m, "BLOCK_N": block_n,
              "BLOCK_D": block_d, "NUM_SPLITS": num_splits, "PAGE_SIZE": page_size, "PAGE_TILES": page_tiles,
              "num_warps": num_warps, "num_stages": num_stages}
    merge = None
    if num_splits > 1:
        block_r = 16
        merge = (grid_1d(_cdiv(n_rows, block_r)),
                 {"NUM_HEADS_Q": hq, "NUM_SPLITS": num_splits, "SPLITS_P2": _next_pow2(num_splits), "HEAD_DIM": d,
                  "BLOCK_D": block_d, "BLOCK_R": block_r, "num_warps": 4})
    if num_splits > 1:
        consts["SPLITS_P2"] = _next_pow2(num_splits)
        consts["SPLIT_CHUNK"] = split_chunk(block_m, block_d, num_splits)
    plan = (grid_1d(b * hkv * num_m_blocks * num_splits), consts, merge,
            n_rows * ws_row_floats(num_splits, block_d) if num_splits > 1 else 0, b * hkv * num_m_blocks)
    if len(_PLANS) >= 4096:
        _PLANS.clear()
    _PLANS[key] = plan
    return plan


def _launch_plan(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None, has_leftpad: bool,
                 num_splits: int) -> tuple:
    """The cached plan (_plan) of a call with these tensors."""
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    page_size = 0 if block_table is None else k_cache.shape[1]
    max_seqlen_k = k_cache.shape[1] if block_table is None else block_table.shape[1] * page_size
    key = (b, sq, hq, hkv, d, max_seqlen_k, page_size, has_leftpad, num_splits, q.device)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(key, b, sq, hq, hkv, d, max_seqlen_k, page_size, has_leftpad, num_splits, q.device)
    return plan


def launch_constants(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None = None,
                     has_leftpad: bool = False, num_splits: int = 0) -> dict:
    """The decode kernel's compile-time constants (BLOCK_N, NUM_SPLITS, ...) for a call with these tensors."""
    return dict(_launch_plan(q, k_cache, block_table, has_leftpad, num_splits)[1])


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor | int,
    seqlen_new: int, *, scale: float, cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, num_splits: int = 0, rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None, rotary_interleaved: bool = True, rotary_pos_step: int = 1,
    need_lse: bool = True, attn_mask: torch.Tensor | None = None, causal_top_left: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of q (b, sq, hq, d) over a cache (already holding the new rows); returns
    out (b, sq, hq, d) in q's dtype and the fp32 natural-log lse (b, hq, sq) (None unless need_lse).

    cache_seqlens, (b,) int32 or one int for every sequence, counts the cache rows *before* the
    seqlen_new appended ones. Windows use -1 for "unbounded"; causal is window_right = 0. num_splits 0
    picks the heuristic. rotary_cos/sin (contiguous (seqlen_ro, rotary_dim / 2)) rotate q in the kernel
    at position cache_seqlens[b] + i * rotary_pos_step. One launch (plus the merge launch when the keys
    are split and FUSED_MERGE is off); no other device work after the first call on a stream, which
    zeroes the merge's arrival counters (CUDA-graph safe). Inputs are validated by the caller: the last dim of
    q and of the caches must be contiguous, alibi_slopes contiguous.

    attn_mask (SDPA's): bool (True = attend) or additive (fp16 / bf16 / fp32), any shape broadcastable to
    (b, hq, sq, max_seqlen_k) with column j for key j; read through its strides (0 on broadcast dims,
    never expanded in memory). causal_top_left (SDPA's is_causal): query i sees keys j <= i; needs one
    int cache_seqlens and no cache_leftpad (every sequence has the same length).
    """
    b, sq, hq, d = q.shape
    max_seqlen_k = k_cache.shape[1] if block_table is None else block_table.shape[1] * k_cache.shape[1]
    grid, consts, merge, ws_numel, n_tiles = _launch_plan(q, k_cache, block_table, cache_leftpad is not None,
                                                          num_splits)
    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device) if need_lse else None
    if b * sq * hq == 0 or d == 0:
        return out, lse
    ws = torch.empty(ws_numel, dtype=torch.float32, device=q.device) if merge is not None else None
    counters = arrival_counters(q.device, n_tiles) if merge is not None and FUSED_MERGE else None
    if _launch.POISON_OUTPUTS:
        _launch.poison(*(t for t in (out, lse, ws) if t is not None))
    seqlens_t, seq_base = (None, int(cache_seqlens)) if isinstance(cache_seqlens, int) else (cache_seqlens, 0)
    has_right, right = window_right >= 0, max(window_right, 0)
    if causal_top_left:
        if seqlens_t is not None or cache_leftpad is not None:
            raise ValueError("causal_top_left needs one int cache_seqlens for every sequence and no cache_leftpad")
        # key j is visible to query i iff j - (i + seqlen_k - sq) <= right; top-left: j <= i
        top_left = sq - (seq_base + seqlen_new)
        has_right, right = True, top_left if window_right < 0 else min(window_right, top_left)
    if attn_mask is not None:
        mask = expand_mask(attn_mask, b, hq, sq, max_seqlen_k)
        mask_ptr, mask_strides, mask_kind = mask, mask.stride(), 1 if attn_mask.dtype == torch.bool else 2
    else:
        mask_ptr, mask_strides, mask_kind = None, (None,) * 4, 0
    qb, qm, qh, _ = q.stride()
    kb, kn, kh, _ = k_cache.stride()
    vb, vn, vh, _ = v_cache.stride()
    _launch.launch(_decode_split, grid, (
        q, k_cache, v_cache, out, lse, ws,
        seqlens_t, cache_batch_idx, cache_leftpad, block_table, alibi_slopes, rotary_cos, rotary_sin, mask_ptr,
        counters, qb, qm, qh, kb, kn, kh, vb, vn, vh, 0 if block_table is None else block_table.stride(0), *mask_strides,
        sq, seqlen_new, seq_base, scale, softcap, max(window_left, 0), right, max_seqlen_k, k_cache.shape[0],
    ), dict(
        SOFTCAP=softcap > 0.0, HAS_LEFT=window_left >= 0, HAS_RIGHT=has_right,
        ALIBI_PER_BATCH=alibi_slopes is not None and alibi_slopes.dim() == 2,
        ROTARY_DIM=0 if rotary_cos is None else 2 * rotary_cos.shape[1], ROTARY_INTERLEAVED=rotary_interleaved,
        ROTARY_POS_STEP=rotary_pos_step, MASK_KIND=mask_kind, **consts,
    ))
    if merge is not None and counters is None:
        _launch.launch(_merge_splits, merge[0], (ws, out, lse, b * sq * hq, sq), merge[1])
    return out, lse
