"""The general dK / dV kernel's causal rows in one masked loop (flash_bwd.CAUSAL_ONE_LOOP, per head-dim tile):
the same gradients within the 2x rule as the two loops, causal both alignments, GQA, partial tiles, more queries
than keys and fewer; calls with features keep the two loops."""

from __future__ import annotations

import sys

import pytest
import torch

import fa_backend
from tests.conftest import DEVICE
from tests.kernels.triton.conftest import record_launch_kwargs
from tests.reference import check_attention

pytestmark = pytest.mark.usefixtures("poisoned")

_FLASH_BWD = sys.modules["fa_backend.kernels.triton.flash_bwd"]
_SCALE = 1 if DEVICE == "cpu" else 24  # interpreter sizes here, real ones on a GPU
_ALL_TILES = frozenset({16, 32, 64, 128, 256})


@pytest.fixture
def dkdv_kwargs(monkeypatch):
    """One loop at every head-dim tile; yields the keyword arguments of each `_bwd_dkdv` launch, in order."""
    monkeypatch.setattr(_FLASH_BWD, "CAUSAL_ONE_LOOP", _ALL_TILES)
    return record_launch_kwargs(monkeypatch, "_bwd_dkdv")["_bwd_dkdv"]


def _qkv(b, hq, hkv, sq, sk, d, dtype=torch.float16):
    q = torch.randn(b, hq, sq, d, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("d,hq,hkv,sq,sk", [(64, 4, 2, 40, 40), (64, 2, 2, 33, 70), (64, 2, 1, 70, 33),
                                            (128, 2, 2, 37, 37), (48, 2, 2, 50, 50)])
def test_one_loop_gradients(dkdv_kwargs, d, hq, hkv, sq, sk, alignment):
    q, k, v = _qkv(2, hq, hkv, sq * _SCALE, sk * _SCALE, d)
    check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=True, causal_alignment=alignment),
                    q, k, v, is_causal=True, bottom_right=alignment == "bottom_right")
    assert dkdv_kwargs and all(kw.get("ONE_LOOP") is True for kw in dkdv_kwargs), dkdv_kwargs


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 under the interpreter is unreliable")
def test_one_loop_gradients_bf16(dkdv_kwargs):
    q, k, v = _qkv(2, 8, 8, 2048, 2048, 128, torch.bfloat16)
    check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=True), q, k, v, is_causal=True)
    assert dkdv_kwargs and all(kw.get("ONE_LOOP") is True for kw in dkdv_kwargs), dkdv_kwargs


@pytest.mark.parametrize("call", ["non_causal", "mask", "window", "dropout", "softcap", "off"])
def test_one_loop_only_for_plain_causal(dkdv_kwargs, monkeypatch, call):
    """Calls with a feature beside the causal bound keep the two loops (their masked rows differ), as do calls
    without a causal mask and head-dim tiles outside CAUSAL_ONE_LOOP."""
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 40, 40, 64))
    kw = dict(is_causal=call != "non_causal")
    if call == "mask":
        kw["attn_mask"] = torch.rand(40, 40, device=DEVICE) > 0.3
    elif call == "window":
        kw["window_size"] = (8, 0)
    elif call == "dropout":
        kw["dropout_p"] = 0.25
    elif call == "softcap":
        kw["softcap"] = 30.0
    elif call == "off":
        monkeypatch.setattr(_FLASH_BWD, "CAUSAL_ONE_LOOP", frozenset({128}))
    fa_backend.attention(q, k, v, **kw).sum().backward()
    assert dkdv_kwargs and not any(kw.get("ONE_LOOP") for kw in dkdv_kwargs), dkdv_kwargs

