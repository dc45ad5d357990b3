"""torch.library contracts of fa_backend::triton_flash_fwd / _bwd: opcheck, fakes, torch.compile."""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend.ops import triton_flash_bwd, triton_flash_fwd
from tests.conftest import DEVICE
from tests.reference import attention_math

pytestmark = pytest.mark.usefixtures("poisoned")


def _inputs(b=1, hq=2, hkv=1, sq=20, sk=24, d=16, dv=16, transposed=False, grad=False):
    if transposed:  # (b, s, h, d) memory viewed as (b, h, s, d)
        q = torch.randn(b, sq, hq, d, dtype=torch.float16, device=DEVICE).transpose(1, 2)
        k = torch.randn(b, sk, hkv, d, dtype=torch.float16, device=DEVICE).transpose(1, 2)
        v = torch.randn(b, sk, hkv, dv, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    else:
        q = torch.randn(b, hq, sq, d, dtype=torch.float16, device=DEVICE)
        k = torch.randn(b, hkv, sk, d, dtype=torch.float16, device=DEVICE)
        v = torch.randn(b, hkv, sk, dv, dtype=torch.float16, device=DEVICE)
    return [t.requires_grad_(grad) for t in (q, k, v)]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("is_causal,bottom_right", [(False, False), (True, False), (True, True)])
def test_opcheck_fwd(is_causal, bottom_right, transposed):
    q, k, v = _inputs(transposed=transposed, grad=True)
    torch.library.opcheck(triton_flash_fwd, (q, k, v, None, is_causal, bottom_right))
    if is_causal and bottom_right and transposed:  # an explicit scale: once (the same schema and fake)
        torch.library.opcheck(triton_flash_fwd, (q, k, v, 0.3, is_causal, bottom_right))


def test_opcheck_bwd():
    q, k, v = _inputs(d=32, dv=16)
    out, lse = triton_flash_fwd(q, k, v, None, True, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(triton_flash_bwd, (dout, q, k, v, out, lse, None, None, True, True))
    torch.library.opcheck(triton_flash_bwd, (dout, q, k, v, out, lse, torch.randn_like(lse), 0.2, False, False))


@pytest.mark.parametrize("transposed", [False, True])
def test_fake_matches_real_metadata(transposed):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _inputs(d=32, dv=16, transposed=transposed)
    real = triton_flash_fwd(q, k, v, None, False, False)
    real_grads = triton_flash_bwd(torch.randn_like(real[0]), q, k, v, *real, None, None, False, False)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = triton_flash_fwd(fq, fk, fv, None, False, False)
        fake_grads = triton_flash_bwd(torch.empty_like(fake[0]), fq, fk, fv, *fake, None, None, False, False)
    for r, f in zip((*real, *real_grads), (*fake, *fake_grads)):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_fullgraph_matches_eager(backend, dynamic):
    def block(q, k, v):
        o = fa_backend.attention(q, k, v, is_causal=True, causal_alignment="bottom_right")
        return (o.transpose(1, 2).flatten(2) * 2).sum(-1)

    compiled = torch.compile(block, fullgraph=True, backend=backend, dynamic=dynamic)
    q, k, v = _inputs(sq=20, sk=24, grad=True)
    eager = block(q, k, v)
    got = compiled(q, k, v)
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    g_eager = torch.autograd.grad(eager.sum(), (q, k, v))
    g_comp = torch.autograd.grad(compiled(q, k, v).sum(), (q, k, v))
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_compiled_graph_holds_the_op():
    seen = []

    def recorder(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: fa_backend.attention(q, k, v), fullgraph=True, backend=recorder)
    q, k, v = _inputs()
    torch.testing.assert_close(fn(q, k, v), fa_backend.attention(q, k, v), rtol=0, atol=0)
    assert any("fa_backend.triton_flash_fwd" in s for s in seen), seen


def test_matches_reference_after_compile():
    q, k, v = _inputs(hq=4, hkv=2, sq=30, sk=30, d=32)
    fn = torch.compile(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=True), fullgraph=True, backend="aot_eager")
    ref = attention_math(q.double(), k.double(), v.double(), is_causal=True)
    assert (fn(q, k, v).double() - ref).abs().max() < 2e-3


@pytest.mark.parametrize("use_lse", [False, True])
def test_eager_twin_matches_the_op_bitwise(use_lse):
    from fa_backend.dispatch import counters
    from fa_backend.ops import triton_flash_attention

    q, k, v = _inputs(hq=4, hkv=2, sq=21, sk=37, d=32, dv=16, grad=True)
    counters.reset_stats()
    results = []
    for fn in (triton_flash_attention, triton_flash_fwd):
        out, lse = fn(q, k, v, 0.3, True, True)
        loss = (out.float() * torch.linspace(-1, 1, out.shape[-1], device=DEVICE)).sum()
        if use_lse:
            loss = loss + lse.sum()
        results.append((out, lse, *torch.autograd.grad(loss, (q, k, v))))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert counters.stats()["runs"] == {"triton": 2}


def _feature_args(q, kind):
    """(attn_mask, dropout_p, rng_state, window_left, window_right, softcap, alibi_slopes) for one case."""
    b, hq, sq = q.shape[:3]
    sk = 24
    none = [None, 0.0, None, -1, -1, 0.0, None]
    if kind == "bool_mask":
        none[0] = torch.rand(b, 1, 1, sk, device=DEVICE) > 0.3
    elif kind == "additive_mask":
        none[0] = torch.randn(sq, sk, device=DEVICE)
    elif kind == "dropout":
        none[1], none[2] = 0.25, torch.tensor([2**40 + 5, 3], dtype=torch.int64)
    elif kind == "window_softcap_alibi":
        none[3], none[4], none[5], none[6] = 6, 2, 3.0, torch.rand(hq, device=DEVICE)
    return none


FEATURE_CASES = ["bool_mask", "additive_mask", "dropout", "window_softcap_alibi"]


@pytest.mark.parametrize("kind", FEATURE_CASES)
def test_opcheck_fwd_features(kind):
    q, k, v = _inputs(sq=12, sk=24, grad=True)
    feats = _feature_args(q, kind)
    torch.library.opcheck(triton_flash_fwd, (q, k, v, None, True, True, *feats))


@pytest.mark.parametrize("kind", FEATURE_CASES)
def test_opcheck_bwd_features(kind):
    from fa_backend.ops import triton_flash_bwd_out

    q, k, v = _inputs(sq=12, sk=24, d=16)
    feats = _feature_args(q, kind)
    out, lse = triton_flash_fwd(q, k, v, None, False, False, *feats)
    dout = torch.randn_like(out)
    torch.library.opcheck(triton_flash_bwd, (dout, q, k, v, out, lse, None, None, False, False, *feats))
    grads = [torch.empty_like(t) for t in (q, k, v)]
    torch.library.opcheck(triton_flash_bwd_out, (dout, q, k, v, out, lse, None, *grads, None, False, False, *feats))


@pytest.mark.parametrize("kind", FEATURE_CASES)
def test_eager_twin_matches_the_op_bitwise_with_features(kind):
    from fa_backend.dispatch import counters
    from fa_backend.ops import triton_flash_attention

    q, k, v = _inputs(hq=2, hkv=1, sq=12, sk=24, d=16, grad=True)
    mask, p, rng, wl, wr, cap, slopes = _feature_args(q, kind)
    counters.reset_stats()
    results = []
    for use_op in (False, True):
        if use_op:
            out, lse = triton_flash_fwd(q, k, v, 0.3, True, True, mask, p, rng, wl, wr, cap, slopes)
        else:
            out, lse = triton_flash_attention(q, k, v, 0.3, True, True, attn_mask=mask, dropout_p=p, rng_state=rng,
                                              window_left=wl, window_right=wr, softcap=cap, alibi_slopes=slopes)
        loss = (out.float() * torch.linspace(-1, 1, out.shape[-1], device=DEVICE)).sum() + lse.clamp_min(-1e4).sum()
        results.append((out, lse, *torch.autograd.grad(loss, (q, k, v))))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert counters.stats()["runs"] == {"triton": 2}


def test_fake_matches_real_metadata_with_features():
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _inputs(sq=12, sk=24, d=32, dv=16, transposed=True)
    feats = _feature_args(q, "bool_mask")
    feats[1], feats[2] = 0.1, torch.tensor([2**40, 0], dtype=torch.int64)
    real = triton_flash_fwd(q, k, v, None, False, False, *feats)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fmask = mode.from_tensor(feats[0])
        fake = triton_flash_fwd(fq, fk, fv, None, False, False, fmask, *feats[1:])
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)


def test_compile_with_mask_and_dropout_matches_eager():
    q, k, v = _inputs(sq=12, sk=24, grad=True)
    mask = torch.rand(1, 1, 1, 24, device=DEVICE) > 0.3

    def block(q, k, v):
        return fa_backend.attention(q, k, v, attn_mask=mask, window_size=(8, -1)).sum(-1)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), block(q, k, v), rtol=0, atol=0)
    drop = torch.compile(lambda q, k, v: fa_backend.attention(q, k, v, dropout_p=0.2), fullgraph=True,
                         backend="aot_eager")
    out = drop(q, k, v)
    assert torch.isfinite(out).all() and out.shape == q.shape
