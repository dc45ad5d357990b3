"""Host-side helpers shared by the Triton launchers."""

from __future__ import annotations

import os

import triton


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pad_head_dim(d: int) -> int:
    """Tile width for a head dim: Triton tiles are powers of two and tl.dot needs K >= 16."""
    return max(16, triton.next_power_of_2(d))


def tile_dims(d: int, dv: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DV) for head dims d and dv.

    When both dims need column masks and pad to different widths (e.g. d=40 -> 64, dv=24 -> 32),
    Triton 3.6 produced wrong forward outputs on sm90 with 64-key tiles (seen on an H200; the
    interpreter was right). Both are then padded to the wider tile, a combination that tested
    correct.
    """
    block_d, block_dv = pad_head_dim(d), pad_head_dim(dv)
    if block_d != d and block_dv != dv and block_d != block_dv:
        block_d = block_dv = max(block_d, block_dv)
    return block_d, block_dv


def grid_1d(n_programs: int) -> tuple[int]:
    """A 1-D launch grid; axis 0 allows 2**31 - 1 programs, unlike the 65535 of axes 1 and 2."""
    if n_programs >= 2**31:
        raise ValueError(f"attention launch needs {n_programs} programs, more than the 2**31 - 1 a grid allows")
    return (n_programs,)


# Test hook: fill every output buffer with NaN before the kernels run, so that an element a
# kernel fails to write shows up as NaN instead of as stale memory. Off in normal use.
POISON_OUTPUTS = os.environ.get("FA_BACKEND_DEBUG_POISON", "0") == "1"


def poison(*tensors) -> None:
    if POISON_OUTPUTS:
        for t in tensors:
            t.fill_(float("nan"))
