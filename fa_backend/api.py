"""The public attention function."""

from __future__ import annotations

import torch

from .dispatch.call import CAUSAL_ALIGNMENTS
from .ops import triton_flash_attention


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    scale: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention on fused kernels, in SDPA layout.

    Args:
        q: (batch, heads_q, seqlen_q, head_dim), fp16 or bf16, any strides.
        k: (batch, heads_kv, seqlen_k, head_dim); heads_q must be a multiple of heads_kv (GQA/MQA).
        v: (batch, heads_kv, seqlen_k, head_dim_v); head_dim_v may differ from head_dim.
        is_causal: mask out keys after each query's position.
        causal_alignment: "top_left" (query i sees keys j <= i, as SDPA's ``is_causal``) or
            "bottom_right" (query i sees keys j <= i + seqlen_k - seqlen_q, as FlashAttention's
            ``causal``). Rows that see no key output zeros.
        scale: softmax scale; ``None`` means ``1 / sqrt(head_dim)``.

    Returns:
        (batch, heads_q, seqlen_q, head_dim_v) in the input dtype. Differentiable in q, k and v.

    Raises:
        ValueError: malformed input (ranks, shapes, dtypes or devices that do not match).
        BackendUnsupportedError: (a NotImplementedError, hence a RuntimeError) valid input the
            kernels do not support, e.g. fp32, listing every reason.
    """
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got {causal_alignment!r}")
    # The op checks the tensors (ValueError / BackendUnsupportedError), once per shape.
    out, _ = triton_flash_attention(q, k, v, scale, bool(is_causal), bool(is_causal) and causal_alignment == "bottom_right")
    return out
