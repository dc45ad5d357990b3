"""The backward kernels' TMA loads (TileConfig.tma; kernels/triton/flash_bwd.py): Q and dO in the dK/dV
kernel, K and V in the dQ kernel, under the interpreter here and on sm90 in the GPU suite: gradients within
the 2x rule, and the fallback to pointer loads where TMA's alignment rules do not hold."""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _configs
from fa_backend.kernels.triton.flash_bwd import _tma_ok
from fa_backend.kernels.triton._configs import BwdConfig, TileConfig
from tests.conftest import DEVICE
from tests.reference import check_attention

pytestmark = pytest.mark.usefixtures("poisoned")

TMA_BWD = (BwdConfig(TileConfig(16, 32, 4, 1, tma=True), TileConfig(16, 16, 4, 1, tma=True)) if DEVICE == "cpu"
           else BwdConfig(TileConfig(64, 128, 8, 2, tma=True), TileConfig(64, 64, 4, 2, tma=True)))


def _qkv(b, hq, hkv, sq, sk, d, dtype=torch.float16):
    return (torch.randn(b, hq, sq, d, dtype=dtype, device=DEVICE),
            torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE),
            torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("d,causal", [(16, True), (40, False)] if DEVICE == "cpu"
                         else [(d, c) for d in (16, 40, 64, 128) for c in (False, True)])
def test_tma_dkdv_gradients(d, causal):
    # sq not a multiple of the tile (rows past the end come zero-filled from the copy), d = 40 padded to 64
    # columns (zero-filled too), GQA (the Q / dO descriptors of every query head of a group).
    q, k, v = _qkv(2, 4, 2, 45 if DEVICE == "cpu" else 1000, 70 if DEVICE == "cpu" else 1100, d)
    assert _tma_ok(q, q)
    with _configs.override(bwd=TMA_BWD):
        check_attention(
            lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal, causal_alignment="bottom_right"),
            q, k, v, is_causal=causal, bottom_right=True)


def test_tma_needs_aligned_strides():
    q, k, v = _qkv(1, 2, 2, 33, 33, 24)
    assert _tma_ok(q, q)
    odd = torch.randn(1, 2, 33, 28, dtype=torch.float16, device=DEVICE)[..., :24]  # rows 56 bytes apart
    assert not _tma_ok(odd, odd) and not _tma_ok(q, odd)
    shifted = torch.randn(2 * 33 * 24 + 4, dtype=torch.float16, device=DEVICE)[4:].view(1, 2, 33, 24)  # 8-byte base
    assert not _tma_ok(shifted, shifted)
    broadcast = torch.randn(1, 1, 1, 24, dtype=torch.float16, device=DEVICE).expand(1, 2, 33, 24)
    assert not _tma_ok(q, broadcast)  # an expanded gradient (stride-0 rows)
    # such views take the pointer loads, with the same results
    with _configs.override(bwd=TMA_BWD):
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v), odd, k, v)


def test_tma_tile_falls_back_to_one_stage():
    from fa_backend.kernels.triton.flash_bwd import _without_tma

    cfg = BwdConfig(TileConfig(64, 128, 8, 2, tma=True), TileConfig(64, 64, 4, 2))
    assert _without_tma(cfg, True) == cfg
    assert _without_tma(cfg, False) == BwdConfig(TileConfig(64, 128, 8, 1), TileConfig(64, 64, 4, 2))
    both = BwdConfig(TileConfig(64, 128, 8, 2, tma=True), TileConfig(64, 64, 4, 3, tma=True))
    assert _without_tma(both, True, False) == BwdConfig(TileConfig(64, 128, 8, 2, tma=True), TileConfig(64, 64, 4, 3))
