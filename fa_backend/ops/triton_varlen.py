"""torch.library ops for packed variable-length batches on the Triton kernels:
fa_backend::triton_varlen_fwd / triton_varlen_bwd (and triton_varlen_bwd_out, the backward writing
into given gradient buffers).

FlashAttention-2's varlen layout: q (total_q, hq, d), k / v (total_k, hkv, d / dv), int32
cumulative lengths cu_seqlens_q / _k (b + 1,) on q's device, and max_seqlen_q / _k, Python ints
bounding every length (they size the launch grids: nothing is read back from the device, so the
ops work under CUDA graphs and torch.compile). Sequence i is queries [cu_seqlens_q[i],
cu_seqlens_q[i + 1]) over keys [cu_seqlens_k[i], cu_seqlens_k[i + 1]); causal, the window and
ALiBi are aligned bottom-right per sequence. Forward returns out (total_q, hq, dv) and the fp32
LSE (hq, total_q) (before dropout). Features as in triton_flash (no attn_mask).

Schemas, fakes and autograd only; kernels are imported lazily.
"""

from __future__ import annotations

import torch

from ..dispatch import counters
from ._library import NAMESPACE
from .triton_flash import (
    _check_features,
    _plain,
    _resolve_scale,
    check_triton_inputs,
    new_rng_state,
)


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, dropout_p,
                        rng_state, window_left, window_right, softcap, alibi_slopes, cache: bool = True) -> None:
    """ValueError for malformed varlen input; BackendUnsupportedError (every reason) for input the
    kernels do not support (dtype, head dims, GQA ratio, device). Metadata only: no device sync."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"expected {name} of shape (total, nheads, headdim), got {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit together "
                         "(k and v need the same (total_k, nheads_k), q and k the same headdim)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor (batch + 1,), got {cu.dtype} {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} "
                         "must have the same length (batch + 1)")
    if max_seqlen_q < 0 or max_seqlen_k < 0:
        raise ValueError(f"max_seqlen_q / max_seqlen_k must be >= 0, got {max_seqlen_q} / {max_seqlen_k}")
    if alibi_slopes is not None:
        b, hq = cu_seqlens_q.shape[0] - 1, q.shape[1]
        if alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
            raise ValueError(f"alibi_slopes must be float32 of shape ({hq},) or ({b}, {hq}), got "
                             f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, the query on {q.device}")
    _check_features(q, None, dropout_p, rng_state, window_left, window_right, softcap, None)
    # The kernels' limits (dtype, head dims, GQA, device) on (1, h, total, d) views.
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    check_triton_inputs(q4, k4, v4, is_causal, cache=cache, dropout_p=dropout_p)


def _features(dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes) -> dict:
    rng = tuple(rng_state.tolist()) if dropout_p > 0 else None  # a CPU tensor: no device sync
    return dict(dropout_p=dropout_p, rng=rng, window=(window_left, window_right), softcap=softcap,
                alibi_slopes=alibi_slopes)


@torch.library.custom_op(f"{NAMESPACE}::triton_varlen_fwd", mutates_args=())
def triton_varlen_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, scale: float | None = None, is_causal: bool = False,
    dropout_p: float = 0.0, rng_state: torch.Tensor | None = None, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen attention forward; returns out (total_q, hq, dv) and fp32 lse (hq, total_q)."""
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, dropout_p,
                        rng_state, window_left, window_right, softcap, alibi_slopes)
    from ..kernels.triton import flash_fwd_varlen

    counters.record_run("triton")
    return flash_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            _resolve_scale(q, scale), is_causal,
                            **_features(dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes))


@triton_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=None, is_causal=False, dropout_p=0.0,
      rng_state=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, dropout_p,
                        rng_state, window_left, window_right, softcap, alibi_slopes, cache=False)
    total_q, hq, _ = q.shape
    out = q.new_empty((total_q, hq, v.shape[-1]))
    lse = q.new_empty((hq, total_q), dtype=torch.float32)
    return out, lse


@torch.library.custom_op(f"{NAMESPACE}::triton_varlen_bwd", mutates_args=())
def triton_varlen_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, scale: float | None = None, is_causal: bool = False,
    dropout_p: float = 0.0, rng_state: torch.Tensor | None = None, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of triton_varlen_fwd; dlse is the gradient of its lse output, if any.
    The feature arguments must be the forward's (same rng_state: the same dropout mask)."""
    from ..kernels.triton import flash_bwd_varlen

    return flash_bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            _resolve_scale(q, scale), is_causal, dlse,
                            **_features(dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes))


@triton_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=None,
      is_causal=False, dropout_p=0.0, rng_state=None, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op(f"{NAMESPACE}::triton_varlen_bwd_out", mutates_args=("dq", "dk", "dv"))
def triton_varlen_bwd_out(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    scale: float | None = None, is_causal: bool = False, dropout_p: float = 0.0,
    rng_state: torch.Tensor | None = None, window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> None:
    """triton_varlen_bwd writing into dq, dk, dv (any strides: e.g. views of one packed qkv gradient)."""
    from ..kernels.triton import flash_bwd_varlen

    flash_bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     _resolve_scale(q, scale), is_causal, dlse,
                     **_features(dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes),
                     dq=dq, dk=dk, dv=dv)


@triton_varlen_bwd_out.register_fake
def _(dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      scale=None, is_causal=False, dropout_p=0.0, rng_state=None, window_left=-1, window_right=-1, softcap=0.0,
      alibi_slopes=None):
    return None


_N_NON_TENSOR_GRADS = 12  # cu_seqlens_q ... alibi_slopes


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, dropout_p, rng_state, window_left, window_right,
     softcap, alibi_slopes) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, alibi_slopes)
    ctx.args = (max_q, max_k, scale, is_causal, dropout_p, window_left, window_right, softcap)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, rng_state, alibi_slopes = ctx.saved_tensors
    max_q, max_k, scale, is_causal, dropout_p, window_left, window_right, softcap = ctx.args
    dq, dk, dv = triton_varlen_bwd(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, scale, is_causal,
                                   dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes)
    return (dq, dk, dv) + (None,) * _N_NON_TENSOR_GRADS


triton_varlen_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerTritonVarlen(torch.autograd.Function):
    """The op's eager twin (same checks, kernels, counters and bitwise gradients) without the
    torch.library dispatch and custom-op autograd layers (see triton_flash._EagerTritonFlash)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, is_causal, dropout_p, rng_state, window_left,
                window_right, softcap, alibi_slopes):
        from ..kernels.triton import flash_fwd_varlen

        check_varlen_inputs(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, dropout_p, rng_state, window_left,
                            window_right, softcap, alibi_slopes)
        counters.record_run("triton")
        feats = _features(dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes)
        out, lse = flash_fwd_varlen(q, k, v, cu_q, cu_k, max_q, max_k, _resolve_scale(q, scale), is_causal, **feats)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes)
        ctx.args = (max_q, max_k, scale, is_causal, feats)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from ..kernels.triton import flash_bwd_varlen

        q, k, v, out, lse, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
        max_q, max_k, scale, is_causal, feats = ctx.args
        dq, dk, dv = flash_bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, _resolve_scale(q, scale),
                                      is_causal, dlse, **dict(feats, alibi_slopes=alibi_slopes))
        return (dq, dk, dv) + (None,) * _N_NON_TENSOR_GRADS


def triton_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int, scale: float | None = None, is_causal: bool = False, *,
    dropout_p: float = 0.0, rng_state: torch.Tensor | None = None, window_left: int = -1, window_right: int = -1,
    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the varlen kernels, differentiable in q, k and v.

    Under torch.compile and for tensor subclasses this is the custom op fa_backend::triton_varlen_fwd;
    for plain tensors in eager mode its autograd.Function twin. With dropout_p > 0 and no rng_state,
    a fresh one is drawn (new_rng_state: torch's CPU generator).
    """
    if dropout_p > 0 and rng_state is None:
        rng_state = new_rng_state()
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, bool(is_causal),
            float(dropout_p), rng_state, int(window_left), int(window_right), float(softcap), alibi_slopes)
    if torch.compiler.is_compiling() or not _plain(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes):
        return triton_varlen_fwd(*args)
    return _EagerTritonVarlen.apply(*args)
