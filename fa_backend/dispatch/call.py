"""AttentionCall: the metadata of one attention call, built without reading tensor values.

Only metadata is read (device, dtype, shapes, strides, flags), so the same description comes out
of real tensors, FakeTensors under torch.compile and meta tensors, with no device sync.
"""

from __future__ import annotations

import dataclasses

import torch

from .._device import device_capability

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
MASK_KINDS = ("none", "bool", "additive")
# Calls with at most this many queries are decode calls (a generation step, e.g. with a static KV cache):
# the split-KV kernel's domain (kernels/triton/decode.py), which spreads the keys over the GPU instead.
DECODE_MAX_SEQLEN_Q = 16


def _plain_tensor_types() -> tuple[type, ...]:
    # Tensors PyTorch itself substitutes while tracing (fake, functional) are not user subclasses.
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return (torch.Tensor, torch.nn.Parameter, FakeTensor, FunctionalTensor)


# Built at import, not on the first call: filled lazily inside a torch.compile trace, the list's mutation was a side
# effect Dynamo guarded on (the process's first compiled call recompiled on its second run) and replayed on restart
# (SpeculationLogDivergence with dynamic=True); seen on the H200 under pytest-xdist, where no eager call came first.
_PLAIN_TYPES: tuple[type, ...] = _plain_tensor_types()


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One call in SDPA terms: q (b, hq, sq, d), k (b, hkv, sk, d), v (b, hkv, sk, dv).

    Shape fields of non-4-D inputs are left at 0; `ranks` tells. `shapes_consistent` is False when
    q, k and v do not fit together (batch, heads, seqlens, head dims): PyTorch then raises its error.
    """

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
    mask_kind: str = "none"
    mask_shape: tuple[int, ...] | None = None
    mask_dtype: torch.dtype | None = None
    mask_requires_grad: bool = False
    mask_same_device: bool = True
    # the mask has no query dim (rank < 2, or size 1 or stride 0 there): one row of keys per (batch, head)
    mask_key_only: bool = False
    dropout_p: float = 0.0
    scale: float | None = None
    enable_gqa: bool = False
    requires_grad: bool = False
    ranks: tuple[int, int, int] = (4, 4, 4)
    shapes_consistent: bool = True
    same_dtype: bool = True
    same_device: bool = True
    subclass: bool = False
    kv_last_dim_contiguous: bool = True  # key and value have stride 1 on head_dim
    # q, k and v as TMA reads them: stride 1 on head_dim, every other stride and the storage offset a
    # multiple of 16 bytes (the CuTe kernels' loads)
    tma_aligned: bool = True

    @property
    def kind(self) -> str:
        """"decode" for a short query (4-D, seqlen_q <= DECODE_MAX_SEQLEN_Q), else "dense"."""
        return "decode" if self.ranks == (4, 4, 4) and self.seqlen_q <= DECODE_MAX_SEQLEN_Q else "dense"

    @property
    def mask_broadcastable(self) -> bool:
        """The mask's shape broadcasts to (batch, heads_q, seqlen_q, seqlen_k) (at most 4-D)."""
        if self.mask_shape is None:
            return True
        full = (self.batch, self.heads_q, self.seqlen_q, self.seqlen_k)
        if len(self.mask_shape) > 4:
            return False
        return all(m in (1, f) for m, f in zip(reversed(self.mask_shape), reversed(full)))

    @property
    def gqa_group(self) -> int:
        return self.heads_q // self.heads_kv if self.heads_kv else 0

    def describe(self) -> str:
        causal = f", causal={self.causal_alignment}" if self.is_causal else ""
        mask = f", mask={self.mask_kind}{list(self.mask_shape or ())}" if self.mask_kind != "none" else ""
        drop = f", dropout_p={self.dropout_p}" if self.dropout_p else ""
        kind = ", decode" if self.kind == "decode" else ""
        return (f"attention(q={self.batch}x{self.heads_q}x{self.seqlen_q}x{self.head_dim}, "
                f"k/v heads={self.heads_kv}, sk={self.seqlen_k}, dv={self.head_dim_v}, "
                f"dtype={self.dtype}, device={self.device_type}{causal}{mask}{drop}{kind})")

    def shape_class(self) -> str:
        """A coarse label for logs: what selects kernels, not every seqlen."""
        return (f"{self.device_type}/{str(self.dtype).replace('torch.', '')}/d{self.head_dim}"
                f"{'' if self.head_dim_v == self.head_dim else f'-dv{self.head_dim_v}'}/h{self.heads_q}:{self.heads_kv}")

    @classmethod
    def from_tensors(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                     dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False, causal_alignment: str = "top_left") -> AttentionCall:
        """Describe a call from its arguments (SDPA's, plus FlashAttention's causal alignment)."""
        ranks = (q.dim(), k.dim(), v.dim())
        if ranks == (4, 4, 4):
            b, hq, sq, d = q.shape
            hkv, sk, dv = k.shape[1], k.shape[2], v.shape[3]
            consistent = (b == k.shape[0] == v.shape[0] and hkv == v.shape[1] and sk == v.shape[2]
                          and d == k.shape[3])
            kv_contiguous = k.stride(3) == 1 and v.stride(3) == 1
            tma_aligned = all(is_tma_aligned(t) for t in (q, k, v))
        else:
            b = hq = hkv = sq = sk = d = dv = 0
            consistent = kv_contiguous = tma_aligned = False
        if attn_mask is None:
            mask_kind, mask_shape, mask_dtype, mask_grad, mask_device = "none", None, None, False, True
            key_only = False
        else:
            key_only = attn_mask.dim() < 2 or attn_mask.shape[-2] == 1 or attn_mask.stride(-2) == 0
            mask_kind = "bool" if attn_mask.dtype == torch.bool else "additive"
            mask_shape, mask_dtype = tuple(attn_mask.shape), attn_mask.dtype
            mask_grad = torch.is_grad_enabled() and attn_mask.requires_grad
            mask_device = attn_mask.device == q.device
        subclass = any(type(t) not in _PLAIN_TYPES for t in (q, k, v, attn_mask) if t is not None)
        grad = torch.is_grad_enabled() and any(
            t.requires_grad for t in (q, k, v, attn_mask) if t is not None)
        return cls(
            device_type=q.device.type, capability=device_capability(q.device), dtype=q.dtype,
            batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=sq, seqlen_k=sk, head_dim=d, head_dim_v=dv,
            is_causal=bool(is_causal), causal_alignment=causal_alignment, mask_kind=mask_kind,
            mask_shape=mask_shape, mask_dtype=mask_dtype, mask_requires_grad=mask_grad,
            mask_same_device=mask_device, mask_key_only=bool(key_only), dropout_p=float(dropout_p), scale=scale, enable_gqa=bool(enable_gqa),
            requires_grad=grad, ranks=ranks, shapes_consistent=consistent,
            same_dtype=q.dtype == k.dtype == v.dtype, same_device=q.device == k.device == v.device,
            subclass=subclass, kv_last_dim_contiguous=bool(kv_contiguous), tma_aligned=bool(tma_aligned),
        )


def is_tma_aligned(t: torch.Tensor) -> bool:
    """Stride 1 on the last dim, the other strides positive multiples of 16 bytes (a TMA descriptor's
    rule, whatever the size), the storage offset a multiple of 16 bytes. The offset is not read while
    torch.compile traces (storage_offset() breaks the graph): the CuTe op copies a misaligned input."""
    size = t.element_size()
    return (t.stride(-1) == 1 and all(s > 0 and s * size % 16 == 0 for s in t.stride()[:-1])
            and (torch.compiler.is_compiling() or t.storage_offset() * size % 16 == 0))


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_alignment: str = "top_left") -> None:
    """Raise ValueError for malformed input to fa_backend.attention (ranks, shapes, dtypes, devices)."""
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
