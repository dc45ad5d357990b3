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
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = True,
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
        attn_mask: bool (True = attend) or additive float mask (the query dtype or float32), any
            shape broadcastable to (batch, heads_q, seqlen_q, seqlen_k); combinable with
            ``is_causal``. Never differentiated (a mask requiring grad is rejected). Rows with no
            visible key output zeros with zero gradients (PyTorch's math backend).
        dropout_p: dropout on the attention probabilities, applied whenever > 0 (as SDPA, even in
            eval), scaled by 1 / (1 - p); reproducible under ``torch.manual_seed``.
        window_size: (left, right) sliding window, FlashAttention-2 semantics: query i sees keys
            i + sk - sq - left ... i + sk - sq + right; -1 = unbounded.
        softcap: > 0 replaces the scaled scores s by ``softcap * tanh(s / softcap)`` (FA2).
        alibi_slopes: fp32 (heads_q,) or (batch, heads_q): bias -slope * |i + sk - sq - j| (FA2).
        deterministic: accepted for FlashAttention compatibility; the backward is always
            deterministic (no atomics), so this changes nothing.

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
    out, _ = triton_flash_attention(q, k, v, scale, bool(is_causal), bool(is_causal) and causal_alignment == "bottom_right",
                                    attn_mask=attn_mask, dropout_p=dropout_p, window_left=window_size[0],
                                    window_right=window_size[1], softcap=softcap, alibi_slopes=alibi_slopes)
    return out
