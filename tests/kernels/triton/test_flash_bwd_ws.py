"""The warp-specialized dK / dV kernel (flash_bwd_ws): gradients within the 2x rule under the interpreter here
(which runs the same math without the specialization) and on sm90 in the GPU suite; which calls take it."""

from __future__ import annotations

import sys

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _launch, flash_bwd_ws
from tests.conftest import DEVICE
from tests.reference import check_attention

pytestmark = pytest.mark.usefixtures("poisoned")

ON_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
_FLASH_BWD = sys.modules["fa_backend.kernels.triton.flash_bwd"]


@pytest.fixture
def launches(monkeypatch):
    """The WS dK / dV kernel enabled (also under the interpreter); yields the kernels launched."""
    monkeypatch.setattr(flash_bwd_ws, "INTERPRET", True)
    monkeypatch.setattr(flash_bwd_ws, "ENABLED", True)
    if DEVICE == "cpu":
        monkeypatch.setattr(flash_bwd_ws, "WS_TILES", {d: (16, 16, 4, 1) for d in (48, 64, 96, 128)})
        monkeypatch.setattr(flash_bwd_ws, "MIN_SEQ_K", {})
        # small calls take the exact-dS path of the general kernel: off, so that these shapes reach this kernel
        monkeypatch.setattr(_FLASH_BWD, "EXACT_DS_MAX_SCORES", 0)
    names = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, args, kw: names.append(kernel.fn.__name__)
                        or real(kernel, grid, args, kw))
    return names


def _qkv(b, h, sq, sk, d, dtype, bshd):
    def make(s):
        if bshd:
            return torch.randn(b, s, h, d, dtype=dtype, device=DEVICE).transpose(1, 2)
        return torch.randn(b, h, s, d, dtype=dtype, device=DEVICE)
    return make(sq), make(sk), make(sk)


def _check(q, k, v, names):
    check_attention(lambda q, k, v: fa_backend.attention(q, k, v), q, k, v)
    assert "_bwd_dkdv_ws" in names and "_bwd_dkdv" not in names, names


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,sq,sk,bshd", [(64, 44, 70, True), (64, 64, 32, False), (128, 33, 40, True),
                                          (96, 36, 40, True), (48, 40, 28, False)])  # (padded to 128 / 64 wide)
def test_ws_dkdv_interpreted(launches, d, sq, sk, bshd):
    _check(*_qkv(2, 2, sq, sk, d, torch.float16, bshd), launches)


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
def test_ws_dkdv_min_keys(launches, monkeypatch):
    """Below MIN_SEQ_K keys a head dim takes the general dK / dV kernel; from it on, this one."""
    monkeypatch.setattr(flash_bwd_ws, "MIN_SEQ_K", {64: 48})
    for sk, kernel in ((40, "_bwd_dkdv"), (48, "_bwd_dkdv_ws")):
        launches.clear()
        q, k, v = _qkv(1, 2, 32, sk, 64, torch.float16, False)
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v), q, k, v)
        assert kernel in launches and {"_bwd_dkdv", "_bwd_dkdv_ws"} - {kernel} - set(launches), (sk, launches)


def _check_causal(q, k, v, causal=True, bottom_right=False):
    """check_attention of fa_backend.attention, causal (in either alignment) or not."""
    align = "bottom_right" if bottom_right else "top_left"
    check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal, causal_alignment=align), q, k, v,
                    is_causal=causal, bottom_right=bottom_right)


# d, sq, sk, bottom_right, bshd: top-left with more keys than queries (key blocks no query sees: dK = dV = 0),
# bottom-right with keys to the left, square, partial tiles, padded head dims
CPU_CAUSAL_CASES = [(64, 44, 70, False, True), (64, 30, 70, True, False), (128, 33, 33, False, True),
                    (96, 36, 40, True, True), (48, 40, 40, True, False)]


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,sq,sk,bottom_right,bshd", CPU_CAUSAL_CASES)
def test_ws_dkdv_causal_interpreted(launches, monkeypatch, d, sq, sk, bottom_right, bshd):
    monkeypatch.setattr(flash_bwd_ws, "CAUSAL_ENABLED", True)
    q, k, v = _qkv(2, 2, sq, sk, d, torch.float16, bshd)
    _check_causal(q, k, v, bottom_right=bottom_right)
    assert "_bwd_dkdv_ws" in launches and "_bwd_dkdv" not in launches, launches


def _qkv_gqa(b, hq, hkv, sq, sk, d, dtype, bshd):
    q = _qkv(b, hq, sq, sq, d, dtype, bshd)[0]
    return (q, *_qkv(b, hkv, sk, sk, d, dtype, bshd)[1:])


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,hq,hkv,sq,sk,causal,bottom_right,bshd", [
    (64, 4, 2, 44, 70, False, False, True), (64, 6, 2, 30, 70, True, True, False),
    (96, 3, 1, 36, 40, True, False, True), (48, 4, 1, 40, 28, False, False, False),
    (64, 2, 1, 20, 60, True, False, True)])
def test_ws_dkdv_gqa_interpreted(launches, monkeypatch, d, hq, hkv, sq, sk, causal, bottom_right, bshd):
    # GQA_ENABLED: a program per key / value head over its group's query heads (the last causal case: key blocks
    # no query sees)
    monkeypatch.setattr(flash_bwd_ws, "GQA_ENABLED", True)
    monkeypatch.setattr(flash_bwd_ws, "CAUSAL_ENABLED", True)
    q, k, v = _qkv_gqa(2, hq, hkv, sq, sk, d, torch.float16, bshd)
    _check_causal(q, k, v, causal, bottom_right)
    assert "_bwd_dkdv_ws" in launches and "_bwd_dkdv" not in launches, launches


def test_ws_dkdv_causal_only_where_every_row_sees_a_key(launches, monkeypatch):
    # bottom-right with more queries than keys: the first rows see none (their zero gradients: the general kernel)
    monkeypatch.setattr(flash_bwd_ws, "CAUSAL_ENABLED", True)
    d = 64 if DEVICE == "cpu" else 128
    q, k, v = _qkv(1, 2, 48, 32, d, torch.float16, False)
    _check_causal(q, k, v, bottom_right=True)
    assert "_bwd_dkdv" in launches and "_bwd_dkdv_ws" not in launches, launches
    launches.clear()
    _check_causal(q, k, v)
    assert "_bwd_dkdv_ws" in launches and "_bwd_dkdv" not in launches, launches


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (Triton's warp specialization on Hopper)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sq,sk,bottom_right,bshd", [(2048, 2048, False, True), (1000, 3001, False, False),
                                                     (1000, 3001, True, True), (3001, 3001, True, False),
                                                     (4096, 8192, True, True)])
@pytest.mark.parametrize("d", [128, 96, 64])
def test_ws_dkdv_causal_real_size(launches, monkeypatch, dtype, sq, sk, bottom_right, bshd, d):
    # the opt-in causal form (CAUSAL_ENABLED): what its first GPU run has to pass before it goes on by default
    monkeypatch.setattr(flash_bwd_ws, "CAUSAL_ENABLED", True)
    monkeypatch.setattr(flash_bwd_ws, "MIN_SEQ_K", {})
    q, k, v = _qkv(2, 4, sq, sk, d, dtype, bshd)
    _check_causal(q, k, v, bottom_right=bottom_right)
    assert "_bwd_dkdv_ws" in launches and "_bwd_dkdv" not in launches, launches


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (Triton's warp specialization on Hopper)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("hq,hkv,sq,sk,causal,bottom_right,bshd", [
    (8, 2, 2048, 2048, False, False, True), (8, 2, 1000, 3001, True, True, False),
    (4, 1, 3001, 1000, False, False, True), (6, 2, 2048, 4096, True, False, True)])
@pytest.mark.parametrize("d", [128, 64])
def test_ws_dkdv_gqa_real_size(launches, monkeypatch, dtype, hq, hkv, sq, sk, causal, bottom_right, bshd, d):
    # the opt-in GQA form (GQA_ENABLED), causal too: what its first GPU run has to pass before it goes on by default
    monkeypatch.setattr(flash_bwd_ws, "GQA_ENABLED", True)
    monkeypatch.setattr(flash_bwd_ws, "CAUSAL_ENABLED", True)
    monkeypatch.setattr(flash_bwd_ws, "MIN_SEQ_K", {})
    q, k, v = _qkv_gqa(2, hq, hkv, sq, sk, d, dtype, bshd)
    _check_causal(q, k, v, causal, bottom_right)
    assert "_bwd_dkdv_ws" in launches and "_bwd_dkdv" not in launches, launches


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (Triton's warp specialization on Hopper)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("sq,sk,bshd", [(2048, 2048, True), (1000, 3001, False), (3001, 1000, True),
                                        (4096, 8192, True)])
@pytest.mark.parametrize("d", [128, 96, 64])
def test_ws_dkdv_real_size(launches, monkeypatch, dtype, sq, sk, bshd, d):
    if d not in flash_bwd_ws.WS_TILES:  # a timed tile on its way to the table
        monkeypatch.setitem(flash_bwd_ws.WS_TILES, d, flash_bwd_ws.CANDIDATE_TILES[d])
    if sk < flash_bwd_ws.MIN_SEQ_K.get(d, 0):  # the general kernel's, and said so
        q, k, v = _qkv(2, 4, sq, sk, d, dtype, bshd)
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v), q, k, v)
        assert "_bwd_dkdv_ws" not in launches and "_bwd_dkdv" in launches, launches
        return
    _check(*_qkv(2, 4, sq, sk, d, dtype, bshd), launches)


@pytest.mark.parametrize("case", ["causal", "gqa", "dropout", "window"])
def test_ws_dkdv_not_taken(launches, case):
    d = 64 if DEVICE == "cpu" else 128
    q, k, v = _qkv(1, 2, 40, 40, d, torch.float16, False)
    kw = {}
    if case == "gqa":
        k, v = k[:, :1], v[:, :1]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    if case == "causal":
        out = fa_backend.attention(*leaves, is_causal=True)
    elif case == "dropout":
        out = fa_backend.attention(*leaves, dropout_p=0.1)
    elif case == "window":
        out = fa_backend.attention(*leaves, window_size=(8, 8))
    else:
        out = fa_backend.attention(*leaves, **kw)
    out.sum().backward()
    assert "_bwd_dkdv" in launches and "_bwd_dkdv_ws" not in launches, launches
