"""FlashAttention-2 compatible functions on fa_backend's Triton kernels.

    from fa_backend import flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func
    from fa_backend import (flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func,
                            flash_attn_varlen_kvpacked_func)

Same signatures and semantics as ``flash_attn.flash_attn_interface`` (FlashAttention 2): inputs in
(batch, seqlen, heads, head_dim) layout, ``causal=True`` aligned bottom-right (query i sees keys
j <= i + seqlen_k - seqlen_q), ``window_size=(left, right)`` with -1 = unbounded, ``softcap``,
``alibi_slopes`` (fp32 (nheads,) or (batch, nheads)), ``dropout_p`` (applied whenever > 0,
reproducible under ``torch.manual_seed``). Every call runs the custom ops
``fa_backend::triton_flash_fwd`` / ``_bwd`` (or their eager twin), so it is counted in
``fa_backend.stats()["runs"]["triton"]`` like routed SDPA calls.

The varlen functions take packed batches: q (total_q, nheads, headdim), k / v (total_k, nheads_k,
headdim), int32 ``cu_seqlens_q`` / ``cu_seqlens_k`` (batch + 1,) on the inputs' device and Python
ints ``max_seqlen_q`` / ``max_seqlen_k`` that bound every length (they size the launch; nothing is
read back from the GPU, so the calls work under CUDA graphs and torch.compile). Causal, window and
ALiBi are aligned bottom-right per sequence; a sequence may be empty, and a query sequence with no
keys outputs zeros (LSE -inf). They run ``fa_backend::triton_varlen_fwd`` / ``_bwd`` (or their
eager twin), also counted under "triton"; softmax_lse is fp32 (nheads, total_q).

Differences from FlashAttention 2:
- ``return_attn_probs=True`` raises NotImplementedError: the kernels never materialise the attention
  probabilities (FA2's ``S_dmask``). Pass ``return_softmax_lse=True`` (keyword, an fa_backend
  extension) to get ``(out, softmax_lse)``, softmax_lse being fp32 (batch, nheads, seqlen_q).
- ``deterministic`` is accepted and ignored: the backward never uses atomics and is always
  bitwise deterministic.
- The packed variants pass strided views of ``qkv`` / ``kv`` to the kernels (no copies), and their
  backward writes dq, dk, dv straight into one gradient buffer shaped like ``qkv`` / ``kv``.
"""

from __future__ import annotations

import torch

from .ops import new_rng_state, triton_flash_attention, triton_varlen_attention
from .ops.triton_flash import triton_flash_bwd_out, triton_flash_fwd
from .ops.triton_varlen import triton_varlen_bwd_out, triton_varlen_fwd

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func"]

_PROBS_MESSAGE = ("return_attn_probs=True: fa_backend's kernels never materialise the attention probabilities "
                  "(FlashAttention-2's S_dmask); pass return_softmax_lse=True to get (out, softmax_lse)")


def _check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != rank:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"expected {name} of shape {layout}, got {shape}")


def _window(window_size) -> tuple[int, int]:
    left, right = (int(w) for w in window_size)
    return left, right


def _result(out_bhsd: torch.Tensor, lse: torch.Tensor, return_softmax_lse: bool):
    out = out_bhsd.transpose(1, 2)  # (b, s, h, d) view; the kernels' output memory is (b, s, h, d)
    return (out, lse) if return_softmax_lse else out


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, return_softmax_lse=False):
    """FlashAttention-2's flash_attn_func: q (b, sq, hq, d), k/v (b, sk, hkv, d) -> out (b, sq, hq, dv)."""
    if return_attn_probs:
        raise NotImplementedError(_PROBS_MESSAGE)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, t, 4, "(batch, seqlen, nheads, headdim)")
    left, right = _window(window_size)
    out, lse = triton_flash_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale, bool(causal), True,
        dropout_p=float(dropout_p), window_left=left, window_right=right, softcap=float(softcap),
        alibi_slopes=alibi_slopes)
    return _result(out, lse, return_softmax_lse)


class _PackedFlashAttn(torch.autograd.Function):
    """Attention on views of packed inputs whose backward fills one packed gradient buffer.

    q_or_qkv is qkv (b, s, 3, h, d) when kv is None, else q (b, s, h, d) with kv (b, s, 2, hkv, d).
    The forward runs fa_backend::triton_flash_fwd on (b, h, s, d) views; the backward allocates
    dqkv (or dq, dkv) once and fa_backend::triton_flash_bwd_out writes dq, dk, dv into its views,
    so no stack/cat copy of the gradients happens.
    """

    @staticmethod
    def forward(ctx, q_or_qkv, kv, scale, causal, dropout_p, rng_state, left, right, softcap, alibi_slopes):
        if kv is None:
            q, k, v = (q_or_qkv[:, :, i].transpose(1, 2) for i in range(3))
        else:
            q = q_or_qkv.transpose(1, 2)
            k, v = (kv[:, :, i].transpose(1, 2) for i in range(2))
        out, lse = triton_flash_fwd(q, k, v, scale, causal, True, None, dropout_p, rng_state, left, right, softcap,
                                    alibi_slopes)
        ctx.save_for_backward(q_or_qkv, kv, out, lse, rng_state, alibi_slopes)
        ctx.args = (scale, causal, dropout_p, left, right, softcap)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q_or_qkv, kv, out, lse, rng_state, alibi_slopes = ctx.saved_tensors
        scale, causal, dropout_p, left, right, softcap = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        if kv is None:
            q, k, v = (q_or_qkv[:, :, i].transpose(1, 2) for i in range(3))
            dpacked = torch.empty_like(q_or_qkv)
            dq, dk, dv = (dpacked[:, :, i].transpose(1, 2) for i in range(3))
            grads = (dpacked, None)
        else:
            q = q_or_qkv.transpose(1, 2)
            k, v = (kv[:, :, i].transpose(1, 2) for i in range(2))
            dq_bshd, dkv = torch.empty_like(q_or_qkv), torch.empty_like(kv)
            dq = dq_bshd.transpose(1, 2)
            dk, dv = (dkv[:, :, i].transpose(1, 2) for i in range(2))
            grads = (dq_bshd, dkv)
        triton_flash_bwd_out(dout, q, k, v, out, lse, dlse, dq, dk, dv, scale, causal, True, None, dropout_p,
                             rng_state, left, right, softcap, alibi_slopes)
        return grads + (None,) * 8


def _packed(q_or_qkv, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            return_attn_probs, return_softmax_lse):
    if return_attn_probs:
        raise NotImplementedError(_PROBS_MESSAGE)
    left, right = _window(window_size)
    rng_state = new_rng_state() if dropout_p > 0 else None
    out, lse = _PackedFlashAttn.apply(q_or_qkv, kv, softmax_scale, bool(causal), float(dropout_p), rng_state,
                                      left, right, float(softcap), alibi_slopes)
    return _result(out, lse, return_softmax_lse)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                              return_softmax_lse=False):
    """FlashAttention-2's flash_attn_qkvpacked_func: qkv (b, s, 3, h, d) -> out (b, s, h, d)."""
    _check_rank("qkv", qkv, 5, "(batch, seqlen, 3, nheads, headdim)")
    if qkv.shape[2] != 3:
        raise ValueError(f"expected qkv of shape (batch, seqlen, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return _packed(qkv, None, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs, return_softmax_lse)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                             return_softmax_lse=False):
    """FlashAttention-2's flash_attn_kvpacked_func: q (b, sq, hq, d), kv (b, sk, 2, hkv, d) -> (b, sq, hq, d)."""
    _check_rank("q", q, 4, "(batch, seqlen, nheads, headdim)")
    _check_rank("kv", kv, 5, "(batch, seqlen, 2, nheads_k, headdim)")
    if kv.shape[2] != 2:
        raise ValueError(f"expected kv of shape (batch, seqlen, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return _packed(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   return_attn_probs, return_softmax_lse)


# ------------------------------------------------------------------------------------- varlen

def _varlen_result(out: torch.Tensor, lse: torch.Tensor, return_softmax_lse: bool):
    return (out, lse) if return_softmax_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, return_softmax_lse=False):
    """FlashAttention-2's flash_attn_varlen_func: q (total_q, hq, d), k/v (total_k, hkv, d) -> (total_q, hq, dv).

    alibi_slopes is fp32 (nheads,) or (batch, nheads); with return_softmax_lse=True also returns the
    fp32 softmax_lse (nheads, total_q)."""
    if return_attn_probs:
        raise NotImplementedError(_PROBS_MESSAGE)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_rank(name, t, 3, "(total, nheads, headdim)")
    left, right = _window(window_size)
    out, lse = triton_varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), softmax_scale, bool(causal),
        dropout_p=float(dropout_p), window_left=left, window_right=right, softcap=float(softcap),
        alibi_slopes=alibi_slopes)
    return _varlen_result(out, lse, return_softmax_lse)


class _PackedVarlenAttn(torch.autograd.Function):
    """Varlen attention on views of packed inputs whose backward fills one packed gradient buffer.

    q_or_qkv is qkv (total, 3, h, d) when kv is None, else q (total_q, h, d) with kv (total_k, 2, hkv, d);
    cu_k None means cu_q. The forward runs fa_backend::triton_varlen_fwd on strided views; the backward allocates dqkv (or
    dq, dkv) once and fa_backend::triton_varlen_bwd_out writes dq, dk, dv into its views.
    """

    @staticmethod
    def forward(ctx, q_or_qkv, kv, cu_q, cu_k, max_q, max_k, scale, causal, dropout_p, rng_state, left, right,
                softcap, alibi_slopes):
        q, k, v = _varlen_views(q_or_qkv, kv)
        cu_k = cu_q if cu_k is None else cu_k  # qkvpacked: one tensor (Dynamo rejects a tensor given twice)
        out, lse = triton_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, dropout_p, rng_state, left,
                                     right, softcap, alibi_slopes)
        ctx.save_for_backward(q_or_qkv, kv, out, lse, cu_q, cu_k, rng_state, alibi_slopes)
        ctx.args = (max_q, max_k, scale, causal, dropout_p, left, right, softcap)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q_or_qkv, kv, out, lse, cu_q, cu_k, rng_state, alibi_slopes = ctx.saved_tensors
        max_q, max_k, scale, causal, dropout_p, left, right, softcap = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        q, k, v = _varlen_views(q_or_qkv, kv)
        if kv is None:
            dpacked = torch.empty_like(q_or_qkv)
            dq, dk, dv = dpacked.unbind(1)
            grads = (dpacked, None)
        else:
            dq, dkv = torch.empty_like(q_or_qkv), torch.empty_like(kv)
            dk, dv = dkv.unbind(1)
            grads = (dq, dkv)
        triton_varlen_bwd_out(dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_q, cu_k, max_q, max_k, scale, causal,
                              dropout_p, rng_state, left, right, softcap, alibi_slopes)
        return grads + (None,) * 12


def _varlen_views(q_or_qkv, kv):
    if kv is None:
        return q_or_qkv.unbind(1)
    return (q_or_qkv, *kv.unbind(1))


def _packed_varlen(q_or_qkv, kv, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, return_attn_probs, return_softmax_lse):
    if return_attn_probs:
        raise NotImplementedError(_PROBS_MESSAGE)
    left, right = _window(window_size)
    rng_state = new_rng_state() if dropout_p > 0 else None
    out, lse = _PackedVarlenAttn.apply(q_or_qkv, kv, cu_q, cu_k, int(max_q), int(max_k), softmax_scale, bool(causal),
                                       float(dropout_p), rng_state, left, right, float(softcap), alibi_slopes)
    return _varlen_result(out, lse, return_softmax_lse)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, return_softmax_lse=False):
    """FlashAttention-2's flash_attn_varlen_qkvpacked_func: qkv (total, 3, h, d) -> out (total, h, d)."""
    _check_rank("qkv", qkv, 4, "(total, 3, nheads, headdim)")
    if qkv.shape[1] != 3:
        raise ValueError(f"expected qkv of shape (total, 3, nheads, headdim), got {tuple(qkv.shape)}")
    return _packed_varlen(qkv, None, cu_seqlens, None, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
                          window_size, softcap, alibi_slopes, return_attn_probs, return_softmax_lse)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *,
                                    return_softmax_lse=False):
    """FlashAttention-2's flash_attn_varlen_kvpacked_func: q (total_q, hq, d), kv (total_k, 2, hkv, d)."""
    _check_rank("q", q, 3, "(total_q, nheads, headdim)")
    _check_rank("kv", kv, 4, "(total_k, 2, nheads_k, headdim)")
    if kv.shape[1] != 2:
        raise ValueError(f"expected kv of shape (total_k, 2, nheads_k, headdim), got {tuple(kv.shape)}")
    return _packed_varlen(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                          causal, window_size, softcap, alibi_slopes, return_attn_probs, return_softmax_lse)
