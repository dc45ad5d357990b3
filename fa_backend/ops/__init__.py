"""Custom ops (torch.ops.fa_backend.*): schemas, fake implementations and autograd."""

from .cute_flash import cute_flash_attention, cute_flash_bwd, cute_flash_fwd
from .triton_flash import (new_rng_state, triton_flash_attention, triton_flash_bwd, triton_flash_bwd_out,
                           triton_flash_fwd)
from .triton_decode import triton_sdpa_decode
from .triton_varlen import (triton_varlen_attention, triton_varlen_bwd, triton_varlen_bwd_out,
                            triton_varlen_fwd)

__all__ = ["cute_flash_attention", "cute_flash_bwd", "cute_flash_fwd", "new_rng_state", "triton_flash_attention", "triton_flash_fwd", "triton_flash_bwd", "triton_flash_bwd_out",
           "triton_sdpa_decode", "triton_varlen_attention", "triton_varlen_fwd", "triton_varlen_bwd", "triton_varlen_bwd_out"]
