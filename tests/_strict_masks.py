"""Triton's CPU interpreter made to reject load and store masks that are not bools, as Triton 3.9's does.

The interpreter gives a scalar comparison the dtype of the values it compared, so `block_mask & (x >= 0)` with a
scalar x splats the comparison as int32 and makes an int32 mask. Triton 3.9's interpreter rejects such a mask
("mask has unsupported dtype"); 3.6-3.8 read it as truthy, so the CPU suite on CI's Triton 3.6 would not notice the
pattern. Compiled kernels are not affected (the comparison is an i1 there). With this check installed, every Triton
version fails on it in the interpreter; `fa_backend.kernels.triton._common._bool_block` is the way around it.
Installed by tests/conftest.py on CPU runs.
"""

from __future__ import annotations

import functools

import numpy as np


def _check(mask, op: str) -> None:
    dtype = getattr(mask.data, "dtype", None)
    if dtype is not None and dtype != np.bool_:
        raise ValueError(f"{op} mask has dtype {dtype}, not bool (a scalar comparison and-ed into a block mask? "
                         "use _common._bool_block): Triton 3.9's interpreter rejects it")


def install() -> bool:
    """Wrap the interpreter's masked load and store (once); False if this Triton has neither."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_fa_backend_strict_masks", False):
        return False
    if not (hasattr(builder, "create_masked_load") and hasattr(builder, "create_masked_store")):
        return False
    load, store = builder.create_masked_load, builder.create_masked_store

    @functools.wraps(load)
    def masked_load(self, ptrs, mask, *args, **kwargs):
        _check(mask, "load")
        return load(self, ptrs, mask, *args, **kwargs)

    @functools.wraps(store)
    def masked_store(self, ptrs, value, mask, *args, **kwargs):
        _check(mask, "store")
        return store(self, ptrs, value, mask, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
    builder._fa_backend_strict_masks = True
    return True
