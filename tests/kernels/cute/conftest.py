"""Fixtures of the CuTe compile tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def shared_ptx(tmp_path_factory):
    """shared_ptx(compile_fn, dtype, head_dim, causal, bottom_right, **kwargs): compile_fn(...) for sm_90a (with a
    dump directory, so uncached by the kernels' own compile cache) and its PTX, compiled once per variant and process.
    Tests that check different properties of the same variant take it from here rather than compiling it again (a
    compile costs seconds in CI); each test still runs ptxas on the PTX in its own directory where it needs a report."""
    compiled: dict = {}

    def ptx(compile_fn, dtype, head_dim, causal, bottom_right, **kwargs) -> str:
        key = (compile_fn.__module__, compile_fn.__qualname__, dtype, head_dim, causal, bottom_right,
               tuple(sorted(kwargs.items())))
        if key not in compiled:
            dump = tmp_path_factory.mktemp("shared_ptx")
            compiled[key] = compile_fn(dtype, head_dim, causal, bottom_right, "sm_90a", str(dump), **kwargs).__ptx__
        return compiled[key]

    return ptx
