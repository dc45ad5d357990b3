"""Saved dropout keep bits (layout and memory budget: kernels/keep_bits.py): a Triton kernel that fills them from the
RNG state, and an unpacker.

`fill_keep_bits` writes the whole buffer from the RNG state (where the CuTe forward did not run: a compile failure, a
zero scale); the CuTe forward writes the tiles it visits (every tile a backward step reads). `unpack_keep_bits` turns a
buffer back into the (b, hq, sq, sk) bool mask (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..keep_bits import (KEEP_KEYS, KEEP_ROWS, KEEP_TILE_BYTES, keep_bit, keep_bits_bytes, keep_byte,
                         keep_head_tiles, keep_row_blocks, keep_row_start)
from . import _launch
from ._features import DROP_HALVES, dropout_draw


@triton.jit
def _halves_bits(word, thr, W: tl.constexpr):
    """The keep bits of word W's two halves (h = 0: the low 16 bits) at their positions keep_bit(W, h)."""
    lo = ((word & 0xFFFF) >= thr).to(tl.int32)
    hi = ((word >> 16) >= thr).to(tl.int32)
    return (lo << (2 * (2 * (W // 2)) + W % 2)) | (hi << (2 * (2 * (W // 2) + 1) + W % 2))


@triton.jit
def _keep_bits_kernel(BITS, STARTS, seed, rng_offset, drop_threshold, SEQ_Q, SEQ_K, HEAD_TILES,
                      TILE_BYTES: tl.constexpr, PERIOD: tl.constexpr):
    c = tl.program_id(0)
    saved = tl.program_id(1)  # the saved row of tiles; its rows are those of row of tiles saved * PERIOD
    start = tl.load(STARTS + saved)
    if c < tl.load(STARTS + saved + 1) - start:  # a tile of the row (the causal layout's rows are shorter)
        r = saved * PERIOD
        bh = tl.program_id(2)
        t = tl.arange(0, TILE_BYTES)
        g, qq = t // 16, t % 16
        a, p, rq = g // 16, (g // 4) % 4, g % 4  # the byte's 32-key block, p, and its row's (i % 8) // 2
        row = r * 64 + 8 * (qq // 2) + 2 * rq + qq % 2
        counter = ((bh.to(tl.int64) * SEQ_Q + row) * (((SEQ_K + 31) // 32) * 4) + (4 * (4 * c + a) + p)
                   + rng_offset)
        r0, r1, r2, r3 = tl.randint4x(seed, counter)
        thr = tl.full([], drop_threshold, tl.int64).to(tl.uint32)
        byte = (_halves_bits(r0, thr, 0) | _halves_bits(r1, thr, 1) | _halves_bits(r2, thr, 2)
                | _halves_bits(r3, thr, 3))
        tile = (bh.to(tl.int64) * HEAD_TILES + start + c) * TILE_BYTES
        tl.store(BITS + tile + t, byte.to(tl.uint8))


def _row_starts(sq: int, sk: int, period: int, causal_offset: int | None) -> list[int]:
    """Each saved row of tiles' first tile within a head, then the head's tile count."""
    rows = keep_row_blocks(sq, period)
    return [keep_row_start(i * period, sk, period, causal_offset) for i in range(rows + 1)]


def fill_keep_bits(bits: torch.Tensor, b: int, hq: int, sq: int, sk: int, dropout_p: float,
                   rng: tuple[int, int], period: int = 1, causal_offset: int | None = None) -> torch.Tensor:
    """Write the keep bits of this call's mask (the RNG state (seed, offset), 16-bit draws) into `bits`, a uint8
    buffer of at least keep_bits_bytes(b, hq, sq, sk, period, causal_offset), for every period-th row of tiles (in
    the causal layout where causal_offset is not None); returns it."""
    draw, threshold = dropout_draw(dropout_p)
    if draw != DROP_HALVES:
        raise ValueError(f"dropout_p={dropout_p} needs 32-bit draws; saved keep bits hold 16-bit ones")
    size = keep_bits_bytes(b, hq, sq, sk, period, causal_offset)
    if bits.dtype != torch.uint8 or not bits.is_contiguous() or bits.numel() < size:
        raise ValueError(f"keep bits must be a contiguous uint8 buffer of at least {size} bytes, got {bits.dtype} "
                         f"({bits.numel()})")
    if size:
        starts = torch.tensor(_row_starts(sq, sk, period, causal_offset), dtype=torch.int64, device=bits.device)
        rows, keys = keep_row_blocks(sq, period), -(-sk // KEEP_KEYS)
        _keep_bits_kernel[(keys, rows, b * hq)](bits, starts, int(rng[0]), int(rng[1]), threshold, sq, sk,
                                                keep_head_tiles(sq, sk, period, causal_offset),
                                                TILE_BYTES=KEEP_TILE_BYTES, PERIOD=period,
                                                **_launch.COMPILE_OPTIONS)
    return bits


def unpack_keep_bits(bits: torch.Tensor, b: int, hq: int, sq: int, sk: int, period: int = 1,
                     causal_offset: int | None = None) -> torch.Tensor:
    """The (b, hq, sq, sk) bool keep mask a buffer of saved keep bits holds; with a period, the rows of the rows of
    tiles it does not save are False (keep_saved_rows tells them), and in the causal layout the tiles it does not
    hold."""
    starts = _row_starts(sq, sk, period, causal_offset)
    keys, rows = -(-sk // KEEP_KEYS), -(-sq // KEEP_ROWS)
    size = keep_bits_bytes(b, hq, sq, sk, period, causal_offset)
    held = bits[:size].view(b * hq, starts[-1], KEEP_TILE_BYTES).to(torch.int32)
    tiles = held.new_zeros(b * hq, rows, keys, KEEP_TILE_BYTES)
    for i in range(len(starts) - 1):
        tiles[:, i * period, :starts[i + 1] - starts[i]] = held[:, starts[i]:starts[i + 1]]
    i = torch.arange(KEEP_ROWS, device=bits.device)[:, None]
    j = torch.arange(KEEP_KEYS, device=bits.device)[None, :]
    a, w, p, h = j // 32, j % 32 // 8, j % 8 // 2, j % 2
    byte = keep_byte(a, p, i).expand(KEEP_ROWS, KEEP_KEYS)
    keep = (tiles[..., byte] >> keep_bit(w, h)) & 1  # (bh, R, C, row, key)
    keep = keep.permute(0, 1, 3, 2, 4).reshape(b, hq, rows * KEEP_ROWS, keys * KEEP_KEYS)
    return keep[:, :, :sq, :sk].bool()


def keep_saved_rows(sq: int, period: int, device: torch.device | str) -> torch.Tensor:
    """(sq,) bool: the query rows whose keep bits a buffer of this period holds."""
    return torch.arange(sq, device=device) // KEEP_ROWS % period == 0
