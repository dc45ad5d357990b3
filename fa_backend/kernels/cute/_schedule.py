"""Tile order of the causal kernels: longest tiles first over all heads, in sections of heads whose K and V fit in L2.

With one CTA per (query tile, head, batch) launched in block order, a grid whose x is the query tile walks each head's
tiles before the next head's, so the last wave holds long tiles of the last heads beside short ones and the GPU idles
while they finish. Launched longest first over all heads instead (FA3 / FA4's LPT order), the tail is the short tiles.
Heads change fastest within a section of `section` (batch, head) pairs whose shared operands fit in L2 together (the
forward's K and V; the backward's Q, dO and fp32 dQ, which every key block of a head reads or adds to), so every tile
of a section still finds its head's in L2. The backward's longest tiles are its first key blocks (causal: key block 0
is seen by every query).

The arithmetic is plain integer code, so the same functions run on Python ints (tests) and on the DSL's Int32 inside
a kernel (`select` / `minimum`: the caller's conditional and min, `cutlass.select_` / `cutlass.min` there).
"""

from __future__ import annotations

from typing import Any, Callable

# bytes of L2 a section's shared operands may take: the H100 / H200's 50 MB L2 less room for what streams through
# (FA4's figure for K and V)
L2_SECTION_BYTES = 40 * 1024 * 1024
MAX_SECTION_LOG2 = 15  # sections of at most 32768 (batch, head) pairs: more than any grid of a real call


def l2_section(heads_fit: Any, select: Callable[[Any, Any, Any], Any]) -> Any:
    """The section size: the largest power of two <= heads_fit (how many heads' K and V fit in L2), at least 1
    (a power of two: FA4 found those faster)."""
    section = 1
    for i in range(1, MAX_SECTION_LOG2 + 1):
        section = select(heads_fit >= (1 << i), 1 << i, section)
    return section


def section_size(rows: Any, row_bytes: int, maximum: Callable[[Any, Any], Any],
                 select: Callable[[Any, Any, Any], Any]) -> Any:
    """l2_section for (batch, head) pairs whose shared operands take `rows` rows of `row_bytes` bytes each (a
    compile-time count: one runtime division)."""
    return l2_section((L2_SECTION_BYTES // row_bytes) // maximum(rows, 1), select)


def longest_first(linear: Any, m_tiles: Any, pairs: Any, section: Any,
                  minimum: Callable[[Any, Any], Any]) -> tuple[Any, Any]:
    """(query tile, (batch, head) pair index) of the `linear`-th CTA in launch order, for `m_tiles` query tiles per
    pair and `pairs` pairs: sections of `section` pairs (the last one may hold fewer), in each the last query tile of
    every pair, then the one before, ...; a bijection of [0, m_tiles * pairs)."""
    per_section = section * m_tiles
    index = linear // per_section
    within = linear - index * per_section
    size = minimum(section, pairs - index * section)  # pairs in this section
    rank = within // size  # 0: the longest (last) query tile
    return m_tiles - 1 - rank, index * section + within - rank * size
