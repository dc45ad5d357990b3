"""Program orders, which are only schedules: the dK/dV kernel's key-block-major order (TileConfig.key_major, a
tuning candidate; `_common._grid_order`, whose split-kernel uses test_flash_bwd_split.py tests): the same results
within the 2x rule, causal and not, with GQA and partial tiles."""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _configs
from fa_backend.kernels.triton._configs import BwdConfig, TileConfig
from tests.conftest import DEVICE
from tests.kernels.triton.conftest import record_launch_kwargs
from tests.reference import check_attention

pytestmark = pytest.mark.usefixtures("poisoned")

KEY_MAJOR = (BwdConfig(TileConfig(16, 16, 4, 1, key_major=True), TileConfig(16, 16, 4, 1)) if DEVICE == "cpu"
             else BwdConfig(TileConfig(64, 128, 8, 2, key_major=True), TileConfig(64, 64, 4, 2)))


@pytest.mark.parametrize("causal,alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
@pytest.mark.parametrize("hq,hkv,sq,sk", [(4, 1, 40, 70), (2, 2, 70, 33)])
def test_key_major_order_gradients(monkeypatch, causal, alignment, hq, hkv, sq, sk):
    kwargs = record_launch_kwargs(monkeypatch, "_bwd_dkdv")["_bwd_dkdv"]
    scale = 1 if DEVICE == "cpu" else 16
    q = torch.randn(2, hq, sq * scale, 64, dtype=torch.float16, device=DEVICE)
    k, v = (torch.randn(2, hkv, sk * scale, 64, dtype=torch.float16, device=DEVICE) for _ in range(2))
    with _configs.override(bwd=KEY_MAJOR):
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal, causal_alignment=alignment),
                        q, k, v, is_causal=causal, bottom_right=alignment == "bottom_right")
    assert any(kw.get("KEY_MAJOR") is True for kw in kwargs)


def test_key_major_is_a_candidate_only():
    for table in (_configs._GPU_BWD, _configs._GPU_BWD_CAUSAL):
        assert not any(cfg.dkdv.key_major for cfg in table.values())
    assert any(c.key_major for c in _configs.dkdv_candidates(128))
