"""TMA reads of (b, h, s, d) tensors by the Triton kernels: when the host may ask for them."""

from __future__ import annotations

import torch
import triton
from triton.runtime import _allocation

from . import _launch


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether a kernel may read these (b, h, s, d) tensors by TMA (forward and dQ: K and V; dK/dV: Q and dO):
    sm90+, the head dim contiguous, every other stride and the base address 16-byte aligned (TMA's rules), no
    broadcast dim; and an allocator for the descriptors, which the kernel builds in global memory (set for the
    launching thread: Triton keeps it in a context variable, and autograd runs the backward in its own thread)."""
    t0 = tensors[0]
    if not _launch._INTERPRET and not (t0.is_cuda and torch.cuda.get_device_capability(t0.device)[0] >= 9):
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(3) != 1 or t.data_ptr() % 16 or any((st * size) % 16 or (st == 0 and n > 1)
                                                        for st, n in zip(t.stride()[:3], t.shape[:3])):
            return False  # (a broadcast gradient, e.g. of out.sum(), has stride-0 dims: pointer loads)
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_descriptor_memory)
    return True


def _descriptor_memory(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu" if _launch._INTERPRET else "cuda")
