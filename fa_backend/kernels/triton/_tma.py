"""TMA reads of (b, h, s, d) tensors by the Triton kernels: when the host may ask for them, and the host-side
descriptors of the kernels that take them as arguments."""

from __future__ import annotations

import torch
import triton
from triton.runtime import _allocation
from triton.tools.tensor_descriptor import TensorDescriptor

from ..._device import device_capability
from . import _launch


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether a kernel may read these (b, h, s, d) tensors by TMA (forward and dQ: K and V; dK/dV: Q and dO):
    sm90+, the head dim contiguous, every other stride and the base address 16-byte aligned (TMA's rules), no
    broadcast dim; and an allocator for the descriptors that the warp-specialized kernels still build in global
    memory (set for the launching thread: Triton keeps it in a context variable, and autograd runs the backward in
    its own thread; the other kernels take host descriptors, `head_tiles`)."""
    t0 = tensors[0]
    if not _launch._INTERPRET and (device_capability(t0.device) or (0,))[0] < 9:
        return False
    for t in tensors:  # (plain loops: this runs several times per call, on every call)
        strides = t.stride()
        if strides[3] != 1 or t.data_ptr() & 15:
            return False
        unit, shape = 16 // t.element_size(), t.shape  # 16 bytes in elements
        for i in (0, 1, 2):
            st = strides[i]
            if st % unit or (not st and shape[i] > 1):
                return False  # (a broadcast gradient, e.g. of out.sum(), has stride-0 dims: pointer loads)
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_descriptor_memory)
    return True


def _descriptor_memory(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cpu" if _launch._INTERPRET else "cuda")


_BLOCKS: set = set()  # tile shapes (rows, cols) validated once
_new = object.__new__


def head_tiles(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """Host TMA descriptor of a (b, h, s, d) tensor that `tma_ok` accepted, read or written in tiles of `rows` rows
    and `cols` columns of one head (block [1, 1, rows, cols], coordinates [batch, head, row, column]): rows past s
    and columns past d come zero-filled on loads and are dropped on stores.

    Built on the host once per launch, where a kernel's `tl.make_tensor_descriptor` builds one per program: each of
    those writes 128 bytes to global memory and waits for them before its first load (sm90 SASS: ATOMG.E.EXCH, then
    DEPBAR and UTMACCTL.IV), a serial cost at the start of every program (the d=96 / 192 split forward with six
    of them: 220 -> 299 TFLOP/s causal at 1k keys on an H100, 301 -> 359 at 2k)."""
    shape, strides = list(t.shape), list(t.stride())
    unit = 16 // t.element_size()  # 16 bytes in elements
    # TensorDescriptor's own checks (and no broadcast dim), without its dataclass constructor: ~1 µs of host time
    # (plain loops: a split backward builds sixteen of these per call)
    bad = strides[3] != 1 or t.data_ptr() & 15 or 0 in shape
    for i in (0, 1, 2):
        st = strides[i]
        if not st and shape[i] == 1:  # a size-1 dim's stride is never used; TMA wants a non-zero multiple of 16 bytes
            strides[i] = unit
        elif not st or st % unit:
            bad = True
    if bad:
        raise ValueError(f"head_tiles: a tensor TMA cannot read (shape {shape}, strides {list(t.stride())}, "
                         f"address {t.data_ptr()})")
    if (rows, cols) not in _BLOCKS:  # the tile shape once through the constructor's own validation
        desc = TensorDescriptor(t, shape, strides, [1, 1, rows, cols])
        _BLOCKS.add((rows, cols))
        return desc
    desc = _new(TensorDescriptor)
    desc.base, desc.shape, desc.strides, desc.block_shape, desc.padding = t, shape, strides, [1, 1, rows, cols], "zero"
    return desc
