"""The forward's lazy rescale (a tile-config option, kernels/triton/_common.RESCALE_LOG2): the running max
moves only when it grows by more than 8 log2 units; the result must stay within the usual bar.

Scores are built so that both branches run: queries and keys aligned with a growing magnitude make the
row max grow by more than the threshold on some key blocks and by less on others.
"""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _configs
from fa_backend.kernels.triton._configs import TileConfig
from tests.conftest import DEVICE, DTYPES
from tests.reference import attention_math, check_attention, max_err

pytestmark = pytest.mark.usefixtures("poisoned")

GPU = DEVICE == "cuda"
TILE = TileConfig(128, 64, 8, 3, lazy_rescale=True) if GPU else TileConfig(16, 16, 4, 1, lazy_rescale=True)


def _growing(b, h, s, d, dtype, growth):
    """q, k, v whose scores grow along the keys by about `growth` log2 units per key block."""
    q = torch.randn(b, h, s, d, device=DEVICE, dtype=torch.float32)
    k = torch.randn(b, h, s, d, device=DEVICE, dtype=torch.float32) * 0.5
    direction = torch.randn(d, device=DEVICE)
    direction = direction / direction.norm()
    q = q * 0.3 + direction * 3.0  # every query leans on one direction...
    # ...and keys carry a ramp along it: the score of key j grows ~linearly in j
    ramp = torch.arange(s, device=DEVICE, dtype=torch.float32) / TILE.block_n * growth
    k = k + direction * (ramp[:, None] * d ** 0.5 / 3.0 / 1.4427)
    v = torch.randn(b, h, s, d, device=DEVICE, dtype=torch.float32)
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("growth", [0.5, 3.0, 20.0])  # below, around and above the threshold per block
@pytest.mark.parametrize("causal", [False, True])
def test_lazy_rescale_within_bar(dtype, growth, causal):
    s = 512 if GPU else 96
    q, k, v = _growing(2, 2, s, 64, dtype, growth)
    with _configs.override(fwd=TILE):
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal), q, k, v, is_causal=causal,
                        grad=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lazy_and_eager_rescale_agree_on_random_inputs(dtype):
    s = 1024 if GPU else 80
    q, k, v = (torch.randn(1, 2, s, 64, device=DEVICE, dtype=dtype) for _ in range(3))
    ref = attention_math(*(t.double() for t in (q, k, v)))
    with _configs.override(fwd=TILE):
        lazy = fa_backend.attention(q, k, v)
    with _configs.override(fwd=TileConfig(TILE.block_m, TILE.block_n, TILE.num_warps, TILE.num_stages)):
        eager = fa_backend.attention(q, k, v)
    assert not torch.isnan(lazy).any()
    # both within a rounding step or two of the float64 result: the lazy path changes the order of rounding
    assert max_err(lazy, ref) <= 2 * max_err(eager, ref) + 1e-3


def test_lazy_rescale_is_a_timed_candidate_only():
    for width in (64, 128, 256):
        assert not any(t[width].lazy_rescale for t in (_configs._GPU_FWD, _configs._GPU_FWD_CAUSAL))
        assert any(c.lazy_rescale for c in _configs.fwd_candidates(width))
