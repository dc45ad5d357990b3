"""Routing on a GPU: the measured preference, nn modules' fast path, routed results equal the direct op."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fa_backend
from fa_backend.dispatch import ReasonCode
from fa_backend.dispatch.backends import pytorch_choice

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_state")]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _qkv(b=2, h=8, s=1024, d=128, dtype=torch.bfloat16):
    return [torch.randn(b, h, s, d, device="cuda", dtype=dtype) for _ in range(3)]


@pytest.mark.skipif(not HOPPER, reason="the measured preference is for sm90")
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_preference_premise_pytorch_picks_cudnn(d):
    # The rule assumes PyTorch itself runs cuDNN for these calls on sm90: check it on this torch.
    q, k, v = _qkv(d=d)
    assert pytorch_choice(q, k, v, is_causal=True) == "cudnn_attention"
    explanation = fa_backend.explain(q, k, v, is_causal=True)
    assert explanation.backend == "torch"
    assert [r.code for r in explanation.reasons["triton"]] == [ReasonCode.SLOWER]


@pytest.mark.skipif(not HOPPER, reason="the measured preference is for sm90")
@pytest.mark.parametrize("d", [64, 128, 192, 256])
def test_gqa_preference_premise_pytorch_picks_cudnn(d):
    # The GQA rules assume PyTorch runs cuDNN for enable_gqa=True calls on sm90: check it on this torch.
    q = torch.randn(2, 8, 1024, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1024, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    assert pytorch_choice(q, k, v, is_causal=True, enable_gqa=True) == "cudnn_attention"
    explanation = fa_backend.explain(q, k, v, is_causal=True, enable_gqa=True)
    assert explanation.backend == "torch"
    assert [r.code for r in explanation.reasons["triton"]] == [ReasonCode.SLOWER]
    assert "GQA" in explanation.reasons["triton"][0].message


@pytest.mark.skipif(not HOPPER, reason="the measured preference is for sm90")
def test_deterministic_mode_keeps_the_cudnn_class_on_ours():
    # PyTorch skips cuDNN under deterministic algorithms: the routed call runs our kernels (deterministic backwards),
    # and the eager decision cache tells the two modes apart
    q, k, v = (t.requires_grad_() for t in _qkv())
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with fa_backend.enabled():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert fa_backend.stats()["runs"] == {"torch": 1}
        torch.use_deterministic_algorithms(True)
        try:
            outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True) for _ in range(2)]
            grads = [torch.autograd.grad(o.float().sum(), (q, k, v)) for o in outs]
        finally:
            torch.use_deterministic_algorithms(was, warn_only=was_warn)
        ours = {name: n for name, n in fa_backend.stats()["runs"].items() if name != "torch"}
        assert sum(ours.values()) == 2 and set(ours) <= {"cute", "triton"}
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert fa_backend.stats()["runs"]["torch"] == 2
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.skipif(not HOPPER, reason="the measured preference is for sm90")
def test_preferred_call_runs_pytorchs_kernel_and_forcing_runs_ours():
    q, k, v = (t.requires_grad_() for t in _qkv())
    with fa_backend.enabled():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert fa_backend.stats()["runs"] == {"torch": 1}
        with fa_backend.sdpa_backends(["triton", "torch"]):
            forced = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert fa_backend.stats()["runs"] == {"torch": 1, "triton": 1}
    direct = fa_backend.attention(q, k, v, is_causal=True)
    assert torch.equal(forced, direct)
    torch.testing.assert_close(out, direct, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(forced, (q, k, v), g)
    ref = torch.autograd.grad(direct, (q, k, v), g)
    for a, b in zip(grads, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d", [80, 160])  # head dims no preference names (d=64 / 96 / 128 / 192 / 256: cuDNN on sm90)
def test_outside_the_preference_our_kernel_runs_and_equals_the_op(d):
    q, k, v = (t.requires_grad_() for t in _qkv(s=512, d=d))
    with fa_backend.enabled():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert fa_backend.stats()["runs"] == {"triton": 1}
    direct = fa_backend.attention(q, k, v, is_causal=True)
    assert torch.equal(out, direct)
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(direct, (q, k, v), g)):
        assert torch.equal(a, b)


def test_compiled_routing_matches_eager_routing():
    q, k, v = _qkv(s=512, d=80)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with fa_backend.enabled():
        eager = fn(q, k, v)
        compiled = torch.compile(fn, fullgraph=True)(q, k, v)
    assert fa_backend.stats()["runs"] == {"triton": 2}
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)


@pytest.mark.skipif(not HOPPER, reason="the measured preference is for sm90")
@pytest.mark.parametrize("module", ["mha", "encoder_layer"])
def test_module_fast_path_kept_on_gpu(module):
    if module == "mha":
        m = nn.MultiheadAttention(1024, 16, batch_first=True, device="cuda", dtype=torch.bfloat16).eval()
        fn, fused = (lambda x: m(x, x, x, need_weights=False)[0]), "aten::_native_multi_head_attention"
    else:
        m = nn.TransformerEncoderLayer(1024, 16, 4096, dropout=0.0, batch_first=True, device="cuda",
                                       dtype=torch.bfloat16).eval()
        fn, fused = m, "aten::_transformer_encoder_layer_fwd"
    x = torch.randn(4, 512, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = fn(x)
        with fa_backend.enabled():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = fn(x)
    assert fused in {e.name for e in prof.events()}
    assert torch.equal(out, ref)
    assert fa_backend.stats()["runs"] == {"torch": 1}
    assert fa_backend.stats()["fallbacks"]["triton:slower"] == 1


@pytest.mark.parametrize("d", [32, 64, 96])
def test_host_bound_call_runs_pytorchs_fused_kernel(d):
    # Under 2**30 forward FLOPs (dispatch/preference.py): PyTorch's C++ path, on any GPU; forcing runs ours.
    q, k, v = _qkv(b=1, h=2, s=16, d=d)
    assert pytorch_choice(q, k, v) in ("flash_attention", "efficient_attention", "cudnn_attention")
    explanation = fa_backend.explain(q, k, v)
    assert explanation.backend == "torch"
    (reason,) = explanation.reasons["triton"]
    assert reason.code is ReasonCode.SLOWER and "host-bound" in reason.message
    with fa_backend.enabled():
        out = F.scaled_dot_product_attention(q, k, v)
        assert fa_backend.stats()["runs"] == {"torch": 1}
        with fa_backend.sdpa_backends(["triton"]):
            forced = F.scaled_dot_product_attention(q, k, v)
    runs = fa_backend.stats()["runs"]  # forced: the dense kernel, or the decode kernel (16 queries)
    assert runs.pop("torch") == 1 and runs in ({"triton": 1}, {"triton_decode": 1})
    torch.testing.assert_close(out, forced, atol=2e-2, rtol=2e-2)


def _aten_ops(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, {e.name for e in prof.events() if e.name.startswith("aten::") and "attention" in e.name}


def _direct(ops) -> bool:
    """The efficient kernel's op ran without SDPA around it."""
    return "aten::_scaled_dot_product_efficient_attention" in ops and "aten::scaled_dot_product_attention" not in ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_tiny_forward_runs_pytorchs_efficient_kernel_directly(dtype, causal):
    # A host-bound forward call (dispatch/backends/pytorch.py, direct_runner): the efficient kernel's own op, whose
    # host cost is the lowest of PyTorch's kernels; the result is SDPA's on that kernel, bit for bit.
    q, k, v = _qkv(b=1, h=2, s=16, d=64, dtype=dtype)
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    with fa_backend.enabled():
        out, ops = _aten_ops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3))
        assert _direct(ops)
        assert torch.equal(out, ref)
        assert fa_backend.stats()["runs"] == {"torch": 1}
        assert fa_backend.explain(q, k, v, is_causal=causal, scale=0.3).pytorch_kernel.startswith("efficient_attention")
        # Not taken (the call goes through SDPA, or to our kernel where PyTorch would not run the preferred one):
        # without PyTorch's efficient kernel, with grad, for a larger call
        SDPBackend = torch.nn.attention.SDPBackend
        with torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]):
            out, ops = _aten_ops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3))
        assert not _direct(ops) and "aten::_scaled_dot_product_efficient_attention" not in ops
        q.requires_grad_()
        out, ops = _aten_ops(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3))
        assert not _direct(ops)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)  # another kernel may run it
        big = _qkv(b=1, h=8, s=512, d=64, dtype=dtype)
        _, ops = _aten_ops(lambda: F.scaled_dot_product_attention(*big))
        assert not _direct(ops)


def test_tiny_module_keeps_pytorchs_fast_path():
    m = nn.MultiheadAttention(64, 2, batch_first=True, device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(1, 16, 64, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ref = m(x, x, x, need_weights=False)[0]
        with fa_backend.enabled():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = m(x, x, x, need_weights=False)[0]
    assert "aten::_native_multi_head_attention" in {e.name for e in prof.events()}
    assert torch.equal(out, ref)
    assert fa_backend.stats()["runs"] == {"torch": 1}


@pytest.mark.parametrize("training", [False, True])
def test_tiny_odd_head_module_takes_pytorchs_own_path(training):
    # One head (no fused fast path) and host-bound: PyTorch's Python path runs, counted as routed to torch.
    torch.manual_seed(0)
    m = nn.MultiheadAttention(64, 1, batch_first=True, device="cuda", dtype=torch.bfloat16).train(training)
    x = torch.randn(1, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=training)
    with torch.random.fork_rng(devices=["cuda"]):
        ref = m(x, x, x, need_weights=False)[0]
    with fa_backend.enabled():
        out = m(x, x, x, need_weights=False)[0]
    assert torch.equal(out, ref)
    assert fa_backend.stats()["runs"] == {"torch": 1}


def test_a_materialised_mask_after_a_key_mask_of_its_shape_is_routed_anew():
    # A bool key mask expanded over the queries runs where key masks run (cute on sm90 with the DSL); a materialised
    # mask of the same shape that varies along the queries must be decided anew (the eager cache keys on the mask's
    # strides): it runs a backend that takes it and equals PyTorch's result, it does not raise in the cute op.
    q, k, v = _qkv(b=2, h=8, s=1024, d=128)
    keys = torch.rand(2, 1, 1, 1024, device="cuda") > 0.3
    expanded = keys.expand(2, 1, 1024, 1024)
    full = torch.rand(2, 1, 1024, 1024, device="cuda") > 0.3
    with fa_backend.enabled():
        outs = [F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for mask in (expanded, full)]
    for out, mask in zip(outs, (expanded, full)):  # PyTorch's own bf16 result, routing off
        assert (out.float() - F.scaled_dot_product_attention(q, k, v, attn_mask=mask).float()).abs().max() < 2e-2
