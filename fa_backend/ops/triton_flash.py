"""torch.library ops for the Triton kernels: fa_backend::triton_flash_fwd / triton_flash_bwd
(and triton_flash_bwd_out, the backward writing into given gradient buffers).

Schemas, fake implementations (same shapes, dtypes and strides as the real outputs) and the
autograd formula. Nothing numeric lives here; kernels are imported lazily so that importing
fa_backend works where Triton is missing.

Optional features (all default off): attn_mask (bool, True = attend, or additive; broadcastable to
(b, hq, sq, sk); never differentiated), dropout_p with rng_state (int64 CPU tensor (2,) = (seed,
offset) of the kernels' counter-based RNG; the backward regenerates the mask from it),
window_left/right (FlashAttention-2 sliding window, -1 = unbounded), softcap (> 0: FA2 softcapping)
and alibi_slopes (fp32 (hq,) or (b, hq), FA2 ALiBi).
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


def _check_features(q, attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes) -> None:
    """ValueError for malformed feature arguments (the dispatcher's reasons cover the rest)."""
    if dropout_p > 0 and (rng_state is None or rng_state.numel() != 2 or rng_state.dtype != torch.int64
                          or rng_state.device.type != "cpu"):
        raise ValueError("dropout_p > 0 needs rng_state, an int64 CPU tensor (seed, offset); "
                         "see fa_backend.ops.new_rng_state()")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 disables it), got {softcap}")
    if window_left < -1 or window_right < -1:
        raise ValueError(f"window sizes must be >= -1 (-1: unbounded), got ({window_left}, {window_right})")
    if alibi_slopes is not None:
        b, hq = q.shape[0], q.shape[1]
        if alibi_slopes.dtype != torch.float32 or tuple(alibi_slopes.shape) not in ((hq,), (b, hq)):
            raise ValueError(f"alibi_slopes must be float32 of shape ({hq},) or ({b}, {hq}), got "
                             f"{alibi_slopes.dtype} {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != q.device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, the query on {q.device}")
    if attn_mask is not None and attn_mask.dim() > 4:
        raise ValueError(f"attn_mask must have at most 4 dims, got shape {tuple(attn_mask.shape)}")


def check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        cache: bool = True, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0) -> None:
    """ValueError for malformed input; BackendUnsupportedError listing every reason otherwise.

    cache=False for fake tensors, whose symbolic sizes are not hashable. The ops accept a mask
    together with causal (SDPA routing does not send that combination here).
    """
    mask_key = None if attn_mask is None else (attn_mask.dtype, attn_mask.shape, attn_mask.device,
                                               attn_mask.requires_grad and torch.is_grad_enabled())
    key = (type(q), type(k), type(v), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.shape, k.shape,
           v.shape, mask_key, dropout_p) if cache else None
    if key is not None and key in _CHECKED:
        return
    validate(q, k, v)
    call = AttentionCall.from_tensors(q, k, v, attn_mask, dropout_p, is_causal=is_causal and attn_mask is None,
                                      enable_gqa=True)
    reasons = TritonBackend.why_not(call)
    if reasons:
        raise BackendUnsupportedError(call.describe(), {TritonBackend.NAME: reasons})
    if key is not None:
        if len(_CHECKED) >= 4096:
            _CHECKED.clear()
        _CHECKED.add(key)


def _resolve_scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def new_rng_state() -> torch.Tensor:
    """(seed, offset) for the dropout RNG, drawn from PyTorch's default CPU generator: reproducible
    under torch.manual_seed, no device sync. Seeds are >= 2**32 so the kernels' seed argument
    always has the same (64-bit) type."""
    return torch.randint(2**32, 2**62, (2,), dtype=torch.int64, device="cpu")


def _features(attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes) -> dict:
    """Keyword arguments of flash_fwd / flash_bwd for the ops' feature arguments."""
    rng = tuple(rng_state.tolist()) if dropout_p > 0 else None  # a CPU tensor: no device sync
    return dict(attn_mask=attn_mask, dropout_p=dropout_p, rng=rng, window=(window_left, window_right),
                softcap=softcap, alibi_slopes=alibi_slopes)


@torch.library.custom_op(f"{NAMESPACE}::triton_flash_fwd", mutates_args=())
def triton_flash_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float | None = None, is_causal: bool = False, bottom_right: bool = False,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward; returns out (b, hq, sq, dv) and fp32 lse (b, hq, sq) (before dropout)."""
    check_triton_inputs(q, k, v, is_causal, attn_mask=attn_mask, dropout_p=dropout_p)
    _check_features(q, attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes)
    from ..kernels.triton import flash_fwd

    counters.record_run("triton")
    return flash_fwd(q, k, v, _resolve_scale(q, scale), is_causal, bottom_right,
                     **_features(attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes))


@triton_flash_fwd.register_fake
def _(q, k, v, scale=None, is_causal=False, bottom_right=False, attn_mask=None, dropout_p=0.0, rng_state=None,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    check_triton_inputs(q, k, v, is_causal, cache=False, attn_mask=attn_mask, dropout_p=dropout_p)
    _check_features(q, attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes)
    out = new_attention_output(q, v.shape[-1])
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return out, lse


@torch.library.custom_op(f"{NAMESPACE}::triton_flash_bwd", mutates_args=())
def triton_flash_bwd(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
    scale: float | None = None, is_causal: bool = False, bottom_right: bool = False,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of triton_flash_fwd; dlse is the gradient of its lse output, if any.
    The feature arguments must be the forward's (same rng_state: the same dropout mask)."""
    from ..kernels.triton import flash_bwd

    return flash_bwd(dout, q, k, v, out, lse, _resolve_scale(q, scale), is_causal, bottom_right, dlse,
                     **_features(attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes))


@triton_flash_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, scale=None, is_causal=False, bottom_right=False, attn_mask=None, dropout_p=0.0,
      rng_state=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.custom_op(f"{NAMESPACE}::triton_flash_bwd_out", mutates_args=("dq", "dk", "dv"))
def triton_flash_bwd_out(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None,
    dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    scale: float | None = None, is_causal: bool = False, bottom_right: bool = False,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> None:
    """triton_flash_bwd writing into dq, dk, dv (any strides: e.g. views of one packed qkv gradient)."""
    from ..kernels.triton import flash_bwd

    flash_bwd(dout, q, k, v, out, lse, _resolve_scale(q, scale), is_causal, bottom_right, dlse,
              **_features(attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes),
              dq=dq, dk=dk, dv=dv)


@triton_flash_bwd_out.register_fake
def _(dout, q, k, v, out, lse, dlse, dq, dk, dv, scale=None, is_causal=False, bottom_right=False, attn_mask=None,
      dropout_p=0.0, rng_state=None, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return None


_FEATURES = ("attn_mask", "dropout_p", "rng_state", "window_left", "window_right", "softcap", "alibi_slopes")


def _setup_context(ctx, inputs, output):
    q, k, v, scale, is_causal, bottom_right, *features = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, features[0], features[2], features[6])
    ctx.scale, ctx.is_causal, ctx.bottom_right = scale, is_causal, bottom_right
    ctx.dropout_p, ctx.window_left, ctx.window_right, ctx.softcap = features[1], features[3], features[4], features[5]


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, attn_mask, rng_state, alibi_slopes = ctx.saved_tensors
    dq, dk, dv = triton_flash_bwd(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.is_causal, ctx.bottom_right,
                                  attn_mask, ctx.dropout_p, rng_state, ctx.window_left, ctx.window_right,
                                  ctx.softcap, alibi_slopes)
    return (dq, dk, dv) + (None,) * (3 + len(_FEATURES))


triton_flash_fwd.register_autograd(_backward, setup_context=_setup_context)


_KERNELS: list = []  # the kernels module, imported on first use (importing fa_backend needs no Triton)


def _kernels():
    if not _KERNELS:
        from ..kernels import triton as kernels

        _KERNELS.append(kernels)
    return _KERNELS[0]


def _eager_forward(q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state, window_left,
                   window_right, softcap, alibi_slopes):
    """The op's forward for plain tensors in eager mode: same checks, counters and kernels; (out, lse, feats)."""
    check_triton_inputs(q, k, v, is_causal, attn_mask=attn_mask, dropout_p=dropout_p)
    if (attn_mask is not None or dropout_p or rng_state is not None or window_left != -1 or window_right != -1
            or softcap or alibi_slopes is not None):
        _check_features(q, attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes)
        feats = _features(attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes)
    else:
        feats = {}
    counters.record_run("triton")
    out, lse = _kernels().flash_fwd(q, k, v, _resolve_scale(q, scale), is_causal, bottom_right, **feats)
    return out, lse, feats


class _EagerTritonFlash(torch.autograd.Function):
    """The op's eager twin: same checks, kernels, counters and gradients (bitwise), without the
    torch.library dispatch and custom-op autograd layers, which cost tens of microseconds of Python
    per call (measured: a tiny routed call's host time is what bounds small attention calls)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state,
                window_left, window_right, softcap, alibi_slopes):
        out, lse, feats = _eager_forward(q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state,
                                         window_left, window_right, softcap, alibi_slopes)
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi_slopes)
        ctx.scale, ctx.is_causal, ctx.bottom_right, ctx.feats = scale, is_causal, bottom_right, feats
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, alibi_slopes = ctx.saved_tensors
        feats = dict(ctx.feats, attn_mask=attn_mask, alibi_slopes=alibi_slopes) if ctx.feats else {}
        dq, dk, dv = _kernels().flash_bwd(dout, q, k, v, out, lse, _resolve_scale(q, ctx.scale), ctx.is_causal,
                               ctx.bottom_right, dlse, **feats)
        return (dq, dk, dv) + (None,) * (3 + len(_FEATURES))


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain(*tensors) -> bool:
    return all(t is None or type(t) in _PLAIN_TENSORS for t in tensors)


def triton_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float | None = None, is_causal: bool = False, bottom_right: bool = False, *,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
    window_left: int = -1, window_right: int = -1, softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of our Triton kernels, differentiable in q, k and v.

    Under torch.compile and for tensor subclasses (fake, functional, ...) this is the custom op
    fa_backend::triton_flash_fwd; for plain tensors in eager mode its autograd.Function twin.
    With dropout_p > 0 and no rng_state, a fresh one is drawn (new_rng_state: torch's CPU generator).
    """
    if dropout_p > 0 and rng_state is None:
        rng_state = new_rng_state()
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        # Checked here: inside the autograd.Function / op, grad mode no longer tells.
        check_triton_inputs(q, k, v, is_causal, cache=False, attn_mask=attn_mask, dropout_p=dropout_p)
    args = (q, k, v, scale, is_causal, bottom_right, attn_mask, float(dropout_p), rng_state,
            int(window_left), int(window_right), float(softcap), alibi_slopes)
    if torch.compiler.is_compiling() or not _plain(q, k, v, attn_mask, alibi_slopes):
        return triton_flash_fwd(*args)
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        out, lse, _ = _eager_forward(*args)  # nothing to differentiate: no autograd.Function layer
        return out, lse
    return _EagerTritonFlash.apply(*args)
