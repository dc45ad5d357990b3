"""Saved dropout keep bits (kernels/keep_bits.py; kernels/triton/keep_bits.py): the layout's byte map, the Triton kernel
that fills a buffer from the RNG state against the kernels' own mask (dropout_keep_mask), and which calls save them
(ops.cute_flash.save_keep_bits). The CuTe forward's bytes and the CuTe backward that reads them are checked on the
H200 (tests/kernels/cute/test_dropout_gpu.py).

Runs on CUDA when present, otherwise in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from fa_backend.kernels import keep_bits
from fa_backend.kernels.triton import dropout_keep_mask
from fa_backend.kernels.keep_bits import (
    KEEP_KEYS, KEEP_PERIODS, KEEP_ROWS, KEEP_TILE_BYTES, causal_offset, keep_bit, keep_bits_bytes, keep_byte,
    keep_head_tiles, keep_period, keep_period_of, keep_row_start, keep_row_width)
from fa_backend.kernels.triton.keep_bits import fill_keep_bits, keep_saved_rows, unpack_keep_bits
from tests.conftest import DEVICE


def test_each_draw_of_a_tile_has_a_byte_of_its_own():
    """(row, 32-key block, p) -> byte is a bijection onto the tile's bytes, each drawing thread's 16 bytes are its
    16 rows (rows r with the same (r % 8) // 2, every r // 8 and r % 2), and (w, h) -> bit onto a byte's bits."""
    draws = [(r, a, p) for r in range(KEEP_ROWS) for a in range(KEEP_KEYS // 32) for p in range(4)]
    assert sorted(keep_byte(a, p, r) for r, a, p in draws) == list(range(KEEP_TILE_BYTES))
    for r, a, p in draws:
        assert keep_byte(a, p, r) // 16 == 16 * a + 4 * p + r % 8 // 2
    assert sorted(keep_bit(w, h) for w in range(4) for h in range(2)) == list(range(8))


@pytest.mark.parametrize("b,hq,sq,sk", [(1, 2, 70, 200), (2, 1, 64, 128), (1, 1, 5, 33), (1, 3, 129, 300)])
@pytest.mark.parametrize("p", [0.25, 0.1])
def test_filled_bits_are_the_kernels_mask(b, hq, sq, sk, p):
    """The buffer fill_keep_bits writes holds, bit for bit, the mask the forward and backward kernels draw for the
    same RNG state (ragged tiles included), and another RNG state gives other bits."""
    rng = (int(torch.randint(0, 2**62, ())), 16 * int(torch.randint(0, 2**20, ())))
    bits = torch.empty(keep_bits_bytes(b, hq, sq, sk), dtype=torch.uint8, device=DEVICE)
    fill_keep_bits(bits, b, hq, sq, sk, p, rng)
    keep = unpack_keep_bits(bits, b, hq, sq, sk)
    assert torch.equal(keep, dropout_keep_mask(b, hq, sq, sk, p, rng, DEVICE))
    other = fill_keep_bits(torch.empty_like(bits), b, hq, sq, sk, p, (rng[0] + 1, rng[1]))
    assert not torch.equal(unpack_keep_bits(other, b, hq, sq, sk), keep)


@pytest.mark.parametrize("period", [2, 4])
@pytest.mark.parametrize("b,hq,sq,sk", [(1, 2, 200, 130), (2, 1, 64, 128), (1, 1, 129, 33)])
def test_a_period_saves_every_periodth_row_of_tiles(b, hq, sq, sk, period):
    """With a period, the buffer holds the mask's bits of the rows of tiles R % period == 0 (their rows of 64
    queries), in keep_bits_bytes(..., period) bytes, and nothing of the others."""
    p, rng = 0.25, (int(torch.randint(0, 2**62, ())), 16 * int(torch.randint(0, 2**20, ())))
    bits = torch.full((keep_bits_bytes(b, hq, sq, sk, period),), 0xA5, dtype=torch.uint8, device=DEVICE)
    fill_keep_bits(bits, b, hq, sq, sk, p, rng, period)
    rows = keep_saved_rows(sq, period, DEVICE)
    assert rows[:KEEP_ROWS].all() and (rows.sum() < sq if sq > KEEP_ROWS else rows.all())
    keep = unpack_keep_bits(bits, b, hq, sq, sk, period)
    assert torch.equal(keep[:, :, rows], dropout_keep_mask(b, hq, sq, sk, p, rng, DEVICE)[:, :, rows])
    assert not keep[:, :, ~rows].any()
    whole = fill_keep_bits(torch.empty(keep_bits_bytes(b, hq, sq, sk), dtype=torch.uint8, device=DEVICE), b, hq, sq,
                           sk, p, rng)
    assert torch.equal(unpack_keep_bits(whole, b, hq, sq, sk)[:, :, rows], keep[:, :, rows])


class _TruncatingInt(int):
    """An integer whose // truncates toward zero, as the DSL's signed division did on the GPU."""

    def _wrap(self, value):
        return _TruncatingInt(value)

    def __floordiv__(self, k):
        return _TruncatingInt(int(self / k) if abs(int(self)) < 2**52 else -(-int(self) // k))

    __add__ = lambda self, o: _TruncatingInt(int(self) + int(o))  # noqa: E731
    __radd__ = __add__
    __sub__ = lambda self, o: _TruncatingInt(int(self) - int(o))  # noqa: E731
    __rsub__ = lambda self, o: _TruncatingInt(int(o) - int(self))  # noqa: E731
    __mul__ = lambda self, o: _TruncatingInt(int(self) * int(o))  # noqa: E731
    __rmul__ = __mul__
    __neg__ = lambda self: _TruncatingInt(-int(self))  # noqa: E731


def test_the_kernels_closed_form_floors_with_a_truncating_division():
    """keep_row_start / keep_row_width with dsl_ops (what the CuTe kernels compute) on integers whose // truncates:
    the same tiles as Python's floor division, where the causal offset is negative (rows that see no key) and in the
    period-4 series."""
    ops = keep_bits.dsl_ops(max, min, lambda c, a, b: a if c else b)
    for sq, sk in ((700, 300), (256, 256), (1000, 1100), (129, 900)):
        for diagonal in (0, sk - sq):
            for period in KEEP_PERIODS:
                for r in range(0, -(-sq // KEEP_ROWS) + 1, period):
                    t = _TruncatingInt
                    assert keep_row_start(t(r), t(sk), period, t(diagonal), ops) == keep_row_start(
                        r, sk, period, diagonal), (sq, sk, diagonal, period, r)
                    assert keep_row_width(t(r), t(sk), t(diagonal), ops) == keep_row_width(r, sk, diagonal)
    assert _TruncatingInt(-145) // 128 == -1  # the division the kernels must not rely on


@pytest.mark.parametrize("period", [1, 2])
@pytest.mark.parametrize("b,hq,sq,sk,bottom_right", [(1, 2, 300, 200, True), (2, 1, 129, 300, True),
                                                     (1, 1, 200, 130, False)])
def test_the_causal_layout_holds_the_visible_bits(b, hq, sq, sk, bottom_right, period):
    """In the causal layout the buffer holds the mask's bits of every key a saved row of queries sees (and of the
    tiles up to the next rows' diagonal), in keep_bits_bytes(..., diagonal) bytes, at most those without the mask."""
    p, rng = 0.25, (int(torch.randint(0, 2**62, ())), 16 * int(torch.randint(0, 2**20, ())))
    diagonal = causal_offset(sq, sk, True, bottom_right)
    size = keep_bits_bytes(b, hq, sq, sk, period, diagonal)
    assert size <= keep_bits_bytes(b, hq, sq, sk, period)
    bits = fill_keep_bits(torch.full((size,), 0xA5, dtype=torch.uint8, device=DEVICE), b, hq, sq, sk, p, rng, period,
                          diagonal)
    keep = unpack_keep_bits(bits, b, hq, sq, sk, period, diagonal)
    i, j = torch.arange(sq, device=DEVICE)[:, None], torch.arange(sk, device=DEVICE)[None, :]
    seen = (j <= i + diagonal) & keep_saved_rows(sq, period, DEVICE)[:, None]
    assert torch.equal(keep[:, :, seen], dropout_keep_mask(b, hq, sq, sk, p, rng, DEVICE)[:, :, seen])


def test_the_period_is_the_smallest_within_the_budget(monkeypatch):
    """keep_period: every row of tiles while all the bits fit the budget (8k tokens at d=128, MHA; 16k causal, whose
    layout holds the visible tiles only), then every second (16k; 32k causal) or fourth (32k; 64k causal), then
    none; a larger budget saves more."""
    def period(s, b=1, h=16, hkv=16, diagonal=None):
        return keep_period(b, h, hkv, s, s, 128, 128, 2, diagonal)

    assert [period(s) for s in (1024, 8192, 8192 + 512, 16384, 32768, 32768 + 2048, 65536)] == [1, 1, 2, 2, 4, 0, 0]
    assert [period(s, diagonal=0) for s in (8192, 16384, 16384 + 1024, 32768, 65536, 65536 + 4096)] == [
        1, 1, 2, 2, 4, 0]
    assert period(8192, hkv=4) == 2  # GQA: fewer K / V bytes in the budget
    monkeypatch.setattr(keep_bits, "KEEP_BITS_BUDGET", 2.0)
    assert period(16384) == 1 and period(65536) == 4 and period(16384 + 1024, diagonal=0) == 1
    monkeypatch.setattr(keep_bits, "KEEP_BITS_BUDGET", 0.0)
    assert period(1024) == 0 and period(1024, diagonal=0) == 0


@pytest.mark.parametrize("period", KEEP_PERIODS)
def test_the_causal_layout_holds_each_rows_visible_tiles(period):
    """The causal layout (keep_row_width, keep_row_start's closed form): row of tiles R holds the key tiles up to the
    last key its queries and the next row's see, for both alignments and any lengths (rows that see nothing hold
    none), saved rows one after another; without a causal mask every row holds every key tile."""
    for sq in (*range(1, 700, 29), 2048, 2049):
        for sk in (*range(1, 900, 43), 2048):
            keys, rows = -(-sk // KEEP_KEYS), -(-sq // KEEP_ROWS)
            for diagonal in {None, 0, sk - sq}:
                start = 0
                for r in range(0, rows, period):
                    assert keep_row_start(r, sk, period, diagonal) == start, (sq, sk, diagonal, r)
                    last_key = None if diagonal is None else KEEP_ROWS * r + 2 * KEEP_ROWS - 1 + diagonal
                    width = keys if diagonal is None else min(max(last_key // KEEP_KEYS + 1, 0), keys)
                    assert keep_row_width(r, sk, diagonal) == width
                    start += width
                assert keep_head_tiles(sq, sk, period, diagonal) == start
    assert causal_offset(100, 300, True, True) == 200 and causal_offset(100, 300, True, False) == 0
    assert causal_offset(100, 300, False, True) is None
    # about half the bytes: a 16k causal call's triangle and its diagonal tiles (1.6 % of the full layout more)
    full = keep_bits_bytes(1, 1, 16384, 16384)
    assert full // 2 < keep_bits_bytes(1, 1, 16384, 16384, 1, 0) < full * 0.51


def test_the_size_names_the_period():
    """Two periods whose buffers have one size save the same tiles, so the backward may read the period from the
    size (keep_period_of; in the causal layout, rows that hold no tile aside); any other size names none."""
    for sq in range(1, 64 * 20, 37):
        for diagonal in (None, 0, 300 - sq):
            for period in KEEP_PERIODS:
                size = keep_bits_bytes(1, 2, sq, 300, period, diagonal)
                found = keep_period_of(size, 1, 2, sq, 300, diagonal)
                rows = [r for r in range(-(-sq // KEEP_ROWS)) if keep_row_width(r, 300, diagonal)]
                assert {r for r in rows if r % found == 0} == {r for r in rows if r % period == 0}, (sq, period)
    assert keep_period_of(keep_bits_bytes(1, 2, 640, 300) + 1, 1, 2, 640, 300) == 0


def test_fill_refuses_what_it_cannot_hold():
    bits = torch.empty(keep_bits_bytes(1, 1, 64, 128) - 1, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="at least 1024 bytes"):
        fill_keep_bits(bits, 1, 1, 64, 128, 0.1, (1, 0))
    with pytest.raises(ValueError, match="32-bit draws"):
        fill_keep_bits(torch.empty(1024, dtype=torch.uint8, device=DEVICE), 1, 1, 64, 128, 0.01, (1, 0))


def test_which_calls_save_keep_bits(monkeypatch):
    """d = dv = 128 dropout without a mask, a nonzero scale or deterministic algorithms, while one bit per score of
    every fourth row of tiles at least is within KEEP_BITS_BUDGET times q, k, v and out (at 1.05: 33k tokens at d=128
    for MHA, 64k causal, 21k with GQA 4:1)."""
    from fa_backend.ops import cute_flash

    def call(sq=1024, sk=1024, d=128, dv=128, hkv=4, p=0.1, mask=None, scale=None, causal=False):
        q, k, v = (torch.empty(2, h, s, e, dtype=torch.bfloat16) for h, s, e in ((4, sq, d), (hkv, sk, d), (hkv, sk, dv)))
        return cute_flash.save_keep_bits(q, k, v, scale, mask, p, causal, True)

    assert call() and call(sq=8192, sk=8192) and call(sq=100, sk=300)
    assert call(sq=8192, sk=8192 + 128) and call(sq=16384, sk=16384)  # every second row of tiles
    assert call(sq=33280, sk=33280) and not call(sq=34816, sk=34816)  # every fourth; then none
    assert call(sq=65536, sk=65536, causal=True) and not call(sq=69632, sk=69632, causal=True)
    assert call(sq=21504, sk=21504, hkv=1) and not call(sq=22528, sk=22528, hkv=1)
    assert not call(p=0.0) and not call(d=64, dv=64) and not call(dv=64) and not call(scale=0.0)
    assert not call(mask=torch.ones(1, 1, 1, 1024, dtype=torch.bool))
    monkeypatch.setattr(keep_bits, "KEEP_BITS_BUDGET", 0.0)
    assert not call()
    monkeypatch.setattr(keep_bits, "KEEP_BITS_BUDGET", 1.0)
    torch.use_deterministic_algorithms(True)
    try:
        assert not call()
    finally:
        torch.use_deterministic_algorithms(False)
