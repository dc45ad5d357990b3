"""fa_backend.flash_attn_func & co.: FlashAttention-2 signatures, (b, s, h, d) layout, bottom-right
causal, packed inputs read as strided views and packed gradients written in one buffer."""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from fa_backend.dispatch import counters
from tests.conftest import DEVICE
from tests.reference import check_features

pytestmark = pytest.mark.usefixtures("poisoned")


def _bshd(b, s, h, d):
    return torch.randn(b, s, h, d, dtype=torch.float16, device=DEVICE)


def _to_bhsd(fn):
    # check_features works in (b, h, s, d): wrap an FA-layout function.
    return lambda q, k, v: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (6, 2), 2.0)])
def test_flash_attn_func_semantics(causal, window, softcap):
    q, k, v = _bshd(2, 17, 4, 16), _bshd(2, 30, 2, 16), _bshd(2, 30, 2, 16)
    slopes = torch.rand(4, device=DEVICE) * 0.2
    fn = _to_bhsd(lambda q, k, v: flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                                  alibi_slopes=slopes, deterministic=True))
    check_features(fn, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, bottom_right=True,
                   window=window, softcap=softcap, alibi_slopes=slopes)


def test_flash_attn_func_outputs_and_counters():
    q, k, v = _bshd(1, 9, 2, 16), _bshd(1, 9, 2, 16), _bshd(1, 9, 2, 16)
    counters.reset_stats()
    out = flash_attn_func(q, k, v, causal=True)
    assert out.shape == (1, 9, 2, 16) and out.is_contiguous()
    out2, lse = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    assert torch.equal(out, out2) and lse.shape == (1, 2, 9) and lse.dtype == torch.float32
    assert fa_backend.stats()["runs"] == {"triton": 2}
    with pytest.raises(NotImplementedError, match="probabilities"):
        flash_attn_func(q, k, v, return_attn_probs=True)
    with pytest.raises(ValueError, match="batch, seqlen, nheads, headdim"):
        flash_attn_func(q[0], k, v)


def test_dropout_reproducible():
    q = _bshd(1, 12, 2, 16)
    torch.manual_seed(5)
    a = flash_attn_func(q, q, q, dropout_p=0.3)
    torch.manual_seed(5)
    b = flash_attn_func(q, q, q, dropout_p=0.3)
    assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_matches_unpacked_and_writes_one_grad_buffer(causal, monkeypatch):
    from fa_backend.kernels import triton as kt

    qkv = torch.randn(2, 13, 3, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    dout = torch.randn(2, 13, 2, 16, dtype=torch.float16, device=DEVICE)
    seen = {}
    real_bwd = kt.flash_bwd

    def spy(*args, **kw):
        if not seen:
            seen.update(dq=kw.get("dq"), dk=kw.get("dk"), dv=kw.get("dv"))
        return real_bwd(*args, **kw)

    monkeypatch.setattr(kt, "flash_bwd", spy)
    counters.reset_stats()
    out = flash_attn_qkvpacked_func(qkv, causal=causal, window_size=(5, -1))
    (g,) = torch.autograd.grad(out, qkv, dout)
    # The kernels wrote dq, dk, dv straight into the returned gradient: no stack/cat copy.
    assert g.shape == qkv.shape and g.is_contiguous()
    for i, name in enumerate(("dq", "dk", "dv")):
        assert seen[name].data_ptr() == g[:, :, i].data_ptr()
        assert seen[name].untyped_storage().data_ptr() == g.untyped_storage().data_ptr()
    assert fa_backend.stats()["runs"] == {"triton": 1}
    # Same numbers as the unpacked function on the same views (bitwise).
    leaf = qkv.detach().requires_grad_()
    q, k, v = leaf.unbind(2)
    ref = flash_attn_func(q, k, v, causal=causal, window_size=(5, -1))
    (g_ref,) = torch.autograd.grad(ref, leaf, dout)
    assert torch.equal(out, ref) and torch.equal(g, g_ref)


def test_kvpacked_matches_unpacked():
    q = torch.randn(1, 11, 4, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    kv = torch.randn(1, 19, 2, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    out = flash_attn_kvpacked_func(q, kv, causal=True, softcap=3.0)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    q2, kv2 = q.detach().requires_grad_(), kv.detach().requires_grad_()
    ref = flash_attn_func(q2, kv2[:, :, 0], kv2[:, :, 1], causal=True, softcap=3.0)
    dq2, dkv2 = torch.autograd.grad(ref, (q2, kv2), dout)
    assert torch.equal(out, ref) and torch.equal(dq, dq2) and torch.equal(dkv, dkv2)
    with pytest.raises(NotImplementedError):
        flash_attn_kvpacked_func(q, kv, return_attn_probs=True)
