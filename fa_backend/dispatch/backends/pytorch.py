"""PyTorch's own SDPA as backends: `torch` (its fused kernels, as it picks) and `math`."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..call import AttentionCall
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
    def run(cls, call, sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
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
