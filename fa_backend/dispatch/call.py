"""AttentionCall: the metadata of one attention call, built without reading tensor values."""

from __future__ import annotations

import dataclasses
import functools

import torch

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


@functools.cache
def _capability(device_type: str, index: int | None) -> tuple[int, int] | None:
    if device_type != "cuda":
        return None
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, cached; None for other devices."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else None)
    return _capability(device.type, index)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """Shapes in SDPA layout: q (b, hq, sq, d), k (b, hkv, sk, d), v (b, hkv, sk, dv)."""

    device_type: str
    capability: tuple[int, int] | None
    dtype: torch.dtype
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    is_causal: bool = False
    causal_alignment: str = "top_left"
    scale: float | None = None
    requires_grad: bool = False

    @property
    def gqa_group(self) -> int:
        return self.heads_q // self.heads_kv if self.heads_kv else 0

    def describe(self) -> str:
        causal = f", causal={self.causal_alignment}" if self.is_causal else ""
        return (f"attention(q={self.batch}x{self.heads_q}x{self.seqlen_q}x{self.head_dim}, "
                f"k/v heads={self.heads_kv}, sk={self.seqlen_k}, dv={self.head_dim_v}, "
                f"dtype={self.dtype}, device={self.device_type}{causal})")


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_alignment: str = "top_left") -> None:
    """Raise ValueError for malformed input (wrong ranks, mismatched shapes, dtypes or devices)."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"expected {name} to be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"expected {name} of shape (batch, heads, seqlen, head_dim), got {t.dim()}-D shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"expected query, key and value to have the same dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"expected query, key and value on the same device, got {q.device}, {k.device} and {v.device}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"expected the same batch size, got query {q.shape[0]}, key {k.shape[0]}, value {v.shape[0]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"expected key and value with the same heads and seqlen, got key {tuple(k.shape)} and value {tuple(v.shape)}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"expected query and key with the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    hq, hkv = q.shape[1], k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"number of query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, got {causal_alignment!r}")


def describe_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                  causal_alignment: str = "top_left", scale: float | None = None) -> AttentionCall:
    """Build the AttentionCall of validated tensors (metadata only: works on meta/fake tensors)."""
    b, hq, sq, d = q.shape
    return AttentionCall(
        device_type=q.device.type,
        capability=device_capability(q.device),
        dtype=q.dtype,
        batch=b, heads_q=hq, heads_kv=k.shape[1], seqlen_q=sq, seqlen_k=k.shape[2],
        head_dim=d, head_dim_v=v.shape[3],
        is_causal=bool(is_causal), causal_alignment=causal_alignment, scale=scale,
        requires_grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
    )
