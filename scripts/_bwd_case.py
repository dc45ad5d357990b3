"""One backward timing case shared by the backward scripts (time_bwd_ws.py, time_bwd_split.py): the inputs, our
forward's output and LSE, and the peers' (cuDNN, SDPA-flash) backwards through autograd."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa_backend.kernels.triton.flash_fwd import flash_fwd


@dataclass
class BackwardCase:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    out: torch.Tensor  # our forward's
    lse: torch.Tensor
    flops: float  # of the backward: 2.5x the forward's
    ref: tuple  # cuDNN's gradients, the reference of the max-difference column
    peers: dict[str, Callable[[], tuple]]  # "cudnn", "sdpa_flash": their backward through autograd


def backward_case(d: int, s: int, causal: bool, gqa: int = 1) -> BackwardCase:
    """bf16, (b, s, h, d) layout transposed to (b, h, s, d), batch 16384 / s, heads 2048 / d (query heads; key /
    value heads h / gqa)."""
    b, h = 16384 // s, 2048 // d

    def make(heads):
        return torch.randn(b, s, heads, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)

    q, k, v, do = make(h), make(h // gqa), make(h // gqa), make(h)
    out, lse = flash_fwd(q, k, v, d ** -0.5, causal, False)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    outs = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            outs[name] = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=gqa > 1)
    peers = {name: (lambda o=o: torch.autograd.grad(o, leaves, do, retain_graph=True)) for name, o in outs.items()}
    return BackwardCase(q, k, v, do, out, lse, 2.5 * 4 * b * h * s * s * d / (2 if causal else 1),
                        peers["cudnn"](), peers)
