"""Triton FlashAttention kernels: forward (out, lse) and a deterministic backward.

Launchers take SDPA-layout tensors (b, h, s, d) with any strides (the *_varlen launchers packed
(total, h, d) sequences, FlashAttention-2's varlen layout) and assume validated inputs;
limits are declared by the callers (ops/api), not asserted here.
"""

from .flash_bwd import flash_bwd, flash_bwd_varlen
from .flash_fwd import (
    dropout_keep_mask,
    dropout_keep_mask_varlen,
    flash_fwd,
    flash_fwd_varlen,
)

__all__ = ["flash_fwd", "flash_bwd", "flash_fwd_varlen", "flash_bwd_varlen", "dropout_keep_mask",
           "dropout_keep_mask_varlen"]
