"""Split-KV attention over a KV cache (FlashDecoding), contiguous or paged, and the split merge.

One program of `_decode_split` takes one (batch, KV head, query block, split): the query rows of
all `GROUP = hq / hkv` query heads that share the KV head are packed into the M dimension of the
tile (row r = g * seqlen_q + i: head hk * GROUP + g, query i), so each K/V tile is read once per KV
head, not once per query head; M is padded to at least 16 rows for tl.dot. The keys visible to
the block (cache length, causal / sliding window) are cut into NUM_SPLITS contiguous ranges of
whole BLOCK_N tiles, one per program, computed from the runtime lengths so that every split of a
short sequence still gets work. With one split the program writes the final output and LSE;
otherwise it writes an fp32 partial output (normalised by its own sum) and its log2 LSE, and
`_merge_splits` combines them with weights exp2(lse_s - max).

Key j of batch b (0 <= j < seqlen_k[b]) is cache row leftpad[b] + j, seqlen_k = cache_seqlens[b]
+ seqlen_new - leftpad[b]. Scores: softcap * tanh(scale * q.k / softcap) (when softcap > 0) minus
alibi_slope * |i + seqlen_k - seqlen_q - j|; key j is visible to query i when j < seqlen_k and
i + seqlen_k - seqlen_q - WINDOW_LEFT <= j <= i + seqlen_k - seqlen_q + WINDOW_RIGHT (each bound
only when set; causal sets WINDOW_RIGHT = 0). Rows that see no key output 0 with LSE -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _launch
from ._common import LN2, LOG2E
from ._launch import grid_1d, interpreting, pad_head_dim

MAX_SPLITS = 128


@triton.jit
def _load_kv_tile(base, rows_phys, page_base, offs_d, HEAD_DIM: tl.constexpr, stride_n, stride_d, valid,
                  PAGE_SIZE: tl.constexpr, BLOCK_TABLE, stride_page):
    """(BLOCK_N, BLOCK_D) tile of cache rows `rows_phys` (zero where not valid / past HEAD_DIM)."""
    if PAGE_SIZE > 0:
        page = tl.load(page_base + rows_phys // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
        row_ptr = base + page * stride_page + (rows_phys % PAGE_SIZE).to(tl.int64) * stride_n
    else:
        row_ptr = base + rows_phys.to(tl.int64) * stride_n
    return tl.load(row_ptr[:, None] + offs_d[None, :] * stride_d,
                   mask=valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit(do_not_specialize=["SEQ_Q", "SEQ_NEW", "NUM_M_BLOCKS", "WINDOW_LEFT", "WINDOW_RIGHT"])
def _decode_split(
    Q, K, V, O, LSE, O_PART, LSE_PART,
    CACHE_SEQLENS, BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_bt, stride_alibi_b,
    BATCH, NUM_HEADS_Q, NUM_HEADS_K, SEQ_Q, SEQ_NEW, NUM_M_BLOCKS,
    qk_scale, softcap, WINDOW_LEFT, WINDOW_RIGHT,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):
    # Splits innermost: the programs reading one KV head's cache run side by side.
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    rest = pid // NUM_SPLITS
    pid_m = rest % NUM_M_BLOCKS
    rest = rest // NUM_M_BLOCKS
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
    if HAS_LEFTPAD:
        leftpad = tl.load(LEFTPAD + off_b)
    seqlen_k = tl.load(CACHE_SEQLENS + off_b) + SEQ_NEW - leftpad
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

    q_ptrs = (Q + off_b.to(tl.int64) * stride_qb + qh[:, None].to(tl.int64) * stride_qh
              + qi[:, None].to(tl.int64) * stride_qm + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if PAGE_SIZE > 0:
        k_base = K + off_hk * stride_kh
        v_base = V + off_hk * stride_vh
        page_base = BLOCK_TABLE + off_b.to(tl.int64) * stride_bt
    else:
        cb = off_b.to(tl.int64)
        if HAS_BATCH_IDX:
            cb = tl.load(BATCH_IDX + off_b).to(tl.int64)
        k_base = K + cb * stride_kb + off_hk * stride_kh
        v_base = V + cb * stride_vb + off_hk * stride_vh
        page_base = BLOCK_TABLE
    if HAS_ALIBI:
        slope = tl.load(ALIBI + off_b * stride_alibi_b + qh, mask=row_ok, other=0.0) * LOG2E

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        col_ok = cols < seqlen_k
        k = _load_kv_tile(k_base, leftpad + cols, page_base, offs_d, HEAD_DIM, stride_kn, stride_kd, col_ok,
                          PAGE_SIZE, BLOCK_TABLE, stride_kb)
        qk = tl.dot(q, tl.trans(k))
        if SOFTCAP:
            # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (exp(2y) + 1); the log2 factor comes after.
            y2 = qk * (qk_scale / softcap * (2.0 * LOG2E))  # 2 y log2(e), y = scale * q.k / softcap
            s = (softcap * LOG2E) * (1.0 - 2.0 / (tl.math.exp2(y2) + 1.0))
        else:
            s = qk * (qk_scale * LOG2E)
        rel = cols[None, :] - (qi[:, None] + shift)  # key position minus query position
        if HAS_ALIBI:
            s = s - slope[:, None] * tl.abs(rel).to(tl.float32)
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
        v = _load_kv_tile(v_base, leftpad + cols, page_base, offs_d, HEAD_DIM, stride_vn, stride_vd, col_ok,
                          PAGE_SIZE, BLOCK_TABLE, stride_vb)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_ij

    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    out = acc * inv_l[:, None]
    # Row id in (b, hq, sq) order, the layout of LSE and of the partial buffers.
    row_id = (off_b * NUM_HEADS_Q + qh).to(tl.int64) * SEQ_Q + qi
    if NUM_SPLITS == 1:
        tl.store(LSE + row_id, lse2 * LN2, mask=row_ok)
        o_ptrs = (O + off_b.to(tl.int64) * stride_ob + qh[:, None].to(tl.int64) * stride_oh
                  + qi[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        n_rows = BATCH * NUM_HEADS_Q * SEQ_Q
        part = split.to(tl.int64) * n_rows + row_id
        tl.store(LSE_PART + part, lse2, mask=row_ok)
        tl.store(O_PART + part[:, None] * BLOCK_D + offs_d[None, :], out, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["N_ROWS", "SEQ_Q"])
def _merge_splits(
    O_PART, LSE_PART, O, LSE,
    stride_ob, stride_om, stride_oh, stride_od,
    N_ROWS, NUM_HEADS_Q, SEQ_Q,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N_ROWS
    splits = tl.arange(0, SPLITS_P2)
    ok = (splits[:, None] < NUM_SPLITS) & row_ok[None, :]
    lse = tl.load(LSE_PART + splits[:, None].to(tl.int64) * N_ROWS + rows[None, :], mask=ok,
                  other=float("-inf"))  # (SPLITS_P2, BLOCK_R), log2 units
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe[None, :])  # 0 for empty splits
    total = tl.sum(w, 0)
    empty = total == 0.0
    scale = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        w_s = tl.math.exp2(tl.load(LSE_PART + s * N_ROWS + rows, mask=row_ok, other=float("-inf")) - m_safe)
        o_s = tl.load(O_PART + (s * N_ROWS + rows.to(tl.int64))[:, None] * BLOCK_D + offs_d[None, :],
                      mask=row_ok[:, None] & (w_s[:, None] > 0.0), other=0.0)
        acc += w_s[:, None] * o_s
    out = acc * scale[:, None]
    lse_out = tl.where(empty, float("-inf"), (m_safe + tl.math.log2(tl.where(empty, 1.0, total))) * LN2)
    tl.store(LSE + rows, lse_out, mask=row_ok)
    qi = rows % SEQ_Q
    bh = rows // SEQ_Q
    off_h = bh % NUM_HEADS_Q
    off_b = bh // NUM_HEADS_Q
    o_ptrs = (O + off_b.to(tl.int64)[:, None] * stride_ob + off_h[:, None] * stride_oh
              + qi[:, None].to(tl.int64) * stride_om + offs_d[None, :] * stride_od)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 132  # H200; only the heuristic's shape matters off-GPU


_SM_COUNTS: dict[int, int] = {}


def _cuda_sm_count(index: int) -> int:
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def decode_config(d: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for padded head dim d: not tuned on a GPU yet (see PERF.md §9)."""
    if interpreting():
        return 16, 4, 1
    if d <= 128:
        return 64, 4, 3
    return 32, 4, 2


def block_m_for(group: int, sq: int) -> int:
    """Rows of one tile: the packed GQA group x queries, at least 16 (tl.dot), at most 64."""
    return min(64, max(16, triton.next_power_of_2(group * sq)))


def num_splits_heuristic(batch: int, heads_k: int, num_m_blocks: int, max_seqlen_k: int, block_n: int,
                         sm_count: int) -> int:
    """Splits from shapes only (no device values: CUDA-graph safe). One split when the (batch, KV head,
    query block) programs already fill the GPU or the cache is a few tiles; else enough splits for about
    two programs per SM, at least 4 tiles per split, at most MAX_SPLITS."""
    tiles = batch * heads_k * num_m_blocks
    n_blocks = triton.cdiv(max(max_seqlen_k, 1), block_n)
    if n_blocks <= 4 or tiles >= 0.8 * sm_count:
        return 1
    splits = min(triton.cdiv(2 * sm_count, tiles), max(1, n_blocks // 4), MAX_SPLITS)
    return max(1, splits)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
    seqlen_new: int, *, scale: float, cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (b, sq, hq, d) over a cache (already holding the new rows); returns
    out (b, sq, hq, d) in q's dtype and the fp32 natural-log lse (b, hq, sq).

    cache_seqlens (b,) int32 counts the cache rows *before* the seqlen_new appended ones. Windows use
    -1 for "unbounded"; causal is window_right = 0. num_splits 0 picks the heuristic. Inputs are
    validated by the caller.
    """
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = q.new_empty((b, sq, hq, d))
    lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    block_n, num_warps, num_stages = decode_config(pad_head_dim(d))
    block_m = block_m_for(group, sq)
    num_m_blocks = triton.cdiv(group * sq, block_m)
    if block_table is not None:
        max_seqlen_k = block_table.shape[1] * k_cache.shape[1]
    else:
        max_seqlen_k = k_cache.shape[1]
    if num_splits <= 0:
        num_splits = num_splits_heuristic(b, hkv, num_m_blocks, max_seqlen_k, block_n, _sm_count(q.device))
    num_splits = min(num_splits, MAX_SPLITS)
    block_d = pad_head_dim(d)
    n_rows = b * hq * sq
    if num_splits > 1:
        o_part = torch.empty((num_splits, n_rows, block_d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((num_splits, n_rows), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = lse
    _launch.poison(out, lse, *((o_part, lse_part) if num_splits > 1 else ()))
    dummy = cache_seqlens
    has_right = window_right >= 0
    has_left = window_left >= 0
    _decode_split[grid_1d(b * hkv * num_m_blocks * num_splits)](
        q, k_cache, v_cache, out, lse, o_part, lse_part,
        cache_seqlens,
        dummy if cache_batch_idx is None else cache_batch_idx,
        dummy if cache_leftpad is None else cache_leftpad,
        dummy if block_table is None else block_table,
        lse if alibi_slopes is None else alibi_slopes,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        0 if block_table is None else block_table.stride(0),
        0 if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes.stride(0),
        b, hq, hkv, sq, seqlen_new, num_m_blocks,
        scale, float(softcap), max(window_left, 0), max(window_right, 0),
        GROUP=group, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        HAS_BATCH_IDX=cache_batch_idx is not None, HAS_LEFTPAD=cache_leftpad is not None,
        PAGE_SIZE=0 if block_table is None else k_cache.shape[1],
        HAS_ALIBI=alibi_slopes is not None, SOFTCAP=softcap > 0.0, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        block_r = 16
        _merge_splits[grid_1d(triton.cdiv(n_rows, block_r))](
            o_part, lse_part, out, lse, *out.stride(),
            n_rows, hq, sq,
            NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits), HEAD_DIM=d, BLOCK_D=block_d,
            BLOCK_R=block_r, num_warps=4,
        )
    return out, lse
