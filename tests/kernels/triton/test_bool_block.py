"""_common._bool_block: a scalar condition and-ed into a block mask without an int32 mask in Triton's interpreter.

Triton 3.9's interpreter rejects int32 load and store masks, which `block_mask & (scalar >= 0)` makes there; the
CPU suite's interpreter rejects them under every Triton version (tests/_strict_masks.py).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from fa_backend.kernels.triton._common import _bool_block
from fa_backend.kernels.triton._launch import interpreting
from tests.conftest import DEVICE

BLOCK = 16


@triton.jit
def _copy_rows(X, Y, n, lo, HI: tl.constexpr, BOOL_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
    """Y[i] = X[i] for i < n when lo <= HI (a scalar condition), else nothing."""
    offs = tl.arange(0, BLOCK)
    if BOOL_BLOCK:
        ok = (offs < n) & _bool_block(lo <= HI, BLOCK)
    else:
        ok = (offs < n) & (lo <= HI)  # the splatted scalar comparison
    tl.store(Y + offs, tl.load(X + offs, mask=ok, other=0.0), mask=ok)


@pytest.mark.parametrize("lo", [3, 9])
def test_scalar_condition_in_a_block_mask(lo):
    x = torch.randn(BLOCK, device=DEVICE)
    y = torch.full((BLOCK,), 7.0, device=DEVICE)
    n = 11
    _copy_rows[(1,)](x, y, n, lo, HI=5, BOOL_BLOCK=True, BLOCK=BLOCK)
    expected = torch.full((BLOCK,), 7.0, device=DEVICE)
    if lo <= 5:
        expected[:n] = x[:n]
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.skipif(not interpreting(), reason="the interpreter's mask dtype (compiled masks are i1)")
def test_interpreter_rejects_the_splatted_scalar_comparison():
    x = torch.randn(BLOCK)
    y = torch.zeros(BLOCK)
    with pytest.raises(Exception, match="not bool|unsupported dtype"):
        _copy_rows[(1,)](x, y, 11, 3, HI=5, BOOL_BLOCK=False, BLOCK=BLOCK)
