"""The backward's atomic-dQ option (TileConfig.atomic_dq on the dK/dV tile): dQ added from the dK/dV kernel
with fp32 atomics, then converted; gradients within the usual bar, with features, GQA and padded head dims;
the deterministic mode keeps the two-kernel path."""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _configs, _launch
from fa_backend.kernels.triton._configs import BwdConfig, TileConfig
from tests.conftest import DEVICE, DTYPES
from tests.reference import check_attention, check_features

pytestmark = pytest.mark.usefixtures("poisoned")

GPU = DEVICE == "cuda"
DKDV = TileConfig(32, 64, 4, 2, atomic_dq=True) if GPU else TileConfig(16, 16, 4, 1, atomic_dq=True)
DQ = TileConfig(64, 64, 4, 2) if GPU else TileConfig(16, 16, 4, 1)
ATOMIC = BwdConfig(DKDV, DQ)


def _qkv(b, hq, hkv, sq, sk, d, dtype):
    return (torch.randn(b, hq, sq, d, dtype=dtype, device=DEVICE), torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE),
            torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE))


@pytest.fixture
def launched(monkeypatch):
    """Names of the kernels launched."""
    names, real = [], _launch.launch

    def spy(kernel, grid, args, kwargs):
        names.append(getattr(kernel, "__name__", None) or kernel.fn.__name__)
        return real(kernel, grid, args, kwargs)

    monkeypatch.setattr(_launch, "launch", spy)
    return names


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("hq,hkv,sq,sk,d", [(2, 2, 70, 70, 64), (4, 2, 37, 83, 40), (2, 1, 96, 48, 64)])
def test_atomic_dq_gradients_within_bar(launched, dtype, causal, bottom_right, hq, hkv, sq, sk, d):
    if GPU:
        sq, sk = sq * 8, sk * 8
    q, k, v = _qkv(2, hq, hkv, sq, sk, d, dtype)
    alignment = "bottom_right" if bottom_right else "top_left"
    with _configs.override(bwd=ATOMIC):
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal, causal_alignment=alignment),
                        q, k, v, is_causal=causal, bottom_right=bottom_right)
    assert "_bwd_dq_convert" in launched and "_bwd_dq" not in launched


# dQ by TMA bulk reduce-add, Q and dO by TMA (the interpreter: TMA loads, dQ by pointer atomics)
TMA_DKDV = TileConfig(32, 128, 8, 2, atomic_dq=True, tma=True) if GPU else TileConfig(16, 16, 4, 1, atomic_dq=True,
                                                                                     tma=True)


@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("hq,hkv,sq,sk,d", [(2, 2, 70, 70, 64), (4, 2, 37, 83, 40), (2, 1, 96, 48, 128)])
def test_tma_reduce_dq_gradients_within_bar(launched, causal, bottom_right, hq, hkv, sq, sk, d):
    dtype = torch.bfloat16 if GPU else torch.float16
    if GPU:
        sq, sk = sq * 8, sk * 8
    q, k, v = _qkv(2, hq, hkv, sq, sk, d, dtype)
    alignment = "bottom_right" if bottom_right else "top_left"
    with _configs.override(bwd=BwdConfig(TMA_DKDV, DQ)):
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal, causal_alignment=alignment),
                        q, k, v, is_causal=causal, bottom_right=bottom_right)
    assert "_bwd_dq_convert" in launched and "_bwd_dq" not in launched


@pytest.mark.parametrize("feature", ["bool_mask", "window", "softcap"])
def test_atomic_dq_with_features(launched, feature):
    q, k, v = _qkv(1, 2, 2, 48, 64, 32, torch.float16)
    kw = {"bool_mask": {"attn_mask": torch.rand(1, 1, 48, 64, device=DEVICE) < 0.7},
          "window": {"window": (8, 4)}, "softcap": {"softcap": 5.0}}[feature]

    def fn(q, k, v):
        return fa_backend.attention(q, k, v, attn_mask=kw.get("attn_mask"), window_size=kw.get("window", (-1, -1)),
                                    softcap=kw.get("softcap", 0.0))

    with _configs.override(bwd=ATOMIC):
        check_features(fn, q, k, v, **kw)
    assert "_bwd_dq_convert" in launched


def test_deterministic_mode_keeps_the_two_kernel_path(launched):
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 2, 40, 40, 32, torch.float16))
    plain_cfg = BwdConfig(TileConfig(DKDV.block_m, DKDV.block_n, DKDV.num_warps, DKDV.num_stages), DQ)
    with _configs.override(bwd=plain_cfg):
        ref = torch.autograd.grad(fa_backend.attention(q, k, v).sum(), (q, k, v))
    launched.clear()
    torch.use_deterministic_algorithms(True)
    try:
        with _configs.override(bwd=ATOMIC):
            got = torch.autograd.grad(fa_backend.attention(q, k, v).sum(), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(False)
    assert "_bwd_dq" in launched and "_bwd_dq_convert" not in launched
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_atomic_dq_is_a_timed_candidate_only():
    for width in (64, 128, 256):
        assert not any(t[width].dkdv.atomic_dq for t in (_configs._GPU_BWD, _configs._GPU_BWD_CAUSAL))
        assert any(c.atomic_dq for c in _configs.dkdv_candidates(width))
