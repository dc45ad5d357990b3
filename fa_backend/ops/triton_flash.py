"""torch.library ops for the Triton kernels: fa_backend::triton_flash_fwd / triton_flash_bwd.

Schemas, fake implementations (same shapes, dtypes and strides as the real outputs) and the
autograd formula. Nothing numeric lives here; kernels are imported lazily so that importing
fa_backend works where Triton is missing.
"""

from __future__ import annotations

import torch

from ..dispatch import counters
from ..dispatch.backends.triton import TritonBackend
from ..dispatch.call import AttentionCall, validate
from ..dispatch.reasons import BackendUnsupportedError
from ..kernels._layout import new_attention_output
from ._library import NAMESPACE


# Metadata of inputs that already passed the checks (eager calls repeat the same shapes).
_CHECKED: set = set()


def check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        cache: bool = True) -> None:
    """ValueError for malformed input; BackendUnsupportedError listing every reason otherwise.

    cache=False for fake tensors, whose symbolic sizes are not hashable.
    """
    key = (type(q), type(k), type(v), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.shape, k.shape,
           v.shape) if cache else None
    if key is not None and key in _CHECKED:
        return
    validate(q, k, v)
    call = AttentionCall.from_tensors(q, k, v, is_causal=is_causal, enable_gqa=True)
    reasons = TritonBackend.why_not(call)
    if reasons:
        raise BackendUnsupportedError(call.describe(), {TritonBackend.NAME: reasons})
    if key is not None:
        if len(_CHECKED) >= 4096:
            _CHECKED.clear()
        _CHECKED.add(key)


def _resolve_scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


@torch.library.custom_op(f"{NAMESPACE}::triton_flash_fwd", mutates_args=())
def triton_flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float | None = None, is_causal: bool = False, bottom_right: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward; returns out (b, hq, sq, dv) and fp32 lse (b, hq, sq)."""
    check_triton_inputs(q, k, v, is_causal)
    from ..kernels.triton import flash_fwd

    counters.record_run("triton")
    return flash_fwd(q, k, v, _resolve_scale(q, scale), is_causal, bottom_right)


@triton_flash_fwd.register_fake
def _(q, k, v, scale=None, is_causal=False, bottom_right=False):
    check_triton_inputs(q, k, v, is_causal, cache=False)
    out = new_attention_output(q, v.shape[-1])
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op(f"{NAMESPACE}::triton_flash_bwd", mutates_args=())
def triton_flash_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
    scale: float | None = None, is_causal: bool = False, bottom_right: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of triton_flash_fwd; dlse is the gradient of its lse output, if any."""
    from ..kernels.triton import flash_bwd

    return flash_bwd(dout, q, k, v, out, lse, _resolve_scale(q, scale), is_causal, bottom_right, dlse)


@triton_flash_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, scale=None, is_causal=False, bottom_right=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, is_causal, bottom_right = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.is_causal, ctx.bottom_right = scale, is_causal, bottom_right


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = triton_flash_bwd(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.is_causal, ctx.bottom_right)
    return dq, dk, dv, None, None, None


triton_flash_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerTritonFlash(torch.autograd.Function):
    """The op's eager twin: same checks, kernels, counters and gradients (bitwise), without the
    torch.library dispatch and custom-op autograd layers, which cost tens of microseconds of Python
    per call (measured: a tiny routed call's host time is what bounds small attention calls)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, is_causal, bottom_right):
        from ..kernels.triton import flash_fwd

        check_triton_inputs(q, k, v, is_causal)
        counters.record_run("triton")
        out, lse = flash_fwd(q, k, v, _resolve_scale(q, scale), is_causal, bottom_right)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.is_causal, ctx.bottom_right = scale, is_causal, bottom_right
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from ..kernels.triton import flash_bwd

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_bwd(dout, q, k, v, out, lse, _resolve_scale(q, ctx.scale), ctx.is_causal,
                               ctx.bottom_right, dlse)
        return dq, dk, dv, None, None, None


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def triton_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float | None = None, is_causal: bool = False, bottom_right: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of our Triton kernels, differentiable.

    Under torch.compile and for tensor subclasses (fake, functional, ...) this is the custom op
    fa_backend::triton_flash_fwd; for plain tensors in eager mode its autograd.Function twin.
    """
    if torch.compiler.is_compiling() or not (type(q) in _PLAIN_TENSORS and type(k) in _PLAIN_TENSORS
                                              and type(v) in _PLAIN_TENSORS):
        return triton_flash_fwd(q, k, v, scale, is_causal, bottom_right)
    return _EagerTritonFlash.apply(q, k, v, scale, is_causal, bottom_right)
