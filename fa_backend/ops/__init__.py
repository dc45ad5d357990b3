"""Custom ops (torch.ops.fa_backend.*): schemas, fake implementations and autograd."""

from .triton_flash import triton_flash_attention, triton_flash_bwd, triton_flash_fwd

__all__ = ["triton_flash_attention", "triton_flash_fwd", "triton_flash_bwd"]
