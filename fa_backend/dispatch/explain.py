"""fa_backend.explain: which backend would run a call, and why each other one would not."""

from __future__ import annotations

import dataclasses

import torch

from .backends import BACKENDS, PRIORITY, pytorch_choice
from .call import AttentionCall
from .preference import slower_than_peer
from .reasons import Reason, ReasonCode
from .state import allowed_backends


@dataclasses.dataclass(frozen=True)
class Explanation:
    """`backend` runs the call (None if no allowed backend can); `reasons` has every backend's."""

    call: AttentionCall
    backend: str | None
    reasons: dict[str, tuple[Reason, ...]]
    order: tuple[str, ...]
    pytorch_kernel: str | None = None

    def __str__(self) -> str:
        lines = [self.call.describe()]
        width = max(len(n) for n in self.reasons)
        for name in self.order:
            reasons = self.reasons[name]
            if name == self.backend:
                extra = f" (PyTorch would pick: {self.pytorch_kernel})" if name == "torch" and self.pytorch_kernel else ""
                lines.append(f"  {name:<{width}}  RUNS{extra}")
            elif not reasons:
                lines.append(f"  {name:<{width}}  eligible (lower priority)")
            else:
                lines.append(f"  {name:<{width}}  no: " + "; ".join(str(r) for r in reasons))
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
    for name in PRIORITY:
        own = tuple(BACKENDS[name].why_not(call))
        slower = slower_than_peer(name, call) if allowed is None and not own else None
        if slower is not None:
            own = (slower,)
        if name not in order:
            own = (Reason(ReasonCode.DISABLED_BY_USER, "not in the sdpa_backends() restriction"),) + own
        reasons[name] = own
    backend = next((n for n in order if not reasons[n]), None)
    listed = tuple(order) + tuple(n for n in PRIORITY if n not in order)
    choice = pytorch_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa) \
        if backend == "torch" else None
    return Explanation(call, backend, reasons, listed, choice)
