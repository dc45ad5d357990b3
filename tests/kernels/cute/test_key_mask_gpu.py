"""The CuTe kernels' bool key masks on the H200 (issue 4 on the Hopper path): the warp-specialised forward in the
op's variants (flash_fwd_ws.FASTEST) and the warp-specialised backward (d=128 with 64 and 80 query rows per step,
d=64 with 128, flash_bwd_wide at d=192 / 256) with a key mask packed 32 keys per word (ops.cute_flash.key_words), against the float64 reference
with the project's 2x rule (the same-dtype reference as the baseline). Masks: key padding with a fully masked
sequence, a padding length per head (the key bound that skips blocks differs within a GQA group), a random
mask per head, one broadcast over the batch; seqlen_k not a multiple of 32 or 128; GQA; both
causal alignments on top (the kernels compose them; the dispatcher does not route masks with is_causal). Needs the
DSL and a Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.reference import assert_within_bar, attention_ref

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.cute,
              pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}"),
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]

BACKWARDS = {"ws64": dict(wgs=2, warp_specialized=True), "ws80": dict(wgs=2, warp_specialized=True, tile_m=80),
             "ws128": dict(wgs=2, warp_specialized=True, tile_m=128), "wide": dict(wgs=2, warp_specialized=True)}


def _mask(kind: str, b: int, hq: int, sk: int) -> torch.Tensor:
    """A bool key mask (True = attend) of one of the shapes SDPA callers pass."""
    if kind == "padding":  # (b, 1, 1, sk); the last sequence sees no key at all
        # at least two keys for the others: with one key in every batch every row's dS is exactly 0, so is PyTorch's
        # same-dtype dK, and the 2x rule's baseline with it, while a kernel that takes delta as rowsum(dO * O) from
        # the rounded O (FlashAttention's identity) leaves rounding-sized dK (seen: 1.5e-5 at d=192, seed 1733877755)
        lengths = torch.randint(2, sk + 1, (b,), device="cuda")
        lengths[-1] = 0
        return (torch.arange(sk, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    if kind == "head_padding":  # (b, hq, 1, sk): a length per (batch, head), so the heads of a GQA group differ
        lengths = torch.randint(0, sk + 1, (b, hq), device="cuda")
        return (torch.arange(sk, device="cuda") < lengths[..., None])[:, :, None, :]
    if kind == "per_head":  # (b, hq, 1, sk), about 30 % of the keys hidden
        return torch.rand(b, hq, 1, sk, device="cuda") > 0.3
    return (torch.rand(sk, device="cuda") > 0.5)[None, None, None, :]  # (1, 1, 1, sk)


def _run(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, kind, backward):
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.ops.cute_flash import key_words

    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype) for _ in range(2))
    mask = _mask(kind, b, hq, sk)
    words = key_words(mask, b, hq, sk)
    out, lse = flash_fwd_fastest(q, k, v, None, causal, bottom_right, key_words=words)
    feats = dict(attn_mask=mask, is_causal=causal, bottom_right=bottom_right)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_ref(*ref_leaves, **feats)
    pt_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    pt = attention_ref(*pt_leaves, **feats)
    assert out.dtype == dtype and not out.isnan().any()
    assert_within_bar("out", out, pt, ref)
    if backward is None:
        return
    dout = torch.randn_like(out)
    grads = flash_bwd(dout, q, k, v, out, lse, causal=causal, bottom_right=bottom_right, key_words=words,
                      **BACKWARDS[backward])
    truth = torch.autograd.grad(ref, ref_leaves, dout.double())
    base = torch.autograd.grad(pt, pt_leaves, dout)
    for name, ours, same, true in zip(("dq", "dk", "dv"), grads, base, truth):
        assert not ours.isnan().any(), name
        assert_within_bar(name, ours, same, true)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["padding", "head_padding", "per_head", "broadcast"])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("d,backward", [(128, "ws64"), (128, "ws80"), (64, "ws128"), (96, None), (192, "wide"),
                                        (256, "wide")])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(3, 4, 4, 256, 256), (2, 8, 2, 300, 333), (2, 2, 1, 1000, 1100)])
def test_key_mask_within_bar(dtype, kind, causal, bottom_right, d, backward, b, hq, hkv, sq, sk):
    _run(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, kind, backward)


def test_key_mask_through_the_tensor_convention(monkeypatch):
    """The same with _fast_call off (the from_dlpack convention of both kernels)."""
    from fa_backend.kernels.cute import _fast_call

    monkeypatch.setattr(_fast_call, "ENABLED", False)
    _run(torch.bfloat16, 128, False, False, 2, 8, 2, 300, 333, "padding", "ws64")
    _run(torch.bfloat16, 64, True, True, 2, 8, 2, 300, 333, "per_head", "ws128")


def test_all_open_mask_matches_no_mask():
    """A mask that hides nothing: the forward takes its all-open branch on every block, the backward subtracts 0.0
    from every score (one rounding more than the unmasked variant's fused multiply-add: bitwise equality failed on
    the H200, so the gradients are compared within bf16 rounding; dq's fp32 additions run in no fixed order)."""
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.ops.cute_flash import key_words

    q, k, v = (torch.randn(2, 4, 512, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    words = key_words(torch.ones(2, 1, 1, 512, dtype=torch.bool, device="cuda"), 2, 4, 512)
    out, lse = flash_fwd_fastest(q, k, v)
    out_m, lse_m = flash_fwd_fastest(q, k, v, key_words=words)
    torch.testing.assert_close(out_m, out, rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(lse_m, lse, rtol=1e-6, atol=1e-6)
    dout = torch.randn_like(out)
    plain = flash_bwd(dout, q, k, v, out, lse, **BACKWARDS["ws64"])
    masked = flash_bwd(dout, q, k, v, out, lse, key_words=words, **BACKWARDS["ws64"])
    for a, m in zip(plain, masked):
        torch.testing.assert_close(m, a, rtol=2**-7, atol=1e-4)
