"""GPU numerics of the optional features at real sizes (bf16 and fp16): masks, dropout, window,
softcap, ALiBi, with causal and GQA; determinism; SDPA routing of masked / dropout calls.

Same rule as the CPU tests (tests/reference.check_features: float64 reference, 2x the error of the
same computation in the input dtype). Skipped without CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fa_backend
from fa_backend.kernels.triton import dropout_keep_mask
from fa_backend.ops import new_rng_state, triton_flash_attention
from tests.reference import check_features

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned")]

DTYPES = [torch.bfloat16, torch.float16]


def _qkv(b, hq, hkv, sq, sk, d, dtype):
    def make(h, s):
        return torch.randn(b, s, h, d, dtype=dtype, device="cuda").transpose(1, 2)
    return make(hq, sq), make(hkv, sk), make(hkv, sk)


def _check(q, k, v, *, is_causal=False, bottom_right=False, attn_mask=None, window=(-1, -1), softcap=0.0,
           alibi_slopes=None):
    def fn(q, k, v):
        return fa_backend.attention(q, k, v, is_causal=is_causal, causal_alignment="bottom_right" if bottom_right
                                    else "top_left", attn_mask=attn_mask, window_size=window, softcap=softcap,
                                    alibi_slopes=alibi_slopes)
    return check_features(fn, q, k, v, is_causal=is_causal, bottom_right=bottom_right, attn_mask=attn_mask,
                          window=window, softcap=softcap, alibi_slopes=alibi_slopes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", ["key_padding", "q_k", "bhqk"])
def test_masks_real_size(shape, d, dtype):
    b, h, s = 2, 8, 2048
    shapes = {"key_padding": (b, 1, 1, s), "q_k": (s, s), "bhqk": (b, h, s, s)}
    mask = torch.rand(shapes[shape], device="cuda") < 0.8
    if shape == "bhqk":
        mask = torch.randn(shapes[shape], device="cuda", dtype=dtype).masked_fill(~mask, float("-inf"))
    _check(*_qkv(b, h, h, s, s, d, dtype), attn_mask=mask)


def _structured_mask(kind, b, sq, sk, dtype):
    i = torch.arange(sq, device="cuda")[:, None]
    j = torch.arange(sk, device="cuda")[None, :]
    if kind == "causal":
        return j <= i
    if kind == "padding":
        lengths = torch.randint(sk // 3, sk + 1, (b, 1, 1, 1), device="cuda")
        lengths[0] = 1000  # not a multiple of any tile
        return j < lengths
    if kind == "documents":  # block-diagonal documents of uneven length, as in packed training
        cuts = torch.tensor([0, 700, 777, 2000, sq], device="cuda")
        doc_q = torch.bucketize(i, cuts, right=True)
        doc_k = torch.bucketize(j, cuts, right=True)
        return (doc_q == doc_k) & (j <= i)
    # additive: a causal -inf mask plus a bias on part of the rows (open, partial and hidden blocks)
    return torch.zeros(sq, sk, device="cuda", dtype=dtype).masked_fill(j > i, float("-inf")).masked_fill(
        (i > 1500) & (j < 300), -2.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kind", ["causal", "padding", "documents", "additive"])
def test_structured_masks_real_size(kind, d, dtype):
    # Large enough for the kernels to skip the mask's hidden blocks and not read it in its open ones
    # (kernels/triton/_mask_bounds.py); GQA, fwd and bwd against the float64 reference.
    from fa_backend.kernels.triton import _mask_bounds

    b, hq, hkv, s = 2, 8, 2, 2560
    assert _mask_bounds.worth_it(torch.ones(1, dtype=torch.bool, device="cuda"), b, hq, s, s, d)
    mask = _structured_mask(kind, b, s, s, dtype)
    _check(*_qkv(b, hq, hkv, s, s, d, dtype), attn_mask=mask)


def test_structured_mask_skips_hidden_keys_real_size():
    # NaN values in keys the padding mask hides from every query: a kernel that read them returns NaN.
    b, h, s, d = 2, 8, 4096, 128
    q, k, v = _qkv(b, h, h, s, s, d, torch.bfloat16)
    mask = torch.ones(b, 1, 1, s, dtype=torch.bool, device="cuda")
    mask[0, ..., 1000:] = False
    k[0, :, 1024:] = float("nan")
    v[0, :, 1024:] = float("nan")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa_backend.attention(*leaves, attn_mask=mask)
    assert torch.isfinite(out).all()
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert torch.isfinite(dq).all() and torch.isfinite(dk[0, :, :1024]).all() and torch.isfinite(dv[0, :, :1024]).all()
    ref = F.scaled_dot_product_attention(q[:1, :, :, :].float(), k[:1, :, :1000].float(), v[:1, :, :1000].float())
    assert (out[:1].float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bottom_right", [False, True])
def test_mask_causal_gqa_real_size(bottom_right, dtype):
    mask = torch.rand(2, 1, 1, 4096, device="cuda") < 0.9
    _check(*_qkv(2, 8, 2, 3000, 4096, 128, dtype), is_causal=True, bottom_right=bottom_right, attn_mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("window", [(256, 0), (512, 128), (1024, -1)])
def test_window_gqa_real_size(window, dtype):
    _check(*_qkv(2, 8, 2, 4096, 4096, 128, dtype), window=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_softcap_alibi_causal_real_size(d, dtype):
    slopes = torch.rand(8, device="cuda") * 0.1
    _check(*_qkv(2, 8, 8, 2048, 2048, d, dtype), is_causal=True, softcap=30.0, alibi_slopes=slopes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 128])
def test_dropout_real_size(d, dtype):
    b, h, s, p = 2, 8, 1024, 0.1
    q, k, v = _qkv(b, h, h, s, s, d, dtype)
    rng = new_rng_state()
    keep = dropout_keep_mask(b, h, s, s, p, tuple(rng.tolist()), "cuda")
    rate = keep.float().mean().item()
    assert abs(rate - (1 - p)) < 6 * math.sqrt(p * (1 - p) / keep.numel())

    def fn(q, k, v):
        return triton_flash_attention(q, k, v, None, True, False, dropout_p=p, rng_state=rng)[0]
    check_features(fn, q, k, v, is_causal=True, dropout_keep=keep, dropout_p=p)


def test_features_backward_deterministic_real_size():
    q, k, v = _qkv(2, 16, 4, 4096, 4096, 128, torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(2, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)
    kw = dict(attn_mask=torch.rand(2, 1, 1, 4096, device="cuda") < 0.9, window_size=(1024, 64), softcap=20.0,
              alibi_slopes=torch.rand(16, device="cuda") * 0.05)
    runs = []
    for _ in range(3):
        torch.manual_seed(3)
        runs.append(torch.autograd.grad(fa_backend.attention(*leaves, dropout_p=0.1, **kw), leaves, dout))
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["key_padding", "dropout"])
@pytest.mark.parametrize("d", [64, 128])
def test_sdpa_with_mask_or_dropout_is_routed_to_triton(case, d):
    # Routed to our kernel, except where the measured preference (dispatch/preference.py: sm90, d=128, dropout,
    # PyTorch picking cuDNN for these tensors) runs PyTorch's faster cuDNN kernel, with reason `slower`. On sm90
    # with the CuTe DSL installed both go to our CuTe kernels (the first choice where eligible; these calls need no
    # gradient, so the dropout rule for calls with gradients does not pass them over).
    from fa_backend.dispatch.backends import pytorch_choice
    from fa_backend.kernels.cute import DSL_AVAILABLE

    q, k, v = (torch.randn(2, 8, 2048, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kw = ({"attn_mask": torch.rand(2, 1, 1, 2048, device="cuda") < 0.8} if case == "key_padding"
          else {"dropout_p": 0.1})
    on_cute = DSL_AVAILABLE and torch.cuda.get_device_capability() == (9, 0)
    preferred = (torch.cuda.get_device_capability() == (9, 0) and not on_cute and d == 128 and case == "dropout"
                 and pytorch_choice(q, k, v, **kw) == "cudnn_attention")
    fa_backend.reset_stats()
    with fa_backend.enabled():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    stats = fa_backend.stats()
    if preferred:
        assert stats["runs"] == {"torch": 1} and stats["fallbacks"].get("triton:slower") == 1, stats
    else:
        assert stats["runs"] == {"cute" if on_cute else "triton": 1}, stats
    assert torch.isfinite(out).all()


def test_flash_attn_func_real_size():
    from fa_backend import flash_attn_qkvpacked_func

    qkv = torch.randn(2, 4096, 3, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(512, 0))
    (g,) = torch.autograd.grad(out, qkv, torch.randn_like(out))
    assert torch.isfinite(out).all() and torch.isfinite(g).all() and g.shape == qkv.shape
