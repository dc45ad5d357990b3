"""Shared pieces of the warp-specialized kernels (flash_fwd_ws.py, flash_bwd_ws.py): per-head TMA descriptors, the
platform check, and the launch that falls back when Triton's pass cannot specialize a loop."""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from ..._device import device_capability
from . import _launch

# Triton builds with `tl.range(..., warp_specialize=...)` (3.4 and later).
HAS_WS = "warp_specialize" in inspect.signature(tl.range.__init__).parameters


@triton.jit
def _head_rows(T, off_b, off_h, stride_b, stride_h, stride_row, n_rows, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
               BLOCK_D: tl.constexpr = 0):
    """TMA descriptor over the n_rows x HEAD_DIM rows of head (off_b, off_h) of a (b, h, s, d) tensor with a unit
    last stride, read and written in BLOCK x BLOCK_D tiles (BLOCK_D: HEAD_DIM by default, or a power of two above
    it): rows past n_rows and columns past HEAD_DIM come zero-filled and are dropped on stores. Built in each program
    (the other kernels take host descriptors, `_tma.head_tiles`, which cost no per-program set-up): Triton 3.6's
    warp-specialization pass fails on sm90 for kernels with descriptor arguments (forty-eighth session)."""
    return tl.make_tensor_descriptor(T + off_b * stride_b + off_h * stride_h, shape=[n_rows, HEAD_DIM],
                                     strides=[stride_row, 1], block_shape=[BLOCK, BLOCK_D if BLOCK_D else HEAD_DIM])


_INDEX: dict[torch.device, torch.Tensor] = {}


def index_table(device: torch.device, n: int) -> torch.Tensor:
    """int32 0 .. n - 1 on device (a view of one table per device, grown in powers of two): the causal kernels'
    query-row or key indices, read by TMA at a tile's own row coordinate. Triton 3.6's pass hands each consumer its
    rows of a TMA load, where a `tl.arange` over the split rows reaches both as the first consumer's; read at the
    coordinate of the tile's Q / K load (not a constant: the pass offsets a constant coordinate by remapping the
    constant itself, every use of it included, fifty-fifth session)."""
    table = _INDEX.get(device)
    if table is None or table.numel() < n:
        table = _INDEX[device] = torch.arange(max(1024, 1 << (n - 1).bit_length()), dtype=torch.int32, device=device)
    return table[:n]


def platform_ok(t: torch.Tensor, interpret: bool) -> bool:
    """sm90 (Hopper, where these kernels were measured and checked); under TRITON_INTERPRET only when the module's
    INTERPRET switch (`interpret`) asks for it."""
    if _launch._INTERPRET:
        return interpret
    return device_capability(t.device) == (9, 0)


def launch_or_mark(kernel, grid: tuple, args: tuple, kwargs: dict, failed: set, key) -> bool:
    """_launch.launch, or False with key added to failed when this Triton's pass cannot build the kernel (other
    errors propagate)."""
    try:
        _launch.launch(kernel, grid, args, kwargs)
    except Exception as e:  # noqa: BLE001 - only the pass's failure is caught (re-raised otherwise)
        if "PassManager" not in str(e):
            raise
        failed.add(key)
        return False
    return True
