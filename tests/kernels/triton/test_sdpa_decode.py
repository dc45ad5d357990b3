"""The split-KV decode kernel on SDPA calls (fa_backend::triton_sdpa_decode): attn_mask, top-left causal, GQA.

CPU: Triton's interpreter, fp16, small shapes. Every case is checked against a float64 reference with the
2x-PyTorch-same-dtype-error rule (tests/reference.py); outputs are poisoned (NaN) before each launch so
unwritten elements fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa_backend
from fa_backend.kernels.triton import decode
from tests.conftest import DEVICE
from tests.reference import check_features, max_err

pytestmark = pytest.mark.usefixtures("poisoned")

DT = torch.float16


def _qkv(b=2, hq=4, hkv=2, sq=1, sk=37, d=32, dtype=DT):
    return (torch.randn(b, hq, sq, d, dtype=dtype, device=DEVICE), torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE),
            torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE))


def _op(q, k, v, attn_mask=None, is_causal=False, bottom_right=False, scale=None):
    return torch.ops.fa_backend.triton_sdpa_decode(q, k, v, attn_mask, is_causal, bottom_right, scale)


def _check(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """The op's output against the float64 reference (top-left causal, SDPA's)."""
    return check_features(lambda q, k, v: _op(q, k, v, attn_mask, is_causal, scale=scale)[0], q, k, v, grad=False,
                          attn_mask=attn_mask, is_causal=is_causal, scale=scale)


def _keep(shape, p_keep=0.7):
    return torch.rand(shape, device=DEVICE) < p_keep


def _additive(keep, dtype):
    return (torch.randn(keep.shape, device=DEVICE) * 2).masked_fill(~keep, float("-inf")).to(dtype)


# -------------------------------------------------------------------------------- masks

B, HQ, SQ, SK = 2, 4, 3, 37
SHAPES = {"full": (B, HQ, SQ, SK), "key_padding": (B, 1, 1, SK), "hf": (B, 1, SQ, SK), "per_head": (1, HQ, 1, SK),
          "q_k": (SQ, SK), "k": (SK,), "per_query": (B, 1, SQ, 1)}


@pytest.mark.parametrize("shape,kind", [("full", "bool"), ("key_padding", "bool"), ("hf", "additive_fp16"),
                                        ("per_head", "additive_fp32"), ("q_k", "bool"), ("k", "additive_fp16"),
                                        ("per_query", "bool"), ("full", "additive_fp32")])
def test_mask_kinds_and_broadcast_shapes(shape, kind):
    # GQA 4:2: the mask's head of packed row g * sq + i is hk * GROUP + g, not hk.
    keep = _keep(SHAPES[shape], 0.85 if shape == "per_query" else 0.7)
    mask = keep if kind == "bool" else _additive(keep, torch.float16 if kind == "additive_fp16" else torch.float32)
    _check(*_qkv(B, HQ, 2, SQ, SK), attn_mask=mask)


def test_mask_head_index_under_gqa():
    # One head of each GQA group sees only key 0: wrong head indexing would mix the groups' masks up.
    q, k, v = _qkv(1, 4, 2, 1, 20)
    keep = torch.ones(1, 4, 1, 20, dtype=torch.bool, device=DEVICE)
    keep[:, 1, :, 1:] = False
    keep[:, 2, :, 1:] = False
    out = _check(q, k, v, attn_mask=keep)
    assert torch.equal(out[0, 1, 0], v[0, 0, 0]) and torch.equal(out[0, 2, 0], v[0, 1, 0])


def test_mask_read_through_strides_never_expanded():
    # A static cache's mask sliced to the keys in use (strided rows) and an expanded view (stride 0) give
    # the same as the small contiguous mask.
    q, k, v = _qkv(2, 4, 2, 2, 30)
    big = _keep((2, 1, 2, 64))
    sliced = big[..., :30]
    assert not sliced.is_contiguous()
    out = _check(q, k, v, attn_mask=sliced)
    assert torch.equal(out, _op(q, k, v, sliced.contiguous())[0])
    assert torch.equal(out, _op(q, k, v, sliced.expand(2, 4, 2, 30))[0])


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_fully_masked_rows_match_math_backend(kind):
    # PyTorch's math SDPA on this torch gives 0 for a query whose keys are all masked (bool False or -inf).
    q, k, v = _qkv(2, 4, 2, 3, 40)
    keep = _keep((2, 4, 3, 40))
    keep[:, :, 1] = False
    keep[1, 3, 2] = False
    mask = keep if kind == "bool" else torch.zeros(keep.shape, device=DEVICE).masked_fill(~keep, float("-inf"))
    out, lse = _op(q, k, v, mask)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask if kind == "bool"
                                             else mask.double(), enable_gqa=True)
    assert (ref[:, :, 1] == 0).all() and (ref[1, 3, 2] == 0).all()
    assert (out[:, :, 1] == 0).all() and (out[1, 3, 2] == 0).all()
    assert torch.isneginf(lse[:, :, 1]).all() and torch.isneginf(lse[1, 3, 2])
    _check(q, k, v, attn_mask=mask)


def test_fully_masked_splits_are_merged_away():
    # Several key splits, the mask hiding whole splits: the merge must weigh empty splits by 0.
    q, k, v = _qkv(1, 2, 1, 1, 100)
    keep = torch.zeros(1, 1, 1, 100, dtype=torch.bool, device=DEVICE)
    keep[..., 70:75] = True
    mask = torch.zeros(keep.shape, device=DEVICE).masked_fill(~keep, float("-inf"))
    for splits in (1, 4, 7):
        def fn(q, k, v, splits=splits):
            out, _ = decode.decode_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 100, 0,
                                             scale=32 ** -0.5, attn_mask=mask, num_splits=splits)
            return out.transpose(1, 2)
        check_features(fn, q, k, v, grad=False, attn_mask=mask)


# ------------------------------------------------------------------ Hugging Face generation masks

def _hf_masks(b, sq, sk, pad, dtype):
    """The masks Hugging Face models pass at a generation step over a static cache of sk rows holding
    sk - sq past tokens: left padding (pad[i] rows) and causal over the new tokens, as an additive
    (b, 1, sq, sk) mask (-inf, or the dtype's minimum) and as a bool one."""
    i = torch.arange(sq, device=DEVICE)[:, None] + (sk - sq)
    j = torch.arange(sk, device=DEVICE)[None, :]
    keep = (j <= i)[None, None] & (j >= torch.tensor(pad, device=DEVICE)[:, None, None, None])
    neg_inf = torch.zeros(keep.shape, device=DEVICE, dtype=dtype).masked_fill(~keep, float("-inf"))
    neg_min = torch.zeros(keep.shape, device=DEVICE, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
    return {"additive_inf": neg_inf, "additive_min": neg_min, "bool": keep}


@pytest.mark.parametrize("form", ["additive_inf", "additive_min", "bool"])
@pytest.mark.parametrize("sq", [1, 4])
def test_hf_generation_masks(form, sq):
    b, sk = 3, 45
    mask = _hf_masks(b, sq, sk, [0, 5, 17], DT)[form]
    _check(*_qkv(b, 4, 4, sq, sk), attn_mask=mask)


def test_hf_key_padding_bool_mask_with_gqa():
    b, sk = 3, 50
    pad = torch.arange(sk, device=DEVICE)[None, :] >= torch.tensor([[0], [9], [30]], device=DEVICE)
    _check(*_qkv(b, 8, 2, 1, sk), attn_mask=pad[:, None, None, :])


# --------------------------------------------------------------------------- causal (top-left)

@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 20), (3, 3), (3, 40), (3, 2), (16, 16), (16, 50), (16, 5)])
def test_causal_is_top_left(sq, sk):
    out = _check(*_qkv(2, 4, 2, sq, sk), is_causal=True)
    assert out.shape == (2, 4, sq, 32)


def test_causal_single_query_sees_only_key_zero():
    # SDPA's is_causal with sq = 1: query 0 sees key 0 only, whatever the cache length (PyTorch's rule).
    q, k, v = _qkv(2, 4, 2, 1, 33)
    out, _ = _op(q, k, v, is_causal=True)
    assert torch.equal(out, v[:, :, :1].repeat_interleave(2, 1))
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    assert max_err(out, ref) == 0.0


def test_bottom_right_causal():
    q, k, v = _qkv(2, 4, 2, 3, 40)
    out = check_features(lambda q, k, v: _op(q, k, v, is_causal=True, bottom_right=True)[0], q, k, v, grad=False,
                         is_causal=True, bottom_right=True)
    top_left = _op(q, k, v, is_causal=True)[0]
    assert max_err(out, top_left) > 1e-2


def test_mask_together_with_causal():
    # The op accepts both (the router leaves that combination to PyTorch).
    q, k, v = _qkv(2, 4, 2, 5, 30)
    _check(q, k, v, attn_mask=_keep((2, 1, 5, 30), 0.8), is_causal=True)


# ------------------------------------------------------------------------------- GQA, layouts

@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 32), (8, 2, 64), (6, 1, 40), (4, 2, 128)])
def test_gqa_and_head_dims(hq, hkv, d):
    _check(*_qkv(2, hq, hkv, 2, 29, d), scale=0.3)


def test_splits_with_mask_and_causal():
    # Sixteen and a bit key tiles (16 keys under the interpreter, 64 on a GPU): the shape heuristic splits
    # the keys, and the merge runs.
    sk = 16 * decode.decode_config(32)[0] + 4
    assert decode.num_splits_heuristic(1, 2, 1, sk, decode.decode_config(32)[0], 132) > 1
    q, k, v = _qkv(1, 4, 2, 2, sk)
    _check(q, k, v, attn_mask=_additive(_keep((1, 4, 2, sk)), torch.float32))
    _check(q, k, v, is_causal=True)


def test_strided_views_of_a_static_cache():
    # q from a packed (b, s, h, d) projection, K/V a slice of a longer (b, s, h, d) cache: read in place.
    b, hq, hkv, sq, d, L = 2, 4, 2, 2, 32, 64
    q = torch.randn(b, sq, hq, d, dtype=DT, device=DEVICE).transpose(1, 2)
    cache_k = torch.randn(b, L, hkv, d, dtype=DT, device=DEVICE)
    cache_v = torch.randn(b, L, hkv, d, dtype=DT, device=DEVICE)
    k, v = cache_k[:, :41].transpose(1, 2), cache_v[:, :41].transpose(1, 2)
    _check(q, k, v, attn_mask=_keep((b, 1, 1, 41)))


def test_strided_head_dim_is_copied():
    # The kernel reads contiguous head_dim rows; the op copies K/V whose last dim is strided (the router
    # sends such calls to the dense kernel instead).
    q, k, v = _qkv(1, 2, 2, 1, 20, 32)
    k2 = torch.randn(1, 2, 20, 64, dtype=DT, device=DEVICE)[..., ::2]
    k2.copy_(k)
    assert torch.equal(_op(q, k2, v)[0], _op(q, k, v)[0])


def test_lse():
    q, k, v = _qkv(2, 4, 2, 3, 37)
    keep = _keep((2, 1, 3, 37))
    _, lse = _op(q, k, v, keep, scale=0.2)
    kk = k.double().repeat_interleave(2, 1)
    s = (q.double() @ kk.transpose(-1, -2) * 0.2).masked_fill(~keep, float("-inf"))
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 3)
    assert max_err(lse, torch.logsumexp(s, -1)) < 1e-3


def test_empty_sequences():
    q, k, v = _qkv(2, 4, 2, 1, 0)
    out, lse = _op(q, k, v, _keep((2, 1, 1, 0)))
    assert (out == 0).all() and torch.isneginf(lse).all()
    q, k, v = _qkv(2, 4, 2, 0, 10)
    assert _op(q, k, v)[0].shape == (2, 4, 0, 32)


def test_bad_input_raises():
    q, k, v = _qkv(1, 4, 2, 1, 10)
    with pytest.raises(ValueError, match="multiple"):
        _op(q[:, :3], k, v)
    with pytest.raises(fa_backend.BackendUnsupportedError, match=r"\[mask\]"):
        _op(q, k, v, torch.zeros(1, 1, 1, 10, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(fa_backend.BackendUnsupportedError, match=r"\[head_dim\] head_dim_v=16 != head_dim=32"):
        _op(q, k, v[..., :16])


def test_output_layout_and_opcheck():
    q, k, v = _qkv(2, 4, 2, 3, 20)
    out, _ = _op(q, k, v)
    assert out.stride() == torch.empty(2, 3, 4, 32).transpose(1, 2).stride()  # (b, sq, hq, d) memory
    mask = _additive(_keep((2, 1, 3, 20)), torch.float32)
    torch.library.opcheck(torch.ops.fa_backend.triton_sdpa_decode.default, (q, k, v, mask, False, False, 0.25))
    torch.library.opcheck(torch.ops.fa_backend.triton_sdpa_decode.default, (q, k, v, None, True, False, None))
