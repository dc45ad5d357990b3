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


@dataclasses.dataclass(frozen=True)
class FasterPeer:
    """On `capabilities`, PyTorch's `kernel` beats our `backend` on calls of this class."""

    backend: str
    kernel: str
    capabilities: frozenset[tuple[int, int]]
    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int]
    evidence: str
    masks: bool = False  # also calls with an attn_mask (bool or additive)
    dropout: bool = False  # also calls with dropout_p > 0
    choice: str = "cudnn_attention"  # PyTorch's own pick (pytorch_choice) that the evidence is about

    def applies(self, call: AttentionCall) -> bool:
        return (call.device_type == "cuda" and call.capability in self.capabilities and call.dtype in self.dtypes
                and call.head_dim == call.head_dim_v and call.head_dim in self.head_dims
                and (call.mask_kind == "none" or self.masks) and (call.dropout_p == 0.0 or self.dropout)
                and call.heads_q == call.heads_kv
                and not (call.is_causal and call.seqlen_q != call.seqlen_k)
                and call.shapes_consistent and not call.subclass and _cudnn_sdp_enabled())

    def reason(self) -> Reason:
        return Reason(ReasonCode.SLOWER, f"PyTorch's {self.kernel} kernel is faster here ({self.evidence}); "
                                         f"force ours with fa_backend.sdpa_backends(['{self.backend}', ...])")


# The H200 runs of docs/benchmarks.md (torch 2.11, triton 3.6): PyTorch picks cuDNN for these calls
# on sm90 and it ran 1.06-1.43x our Triton forward and 1.23-1.69x our backward (d=64/128,
# seqlen 512-16k), and was faster inside nn.MultiheadAttention at seqlen 128 too.
PREFERENCES: tuple[FasterPeer, ...] = (
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({64, 128}),
               evidence="H200, torch 2.11: cuDNN 1.06-1.43x our Triton forward, 1.23-1.69x backward"),
    # docs/benchmarks.md, masks and dropout (d=128, seqlen 2k-16k): cuDNN 2.1-2.9x our Triton
    # forward and 1.8-4.3x backward with a causal mask, a key-padding mask or dropout 0.1.
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}), masks=True,
               dropout=True, evidence="H200, torch 2.11, d=128: cuDNN 2.1-2.9x our Triton forward and 1.8-4.3x "
                                      "backward with masks or dropout"),
    # docs/benchmarks.md, "Decode (KV cache)" (H200, torch 2.11, bf16, hq=32, hkv 8 and 32, d=128, one query,
    # no mask): our split-KV decode kernel ran at 0.62-1.02x cuDNN's speed as CUDA-graph replays (hkv=32:
    # 0.86-1.02x; eager 0.31-1.02x). Routed decode calls (sq <= 16) look up rules for "triton_decode" first
    # (dispatch/select.py), then the "triton" rules above. This rule's class is the measured one (sm90,
    # fp16/bf16, d=128, no mask) as far as FasterPeer.applies can say it: hq == hkv only (the GQA rows,
    # hkv=8, 0.62-0.95x, still run our kernel), no causal unless sq == sk, and every decode sq <= 16
    # (no query-length field; sq 2-16 is unmeasured, and the first rule above covers those calls anyway).
    FasterPeer(backend="triton_decode", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}),
               evidence="H200, torch 2.11, bf16, hq=32, d=128, one query token: our split-KV decode kernel "
                        "0.62-1.02x cuDNN"),
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


__all__ = ["PREFERENCES", "FasterPeer", "peer_for", "slower_than_peer"]
