"""Triton FlashAttention kernels: forward (out, lse) and a deterministic backward.

Launchers take SDPA-layout tensors (b, h, s, d) with any strides and assume validated inputs;
limits are declared by the callers (ops/api), not asserted here.
"""

from .flash_bwd import flash_bwd
from .flash_fwd import flash_fwd

__all__ = ["flash_bwd", "flash_fwd"]
