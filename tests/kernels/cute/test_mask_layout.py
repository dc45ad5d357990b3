"""The forward's mask (`_fwd_parts.mask_scores`) relies on the wgmma accumulator's layout: every thread's values sit
at its first value's coordinates plus thread 0's (compile-time) ones, and a row half's values in register order lie at
columns 8 * (e // 2) + e % 2, so the visible ones left of a bound are a prefix of `kept_elements(bound)` values.
Checked here for all 128 threads of the forward's S tiles (the DSL evaluates the coordinates while tracing; no GPU)."""

from __future__ import annotations

import pytest

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING

pytestmark = [pytest.mark.cute, pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}")]


def _coordinates(tile_n: int) -> dict[int, list[tuple[int, int]]]:
    """(row, column) of each accumulator value of S = Q K^T (64 x tile_n) per thread of the warpgroup."""
    import cutlass
    import cutlass.cute as cute

    from fa_backend.kernels.cute._fwd_parts import make_tiled_mmas
    from fa_backend.kernels.cute._target import compile_options

    out: dict[int, list[tuple[int, int]]] = {}

    def record(thread: int, crd) -> None:
        out.setdefault(thread, []).append(tuple(int(x) for x in crd))

    @cute.jit
    def probe():
        mma_qk, _ = make_tiled_mmas(cutlass.BFloat16, 64, tile_n, 64)
        for t in cutlass.range_constexpr(128):
            c = mma_qk.get_slice(t).partition_C(cute.make_identity_tensor((64, tile_n)))
            for i in cutlass.range_constexpr(cute.size(c)):
                record(t, c[i])

    cute.compile(probe, options=compile_options("sm_90a"))
    return out


@pytest.mark.parametrize("tile_n", [64, 128])
def test_values_are_a_thread_offset_plus_thread_zeros_and_rows_halves_are_column_prefixes(tile_n: int) -> None:
    from fa_backend.kernels.cute._fwd_parts import kept_elements

    coords = _coordinates(tile_n)
    zero = coords[0]
    elements = len(zero) // 2
    assert len(coords) == 128 and elements == tile_n // 4
    for thread, values in coords.items():
        first_row, first_col = values[0]
        assert values == [(first_row + r, first_col + c) for r, c in zero]
    for half in range(2):
        for e in range(elements):
            assert zero[half * 2 + (e // 2) * 4 + e % 2] == (8 * half, 8 * (e // 2) + e % 2)
    # the visible values left of a bound (in columns from the thread's first) are the first kept_elements of them
    for bound in range(-9, tile_n + 9):
        visible = [8 * (e // 2) + e % 2 < bound for e in range(elements)]
        kept = kept_elements(bound, min, max, elements)
        assert visible == [e < kept for e in range(elements)], bound
