"""torch.library ops for KV-cache inference on the Triton kernels.

fa_backend::triton_kv_append  writes new keys (rotated) and values into the caches in place
                               (declared as mutating k_cache and v_cache: torch.compile and CUDA
                               graphs see the writes);
fa_backend::triton_decode_fwd  split-KV attention of q (rotated in the kernel when asked) over the
                               caches; returns (out, lse).
fa_backend::triton_sdpa_decode the same kernel on an SDPA call with a short query (routed decode
                               calls): SDPA layout and semantics (top-left is_causal, attn_mask);
                               returns (out, lse). No backward.
Schemas and fakes only; kernels are imported lazily. The inputs of triton_decode_fwd are validated by
fa_backend.kvcache.flash_attn_with_kvcache; triton_sdpa_decode validates its own.
"""

from __future__ import annotations

import torch

from ..dispatch import counters
from ..dispatch.call import AttentionCall
from ..dispatch.reasons import BackendUnsupportedError, Reason, ReasonCode
from ..kernels._layout import new_attention_output
from ._library import NAMESPACE
from .triton_flash import _plain, _resolve_scale, check_triton_inputs

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


def _check_sdpa_decode(q, k, v, attn_mask, is_causal, cache=True) -> None:
    """triton_flash's checks (ValueError for malformed input, BackendUnsupportedError otherwise), plus the
    decode kernel's own limit: one head dim for keys and values."""
    check_triton_inputs(q, k, v, is_causal, cache=cache, attn_mask=attn_mask)
    if v.shape[-1] != q.shape[-1]:
        call = AttentionCall.from_tensors(q, k, v, attn_mask, is_causal=is_causal, enable_gqa=True)
        raise BackendUnsupportedError(call.describe(), {BACKEND_NAME: [Reason(
            ReasonCode.HEAD_DIM, f"head_dim_v={v.shape[-1]} != head_dim={q.shape[-1]} (the split-KV decode kernel: "
                                 "equal head dims)")]})


def sdpa_decode_impl(q, k, v, attn_mask, is_causal, bottom_right, scale, need_lse=True):
    """The decode kernel on SDPA-layout tensors (q (b, hq, sq, d), k / v (b, hkv, sk, d) read as
    (b, s, h, d) views: no copy unless a head dim is strided); one launch, plus the merge when the keys
    are split. Returns out (b, hq, sq, d) over (b, sq, hq, d) memory and the lse (None unless need_lse)."""
    from ..kernels.triton.decode import decode_attention

    counters.record_run(BACKEND_NAME)
    out, lse = decode_attention(
        _last_dim_contiguous(q).transpose(1, 2), _last_dim_contiguous(k).transpose(1, 2),
        _last_dim_contiguous(v).transpose(1, 2), k.shape[2], 0, scale=scale,
        window_right=0 if is_causal and bottom_right else -1, causal_top_left=is_causal and not bottom_right,
        attn_mask=attn_mask, need_lse=need_lse)
    return out.transpose(1, 2), lse


@torch.library.custom_op(f"{NAMESPACE}::triton_sdpa_decode", mutates_args=())
def triton_sdpa_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
    bottom_right: bool, scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA forward of q (b, hq, sq, d) over k / v (b, hkv, sk, d) on the split-KV decode kernel (meant
    for short queries): attn_mask bool (True = attend) or additive, broadcastable to (b, hq, sq, sk);
    is_causal top-left (SDPA) or, with bottom_right, FlashAttention's alignment. Returns out (b, hq, sq, d)
    (memory (b, sq, hq, d), like triton_flash_fwd) and the fp32 lse (b, hq, sq). No backward."""
    _check_sdpa_decode(q, k, v, attn_mask, is_causal)
    return sdpa_decode_impl(q, k, v, attn_mask, is_causal, bottom_right, _resolve_scale(q, scale))


@triton_sdpa_decode.register_fake
def _(q, k, v, attn_mask, is_causal, bottom_right, scale):
    _check_sdpa_decode(q, k, v, attn_mask, is_causal, cache=False)
    return new_attention_output(q, q.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                bottom_right: bool, scale: float | None) -> torch.Tensor:
    """The output of triton_sdpa_decode for a call the router has checked: the op under torch.compile and
    for tensor subclasses; in eager mode the kernel itself (no op dispatch, no LSE: host time is what
    bounds a decode step)."""
    if torch.compiler.is_compiling() or not _plain(q, k, v, attn_mask):
        return triton_sdpa_decode(q, k, v, attn_mask, is_causal, bottom_right, scale)[0]
    return eager_sdpa_decode(q, k, v, attn_mask, is_causal, bottom_right, scale)


def eager_sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                      is_causal: bool, bottom_right: bool, scale: float | None) -> torch.Tensor:
    """sdpa_decode's eager path, for callers that know the call is eager on plain tensors."""
    return sdpa_decode_impl(q, k, v, attn_mask, is_causal, bottom_right, _resolve_scale(q, scale), need_lse=False)[0]
