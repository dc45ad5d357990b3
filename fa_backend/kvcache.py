"""flash_attn_with_kvcache: FlashAttention-2's KV-cache inference call on our Triton kernels."""

from __future__ import annotations

import torch

from .ops import triton_decode as _ops

_DTYPES = (torch.float16, torch.bfloat16)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _int32_vector(name: str, t: torch.Tensor | None, b: int, device) -> None:
    if t is None:
        return
    _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _check(tuple(t.shape) == (b,), f"{name} must have shape ({b},), got {tuple(t.shape)}")
    _check(t.device == device, f"{name} is on {t.device}, q on {device}")


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
):
    """Attention of q over a KV cache, appending new keys/values to the cache first (FlashAttention-2 API).

    If k and v are given they are written into k_cache / v_cache *in place* at rows
    cache_seqlens[b], cache_seqlens[b] + 1, ... Attention then runs over cache rows [leftpad, cache_seqlens +
    s_new). The caches must have room: an int cache_seqlens is checked (ValueError); tensor lengths and indices
    stay on the device, so a batch entry with cache_seqlens < 0, cache_seqlens + s_new > the cache's rows,
    cache_leftpad < 0 or past cache_seqlens + s_new, cache_batch_idx out of range, or block_table pages out of
    range is neither written nor read outside the tensors, and its output (and LSE) is NaN.

    Rotary (rotary_cos / rotary_sin given, which requires k): new key i is rotated at position
    cache_seqlens[b] + i. Query i is rotated at position cache_seqlens[b] + i when causal or local
    (window_size != (-1, -1)), else every query at position cache_seqlens[b] (FlashAttention-2's rule).
    Positions are cache rows (cache_leftpad does not shift them). rotary_interleaved=True rotates
    dims (0, 1), (2, 3), ... (GPT-J); False rotates (j, j + rotary_dim / 2) (GPT-NeoX); rotary_dim =
    2 * rotary_cos.shape[1] may be less than head_dim (the rest is left as is).

    causal is aligned to the bottom right: with seqlen_k = cache_seqlens + s_new - leftpad keys,
    query i sees keys j <= i + seqlen_k - seqlen_q. window_size (left, right) limits keys to
    [i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right] (-1: unbounded). Scores are
    softcap * tanh(scale * q.k / softcap) when softcap > 0, minus
    alibi_slopes[(b,) h] * |i + seqlen_k - seqlen_q - j| when alibi_slopes is given. A query that
    sees no key outputs zeros (and LSE -inf).

    Args:
        q: (batch, seqlen_q, heads_q, head_dim), fp16 or bf16; head_dim a multiple of 8 up to 256.
        k_cache, v_cache: (batch_cache, seqlen_cache, heads_kv, head_dim), or paged
            (num_pages, page_size, heads_kv, head_dim) with block_table. heads_q % heads_kv == 0.
        k, v: optional new rows (batch, seqlen_new, heads_kv, head_dim).
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2); seqlen_ro at least the cache's rows (plus
            seqlen_q - seqlen_new when causal or local and seqlen_q > seqlen_new).
        cache_seqlens: int or (batch,) int32: cache rows before the append (None: 0).
        cache_batch_idx: (batch,) int32: cache batch used by each batch entry (not with block_table).
        cache_leftpad: (batch,) int32: first valid cache row of each batch entry.
        block_table: (batch, max_pages_per_seq) int32 page indices (paged cache).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        alibi_slopes: (heads_q,) or (batch, heads_q) fp32.
        num_splits: key-length splits per (batch, KV head); 0 picks a heuristic from shapes only.
        return_softmax_lse: also return the fp32 LSE (batch, heads_q, seqlen_q), natural log.

    Returns:
        out (batch, seqlen_q, heads_q, head_dim), plus the LSE when return_softmax_lse. No backward.
    """
    eager = not torch.compiler.is_compiling() and type(q) in _PLAIN_TENSORS and type(k_cache) in _PLAIN_TENSORS \
        and type(v_cache) in _PLAIN_TENSORS
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            block_table, alibi_slopes, causal, window_size, softcap, num_splits)
    if eager:
        # Checks run once per combination of metadata (eager decode repeats the same shapes every step).
        key = (_meta(q), _meta(k_cache), _meta(v_cache), _meta(k), _meta(v), _meta(rotary_cos), _meta(rotary_sin),
               "int" if cache_seqlens is None or isinstance(cache_seqlens, int) else _meta(cache_seqlens),
               _meta(cache_batch_idx), _meta(cache_leftpad), _meta(block_table), _meta(alibi_slopes), causal,
               tuple(window_size), softcap, num_splits)
        if key not in _CHECKED:
            _validate(*args)
            if len(_CHECKED) >= 4096:
                _CHECKED.clear()
            _CHECKED.add(key)
    else:
        _validate(*args)

    d = q.shape[3]
    seqlen_new = 0 if k is None else k.shape[1]
    if cache_seqlens is None or isinstance(cache_seqlens, int):
        cache_seqlens = int(cache_seqlens or 0)
        capacity = _capacity(k_cache, block_table)
        _check(0 <= cache_seqlens <= capacity - seqlen_new,
               f"cache_seqlens {cache_seqlens} must be in [0, {capacity - seqlen_new}]: the KV cache holds {capacity} "
               f"rows per sequence and {seqlen_new} new rows are appended after cache_seqlens")
        if not eager:  # the custom ops take a tensor
            cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    window_left, window_right = int(window_size[0]), int(window_size[1])
    if causal:
        window_right = 0
    scale = d ** -0.5 if softmax_scale is None else float(softmax_scale)
    rotary_per_row = causal or window_left >= 0 or window_right >= 0
    if eager:
        if k is not None:
            _ops.kv_append_impl(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos,
                                rotary_sin, bool(rotary_interleaved))
        out, lse = _ops.decode_fwd_impl(
            q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
            rotary_sin, bool(rotary_interleaved), rotary_per_row, alibi_slopes, scale, window_left, window_right,
            float(softcap), int(num_splits), need_lse=return_softmax_lse)
        return (out, lse) if return_softmax_lse else out
    if k is not None:
        torch.ops.fa_backend.triton_kv_append(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table,
                                              rotary_cos, rotary_sin, bool(rotary_interleaved))
    out, lse = torch.ops.fa_backend.triton_decode_fwd(
        q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
        rotary_sin, bool(rotary_interleaved), rotary_per_row, alibi_slopes, scale, window_left, window_right,
        float(softcap), int(num_splits))
    return (out, lse) if return_softmax_lse else out


def _capacity(k_cache: torch.Tensor, block_table: torch.Tensor | None) -> int:
    """Cache rows per sequence: the cache's rows, or a block-table row's pages times the page size."""
    return k_cache.shape[1] * (1 if block_table is None else block_table.shape[1])


def _meta(t: torch.Tensor | None):
    return None if t is None else (type(t), t.shape, t.dtype, t.device, t.stride())


# Metadata keys of calls that passed _validate.
_CHECKED: set = set()


def _validate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
              block_table, alibi_slopes, causal, window_size, softcap, num_splits) -> None:
    """ValueError for malformed input, BackendUnsupportedError for what the kernels do not support."""
    _check(q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4,
           f"q, k_cache, v_cache must be 4-D, got {q.dim()}, {k_cache.dim()}, {v_cache.dim()}")
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    device = q.device
    if q.dtype not in _DTYPES:
        from .dispatch.reasons import BackendUnsupportedError, Reason, ReasonCode

        raise BackendUnsupportedError(f"flash_attn_with_kvcache(q {q.dtype})", {_ops.BACKEND_NAME: [
            Reason(ReasonCode.DTYPE, f"dtype={q.dtype} (supported: float16, bfloat16)")]})
    if d % 8 != 0 or d > 256:
        from .dispatch.reasons import BackendUnsupportedError, Reason, ReasonCode

        raise BackendUnsupportedError(f"flash_attn_with_kvcache(head_dim {d})", {_ops.BACKEND_NAME: [
            Reason(ReasonCode.HEAD_DIM, f"head_dim={d} (supported: multiples of 8 up to 256)")]})
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check(t.dtype == q.dtype, f"{name} dtype {t.dtype} != q dtype {q.dtype}")
        _check(t.device == device, f"{name} is on {t.device}, q on {device}")
    _check(tuple(k_cache.shape) == tuple(v_cache.shape),
           f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape")
    _check(k_cache.shape[3] == d, f"cache head_dim {k_cache.shape[3]} != q head_dim {d}")
    _check(hkv > 0 and hq % hkv == 0, f"heads_q {hq} must be a multiple of heads_kv {hkv}")
    _check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1,
           f"k_cache and v_cache must have a contiguous last dimension, got strides {k_cache.stride()} and "
           f"{v_cache.stride()}")

    if block_table is not None:
        _check(block_table.dtype == torch.int32, f"block_table must be int32, got {block_table.dtype}")
        _check(block_table.dim() == 2 and block_table.shape[0] == b,
               f"block_table must be ({b}, max_pages_per_seq), got {tuple(block_table.shape)}")
        _check(block_table.device == device, f"block_table is on {block_table.device}, q on {device}")
        _check(cache_batch_idx is None, "cache_batch_idx is not supported with a paged cache (block_table)")
    else:
        _check(cache_batch_idx is not None or k_cache.shape[0] == b,
               f"k_cache batch {k_cache.shape[0]} != q batch {b} (pass cache_batch_idx to index the cache)")
    _int32_vector("cache_batch_idx", cache_batch_idx, b, device)
    _int32_vector("cache_leftpad", cache_leftpad, b, device)

    if cache_seqlens is not None and not isinstance(cache_seqlens, int):
        _int32_vector("cache_seqlens", cache_seqlens, b, device)

    _check((k is None) == (v is None), "k and v must be given together")
    if k is not None:
        _check(k.dim() == 4 and k.shape[0] == b and k.shape[2:] == k_cache.shape[2:],
               f"k must be ({b}, seqlen_new, {hkv}, {d}), got {tuple(k.shape)}")
        _check(tuple(v.shape) == tuple(k.shape), f"v {tuple(v.shape)} must match k {tuple(k.shape)}")
        for name, t in (("k", k), ("v", v)):
            _check(t.dtype == q.dtype and t.device == device, f"{name} must be {q.dtype} on {device}")

    if rotary_cos is not None or rotary_sin is not None:
        _check(rotary_cos is not None and rotary_sin is not None, "rotary_cos and rotary_sin must be given together")
        _check(k is not None, "rotary embedding needs the new k and v to append (as in FlashAttention-2)")
        _check(rotary_cos.dim() == 2 and tuple(rotary_cos.shape) == tuple(rotary_sin.shape),
               f"rotary_cos {tuple(rotary_cos.shape)} and rotary_sin {tuple(rotary_sin.shape)} must be "
               "(seqlen_ro, rotary_dim / 2)")
        _check(0 < 2 * rotary_cos.shape[1] <= d, f"rotary_dim {2 * rotary_cos.shape[1]} must be in (0, {d}]")
        _check(rotary_cos.device == device and rotary_sin.device == device, "rotary_cos/sin must be on q's device")
        # Every rotated position lies below this bound when the caches have room for the append (new key i of
        # batch b at cache_seqlens[b] + i < capacity); per-row query rotation reaches cache_seqlens[b] + seqlen_q - 1.
        # The kernels read the tables unmasked, so it is checked here (FlashAttention-2 checks seqlen_ro >= capacity).
        capacity = _capacity(k_cache, block_table)
        per_row = causal or int(window_size[0]) >= 0 or int(window_size[1]) >= 0
        needed = capacity + max(0, sq - k.shape[1]) if per_row else capacity
        _check(rotary_cos.shape[0] >= needed,
               f"rotary_cos/sin seqlen {rotary_cos.shape[0]} must be at least {needed}: the KV cache's "
               f"{capacity} rows" + (f" plus seqlen_q {sq} - seqlen_new {k.shape[1]} (queries are rotated at "
                                     "cache_seqlens + i)" if needed > capacity else ""))

    if alibi_slopes is not None:
        _check(alibi_slopes.dtype == torch.float32, f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        _check(tuple(alibi_slopes.shape) in ((hq,), (b, hq)),
               f"alibi_slopes must be ({hq},) or ({b}, {hq}), got {tuple(alibi_slopes.shape)}")
        _check(alibi_slopes.device == device, f"alibi_slopes is on {alibi_slopes.device}, q on {device}")

    _check(len(window_size) == 2 and int(window_size[0]) >= -1 and int(window_size[1]) >= -1,
           f"window_size entries must be >= -1, got {window_size}")
    _check(softcap >= 0.0, f"softcap must be >= 0, got {softcap}")
    _check(num_splits >= 0, f"num_splits must be >= 0, got {num_splits}")

