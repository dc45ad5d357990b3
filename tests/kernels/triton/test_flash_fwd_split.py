"""The split-column forward (flash_fwd_split, head dims 129-192 on 128 + 64 columns, 65-96 on 64 + 32): under the
interpreter here, at real sizes on sm90 in the GPU suite: outputs within the 2x rule, the LSE, which calls take it,
and the fallback to the general kernel."""

from __future__ import annotations

import pytest
import torch

from fa_backend.kernels.triton import _configs, flash_fwd_split, flash_fwd_ws
from fa_backend.kernels.triton.flash_fwd import flash_fwd
from tests.conftest import DEVICE
from tests.reference import assert_within_bar, attention_math, attention_same_dtype, causal_mask

pytestmark = pytest.mark.usefixtures("poisoned")

ON_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)


def qkv(b, hq, hkv, sq, sk, d, dv, dtype, bshd):
    def make(h, s, width):
        if bshd:
            return torch.randn(b, s, h, width, dtype=dtype, device=DEVICE).transpose(1, 2)
        return torch.randn(b, h, s, width, dtype=dtype, device=DEVICE)
    return make(hq, sq, d), make(hkv, sk, d), make(hkv, sk, dv)


def _lse(q, k, causal, bottom_right):
    """float64 natural-log sum-exp of the scaled scores (-inf for a row that sees no key)."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], bottom_right, q.device), float("-inf"))
    return torch.logsumexp(s, -1)


def _check(q, k, v, causal, bottom_right, names):
    out, lse = flash_fwd(q, k, v, q.shape[-1] ** -0.5, causal, bottom_right)
    assert names and names[-1] == "_attn_fwd_split", names
    big = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > 2**27
    kw = dict(is_causal=causal, bottom_right=bottom_right)
    ref = attention_math(*(t.to(torch.float32 if big else torch.float64) for t in (q, k, v)), **kw)
    assert_within_bar("out", out, attention_same_dtype(q, k, v, **kw), ref)
    lse_ref = _lse(q, k, causal, bottom_right)
    seen = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), seen), "LSE -inf exactly on the rows that see no key"
    assert (out[~seen] == 0).all(), "rows that see no key output 0"
    # fp32 sum-exp of dtype-rounded scores against float64: within a few units of the scores' rounding
    assert (lse.double() - lse_ref)[seen].abs().max().item() < 2e-2


CPU_CASES = [
    # d, dv, hq, hkv, sq, sk, bshd, causal, bottom_right
    (192, 192, 2, 2, 40, 56, False, False, False),  # keys not a multiple of the tile
    (192, 192, 4, 2, 48, 48, True, True, False),  # GQA, (b, s, h, d) layout, causal
    (160, 160, 2, 1, 37, 70, True, True, True),  # second column tile zero-filled past d; bottom-right
    (136, 176, 2, 2, 50, 33, False, True, True),  # dv != d; more queries than keys: rows that see no key
    (192, 144, 2, 2, 33, 33, False, False, False),
]


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,dv,hq,hkv,sq,sk,bshd,causal,bottom_right", CPU_CASES)
def test_split_forward_interpreted(split_launches, d, dv, hq, hkv, sq, sk, bshd, causal, bottom_right):
    _check(*qkv(2, hq, hkv, sq, sk, d, dv, torch.float16, bshd), causal, bottom_right, split_launches)


GPU_CASES = [(d, hq, hkv, sq, sk, bshd, causal)
             for d in (192, 160) for causal in (False, True)
             for hq, hkv, sq, sk, bshd in ((8, 8, 2048, 2048, True), (8, 2, 1000, 9001, False),
                                           (4, 4, 3001, 3001, True), (2, 2, 8192, 8192, False))]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (TMA)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bshd,causal", GPU_CASES)
def test_split_forward_real_size(split_launches, dtype, d, hq, hkv, sq, sk, bshd, causal):
    _check(*qkv(2, hq, hkv, sq, sk, d, d, dtype, bshd), causal, True, split_launches)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90")
def test_split_forward_large_logits_finite(split_launches):
    q, k, v = qkv(1, 4, 4, 1024, 1024, 192, 192, torch.bfloat16, True)
    out, lse = flash_fwd(q * 30, k * 30, v, 192 ** -0.5, True, False)
    assert split_launches[-1] == "_attn_fwd_split"
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def _plain_qkv(d=192, dtype=torch.float16):
    return qkv(1, 2, 2, 24, 24, d, d, dtype, False)


@pytest.mark.parametrize("kw", [dict(attn_mask="bool"), dict(dropout_p=0.1), dict(softcap=5.0),
                                dict(window=(8, -1)), dict(alibi_slopes=True), dict(scale=-0.1), dict(d=128),
                                dict(d=200), dict(strided=True), dict(out32=True)],
                         ids=lambda kw: next(iter(kw)))
def test_split_not_taken(split_launches, kw):
    """Features, a negative scale, other head dims, strides TMA cannot read and an fp32 output take `_attn_fwd`."""
    q, k, v = _plain_qkv(kw.pop("d", 192))
    if kw.pop("strided", False):  # head dim not contiguous
        k = torch.randn(1, 2, q.shape[-1], 24, dtype=q.dtype, device=DEVICE).transpose(-1, -2)
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE) if kw.pop("out32", False) else None
    scale = kw.pop("scale", q.shape[-1] ** -0.5)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(24, 24, device=DEVICE) > 0.2
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = torch.rand(2, device=DEVICE)
    if "dropout_p" in kw:
        kw["rng"] = (1, 0)
    flash_fwd(q, k, v, scale, False, True, out, **kw)
    assert "_attn_fwd_split" not in split_launches and split_launches[-1] in (
        "_attn_fwd", "_attn_fwd_ws", "_attn_fwd_ws_persistent")


def test_split_switches(split_launches, monkeypatch):
    q, k, v = _plain_qkv()
    out = torch.empty_like(q)
    assert flash_fwd_split.split_eligible(q, k, v, out, 0.1, True, False) == (DEVICE == "cpu" or ON_SM90)
    assert not flash_fwd_split.split_eligible(q, k, v, out, 0.1, False, False)  # a feature call
    monkeypatch.setattr(flash_fwd_split, "ENABLED", False)
    assert not flash_fwd_split.split_eligible(q, k, v, out, 0.1, True, False)
    monkeypatch.setattr(flash_fwd_split, "ENABLED", True)
    with _configs.override(fwd=_configs.TileConfig(16, 16, 4, 1)):  # a pinned tile is one for _attn_fwd
        assert not flash_fwd_split.split_eligible(q, k, v, out, 0.1, True, False)


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,dv,hq,hkv,causal", [(96, 96, 4, 2, True), (80, 96, 2, 2, False), (72, 72, 2, 1, True)])
def test_split_forward_small_interpreted(split_launches, monkeypatch, d, dv, hq, hkv, causal):
    """Head dims 65-96 on 64 + 32 columns (the second tile zero-filled past d)."""
    monkeypatch.setattr(flash_fwd_split, "MIN_SEQ_K", {})  # interpreter sizes
    _check(*qkv(2, hq, hkv, 37, 50, d, dv, torch.float16, True), causal, True, split_launches)


def test_split_min_seq_k(monkeypatch):
    """A class's MIN_SEQ_K (non-causal, causal): fewer keys keep the other kernels; d=96's defaults are 1k / 1k."""
    def eligible(sk, causal, d=96):
        q, k, v = qkv(1, 1, 1, 8, sk, d, d, torch.float16, False)
        return flash_fwd_split.split_eligible(q, k, v, torch.empty_like(q), 0.1, True, causal)
    if not (DEVICE == "cpu" or ON_SM90):
        pytest.skip("TMA strides: sm90 or the interpreter")
    assert flash_fwd_split.MIN_SEQ_K[96] == (1024, 1024)
    assert [eligible(sk, False) for sk in (1023, 1024)] == [False, True]
    assert [eligible(sk, True) for sk in (1023, 1024)] == [False, True]
    assert eligible(8, True, d=192)  # 129-192: no minimum
    monkeypatch.setattr(flash_fwd_split, "MIN_SEQ_K", {96: (5, 9)})
    assert [eligible(sk, False) for sk in (4, 5)] == [False, True]
    assert [eligible(sk, True) for sk in (8, 9)] == [False, True]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (TMA)")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d,hq,hkv,sq,sk", [(96, 8, 8, 2048, 2048), (96, 8, 2, 1000, 3001), (80, 4, 4, 4096, 4096)])
def test_split_forward_small_real_size(split_launches, causal, d, hq, hkv, sq, sk):
    """d=65-96 at sizes where the default routing takes the split."""
    _check(*qkv(2, hq, hkv, sq, sk, d, d, torch.bfloat16, True), causal, True, split_launches)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (TMA)")
@pytest.mark.parametrize("causal,sk,kernel", [(False, 600, "_attn_fwd_ws_persistent"),
                                              (False, 1024, "_attn_fwd_split"),
                                              (True, 600, "_attn_fwd"), (True, 1024, "_attn_fwd_split")])
def test_split_small_routing(split_launches, causal, sk, kernel):
    """d=96 below its MIN_SEQ_K keeps the warp-specialized (non-causal) or general kernel."""
    q, k, v = qkv(1, 2, 2, sk, sk, 96, 96, torch.bfloat16, True)
    out, _ = flash_fwd(q, k, v, 96 ** -0.5, causal, False)
    assert split_launches[-1] == kernel, split_launches
    ref = attention_math(*(t.double() for t in (q, k, v)), is_causal=causal)
    assert_within_bar("out", out, attention_same_dtype(q, k, v, is_causal=causal), ref)
