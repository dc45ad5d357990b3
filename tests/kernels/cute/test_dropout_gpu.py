"""Dropout in the CuTe forward on the H200 (issue 4 on the Hopper path): the warp-specialised forward's dropout
variants (flash_fwd_ws.fastest_kwargs) against the float64 reference that applies the Triton kernels' keep mask for
the same RNG state (kernels/triton.dropout_keep_mask), with the project's 2x rule; a mask that differed in one
score in a thousand would fail it (the dropped probabilities are O(1 / seqlen) of each row, out of bf16's reach
only when matched); the warp-specialised backward's dropout variant (d=128) the same way. Then the op
(fa_backend::cute_flash_fwd with dropout_p: the CuTe backward at d=128, the Triton kernels' elsewhere, both with the
same mask), reproducibility under torch.manual_seed, and SDPA routing. Needs the CuTe DSL and a
Hopper GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fa_backend
from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.reference import assert_grads_within_bar, assert_within_bar, attention_ref

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.cute,
              pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}"),
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]


def _qkv(b, hq, hkv, sq, sk, d, dtype, grad=False):
    return [torch.randn(b, h, s, d, device="cuda", dtype=dtype).requires_grad_(grad)
            for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


def _keep(q, k, p, rng):
    from fa_backend.kernels.triton import dropout_keep_mask

    return dropout_keep_mask(q.shape[0], q.shape[1], q.shape[2], k.shape[2], p, tuple(rng.tolist()), "cuda")


def _kernel_dropout(p, rng):
    from fa_backend.ops.cute_flash import _dropout_args

    return _dropout_args(torch.empty(0, device="cuda"), p, rng)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 300, 333), (2, 2, 1, 1000, 1100)])
def test_dropout_forward_within_bar(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk):
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.ops import new_rng_state

    p = 0.17
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype)
    rng = new_rng_state()
    out, lse = flash_fwd_fastest(q, k, v, None, causal, bottom_right, dropout=_kernel_dropout(p, rng))
    keep = _keep(q, k, p, rng)
    feats = dict(is_causal=causal, bottom_right=bottom_right, dropout_keep=keep, dropout_p=p)
    ref = attention_ref(q.double(), k.double(), v.double(), **feats)
    assert out.dtype == dtype and not out.isnan().any()
    assert_within_bar("out", out, attention_ref(q, k, v, **feats), ref)
    # the LSE is the one without dropout (the normaliser keeps every probability), as the Triton forward's
    _, lse_plain = flash_fwd_fastest(q, k, v, None, causal, bottom_right)
    seen = lse_plain > float("-inf")
    torch.testing.assert_close(lse[seen], lse_plain[seen], atol=0, rtol=0)


@pytest.mark.parametrize("d", [128, 64])
def test_dropout_with_a_key_mask(d):
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.ops import new_rng_state
    from fa_backend.ops.cute_flash import key_words

    p, (b, hq, hkv, sq, sk) = 0.3, (2, 8, 2, 700, 900)
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, torch.bfloat16)
    mask = torch.rand(b, hq, 1, sk, device="cuda") > 0.2
    rng = new_rng_state()
    out, _ = flash_fwd_fastest(q, k, v, None, False, False, key_words=key_words(mask, b, hq, sk),
                               dropout=_kernel_dropout(p, rng))
    feats = dict(attn_mask=mask, dropout_keep=_keep(q, k, p, rng), dropout_p=p)
    assert_within_bar("out", out, attention_ref(q, k, v, **feats), attention_ref(q.double(), k.double(), v.double(),
                                                                                    **feats))


def _assert_kernel_grads_within_bar(grads, q, k, v, dout, p, rng, causal, bottom_right):
    """A kernel's (dq, dk, dv) against the float64 reference with the kernels' mask for this RNG state, 2x rule."""
    feats = dict(is_causal=causal, bottom_right=bottom_right, dropout_keep=_keep(q, k, p, rng), dropout_p=p)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pt_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    truth = torch.autograd.grad(attention_ref(*ref_leaves, **feats), ref_leaves, dout.double())
    base = torch.autograd.grad(attention_ref(*pt_leaves, **feats), pt_leaves, dout)
    for name, ours, same, true in zip(("dq", "dk", "dv"), grads, base, truth):
        assert not ours.isnan().any(), name
        assert_within_bar(name, ours, same, true)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 300, 333), (2, 2, 1, 1000, 1100)])
def test_dropout_backward_within_bar(dtype, causal, bottom_right, b, hq, hkv, sq, sk):
    """The warp-specialised backward's dropout variant (d=128): a drawing warpgroup (flash_bwd_ws.DRAW_WARPGROUP)
    gives the MMA warpgroups the forward's mask; gradients against the float64 reference with that mask."""
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.ops import new_rng_state

    p = 0.17
    q, k, v = _qkv(b, hq, hkv, sq, sk, 128, dtype)
    rng = new_rng_state()
    dropout = _kernel_dropout(p, rng)
    out, lse = flash_fwd_fastest(q, k, v, None, causal, bottom_right, dropout=dropout)
    dout = torch.randn_like(out)
    grads = flash_bwd(dout, q, k, v, out, lse, causal=causal, bottom_right=bottom_right, wgs=2, warp_specialized=True,
                      dropout=dropout)
    _assert_kernel_grads_within_bar(grads, q, k, v, dout, p, rng, causal, bottom_right)


# the last: bottom-right rows that see no key (no tile in the causal layout of the saved bits)
SAVED_SHAPES = [(2, 4, 4, 256, 256), (1, 8, 2, 300, 333), (2, 2, 1, 1000, 1100), (1, 2, 2, 100, 700),
                (1, 2, 2, 700, 300)]


def _visible(q, k, causal, bottom_right):
    """(sq, sk) bool: the scores a causal mask leaves (all without one)."""
    sq, sk = q.shape[2], k.shape[2]
    rows = torch.arange(sq, device="cuda")[:, None] + (sk - sq if bottom_right else 0)
    return torch.arange(sk, device="cuda")[None, :] <= rows if causal else torch.ones(sq, sk, dtype=torch.bool,
                                                                                     device="cuda")


@pytest.mark.parametrize("period", [1, 2, 4])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SAVED_SHAPES)
def test_forward_saves_the_mask_it_draws(causal, bottom_right, b, hq, hkv, sq, sk, period):
    """The forward that saves its keep bits (kernels/keep_bits.py; of every period-th row of tiles, a causal call's
    in the causal layout) into a poisoned buffer: out and lse bit for bit those of the forward that does not; the
    bits are the kernels' mask on every visible score of the saved rows; every byte of the buffer is written (a
    second poison gives the same buffer), and without a causal mask (every tile visited) the whole buffer is what
    fill_keep_bits writes for the same RNG state."""
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.kernels.keep_bits import causal_offset, keep_bits_bytes
    from fa_backend.kernels.triton.keep_bits import fill_keep_bits, keep_saved_rows, unpack_keep_bits
    from fa_backend.ops import new_rng_state

    p = 0.17
    q, k, v = _qkv(b, hq, hkv, sq, sk, 128, torch.bfloat16)
    rng = new_rng_state()
    dropout = _kernel_dropout(p, rng)
    diagonal = causal_offset(sq, sk, causal, bottom_right)
    bits = torch.full((keep_bits_bytes(b, hq, sq, sk, period, diagonal),), 0xA5, dtype=torch.uint8, device="cuda")
    out, lse = flash_fwd_fastest(q, k, v, None, causal, bottom_right, dropout=(*dropout, bits))
    plain_out, plain_lse = flash_fwd_fastest(q, k, v, None, causal, bottom_right, dropout=dropout)
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    seen = _visible(q, k, causal, bottom_right) & keep_saved_rows(sq, period, "cuda")[:, None]
    seen = seen.expand(b, hq, sq, sk)
    assert torch.equal(unpack_keep_bits(bits, b, hq, sq, sk, period, diagonal)[seen], _keep(q, k, p, rng)[seen])
    again = torch.full_like(bits, 0x5A)
    flash_fwd_fastest(q, k, v, None, causal, bottom_right, dropout=(*dropout, again))
    assert torch.equal(again, bits)
    if not causal:
        assert torch.equal(bits, fill_keep_bits(torch.zeros_like(bits), b, hq, sq, sk, p, tuple(rng.tolist()),
                                                period))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", SAVED_SHAPES)
@pytest.mark.parametrize("period", [1, 2, 4])
def test_backward_on_saved_bits(dtype, causal, bottom_right, b, hq, hkv, sq, sk, period):
    """The backward's keep_bits variant, whose drawing warps load the forward's saved bytes instead of drawing (with
    a period: of the saved rows of tiles, and draw the others' bits): dK and dV bit for bit those of the variant that
    draws (the same mask, the same sums in each CTA), dQ (added by several CTAs in any order) and all three within
    the 2x bar of the float64 reference with the kernels' mask."""
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.kernels.keep_bits import causal_offset, keep_bits_bytes
    from fa_backend.ops import new_rng_state

    p = 0.17
    q, k, v = _qkv(b, hq, hkv, sq, sk, 128, dtype)
    rng = new_rng_state()
    dropout = _kernel_dropout(p, rng)
    bits = torch.empty(keep_bits_bytes(b, hq, sq, sk, period, causal_offset(sq, sk, causal, bottom_right)),
                       dtype=torch.uint8, device="cuda")
    out, lse = flash_fwd_fastest(q, k, v, None, causal, bottom_right, dropout=(*dropout, bits))
    dout = torch.randn_like(out)
    args = dict(causal=causal, bottom_right=bottom_right, wgs=2, warp_specialized=True)
    grads = flash_bwd(dout, q, k, v, out, lse, dropout=(*dropout, bits), **args)
    drawn = flash_bwd(dout, q, k, v, out, lse, dropout=dropout, **args)
    assert torch.equal(grads[1], drawn[1]) and torch.equal(grads[2], drawn[2])
    _assert_kernel_grads_within_bar(grads, q, k, v, dout, p, rng, causal, bottom_right)


def test_op_saves_bits_only_where_they_are_read_and_within_budget(monkeypatch):
    """cute_flash_attention saves the keep bits for calls that will be differentiated (within KEEP_BITS_BUDGET), not
    for calls without gradients; the gradients on saved bits are those on drawn ones (dK and dV bit for bit)."""
    from fa_backend.kernels.cute import flash_bwd
    from fa_backend.kernels import keep_bits
    from fa_backend.ops import cute_flash, cute_flash_attention, new_rng_state

    kinds = []
    real = flash_bwd.flash_bwd
    monkeypatch.setattr(flash_bwd, "flash_bwd", lambda *a, **kw: kinds.append(len(kw["dropout"])) or real(*a, **kw))
    saved = []
    real_fwd = cute_flash._keep_bits_out
    monkeypatch.setattr(cute_flash, "_keep_bits_out",
                        lambda q, k, v, keep, *causal: saved.append(keep) or real_fwd(q, k, v, keep, *causal))
    q, k, v = _qkv(2, 8, 2, 700, 900, 128, torch.bfloat16, grad=True)
    rng = new_rng_state()
    with torch.no_grad():
        cute_flash_attention(q, k, v, None, True, dropout_p=0.2, rng_state=rng)
    runs = []
    for budget in (1.0, 0.0):
        monkeypatch.setattr(keep_bits, "KEEP_BITS_BUDGET", budget)
        out = cute_flash_attention(q, k, v, None, True, dropout_p=0.2, rng_state=rng)[0]
        runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert saved == [False, True, False] and kinds == [4, 3]
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    # a budget that holds every second row of tiles only: those are saved, the backward draws the rest
    inputs = 2 * (2 * 8 * 700 + 2 * 2 * 900) * 256
    half_budget = keep_bits.keep_bits_bytes(2, 8, 700, 900, 2, 0) / inputs * (1 + 1e-6)  # causal top-left
    monkeypatch.setattr(keep_bits, "KEEP_BITS_BUDGET", half_budget)
    assert cute_flash._keep_layout(q, k, v, True) == (2, 0)
    out = cute_flash_attention(q, k, v, None, True, dropout_p=0.2, rng_state=rng)[0]
    halves = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert saved[-1] and kinds[-1] == 4
    assert torch.equal(halves[1], runs[1][1]) and torch.equal(halves[2], runs[1][2])
    # dQ: fp32 adds from several CTAs in either order, then one rounding to bf16 (a flip of its last bit at most)
    torch.testing.assert_close(runs[0][0].float(), runs[1][0].float(), atol=1e-3, rtol=2**-6)


@pytest.mark.parametrize("causal", [False, True])
def test_op_fills_the_bits_when_the_forward_falls_back(monkeypatch, causal):
    """A keep_bits forward whose CuTe variant failed to compile runs the Triton forward and fills the bits with the
    same mask (fill_keep_bits; a causal call's in the causal layout, bottom-right): the CuTe backward on them meets
    the 2x bar."""
    from fa_backend.kernels.cute import flash_fwd_ws
    from fa_backend.kernels.cute._compile_cache import CompileFailedError
    from fa_backend.kernels.cute.flash_fwd import variant_key
    from fa_backend.ops import cute_flash_attention, new_rng_state

    def fail(q, *args, **kwargs):
        raise CompileFailedError(variant_key("test", (128, 128, 2), q.dtype, 128, False, False), "test")

    monkeypatch.setattr(flash_fwd_ws, "flash_fwd_fastest", fail)
    p, rng = 0.2, new_rng_state()
    q, k, v = _qkv(1, 4, 4, 384, 512, 128, torch.bfloat16, grad=True)
    fa_backend.reset_stats()
    out = cute_flash_attention(q, k, v, None, causal, causal, dropout_p=p, rng_state=rng)[0]
    assert fa_backend.stats()["runs"] == {"triton": 1}
    feats = dict(dropout_keep=_keep(q, k, p, rng), dropout_p=p, is_causal=causal, bottom_right=causal)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pt_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, pt = attention_ref(*ref_leaves, **feats), attention_ref(*pt_leaves, **feats)
    assert_grads_within_bar(out, (q, k, v), pt, pt_leaves, ref, ref_leaves)


def test_the_mask_is_the_triton_forwards():
    """Same RNG state, same scores dropped: the CuTe and Triton forwards agree to their own rounding, and a
    different seed moves the CuTe result far beyond it."""
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.kernels.triton import flash_fwd
    from fa_backend.ops import new_rng_state

    q, k, v = _qkv(2, 4, 4, 1024, 1024, 128, torch.bfloat16)
    rng = new_rng_state()
    ours, _ = flash_fwd_fastest(q, k, v, None, True, False, dropout=_kernel_dropout(0.1, rng))
    triton, _ = flash_fwd(q, k, v, 128 ** -0.5, True, False, dropout_p=0.1, rng=tuple(rng.tolist()))
    close = (ours.float() - triton.float()).abs().max().item()
    other, _ = flash_fwd_fastest(q, k, v, None, True, False, dropout=_kernel_dropout(0.1, new_rng_state()))
    assert close < 2e-2 < (other.float() - ours.float()).abs().max().item()


@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, True), (256, False)])
def test_op_forward_and_gradients_within_bar(d, causal, monkeypatch):
    """fa_backend::cute_flash_fwd with dropout: the CuTe forward, then the backward regenerating the same mask (the
    CuTe one at d=128, ops.cute_flash.DROPOUT_BACKWARD; the Triton one elsewhere); gradients against the float64
    reference with that mask."""
    from fa_backend.kernels.cute import flash_bwd
    from fa_backend.ops import cute_flash_attention, new_rng_state

    cute_runs = []
    real = flash_bwd.flash_bwd
    monkeypatch.setattr(flash_bwd, "flash_bwd", lambda *a, **kw: cute_runs.append(kw) or real(*a, **kw))
    p, (b, hq, hkv, sq, sk) = 0.2, (2, 8, 2, 512, 640)
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, torch.bfloat16, grad=True)
    rng = new_rng_state()
    fa_backend.reset_stats()
    out = cute_flash_attention(q, k, v, None, causal, True, dropout_p=p, rng_state=rng)[0]
    assert fa_backend.stats()["runs"] == {"cute": 1}
    feats = dict(is_causal=causal, bottom_right=True, dropout_keep=_keep(q, k, p, rng), dropout_p=p)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    pt_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref, pt = attention_ref(*ref_leaves, **feats), attention_ref(*pt_leaves, **feats)
    assert_within_bar("out", out, pt, ref)
    assert_grads_within_bar(out, (q, k, v), pt, pt_leaves, ref, ref_leaves)
    # at d=128 the forward saved its keep bits and the backward read them (the dropout argument's fourth element)
    assert [len(kw["dropout"]) for kw in cute_runs] == ([4] if d == 128 else [])


def test_op_is_reproducible_under_manual_seed():
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(2, 4, 4, 512, 512, 128, torch.bfloat16)
    torch.manual_seed(3)
    first = cute_flash_attention(q, k, v, dropout_p=0.1)[0]
    second = cute_flash_attention(q, k, v, dropout_p=0.1)[0]
    torch.manual_seed(3)
    again = cute_flash_attention(q, k, v, dropout_p=0.1)[0]
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_dropout_p_needing_32_bit_draws_is_refused():
    from fa_backend.dispatch.reasons import BackendUnsupportedError
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(1, 2, 2, 256, 256, 128, torch.bfloat16)
    with pytest.raises(BackendUnsupportedError, match="32-bit"):
        cute_flash_attention(q, k, v, dropout_p=0.01)


@pytest.fixture
def clean():
    fa_backend.disable()
    fa_backend.reset_stats()
    yield
    fa_backend.disable()


def test_routed_dropout_calls_run_cute_where_the_backward_reads_saved_bits(clean, monkeypatch):
    """SDPA with dropout_p=0.1 at d=128: without gradients the CuTe forward runs it; with gradients the CuTe kernels
    where the forward saves its keep bits (MHA from 2k tokens within the memory budget: the backward reading them beat
    cuDNN's), cuDNN otherwise (1k tokens, a zero budget: dispatch/preference.py)."""
    from fa_backend.kernels import keep_bits

    def runs(s, grad):
        q, k, v = _qkv(4, 16, 16, s, s, 128, torch.bfloat16, grad=grad)
        fa_backend.reset_stats()
        with fa_backend.enabled():
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
            if grad:
                out.sum().backward()
        return fa_backend.stats()["runs"]

    assert runs(2048, False) == {"cute": 1}
    assert runs(2048, True) == {"cute": 1}
    assert runs(1024, True) == {"torch": 1}
    monkeypatch.setattr(keep_bits, "KEEP_BITS_BUDGET", 0.0)
    assert runs(2048, True) == {"torch": 1}


def test_opcheck_with_dropout():
    from fa_backend.ops import cute_flash_fwd, new_rng_state

    q, k, v = _qkv(1, 4, 2, 300, 300, 128, torch.bfloat16, grad=True)
    torch.library.opcheck(cute_flash_fwd, (q, k, v, None, True, False, None, 0.25, new_rng_state()))
    torch.library.opcheck(cute_flash_fwd, (q, k, v, None, True, False, None, 0.25, new_rng_state(), True))
