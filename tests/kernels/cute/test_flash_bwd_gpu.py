"""The sm90 CuTe backward (kernels/cute/flash_bwd.py) on the H200: dq, dk, dv against the float64 reference with
the project's 2x rule (PyTorch's same-dtype math as the baseline), for fp16 / bf16, d 64 / 128, both causal
alignments, GQA and partial tiles, on the CuTe forward's out and LSE. Needs the DSL and a Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.reference import assert_within_bar, attention_math, attention_same_dtype

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.cute,
              pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}"),
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 100, 333), (2, 2, 1, 333, 100),
                                             (1, 4, 2, 1000, 1100)])
def test_backward_within_bar(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk):
    check_backward(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk)


@pytest.mark.parametrize("causal", [False, True])
def test_atomic_dq_variant_within_bar(causal):
    check_backward(torch.bfloat16, 128, causal, True, 1, 8, 2, 300, 333, dq_atomic=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 100, 333), (2, 2, 1, 333, 100),
                                             (1, 4, 2, 1000, 1100), (1, 2, 2, 200, 64)])
@pytest.mark.parametrize("variant", ["stage_dq", "dq_buffer", "warp_specialized", "ws_tile80"])
def test_two_warpgroups_within_bar(dtype, causal, bottom_right, b, hq, hkv, sq, sk, variant):
    """wgs=2 (d=128): 128 keys per CTA; sk = 64 leaves the second warpgroup's keys all past seqlen_k. dq_buffer: the
    dQ block through its own buffer, dS through alternating tiles, one CTA barrier per step; warp_specialized
    (flash_bwd_ws): the same with a producer warpgroup for the loads and the dQ adds (sq = 1000: many steps per
    CTA, so every buffer and pipeline stage is reused); ws_tile80: the same with 80 query rows per step (the dQ GEMM
    transposed)."""
    check_backward(dtype, 128, causal, bottom_right, b, hq, hkv, sq, sk, wgs=2, **VARIANTS[variant])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 100, 333), (2, 2, 1, 333, 100),
                                             (1, 4, 2, 1000, 1100), (1, 2, 2, 200, 64)])
def test_tile128_d64_within_bar(dtype, causal, bottom_right, b, hq, hkv, sq, sk):
    """The warp-specialised kernel at d=64 with 128 query rows per step, the warpgroups splitting dQ by rows."""
    check_backward(dtype, 64, causal, bottom_right, b, hq, hkv, sq, sk, wgs=2, warp_specialized=True, tile_m=128)


@pytest.mark.parametrize("d,tile_m,deterministic", [(128, 64, False), (128, 80, False), (64, 128, False),
                                                    (128, 64, True), (192, 64, False), (256, 64, True)])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(1, 8, 2, 100, 333), (1, 4, 2, 1000, 1100), (1, 2, 2, 200, 64)])
def test_register_epilogue_within_bar(d, tile_m, deterministic, causal, bottom_right, b, hq, hkv, sq, sk):
    """The warp-specialised kernels (flash_bwd_ws; flash_bwd_wide at d=192 / 256) with tma_store=False: dK / dV from
    registers (rows past seqlen_k skipped); every other warp-specialised test runs the default, dK / dV through the
    K / V tiles and TMA stores (keys past seqlen_k clipped by the copy; sk = 64: the second warpgroup's tile
    wholly)."""
    check_backward(torch.bfloat16, d, causal, bottom_right, b, hq, hkv, sq, sk, wgs=2, warp_specialized=True,
                   tile_m=tile_m, deterministic=deterministic, repeat=3 if deterministic else 1, tma_store=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 96])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(1, 8, 2, 100, 333), (1, 4, 2, 1000, 1100)])
def test_dq_buffer_one_warpgroup_within_bar(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk):
    check_backward(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, dq_buffer=True)


@pytest.mark.parametrize("d,wgs,variant", [(128, 1, "stage_dq"), (128, 2, "stage_dq"), (128, 2, "dq_buffer"),
                                           (128, 2, "warp_specialized"), (128, 2, "ws_tile80"), (64, 2, "ws_tile128")])
@pytest.mark.parametrize("causal", [False, True])
def test_fast_call_path_within_bar(d, wgs, variant, causal, monkeypatch):
    """kernels/cute/_fast_call.py for the backward (pointers, sizes, strides), twice per shape (the second call
    from its cache)."""
    from fa_backend.kernels.cute import _fast_call

    monkeypatch.setattr(_fast_call, "ENABLED", True)
    for _ in range(2):
        check_backward(torch.bfloat16, d, causal, True, 1, 8, 2, 300, 333, wgs=wgs, **VARIANTS[variant])


VARIANTS = {"stage_dq": {}, "dq_buffer": dict(dq_buffer=True), "warp_specialized": dict(warp_specialized=True),
            "ws_tile80": dict(warp_specialized=True, tile_m=80), "ws_tile128": dict(warp_specialized=True, tile_m=128)}


@pytest.mark.parametrize("d,tile_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("bottom_right", [False, True])
def test_longest_first_order_over_several_l2_sections(d, tile_m, bottom_right):
    """8k queries of a GQA group of 2: a KV head's Q, dO and fp32 dQ take 16 MB at d=128 (L2 sections of 2 (batch,
    KV head) pairs) and 8 MB at d=64 (4 pairs), so the causal key blocks' longest-first order (_schedule) runs over
    several sections, the last one partial."""
    check_backward(torch.bfloat16, d, True, bottom_right, 1, 10, 5, 8192, 700, wgs=2, warp_specialized=True,
                   tile_m=tile_m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,tile_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(1, 8, 2, 100, 333), (2, 2, 1, 333, 100), (1, 4, 2, 1000, 1100)])
def test_deterministic_variant_within_bar_and_bitwise_stable(dtype, d, tile_m, causal, bottom_right, b, hq, hkv, sq,
                                                             sk):
    """The warp-specialised kernel with its dQ adds in key-block order (the op's backward under
    torch.use_deterministic_algorithms): within the 2x bar, and three runs give the same bits."""
    check_backward(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, wgs=2, warp_specialized=True, tile_m=tile_m,
                   deterministic=True, repeat=3)


@pytest.mark.parametrize("d,tile_m", [(128, 64), (64, 128)])
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_variant_is_bitwise_stable_at_training_sizes(d, tile_m, causal):
    """Many CTAs adding into each query block (32 key blocks at 4k tokens) and GQA 4:1: five runs, the same bits."""
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd import flash_fwd

    q = torch.randn(2, 16, 4096, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 4, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out, lse = flash_fwd(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    runs = [flash_bwd(dout, q, k, v, out, lse, causal=causal, wgs=2, warp_specialized=True, tile_m=tile_m,
                      deterministic=True) for _ in range(5)]
    for run in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), run, runs[0]):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 100, 333), (2, 2, 1, 333, 100),
                                             (1, 4, 2, 1000, 1100), (1, 2, 2, 200, 40)])
def test_wide_head_dims_within_bar(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk):
    """flash_bwd_wide (d = 192 / 256): both MMA warpgroups on one 64-key tile, split by queries for S^T / dP^T and
    by columns for dK, dV and dQ; sq = 1000 reuses every pipeline stage and P^T / dS^T tile many times; sk = 40: a
    partial key tile only."""
    check_backward(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, wgs=2, warp_specialized=True)


@pytest.mark.parametrize("d", [192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_wide_head_dims_fast_call_and_deterministic(d, causal, monkeypatch):
    """The wide kernel through the fast call path (twice: the second call from its cache), and its deterministic
    variant within the bar and bitwise stable over three runs."""
    from fa_backend.kernels.cute import _fast_call

    monkeypatch.setattr(_fast_call, "ENABLED", True)
    for _ in range(2):
        check_backward(torch.bfloat16, d, causal, True, 1, 8, 2, 300, 333, wgs=2, warp_specialized=True)
    check_backward(torch.bfloat16, d, causal, True, 1, 8, 2, 700, 733, wgs=2, warp_specialized=True,
                   deterministic=True, repeat=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 100, 333), (2, 2, 1, 333, 100),
                                             (1, 4, 2, 1000, 1100), (1, 2, 2, 200, 40)])
def test_head_dim_v_within_bar(dtype, causal, bottom_right, b, hq, hkv, sq, sk):
    """flash_bwd_wide with MLA's head dims (q / k 192, v 128): dV 64 x 64 per warpgroup, each dQ part staged in three
    pieces (the Q and dO tiles' column halves and its own region)."""
    check_backward(dtype, 192, causal, bottom_right, b, hq, hkv, sq, sk, wgs=2, warp_specialized=True, dv=128)


@pytest.mark.parametrize("causal", [False, True])
def test_head_dim_v_fast_call_and_deterministic(causal, monkeypatch):
    from fa_backend.kernels.cute import _fast_call

    monkeypatch.setattr(_fast_call, "ENABLED", True)
    for _ in range(2):
        check_backward(torch.bfloat16, 192, causal, True, 1, 8, 2, 300, 333, wgs=2, warp_specialized=True, dv=128)
    check_backward(torch.bfloat16, 192, causal, True, 1, 8, 2, 700, 733, wgs=2, warp_specialized=True,
                   deterministic=True, repeat=3, dv=128)


def check_backward(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, dq_atomic=False, wgs=1, dq_buffer=False,
                   warp_specialized=False, tile_m=64, deterministic=False, repeat=1, dv=None, tma_store=None):
    """The backward's gradients against float64 (2x rule); dv: v's head dim (d if None)."""
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd import HEAD_DIMS, flash_fwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, hkv, sk, d if dv is None else dv, device="cuda", dtype=dtype)
    # d = 192 / 256 and unequal head dims: the warp-specialised forward only
    forward = flash_fwd if d in HEAD_DIMS and dv in (None, d) else flash_fwd_ws
    out, lse = forward(q, k, v, causal=causal, bottom_right=bottom_right)
    dout = torch.randn_like(out)
    def run():
        return flash_bwd(dout, q, k, v, out, lse, causal=causal, bottom_right=bottom_right, dq_atomic=dq_atomic,
                         wgs=wgs, dq_buffer=dq_buffer, warp_specialized=warp_specialized, tile_m=tile_m,
                         deterministic=deterministic, tma_store=tma_store)

    dq, dk, dv = run()
    for _ in range(repeat - 1):  # deterministic: the same bits again
        for name, again, first in zip(("dq", "dk", "dv"), run(), (dq, dk, dv)):
            assert torch.equal(again, first), name

    kw = dict(is_causal=causal, bottom_right=bottom_right)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention_math(*ref_leaves, **kw), ref_leaves, dout.double())
    pt_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    same = torch.autograd.grad(attention_same_dtype(*pt_leaves, **kw), pt_leaves, dout)
    for name, ours, base, truth in zip(("dq", "dk", "dv"), (dq, dk, dv), same, ref):
        assert ours.dtype == dtype and not ours.isnan().any(), name
        assert_within_bar(name, ours, base, truth)
    if causal and bottom_right and sq > sk:  # rows that see no key: zero dq
        assert (dq[:, :, : sq - sk] == 0).all()
