"""Measured speed preferences: where a lower-priority backend is known to be faster.

The default order tries our kernels first. A rule here says that on some GPU, for some class of
calls, PyTorch's own fused kernel has been measured faster than one of ours; the dispatcher then
passes over ours for that call with reason `slower` (and the measurement in the message), so that
enabling fa_backend never makes such a call slower. Rules are data: each names the call class, the
backend passed over, the one that runs, and the evidence. An explicit `sdpa_backends([...])` order
is the user's and is followed as given.

Rules read metadata only. In eager mode the router also asks PyTorch which kernel it would pick
for the actual tensors (once per shape): if that is not the kernel the evidence is about (e.g. cuDNN
refuses this mask layout), our kernel runs after all. Compiled code cannot ask, and follows the rule.

Two kinds of evidence: kernel speed on a given GPU (cuDNN on the H200), and host time per call, which
decides host-bound calls on any GPU (PyTorch's C++ path launches a tiny call in less host time than our
Python launcher).
"""

from __future__ import annotations

import dataclasses

import torch

from .call import AttentionCall
from .reasons import Reason, ReasonCode


@torch.compiler.assume_constant_result
def _cudnn_sdp_enabled() -> bool:
    """PyTorch's cuDNN SDPA switch (read once per trace: Dynamo cannot trace the C getter)."""
    return bool(torch.backends.cuda.cudnn_sdp_enabled())


# PyTorch's fused kernels (what pytorch_choice names them) that run without our per-call Python.
FUSED_CHOICES = frozenset({"flash_attention", "efficient_attention", "cudnn_attention"})


@dataclasses.dataclass(frozen=True)
class FasterPeer:
    """PyTorch's `kernel` beats our `backend` on calls of this class (None: any value of that field)."""

    backend: str
    kernel: str
    capabilities: frozenset[tuple[int, int]] | None
    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int] | None
    evidence: str
    masks: bool = False  # also calls with an attn_mask (bool or additive)
    dropout: bool = False  # also calls with dropout_p > 0
    max_fwd_flops: int | None = None  # only calls with fewer forward FLOPs (fwd_flops)
    choices: frozenset[str] = frozenset({"cudnn_attention"})  # PyTorch's own picks the evidence is about

    def applies(self, call: AttentionCall) -> bool:
        return (call.device_type == "cuda" and (self.capabilities is None or call.capability in self.capabilities)
                and call.dtype in self.dtypes and call.head_dim == call.head_dim_v
                and (self.head_dims is None or call.head_dim in self.head_dims)
                and (call.mask_kind == "none" or self.masks) and (call.dropout_p == 0.0 or self.dropout)
                and call.heads_q == call.heads_kv
                and not (call.is_causal and call.seqlen_q != call.seqlen_k)
                and call.shapes_consistent and not call.subclass
                and (self.max_fwd_flops is None or fwd_flops(call) < self.max_fwd_flops)
                and (self.choices != CUDNN_ONLY or _cudnn_sdp_enabled()))

    def reason(self) -> Reason:
        return Reason(ReasonCode.SLOWER, f"PyTorch's {self.kernel} kernel is faster here ({self.evidence}); "
                                         f"force ours with fa_backend.sdpa_backends(['{self.backend}', ...])")


CUDNN_ONLY = frozenset({"cudnn_attention"})


def fwd_flops(call: AttentionCall) -> int:
    """Forward FLOPs of the call without causal savings: 2 * b * hq * sq * sk * (d + dv)."""
    return 2 * call.batch * call.heads_q * call.seqlen_q * call.seqlen_k * (call.head_dim + call.head_dim_v)


# Below this many forward FLOPs a call is host-bound: at the ~100-500 TFLOP/s of the H200 kernels it is
# 2-10 µs of GPU work, less than the per-call host time our Triton path costs beyond PyTorch's C++ path
# (tens of µs: docs/benchmarks.md, "Host overhead").
TINY_FWD_FLOPS = 1 << 30

PREFERENCES: tuple[FasterPeer, ...] = (
    # docs/benchmarks.md, "nn modules with routing on" (H200, torch 2.11): one tiny call (b=1, s=16, d=32)
    # through our Triton kernel took 250 µs per nn.MultiheadAttention call against 74 µs on PyTorch's path;
    # "Host overhead": our op 89.5 µs of host time per call, PyTorch's SDPA 18.4 µs. Any GPU: host cost.
    FasterPeer(backend="triton", kernel="fused SDPA", capabilities=None,
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=None, masks=True, dropout=True,
               max_fwd_flops=TINY_FWD_FLOPS, choices=FUSED_CHOICES,
               evidence=f"a host-bound call (under {TINY_FWD_FLOPS:.2e} forward FLOPs): PyTorch's C++ path "
                        "costs less host time per call than our Triton launch"),
    # The H200 runs of docs/benchmarks.md (torch 2.11, triton 3.6): PyTorch picks cuDNN for these calls
    # on sm90 and it ran 1.06-1.43x our Triton forward and 1.23-1.69x our backward (d=64/128,
    # seqlen 512-16k), and was faster inside nn.MultiheadAttention at seqlen 128 too.
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({64, 128}),
               evidence="H200, torch 2.11: cuDNN 1.06-1.43x our Triton forward, 1.23-1.69x backward"),
    # docs/benchmarks.md, masks and dropout (d=128, seqlen 2k-16k): cuDNN 2.1-2.9x our Triton
    # forward and 1.8-4.3x backward with a causal mask, a key-padding mask or dropout 0.1.
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}), masks=True,
               dropout=True, evidence="H200, torch 2.11, d=128: cuDNN 2.1-2.9x our Triton forward and 1.8-4.3x "
                                      "backward with masks or dropout"),
)


def peer_for(backend: str, call: AttentionCall) -> FasterPeer | None:
    """The rule that passes over an eligible `backend` for this call, or None."""
    for rule in PREFERENCES:
        if rule.backend == backend and rule.applies(call):
            return rule
    return None


def slower_than_peer(backend: str, call: AttentionCall) -> Reason | None:
    """The reason to pass over an eligible `backend` for this call, or None."""
    rule = peer_for(backend, call)
    return None if rule is None else rule.reason()


__all__ = ["FUSED_CHOICES", "PREFERENCES", "TINY_FWD_FLOPS", "FasterPeer", "fwd_flops", "peer_for", "slower_than_peer"]
