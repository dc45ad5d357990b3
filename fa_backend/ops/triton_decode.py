"""torch.library ops for KV-cache inference on the Triton kernels.

fa_backend::triton_kv_append  writes new keys (rotated) and values into the caches in place
                               (declared as mutating k_cache and v_cache: torch.compile and CUDA
                               graphs see the writes);
fa_backend::triton_decode_fwd  split-KV attention of q (rotated in the kernel when asked) over the
                               caches; returns (out, lse).
Schemas and fakes only; kernels are imported lazily. Inputs are validated by
fa_backend.kvcache.flash_attn_with_kvcache.
"""

from __future__ import annotations

import torch

from ..dispatch import counters
from ._library import NAMESPACE

BACKEND_NAME = "triton_decode"


def _last_dim_contiguous(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def kv_append_impl(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
                   rotary_interleaved):
    """One launch (keys and values). cache_seqlens may also be an int (eager calls)."""
    from ..kernels.triton.kv_append import append_kv

    if rotary_cos is not None and not (rotary_cos.is_contiguous() and rotary_sin.is_contiguous()):
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    append_kv(_last_dim_contiguous(k), _last_dim_contiguous(v), k_cache, v_cache, cache_seqlens, cos=rotary_cos,
              sin=rotary_sin, interleaved=rotary_interleaved, batch_idx=cache_batch_idx, block_table=block_table)


@torch.library.custom_op(f"{NAMESPACE}::triton_kv_append", mutates_args=("k_cache", "v_cache"))
def triton_kv_append(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_seqlens: torch.Tensor,
    cache_batch_idx: torch.Tensor | None, block_table: torch.Tensor | None,
    rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None, rotary_interleaved: bool,
) -> None:
    """k_cache[b, cache_seqlens[b] + i] = rotary(k[b, i]) and v_cache[...] = v[b, i], in place."""
    kv_append_impl(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
                   rotary_interleaved)


@triton_kv_append.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, rotary_cos, rotary_sin,
      rotary_interleaved):
    return None


def decode_fwd_impl(q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad, block_table,
                    rotary_cos, rotary_sin, rotary_interleaved, rotary_per_row, alibi_slopes, scale, window_left,
                    window_right, softcap, num_splits, need_lse=True):
    """The decode kernel (queries rotated inside it) and, for split keys, the merge: at most two launches.
    cache_seqlens may also be an int (eager calls); need_lse=False (eager) skips the LSE."""
    from ..kernels.triton.decode import decode_attention

    if rotary_cos is not None and not (rotary_cos.is_contiguous() and rotary_sin.is_contiguous()):
        rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
    if alibi_slopes is not None and not alibi_slopes.is_contiguous():
        alibi_slopes = alibi_slopes.contiguous()
    counters.record_run(BACKEND_NAME)
    return decode_attention(
        _last_dim_contiguous(q), k_cache, v_cache, cache_seqlens, seqlen_new, scale=scale,
        cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, block_table=block_table,
        alibi_slopes=alibi_slopes, window_left=window_left, window_right=window_right, softcap=softcap,
        num_splits=num_splits, rotary_cos=rotary_cos, rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
        rotary_pos_step=1 if rotary_per_row else 0, need_lse=need_lse)


@torch.library.custom_op(f"{NAMESPACE}::triton_decode_fwd", mutates_args=())
def triton_decode_fwd(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, seqlen_new: int,
    cache_batch_idx: torch.Tensor | None, cache_leftpad: torch.Tensor | None, block_table: torch.Tensor | None,
    rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None, rotary_interleaved: bool,
    rotary_per_row: bool, alibi_slopes: torch.Tensor | None, scale: float, window_left: int, window_right: int,
    softcap: float, num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (b, sq, hq, d) over caches holding cache_seqlens[b] + seqlen_new rows;
    returns out (b, sq, hq, d) and fp32 lse (b, hq, sq)."""
    return decode_fwd_impl(q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad,
                           block_table, rotary_cos, rotary_sin, rotary_interleaved, rotary_per_row, alibi_slopes,
                           scale, window_left, window_right, softcap, num_splits)


@triton_decode_fwd.register_fake
def _(q, k_cache, v_cache, cache_seqlens, seqlen_new, cache_batch_idx, cache_leftpad, block_table, rotary_cos,
      rotary_sin, rotary_interleaved, rotary_per_row, alibi_slopes, scale, window_left, window_right, softcap,
      num_splits):
    b, sq, hq, d = q.shape
    out = q.new_empty((b, sq, hq, d))
    lse = q.new_empty((b, hq, sq), dtype=torch.float32)
    return out, lse
