"""Block-major grid order (`_common._grid_order`) of the general forward's plain causal launches: every query block of
every (batch, head) computed once, within the 2x rule, and only plain causal calls launched that way (an
experiment, off by default; the split kernels' order is tested in test_flash_bwd_split.py)."""

from __future__ import annotations

import sys

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import flash_fwd_ws
from tests.conftest import DEVICE
from tests.kernels.triton.conftest import record_launch_kwargs
from tests.kernels.triton.test_flash_fwd_split import qkv
from tests.reference import check_attention

pytestmark = pytest.mark.usefixtures("poisoned")

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
