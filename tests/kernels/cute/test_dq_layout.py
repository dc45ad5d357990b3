"""The CuTe backward's chunked dQ buffer (kernels/cute/_dq_layout.py): the reference reordering inverts the
kernel's fragment order, and the Triton conversion (reorder, scale, cast in one pass) equals it bit for bit.

No DSL needed: the Triton kernel runs under the interpreter on the CPU machine, on the GPU otherwise.
"""

from __future__ import annotations

import pytest
import torch

from fa_backend.kernels.cute import _dq_layout
from tests.conftest import DEVICE

TILE_M, THREADS = _dq_layout.TILE_M, _dq_layout.THREADS


def _chunks_of(dense: torch.Tensor, wgs: int, tile_m: int = TILE_M, split: str = "columns") -> torch.Tensor:
    """Place a dense (b, hq, m_blocks * tile_m, d) dQacc in the kernel's order: value i of thread t of warpgroup g
    goes to p = g * tile_m * d / wgs + (i // 2) * 256 + 2 t + i % 2 of its block's chunk (flash_bwd._dq_slot without
    the regions); it is row 16 w + 8 rh + lq, column g * d / wgs + 8 c8 + 2 lr + e of the block (wgmma's
    accumulator); split "transposed" (the block computed as dQ^T: the 80-row tile): column
    g * d / wgs + 16 w + 8 rh + lq of row 8 c8 + 2 lr + e; split "rows" (d=64's 128-row tile): row
    64 g + 16 w + 8 rh + lq, column 8 c8 + 2 lr + e."""
    b, hq, rows, d = dense.shape
    m_blocks = rows // tile_m
    chunks = torch.full((b, hq, m_blocks, tile_m * d), float("nan"), dtype=dense.dtype, device=dense.device)
    for g in range(wgs):
        for t in range(THREADS):
            w, lq, lr = t // 32, (t % 32) // 4, t % 4
            for i in range({"columns": d // wgs, "transposed": tile_m, "rows": d}[split] // 2):
                e, rh, c8 = i % 2, (i // 2) % 2, i // 4
                p = g * tile_m * d // wgs + (i // 2) * 2 * THREADS + 2 * t + e
                m, n = 16 * w + 8 * rh + lq, 8 * c8 + 2 * lr + e  # the accumulator's row and column
                row, col = {"columns": (m, g * d // wgs + n), "transposed": (n, g * d // wgs + m),
                            "rows": (64 * g + m, n)}[split]
                chunks[..., p] = dense[:, :, row::tile_m, col]
    assert not chunks.isnan().any()  # every position written once: the map is a bijection
    return chunks


@pytest.mark.parametrize("d,tile_m,split", [(128, 80, "transposed"), (64, 128, "rows")])
def test_warp_specialized_tiles_unchunk_and_convert(d, tile_m, split):
    """The warp-specialised kernel's other tiles (two warpgroups): 80-row blocks of dQ^T at d=128, 128-row blocks
    split by rows at d=64. The reference reordering inverts the fragment order and the Triton pass (80 rows
    rounded up to 128 and masked) equals it bit for bit, partial last block included."""
    b, hq, wgs = 2, 3, 2
    for sq in (150, tile_m, 7):
        m_blocks = -(-sq // tile_m)
        dense = torch.randn(b, hq, m_blocks * tile_m, d, device=DEVICE) * 40
        chunks = _chunks_of(dense, wgs, tile_m, split)
        ref = _dq_layout.unchunk(chunks, sq, wgs, tile_m, split)
        assert torch.equal(ref, dense[:, :, :sq])
        got = _dq_layout.dq_from_chunks(chunks, sq, 0.0883883, torch.float16, wgs, tile_m, split)
        assert torch.equal(got, (ref * 0.0883883).to(torch.float16))


@pytest.mark.parametrize("d,wgs", [(64, 1), (96, 1), (128, 1), (128, 2)])
def test_unchunk_inverts_the_fragment_order(d, wgs):
    b, hq, sq = 2, 3, 150
    m_blocks = -(-sq // TILE_M)
    dense = torch.randn(b, hq, m_blocks * TILE_M, d)
    assert torch.equal(_dq_layout.unchunk(_chunks_of(dense, wgs), sq, wgs), dense[:, :, :sq])


@pytest.mark.parametrize("d,wgs,sq", [(64, 1, 150), (96, 1, 70), (128, 2, 64), (128, 1, 1)])
def test_triton_conversion_equals_reorder_scale_cast(d, wgs, sq):
    b, hq = 2, 3
    m_blocks = -(-sq // TILE_M)
    dense = torch.randn(b, hq, m_blocks * TILE_M, d, device=DEVICE) * 40
    chunks = _chunks_of(dense, wgs)
    scale = 0.0883883
    got = _dq_layout.dq_from_chunks(chunks, sq, scale, torch.float16, wgs)
    want = (_dq_layout.unchunk(chunks, sq, wgs) * scale).to(torch.float16)
    assert got.shape == (b, hq, sq, d) and got.is_contiguous() and got.dtype == torch.float16
    assert torch.equal(got, want)


def test_triton_conversion_rejects_a_buffer_too_short():
    chunks = torch.zeros(1, 1, 2, TILE_M * 64, device=DEVICE)
    with pytest.raises(ValueError, match="do not hold 200 rows"):
        _dq_layout.dq_from_chunks(chunks, 200, 1.0, torch.float16)
