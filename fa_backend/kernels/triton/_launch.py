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
