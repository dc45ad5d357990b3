"""PyTorch's own SDPA as backends: `torch` (its fused kernels, as it picks) and `math`."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..call import AttentionCall
from ..preference import fwd_flops
from ..reasons import Reason, ReasonCode
from .base import Backend


class TorchBackend(Backend):
    """Hands the call to PyTorch unchanged: it picks flash / cuDNN / efficient (or its math path).

    PyTorch's own choice depends on checks that break torch.compile graphs, so eligibility here is
    by device only; `fa_backend.explain` reports which kernel PyTorch itself would pick (eager).
    """

    NAME = "torch"
    DEVICES = frozenset({"cuda", "cpu", "xpu", "mps"})

    @classmethod
    def why_not(cls, call: AttentionCall) -> list[Reason]:
        reasons = []
        if call.device_type not in cls.DEVICES:
            reasons.append(Reason(ReasonCode.DEVICE, f"device={call.device_type} (PyTorch has fused SDPA kernels for: "
                                                     f"{', '.join(sorted(cls.DEVICES))})"))
        if call.ranks == (4, 4, 4) and not (call.shapes_consistent and call.same_dtype and call.same_device):
            # Seen on torch 2.11: the second malformed call into the fused CUDA path crashed the process.
            reasons.append(Reason(ReasonCode.LAYOUT, "query, key and value do not fit together: PyTorch's math "
                                                     "backend reports the error"))
        return reasons

    @classmethod
    def eager_runner(cls, call: AttentionCall, kernel: str | None):
        return _run_sdpa

    @classmethod
    def run(cls, call, sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return _run_sdpa(sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _run_sdpa(sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if scale is None and not enable_gqa:  # keyword arguments cost the binding ~1 µs per call
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal)
    return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


class MathBackend(Backend):
    """PyTorch's math SDPA: runs anything PyTorch accepts; the last resort."""

    NAME = "math"

    @classmethod
    def why_not(cls, call: AttentionCall) -> list[Reason]:
        return []

    @classmethod
    def run(cls, call, sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        with sdpa_kernel([SDPBackend.MATH]):
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def pytorch_choice(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask=None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> str | None:
    """The SDPA kernel PyTorch would pick for these tensors (eager only; None if unknown)."""
    if q.device.type not in ("cuda", "cpu"):
        return None
    try:
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    except (RuntimeError, TypeError, AttributeError):
        return None
    try:
        return SDPBackend(choice).name.lower()
    except ValueError:
        return str(choice)


# Forward FLOPs below which PyTorch's memory-efficient kernel runs a call in well under a µs of GPU time
# (2**26 at its ~130 TFLOP/s on an H200): the call's cost is host time, and that kernel's own op has the least
# (H200, torch 2.11, b=1 h=1 s=16 d=64: efficient op 13.1 µs, cuDNN op 18.5, flash op 18.7, SDPA 19.6;
# docs/benchmarks.md, "Host overhead").
DIRECT_EFFICIENT_MAX_FLOPS = 1 << 26


def _efficient(sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    if scale is None:  # a keyword argument costs the binding a fraction of a µs
        return torch._scaled_dot_product_efficient_attention(q, k, v, None, False, 0.0, is_causal)[0]
    return torch._scaled_dot_product_efficient_attention(q, k, v, None, False, 0.0, is_causal, scale=scale)[0]


def direct_runner(call: AttentionCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  scale: float | None):
    """For an eager CUDA forward call without mask, dropout or GQA that the `torch` backend runs: a runner
    (run()'s arguments after `call`) calling PyTorch's memory-efficient kernel through its own op, or None (the
    call goes through SDPA, which picks). Only for calls of negligible GPU work (DIRECT_EFFICIENT_MAX_FLOPS),
    where host time is the cost and that op has the least of it, and where PyTorch accepts the kernel (its
    flags and input checks, asked once per cached decision). The results are SDPA's on that kernel: it is the
    op SDPA calls. (On CPU, calling SDPA's CPU kernel directly saved nothing: not done.)"""
    if (call.requires_grad or call.mask_kind != "none" or call.dropout_p or call.subclass or call.ranks != (4, 4, 4)
            or not (call.shapes_consistent and call.same_dtype and call.same_device)
            or call.heads_q != call.heads_kv or call.head_dim != call.head_dim_v
            or 0 in (call.batch, call.heads_q, call.seqlen_q, call.seqlen_k, call.head_dim)):
        return None
    if call.device_type != "cuda" or fwd_flops(call) > DIRECT_EFFICIENT_MAX_FLOPS:
        return None
    can_use = getattr(torch.backends.cuda, "can_use_efficient_attention", None)
    params = getattr(torch.backends.cuda, "SDPAParams", None)
    if can_use is None or params is None:
        return None
    try:
        ok = can_use(params(q, k, v, None, 0.0, bool(is_causal), False), False)
    except (RuntimeError, TypeError):
        return None
    return _efficient if ok else None
