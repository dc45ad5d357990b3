"""Output layouts shared by the kernels and the ops' fake implementations (torch only)."""

from __future__ import annotations

import torch


def new_attention_output(q: torch.Tensor, dv: int) -> torch.Tensor:
    """Uninitialised (b, h, sq, dv) output viewed over (b, sq, h, dv) memory.

    This is PyTorch's flash-attention output layout: `out.transpose(1, 2).reshape(b, sq, h * dv)`,
    the usual next step in a model, is then a free view.
    """
    b, h, s, _ = q.shape
    # empty_strided: one allocation call (new_empty + transpose costs twice the host time)
    return torch.empty_strided((b, h, s, dv), (s * h * dv, dv, h * dv, 1), dtype=q.dtype, device=q.device)
