"""fa_backend.explain: which backend would run a call, and why each other one would not."""

from __future__ import annotations

import dataclasses

import torch

from .backends import BACKENDS, PRIORITY, pytorch_choice
from .backends.pytorch import direct_runner
from .call import AttentionCall
from .reasons import Reason, ReasonCode
from .select import slower_reason
from .state import allowed_backends


@dataclasses.dataclass(frozen=True)
class Explanation:
    """`backend` runs the call (None if no allowed backend can); `reasons` has every backend's.

    `kernels` names the kernel each backend would run the call on (for triton: "triton", the dense
    kernel, or "triton_decode", the split-KV decode kernel) and `kernel_reasons` why that is not the
    backend's preferred kernel for the call (e.g. a decode call that needs grad runs the dense kernel).
    """

    call: AttentionCall
    backend: str | None
    reasons: dict[str, tuple[Reason, ...]]
    order: tuple[str, ...]
    pytorch_kernel: str | None = None
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)
    kernel_reasons: dict[str, tuple[Reason, ...]] = dataclasses.field(default_factory=dict)

    def _label(self, name: str) -> str:
        """The backend's name, with its kernel for decode calls, e.g. "triton (split-KV decode)"."""
        labels = BACKENDS[name].KERNEL_LABELS
        kernel = self.kernels.get(name, name)
        return f"{name} ({labels[kernel]})" if self.call.kind == "decode" and kernel in labels else name

    def __str__(self) -> str:
        lines = [self.call.describe()]
        labels = {name: self._label(name) for name in self.order}
        width = max(len(label) for label in labels.values())
        for name in self.order:
            reasons = self.reasons[name]
            if name == self.backend:
                extra = f" (PyTorch would pick: {self.pytorch_kernel})" if name == "torch" and self.pytorch_kernel else ""
                lines.append(f"  {labels[name]:<{width}}  RUNS{extra}")
            elif not reasons:
                lines.append(f"  {labels[name]:<{width}}  eligible (lower priority)")
            else:
                lines.append(f"  {labels[name]:<{width}}  no: " + "; ".join(str(r) for r in reasons))
            eligible = all(r.code is ReasonCode.SLOWER for r in reasons)
            kernel_reasons = self.kernel_reasons.get(name)
            if eligible and kernel_reasons and self.call.kind == "decode":
                passed_over = [label for kernel, label in BACKENDS[name].KERNEL_LABELS.items()
                               if kernel != self.kernels.get(name)]
                lines.append(f"  {'':<{width}}    ({', '.join(passed_over)} kernel not used: "
                             + "; ".join(str(r) for r in kernel_reasons) + ")")
        if self.backend is None:
            lines.append("  -> no allowed backend can run this call (sdpa_backends restriction)")
        return "\n".join(lines)


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
            dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
            *, causal_alignment: str = "top_left") -> Explanation:
    """Explain the routing of `F.scaled_dot_product_attention(query, key, value, ...)`.

    Works on real tensors and on shape-only ones (device="meta": then every device-bound backend
    says so). Honours the current `sdpa_backends` restriction; backends outside it are listed with
    reason `disabled_by_user`.
    """
    call = AttentionCall.from_tensors(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                      causal_alignment=causal_alignment)
    allowed = allowed_backends()
    order = allowed if allowed is not None else PRIORITY
    reasons: dict[str, tuple[Reason, ...]] = {}
    kernels: dict[str, str] = {}
    kernel_reasons: dict[str, tuple[Reason, ...]] = {}
    for name in PRIORITY:
        kernels[name], kernel_reasons[name] = BACKENDS[name].kernel_for(call)
        own = tuple(BACKENDS[name].why_not(call))
        slower = slower_reason(name, call) if allowed is None and not own else None
        if slower is not None:
            own = (slower,)
        if name not in order:
            own = (Reason(ReasonCode.DISABLED_BY_USER, "not in the sdpa_backends() restriction"),) + own
        reasons[name] = own
    backend = next((n for n in order if not reasons[n]), None)
    listed = tuple(order) + tuple(n for n in PRIORITY if n not in order)
    choice = None
    if backend == "torch":
        # eager routed calls of negligible GPU work call PyTorch's efficient kernel's op themselves
        direct = direct_runner(call, query, key, value, is_causal, scale) is not None
        choice = ("efficient_attention (its own op, called by the router: a host-bound forward call)" if direct
                  else pytorch_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa))
    return Explanation(call, backend, reasons, listed, choice, kernels, kernel_reasons)
