"""Small calls take the backward's delta = rowsum(dO * O) from an fp32 recomputation of O
(flash_bwd.EXACT_DELTA_MAX_SCORES), and host-bound ones dS into the dQ / dK products unrounded
(flash_bwd.EXACT_DS_MAX_SCORES): which calls do, that dense and varlen both do, and that each is what makes the
gradients of a small call more accurate (the rounded output's error otherwise decides dK's max error; dS's rounding to
fp16 put dQ at 2.14x PyTorch's error on one CPU CI draw).

Runs on CUDA when present, otherwise in Triton's interpreter (fp16)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

import fa_backend

from fa_backend.kernels.triton import flash_bwd, flash_bwd_varlen, flash_fwd, flash_fwd_varlen
from fa_backend.kernels.triton.flash_fwd import dropout_keep_mask
from tests.conftest import DEVICE
from tests.reference import attention_ref, check_attention, max_err

bwd_module = importlib.import_module("fa_backend.kernels.triton.flash_bwd")  # the package exports the function


@pytest.fixture
def delta_inputs(monkeypatch):
    """The dtypes of the O that bwd_delta receives, call by call."""
    seen = []
    real = bwd_module.bwd_delta

    def spy(out, *args, **kwargs):
        seen.append(out.dtype)
        return real(out, *args, **kwargs)

    monkeypatch.setattr(bwd_module, "bwd_delta", spy)
    return seen


def _grads(q, k, v, dout, causal):
    out, lse = flash_fwd(q, k, v, q.shape[-1] ** -0.5, causal, True)
    return flash_bwd(dout, q, k, v, out, lse, q.shape[-1] ** -0.5, causal, True)


@pytest.mark.parametrize("sq,sk,exact", [(11, 7, True), (256, 256, True), (257, 256, False)])
def test_which_calls_recompute_o_in_fp32(sq, sk, exact, delta_inputs, monkeypatch):
    if sq * sk > 11 * 7 and DEVICE == "cpu":  # the interpreter: the same boundary on a smaller call (CPU suite time)
        monkeypatch.setattr(bwd_module, "EXACT_DELTA_MAX_SCORES", 16 * 16)
        sq, sk = (16, 16) if exact else (17, 16)
    q, k, v, dout = (torch.randn(1, 2, s, 16, dtype=torch.float16, device=DEVICE) for s in (sq, sk, sk, sq))
    _grads(q, k, v, dout, False)
    assert delta_inputs == [torch.float32 if exact else torch.float16]


def test_varlen_recomputes_o_in_fp32_when_small(delta_inputs):
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32, device=DEVICE)  # an empty sequence in the middle
    q, k, v, dout = (torch.randn(12, 2, 16, dtype=torch.float16, device=DEVICE) for _ in range(4))
    out, lse = flash_fwd_varlen(q, k, v, cu, cu, 7, 7, 0.25, True)
    flash_bwd_varlen(dout, q, k, v, out, lse, cu, cu, 7, 7, 0.25, True)
    assert delta_inputs == [torch.float32]


def test_fp32_delta_lowers_the_gradient_error_of_small_calls(monkeypatch):
    """Over ten fresh draws of an 11 x 7 causal call, the summed max error of dK and dQ against float64 with delta
    from the fp32 O is below that with delta from the fp16 output (measured ratio about 0.3-0.6)."""
    totals = {True: 0.0, False: 0.0}
    for _ in range(10):
        q, k, v = (torch.randn(1, 2, s, 24, dtype=torch.float16, device=DEVICE) for s in (11, 7, 7))
        dout = torch.randn(1, 2, 11, 24, dtype=torch.float16, device=DEVICE)
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        s = (leaves[0] @ leaves[1].transpose(-1, -2)) * 24 ** -0.5
        s = s.masked_fill(torch.ones(11, 7, dtype=torch.bool, device=DEVICE).tril(7 - 11).logical_not(), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num()  # the first rows see no key: output 0, as the kernels give
        ref = torch.autograd.grad(p @ leaves[2], leaves, dout.double())
        out, lse = flash_fwd(q, k, v, 24 ** -0.5, True, True)  # the forward does not read the limit: one for both
        for exact in (True, False):
            monkeypatch.setattr(bwd_module, "EXACT_DELTA_MAX_SCORES", 256 * 256 if exact else 0)
            dq, dk, _ = flash_bwd(dout, q, k, v, out, lse, 24 ** -0.5, True, True)
            totals[exact] += max_err(dq, ref[0]) + max_err(dk, ref[1])
    assert totals[True] < totals[False], totals


@pytest.mark.parametrize("case", ["one_query_two_keys", "causal_gqa", "dropout"])
def test_fp32_recomputation_takes_unrounded_probabilities(case):
    """The fp32 O flash_bwd recomputes for delta is P @ V of the fp32 probabilities (the P its backward kernels
    use), not of their fp16 rounding: within fp32 error of float64 (rounded P: about 2e-4 off). With the rounded P,
    delta missed sum_j P_ij dP_ij by 2e-4 on a 1-query 2-key draw and dQ's error was 8x PyTorch's."""
    b, hq, hkv, sq, sk, d, causal, dropout_p = dict(
        one_query_two_keys=(4, 2, 2, 1, 2, 8, False, 0.0), causal_gqa=(1, 4, 2, 13, 21, 24, True, 0.0),
        dropout=(2, 2, 1, 9, 17, 16, False, 0.25))[case]
    q = torch.randn(b, hq, sq, d, dtype=torch.float16, device=DEVICE)
    k, v = (torch.randn(b, hkv, sk, d, dtype=torch.float16, device=DEVICE) for _ in range(2))
    rng = (int(torch.randint(0, 2**31, ())), 4 * int(torch.randint(0, 2**20, ()))) if dropout_p else None
    out32 = torch.empty(b, hq, sq, d, dtype=torch.float32, device=DEVICE)
    flash_fwd(q, k, v, d ** -0.5, causal, True, out32, dropout_p=dropout_p, rng=rng)
    keep = dropout_keep_mask(b, hq, sq, sk, dropout_p, rng, DEVICE) if dropout_p else None
    ref = attention_ref(q, k, v, is_causal=causal, bottom_right=True, dropout_keep=keep, dropout_p=dropout_p,
                        dtype=torch.float64)
    assert max_err(out32, ref) < 2e-5, max_err(out32, ref)  # (values of order 1; exp2's ulps on the GPU)
    # the varlen kernel takes the same path: one sequence of the call's first batch entry
    cu_q = torch.tensor([0, sq], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, sk], dtype=torch.int32, device=DEVICE)
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    out32_v = torch.empty(sq, hq, d, dtype=torch.float32, device=DEVICE)
    flash_fwd_varlen(*packed, cu_q, cu_k, sq, sk, d ** -0.5, causal, out32_v, dropout_p=dropout_p, rng=rng)
    assert max_err(out32_v, ref[0].transpose(0, 1)) < 2e-5


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("layout", ["broadcast", "rows_broadcast", "strided_head_dim"])
def test_backward_kernels_read_a_dense_dout(monkeypatch, varlen, layout):
    # A broadcast or head-dim-strided dout is copied dense before any launch: Triton specialises kernels on its
    # strides and TMA needs dense rows, so otherwise eager autograd's dout (the gradient of a sum, stride 0) and the
    # dense dout of torch.compile would run different code and the gradients differ in the last bits.
    seen = []
    real = bwd_module.bwd_delta
    monkeypatch.setattr(bwd_module, "bwd_delta", lambda out, dout, *a, **kw: seen.append(dout) or real(out, dout, *a,
                                                                                                     **kw))
    dtype = torch.float16
    b, h, s, d = 2, 2, 24, 16
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=DEVICE) for _ in range(3))
    if layout == "broadcast":
        dout = torch.randn((), dtype=dtype, device=DEVICE).expand(b, h, s, d)
    elif layout == "rows_broadcast":
        dout = torch.randn(d, dtype=dtype, device=DEVICE).expand(b, h, s, d)
    else:
        dout = torch.randn(b, h, s, 2 * d, dtype=dtype, device=DEVICE)[..., ::2]
    scale = d ** -0.5
    if varlen:
        cu = torch.tensor([0, s, 2 * s], dtype=torch.int32, device=DEVICE)
        packed = [t.transpose(1, 2).reshape(b * s, h, d) for t in (q, k, v)]
        dout_p = dout.transpose(1, 2).reshape(b * s, h, d) if layout != "broadcast" else \
            dout[0, 0, 0, 0].expand(b * s, h, d)
        if layout == "strided_head_dim":
            dout_p = torch.randn(b * s, h, 2 * d, dtype=dtype, device=DEVICE)[..., ::2]
        out, lse = flash_fwd_varlen(*packed, cu, cu, s, s, scale, True)
        grads = flash_bwd_varlen(dout_p, *packed, out, lse, cu, cu, s, s, scale, True)
        dense = flash_bwd_varlen(dout_p.contiguous(), *packed, out, lse, cu, cu, s, s, scale, True)
    else:
        out, lse = flash_fwd(q, k, v, scale, True, True)
        grads = flash_bwd(dout, q, k, v, out, lse, scale, True, True)
        dense = flash_bwd(dout.contiguous(), q, k, v, out, lse, scale, True, True)
    assert len(seen) == 2 and all(t.stride(-1) == 1 and 0 not in t.stride() for t in seen)
    for a, b_ in zip(grads, dense):
        assert torch.equal(a, b_)


@pytest.fixture
def ds_launches(monkeypatch):
    """EXACT_DS of each backward kernel launch (dK / dV, then dQ), call by call."""
    seen = []
    real = bwd_module._launch.launch

    def spy(kernel, grid, args, kwargs):
        if kernel in (bwd_module._bwd_dkdv, bwd_module._bwd_dq):
            seen.append(kwargs.get("EXACT_DS", False))
        return real(kernel, grid, args, kwargs)

    monkeypatch.setattr(bwd_module._launch, "launch", spy)
    return seen


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("limit,exact", [(2 * 2 * 16 * 16, True), (2 * 2 * 16 * 16 - 1, False)])
def test_which_calls_take_ds_unrounded(varlen, limit, exact, ds_launches, monkeypatch):
    """batch x heads x sq x sk (varlen: the maximum lengths) at most EXACT_DS_MAX_SCORES: both kernels."""
    monkeypatch.setattr(bwd_module, "EXACT_DS_MAX_SCORES", limit)
    q, k, v, dout = (torch.randn(2, 2, 16, 16, dtype=torch.float16, device=DEVICE) for _ in range(4))
    if varlen:
        cu = torch.tensor([0, 9, 25], dtype=torch.int32, device=DEVICE)  # max lengths 16: 2 x 2 x 16 x 16 scores
        packed = [t.transpose(1, 2).reshape(32, 2, 16)[:25] for t in (q, k, v, dout)]
        out, lse = flash_fwd_varlen(*packed[:3], cu, cu, 16, 16, 0.25, True)
        flash_bwd_varlen(packed[3], *packed[:3], out, lse, cu, cu, 16, 16, 0.25, True)
    else:
        _grads(q, k, v, dout, True)
    assert ds_launches == [exact, exact]


def test_unrounded_ds_lowers_the_gradient_error_of_small_calls(monkeypatch):
    """Over ten fresh draws of a 64 x 64 causal call, the summed max error of dQ and dK against float64 with dS
    unrounded in their products is below that with dS rounded to fp16 first (measured ratio about 0.7-0.8)."""
    totals = {True: 0.0, False: 0.0}
    for _ in range(10):
        q, k, v, dout = (torch.randn(1, 2, 64, 16, dtype=torch.float16, device=DEVICE) for _ in range(4))
        leaves = [t.double().requires_grad_() for t in (q, k, v)]
        s = (leaves[0] @ leaves[1].transpose(-1, -2)) * 16 ** -0.5
        s = s.masked_fill(torch.ones(64, 64, dtype=torch.bool, device=DEVICE).tril().logical_not(), float("-inf"))
        ref = torch.autograd.grad(torch.softmax(s, -1) @ leaves[2], leaves, dout.double())
        out, lse = flash_fwd(q, k, v, 16 ** -0.5, True, True)  # the forward does not read the limit: one for both
        for exact in (True, False):
            monkeypatch.setattr(bwd_module, "EXACT_DS_MAX_SCORES", 1 << 20 if exact else 0)
            dq, dk, _ = flash_bwd(dout, q, k, v, out, lse, 16 ** -0.5, True, True)
            totals[exact] += max_err(dq, ref[0]) + max_err(dk, ref[1])
    assert totals[True] < totals[False], totals


_COMPILE_EXACT_PV = r"""
import sys
sys.path.insert(0, "scripts")
import compile_check
from fa_backend.kernels.triton._configs import FWD_EXACT_PV
for d in (64, 256):
    print(d, compile_check.check_fwd(FWD_EXACT_PV, d, True, "bf16", dict(EXACT_PV=True, O="ptr32")))
"""


def test_exact_pv_tile_fits_sm90():
    """The EXACT_PV launch's tile (fp32 P @ V on the CUDA cores) compiled for sm90 without a GPU: within the
    shared memory of a block and without spills at d = 64 and 256 (the plain tables' tiles asked for up to 320 KB
    there)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_EXACT_PV], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 2, res.stdout
    for line in lines:
        smem = int(re.search(r"smem=\s*(\d+)", line).group(1))
        spills = int(re.search(r"spills=\s*(\d+)", line).group(1))
        assert smem <= 232448 and spills == 0, line


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU (the EXACT_PV tile's launch at every head dim)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("is_causal", [False, True])
def test_small_calls_at_every_head_dim_within_bar(d, is_causal, dtype, delta_inputs):
    """Small calls (their O recomputed in fp32 by an EXACT_PV launch) on the Triton backend at every head dim, forward
    and gradients within the 2x rule: the launch's tile fits each one (the tables' tiles did not at d >= 128)."""
    q = torch.randn(2, 3, 100, d, dtype=dtype, device=DEVICE)
    k, v = (torch.randn(2, 3, 150, d, dtype=dtype, device=DEVICE) for _ in range(2))

    def fn(q, k, v):
        with fa_backend.sdpa_backends(["triton"]):
            return fa_backend.attention(q, k, v, is_causal=is_causal, causal_alignment="bottom_right")

    check_attention(fn, q, k, v, is_causal=is_causal, bottom_right=True)
    assert delta_inputs == [torch.float32]  # delta from the recomputed fp32 O
