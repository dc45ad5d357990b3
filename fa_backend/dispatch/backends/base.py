"""What every backend provides: a stable NAME, why_not(call) and run(...)."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from ..call import AttentionCall
from ..reasons import Reason, ReasonCode


def mask_call_reasons(call: AttentionCall) -> list[Reason]:
    """What every fused backend of ours refuses about a call that has an attn_mask, whatever its kind: the mask
    together with is_causal, a shape that does not broadcast, another device, a mask that requires grad."""
    reasons = []
    if call.is_causal:
        reasons.append(Reason(ReasonCode.MASK, "attn_mask together with is_causal=True (PyTorch's backends "
                                               "disagree on it; left to PyTorch)"))
    if not call.mask_broadcastable:
        reasons.append(Reason(ReasonCode.MASK, f"attn_mask shape={list(call.mask_shape or ())} does not broadcast to "
                                               f"{[call.batch, call.heads_q, call.seqlen_q, call.seqlen_k]} "
                                               "(PyTorch reports the error)"))
    if not call.mask_same_device:
        reasons.append(Reason(ReasonCode.DEVICE, "attn_mask is on another device than the query"))
    if call.mask_requires_grad:
        reasons.append(Reason(ReasonCode.GRAD, "attn_mask requires grad (the kernels compute no mask gradient)"))
    return reasons


def input_reasons(call: AttentionCall) -> list[Reason]:
    """The rules every fused-kernel backend applies to the inputs themselves: plain tensors, 4-D
    (batch, heads, seqlen, head_dim), shapes that fit together, one device."""
    reasons: list[Reason] = []
    if call.subclass:
        reasons.append(Reason(ReasonCode.LAYOUT, "tensor subclass inputs (DTensor, NestedTensor, ...) are left to PyTorch"))
    if call.ranks != (4, 4, 4):
        reasons.append(Reason(ReasonCode.LAYOUT, f"ranks={call.ranks} (supported: 4-D (batch, heads, seqlen, head_dim))"))
    elif not call.shapes_consistent:
        reasons.append(Reason(ReasonCode.LAYOUT, "query, key and value shapes do not fit together (PyTorch reports the error)"))
    if not call.same_device:
        reasons.append(Reason(ReasonCode.DEVICE, "query, key and value are on different devices"))
    return reasons


class Backend:
    """Backends are classes with classmethods only; limits are class attributes (data)."""

    NAME: ClassVar[str]
    # Human labels of the backend's kernels, by kernel name, for a backend with more than one.
    KERNEL_LABELS: ClassVar[dict[str, str]] = {}

    @classmethod
    def why_not(cls, call: AttentionCall) -> list[Reason]:
        """Every reason this backend cannot run `call`; empty when it can."""
        raise NotImplementedError

    @classmethod
    def kernel_for(cls, call: AttentionCall) -> tuple[str, tuple[Reason, ...]]:
        """The kernel this backend would run `call` on (its key in stats()["runs"]; measured-speed rules
        may name it) and every reason its preferred kernel for the call is not that one (empty when it
        is). A backend with one kernel returns its own name."""
        return cls.NAME, ()

    @classmethod
    def eager_runner(cls, call: AttentionCall, kernel: str | None):
        """A callable taking run()'s arguments after `call`, for eager calls described by `call` that this
        backend runs on `kernel` (the router caches it with its decision, so per-call work that only
        depends on the description is done once)."""
        return functools.partial(cls.run, call)

    @classmethod
    def run(cls, call: AttentionCall, sdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None,
            enable_gqa: bool) -> torch.Tensor:
        """Run an eligible call. `sdpa` is the intercepted PyTorch function (used by fallbacks)."""
        raise NotImplementedError
