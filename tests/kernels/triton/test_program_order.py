"""Program orders, which are only schedules: the dK/dV kernel's key-block-major order (TileConfig.key_major, a
tuning candidate) and the general forward's block-major order for plain causal calls (flash_fwd.CAUSAL_BLOCK_MAJOR,
an experiment, off by default; `_common._grid_order`, whose split-kernel uses test_flash_bwd_split.py tests): the
same results within the 2x rule, causal and not, with GQA and partial tiles."""

from __future__ import annotations

import sys

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _configs, flash_fwd_ws
from fa_backend.kernels.triton._configs import BwdConfig, TileConfig
from tests.conftest import DEVICE
from tests.kernels.triton.conftest import record_launch_kwargs
from tests.kernels.triton.test_flash_fwd_split import qkv
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


_FLASH_FWD = sys.modules["fa_backend.kernels.triton.flash_fwd"]


@pytest.fixture
def fwd_kwargs(monkeypatch):
    """Block-major order on; yields the keyword arguments of each `_attn_fwd` launch, in order."""
    monkeypatch.setattr(_FLASH_FWD, "CAUSAL_BLOCK_MAJOR", True)
    monkeypatch.setattr(flash_fwd_ws, "ENABLED", False)
    return record_launch_kwargs(monkeypatch, "_attn_fwd")["_attn_fwd"]


@pytest.mark.parametrize("causal,bottom_right,hq,hkv,sq,sk", [
    (True, False, 4, 2, 40, 40),  # GQA, top-left: partial last block
    (True, True, 2, 2, 33, 70),  # bottom-right, more keys than queries
    (False, False, 2, 2, 40, 40),  # non-causal calls keep head-major
])
def test_general_forward_block_major(fwd_kwargs, causal, bottom_right, hq, hkv, sq, sk):
    q, k, v = qkv(2, hq, hkv, sq, sk, 64, 64, torch.float16 if DEVICE == "cpu" else torch.bfloat16, True)
    check_attention(lambda q, k, v: fa_backend.attention(
        q, k, v, is_causal=causal, causal_alignment="bottom_right" if bottom_right else "top_left"),
        q, k, v, is_causal=causal, bottom_right=bottom_right, grad=False)
    assert fwd_kwargs and all(kw.get("BLOCK_MAJOR", False) == causal for kw in fwd_kwargs), fwd_kwargs


@pytest.mark.parametrize("kw", [dict(window_size=(8, 0)), dict(softcap=20.0)], ids=["window", "softcap"])
def test_general_forward_block_major_plain_calls_only(fwd_kwargs, kw):
    """Causal calls with a feature keep head-major order (the experiment covers plain calls only)."""
    q, k, v = qkv(1, 2, 2, 32, 32, 64, 64, torch.float16 if DEVICE == "cpu" else torch.bfloat16, True)
    fa_backend.attention(q, k, v, is_causal=True, **kw)
    assert fwd_kwargs and not any(kw.get("BLOCK_MAJOR", False) for kw in fwd_kwargs), fwd_kwargs
