"""fa_backend.flash_attn_varlen_func & co. (FlashAttention-2's varlen API) and the custom ops
fa_backend::triton_varlen_fwd / _bwd / _bwd_out: semantics against the per-sequence reference,
return values, counters, packed gradients written in one buffer, opcheck, fakes, torch.compile."""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from fa_backend.dispatch import counters
from fa_backend.ops import triton_varlen_bwd, triton_varlen_bwd_out, triton_varlen_fwd
from tests.conftest import DEVICE
from tests.kernels.triton.test_varlen import cu_seqlens, packed
from tests.reference import check_varlen

pytestmark = pytest.mark.usefixtures("poisoned")

LENS_Q, LENS_K = [6, 0, 13, 1], [9, 3, 13, 0]


@pytest.mark.parametrize("causal,window,softcap", [(True, (-1, -1), 0.0), (False, (5, 2), 2.0)])
def test_varlen_func_semantics(causal, window, softcap):
    q, k, v, cq, ck = packed(LENS_Q, LENS_K, 4, 2, 16)
    slopes = torch.rand(len(LENS_Q), 4, device=DEVICE) * 0.3

    def fn(q, k, v):
        return flash_attn_varlen_func(q, k, v, cq, ck, max(LENS_Q), max(LENS_K), causal=causal, window_size=window,
                                      softcap=softcap, alibi_slopes=slopes, deterministic=True,
                                      return_softmax_lse=True)
    check_varlen(fn, q, k, v, cq, ck, is_causal=causal, window=window, softcap=softcap, alibi_slopes=slopes)


def test_varlen_func_outputs_and_counters():
    q, k, v, cq, ck = packed(LENS_Q, LENS_K, 2, 1, 16)
    counters.reset_stats()
    out = flash_attn_varlen_func(q, k, v, cq, ck, 13, 13, causal=True)
    assert out.shape == (sum(LENS_Q), 2, 16) and out.is_contiguous() and out.dtype == q.dtype
    out2, lse = flash_attn_varlen_func(q, k, v, cq, ck, 13, 13, causal=True, return_softmax_lse=True)
    assert torch.equal(out, out2) and lse.shape == (2, sum(LENS_Q)) and lse.dtype == torch.float32
    assert fa_backend.stats()["runs"] == {"triton": 2}
    with pytest.raises(NotImplementedError, match="probabilities"):
        flash_attn_varlen_func(q, k, v, cq, ck, 13, 13, return_attn_probs=True)
    with pytest.raises(ValueError, match="total, nheads, headdim"):
        flash_attn_varlen_func(q[None], k, v, cq, ck, 13, 13)
    with pytest.raises(ValueError, match="int32"):
        flash_attn_varlen_func(q, k, v, cq.long(), ck, 13, 13)
    with pytest.raises(ValueError, match="same length"):
        flash_attn_varlen_func(q, k, v, cq[:-1], ck, 13, 13)
    with pytest.raises(fa_backend.BackendUnsupportedError, match="dtype"):
        flash_attn_varlen_func(q.float(), k.float(), v.float(), cq, ck, 13, 13)


def test_dropout_reproducible_under_manual_seed():
    q, k, v, cq, ck = packed(LENS_Q, LENS_K, 2, 2, 16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, dtype=q.dtype, device=DEVICE)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        out = flash_attn_varlen_func(*leaves, cq, ck, 13, 13, dropout_p=0.3)
        runs.append((out, *torch.autograd.grad(out, leaves, dout)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert not torch.equal(flash_attn_varlen_func(*leaves, cq, ck, 13, 13, dropout_p=0.3), runs[0][0])


@pytest.mark.parametrize("causal", [False, True])
def test_qkvpacked_writes_one_grad_buffer(causal, monkeypatch):
    from fa_backend.kernels import triton as kt

    lens = [7, 0, 12, 1]
    qkv = torch.randn(sum(lens), 3, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    cu = cu_seqlens(lens)
    dout = torch.randn(sum(lens), 2, 16, dtype=torch.float16, device=DEVICE)
    seen = {}
    real_bwd = kt.flash_bwd_varlen

    def spy(*args, **kw):
        if not seen:
            seen.update(dq=kw.get("dq"), dk=kw.get("dk"), dv=kw.get("dv"))
        return real_bwd(*args, **kw)

    monkeypatch.setattr(kt, "flash_bwd_varlen", spy)
    counters.reset_stats()
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 12, causal=causal, window_size=(4, -1))
    (g,) = torch.autograd.grad(out, qkv, dout)
    assert g.shape == qkv.shape and g.is_contiguous()
    for i, name in enumerate(("dq", "dk", "dv")):
        assert seen[name].data_ptr() == g[:, i].data_ptr()
        assert seen[name].untyped_storage().data_ptr() == g.untyped_storage().data_ptr()
    assert fa_backend.stats()["runs"] == {"triton": 1}
    # Same numbers as the unpacked function on the same views (bitwise).
    leaf = qkv.detach().requires_grad_()
    q, k, v = leaf.unbind(1)
    ref = flash_attn_varlen_func(q, k, v, cu, cu, 12, 12, causal=causal, window_size=(4, -1))
    (g_ref,) = torch.autograd.grad(ref, leaf, dout)
    assert torch.equal(out, ref) and torch.equal(g, g_ref)


def test_kvpacked_matches_unpacked():
    q, k, v, cq, ck = packed(LENS_Q, LENS_K, 4, 2, 16)
    q = q.requires_grad_()
    kv = torch.stack((k, v), 1).requires_grad_()
    out, lse = flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 13, 13, causal=True, softcap=3.0, return_softmax_lse=True)
    dout = torch.randn_like(out)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    q2, kv2 = q.detach().requires_grad_(), kv.detach().requires_grad_()
    ref, lse_ref = flash_attn_varlen_func(q2, kv2[:, 0], kv2[:, 1], cq, ck, 13, 13, causal=True, softcap=3.0,
                                          return_softmax_lse=True)
    dq2, dkv2 = torch.autograd.grad(ref, (q2, kv2), dout)
    assert torch.equal(out, ref) and torch.equal(lse, lse_ref) and torch.equal(dq, dq2) and torch.equal(dkv, dkv2)
    with pytest.raises(NotImplementedError):
        flash_attn_varlen_kvpacked_func(q, kv, cq, ck, 13, 13, return_attn_probs=True)


# ------------------------------------------------------------------------------ custom ops

def _op_args(kind, b, hq):
    """(dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes) for one case."""
    if kind == "dropout":
        return 0.25, torch.tensor([2**40 + 5, 3], dtype=torch.int64), -1, -1, 0.0, None
    if kind == "window_softcap_alibi":
        return 0.0, None, 5, 1, 3.0, torch.rand(b, hq, device=DEVICE)
    return 0.0, None, -1, -1, 0.0, None


@pytest.mark.parametrize("kind", ["plain", "dropout", "window_softcap_alibi"])
def test_opcheck(kind):
    lens_q, lens_k = [3, 0, 9], [5, 2, 9]
    q, k, v, cq, ck = packed(lens_q, lens_k, 2, 1, 16)
    feats = _op_args(kind, 3, 2)
    args = (cq, ck, 9, 9, None, True, *feats)
    torch.library.opcheck(triton_varlen_fwd, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *args))
    q, k, v = (t.detach() for t in (q, k, v))
    out, lse = triton_varlen_fwd(q, k, v, *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(triton_varlen_bwd, (dout, q, k, v, out, lse, None, *args))
    if kind == "plain":  # the LSE's gradient enters as delta - dlse whatever the features (CPU suite time)
        torch.library.opcheck(triton_varlen_bwd, (dout, q, k, v, out, lse, torch.randn_like(lse), *args))
    if kind == "plain":  # the out= variant: the same kernels as triton_varlen_bwd, checked above per feature set
        grads = [torch.empty_like(t) for t in (q, k, v)]
        torch.library.opcheck(triton_varlen_bwd_out, (dout, q, k, v, out, lse, None, *grads, *args))


def test_fake_matches_real_metadata():
    from torch._subclasses.fake_tensor import FakeTensorMode

    qkv = torch.randn(sum(LENS_Q), 3, 2, 16, dtype=torch.float16, device=DEVICE)
    q, k, v = qkv.unbind(1)  # strided views
    cq = ck = cu_seqlens(LENS_Q)
    real = triton_varlen_fwd(q, k, v, cq, ck, 13, 13, None, True)
    real_grads = triton_varlen_bwd(torch.randn_like(real[0]), q, k, v, *real, None, cq, ck, 13, 13, None, True)
    with FakeTensorMode() as mode:
        fq, fk, fv, fcq = (mode.from_tensor(t) for t in (q, k, v, cq))
        fake = triton_varlen_fwd(fq, fk, fv, fcq, fcq, 13, 13, None, True)
        fake_grads = triton_varlen_bwd(torch.empty_like(fake[0]), fq, fk, fv, *fake, None, fcq, fcq, 13, 13, None,
                                       True)
    for r, f in zip((*real, *real_grads), (*fake, *fake_grads)):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@pytest.mark.parametrize("use_lse", [False, True])
def test_eager_twin_matches_the_op_bitwise(use_lse):
    from fa_backend.ops import triton_varlen_attention

    q, k, v, cq, ck = packed(LENS_Q, LENS_K, 4, 2, 16)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    slopes = torch.rand(4, device=DEVICE)
    rng = torch.tensor([2**41, 7], dtype=torch.int64)
    counters.reset_stats()
    results = []
    for use_op in (False, True):
        args = (*leaves, cq, ck, 13, 13, 0.3, True)
        if use_op:
            out, lse = triton_varlen_fwd(*args, 0.2, rng, 6, -1, 2.0, slopes)
        else:
            out, lse = triton_varlen_attention(*args, dropout_p=0.2, rng_state=rng, window_left=6, softcap=2.0,
                                               alibi_slopes=slopes)
        loss = (out.float() * torch.linspace(-1, 1, out.shape[-1], device=DEVICE)).sum()
        if use_lse:
            loss = loss + lse.clamp_min(-1e4).sum()
        results.append((out, lse, *torch.autograd.grad(loss, leaves)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert counters.stats()["runs"] == {"triton": 2}


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(dynamic):
    q, k, v, cq, ck = packed(LENS_Q, LENS_K, 2, 1, 16)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def block(q, k, v, cq, ck):
        o = flash_attn_varlen_func(q, k, v, cq, ck, 13, 13, causal=True, window_size=(6, -1))
        return (o.flatten(1) * 2).sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    eager = block(*leaves, cq, ck)
    got = compiled(*leaves, cq, ck)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    g_eager = torch.autograd.grad(eager.sum(), leaves)
    g_comp = torch.autograd.grad(compiled(*leaves, cq, ck).sum(), leaves)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compile_packed_qkv_matches_eager():
    lens = [7, 0, 12]
    qkv = torch.randn(sum(lens), 3, 2, 16, dtype=torch.float16, device=DEVICE, requires_grad=True)
    cu = cu_seqlens(lens)

    def block(qkv, cu):
        return flash_attn_varlen_qkvpacked_func(qkv, cu, 12, causal=True).float().sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    eager = block(qkv, cu)
    torch.testing.assert_close(compiled(qkv, cu), eager, rtol=0, atol=0)
    (g_eager,) = torch.autograd.grad(eager.sum(), qkv)
    (g_comp,) = torch.autograd.grad(compiled(qkv, cu).sum(), qkv)
    torch.testing.assert_close(g_comp, g_eager, rtol=0, atol=0)
