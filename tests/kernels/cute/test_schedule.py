"""The causal kernels' tile order (kernels/cute/_schedule.py) on Python ints: every tile once, longest first within
each L2 section, heads fastest; the section sizes. (No DSL needed: the kernel runs the same arithmetic on Int32.)"""

from __future__ import annotations

import pytest

from fa_backend.kernels.cute._schedule import l2_section, longest_first, section_size


def _select(cond: bool, a: int, b: int) -> int:
    return a if cond else b


@pytest.mark.parametrize("heads_fit, expected", [(0, 1), (1, 1), (2, 2), (3, 2), (100, 64), (128, 128),
                                                 (1 << 20, 1 << 15)])
def test_section_is_the_largest_power_of_two_that_fits(heads_fit: int, expected: int) -> None:
    assert l2_section(heads_fit, _select) == expected


def test_sections_at_the_benchmark_sizes() -> None:
    # bf16, d=64: K and V of a 2k-token head are 512 KB (80 heads fit in 40 MB -> 64), of a 16k-token head 4 MB
    # (10 -> 8); a section of at least one pair however long the sequence
    per_key_row = 2 * (64 + 64)
    assert section_size(2048, per_key_row, max, _select) == 64
    assert section_size(16384, per_key_row, max, _select) == 8
    assert section_size(1 << 24, per_key_row, max, _select) == 1
    assert section_size(0, per_key_row, max, _select) == 1 << 15


@pytest.mark.parametrize("m_tiles, pairs, section", [(11, 256, 64), (16, 128, 64), (3, 5, 2), (7, 13, 4), (1, 9, 8),
                                                     (5, 3, 8), (4, 1, 1), (6, 40, 16)])
def test_longest_first_visits_every_tile_once_longest_first_per_section(m_tiles: int, pairs: int,
                                                                          section: int) -> None:
    order = [longest_first(i, m_tiles, pairs, section, min) for i in range(m_tiles * pairs)]
    assert sorted(order) == [(m, p) for m in range(m_tiles) for p in range(pairs)]
    start = 0
    for first_pair in range(0, pairs, section):
        size = min(section, pairs - first_pair)
        chunk = order[start:start + size * m_tiles]
        start += size * m_tiles
        # this section's pairs only, each query tile over all of them before the next shorter one, heads fastest
        assert {p for _, p in chunk} == set(range(first_pair, first_pair + size))
        assert [m for m, _ in chunk] == [m for m in reversed(range(m_tiles)) for _ in range(size)]
        assert [p for _, p in chunk[:size]] == list(range(first_pair, first_pair + size))
