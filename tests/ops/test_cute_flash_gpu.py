"""fa_backend::cute_flash_fwd on the H200: opcheck, forward and gradients (the CuTe backward, the default, and the
Triton backward with ops.cute_flash.CUTE_BACKWARD off) within the bar, the inputs the op copies or rewrites, the compile-failure
fallback, and SDPA routing onto it (eager and compiled). Needs the CuTe DSL and a Hopper GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fa_backend
from fa_backend.dispatch.backends import pytorch_choice
from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.reference import (assert_grads_within_bar, assert_within_bar, attention_math, attention_same_dtype,
                             check_attention)

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.cute,
              pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}"),
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]


def _qkv(b, hq, hkv, sq, sk, d, dtype=torch.bfloat16, grad=False):
    return [torch.randn(b, h, s, d, device="cuda", dtype=dtype).requires_grad_(grad)
            for h, s in ((hq, sq), (hkv, sk), (hkv, sk))]


def test_opcheck():
    from fa_backend.ops import cute_flash_fwd

    q, k, v = _qkv(1, 4, 2, 200, 300, 64, grad=True)
    torch.library.opcheck(cute_flash_fwd, (q, k, v, None, True, True))
    torch.library.opcheck(cute_flash_fwd, (q, k, v, 0.3, False, False))
    mask = torch.rand(1, 1, 1, 300, device="cuda") > 0.3  # a key mask: the key-mask variants
    torch.library.opcheck(cute_flash_fwd, (q, k, v, None, False, False, mask))


@pytest.mark.parametrize("with_dlse", [False, True])
def test_opcheck_backward(with_dlse):
    """fa_backend::cute_flash_bwd, the op the forward's autograd formula calls (fake tensors must never reach the
    kernel: aot_dispatch traces the backward); q in (b, s, h, d) memory: the fake's contiguous gradients must match
    the real ones' strides."""
    from fa_backend.ops import cute_flash_bwd, cute_flash_fwd

    q = torch.randn(1, 200, 4, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k, v = _qkv(1, 4, 2, 200, 300, 128)[1:]
    out, lse, _ = cute_flash_fwd(q, k, v, None, True, True)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    torch.library.opcheck(cute_flash_bwd, (dout, q, k, v, out, lse, dlse, None, True, True))


@pytest.fixture
def cute_backward(monkeypatch):
    """The op's backward through the CuTe kernel; yields the list of its calls (to show it ran)."""
    from fa_backend.kernels.cute import flash_bwd as module
    from fa_backend.ops import cute_flash

    calls = []
    real, launch = module.flash_bwd, module.BackwardLaunch.__call__

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return real(*args, **kwargs)

    def launched(self, *args, **kwargs):  # a prepared launch (ops.cute_flash._BACKWARD_LAUNCHES)
        calls.append(args[1].shape)
        return launch(self, *args, **kwargs)

    monkeypatch.setattr(cute_flash, "CUTE_BACKWARD", True)
    monkeypatch.setattr(module, "flash_bwd", counted)
    monkeypatch.setattr(module.BackwardLaunch, "__call__", launched)
    yield calls


@pytest.mark.parametrize("backward", ["triton", "cute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 100, 333), (2, 2, 1, 333, 100)])
def test_forward_and_gradients_within_bar(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, backward, request):
    """Outputs and gradients (q, k, v of hkv heads) against float64, the project's 2x rule; the references
    repeat K and V over each query group, so their gradients are summed back over it. d = 192 / 256: the CuTe
    backward is flash_bwd_wide's kernel."""
    from fa_backend.ops import cute_flash_attention

    calls = request.getfixturevalue("cute_backward") if backward == "cute" else None
    if backward == "triton":
        from fa_backend.ops import cute_flash

        request.getfixturevalue("monkeypatch").setattr(cute_flash, "CUTE_BACKWARD", False)

    q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype)

    def rep(t):
        return t.repeat_interleave(hq // hkv, dim=1)

    ours = [t.detach().requires_grad_() for t in (q, k, v)]
    out = cute_flash_attention(*ours, None, causal, bottom_right)[0]
    pt_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    pt = attention_same_dtype(pt_leaves[0], rep(pt_leaves[1]), rep(pt_leaves[2]), is_causal=causal,
                              bottom_right=bottom_right)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_math(ref_leaves[0], rep(ref_leaves[1]), rep(ref_leaves[2]), is_causal=causal,
                         bottom_right=bottom_right)
    assert_within_bar("out", out, pt, ref)
    assert_grads_within_bar(out, ours, pt, pt_leaves, ref, ref_leaves)
    if calls is not None:
        assert len(calls) == 1


def _scores_ref(q, k, scale, bottom_right_causal):
    """Scaled scores in float64 with GQA repeated and (bottom-right) causal masking, differentiable."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if bottom_right_causal:
        sq, sk = s.shape[-2:]
        i = torch.arange(sq, device=s.device)[:, None]
        j = torch.arange(sk, device=s.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    return s


@pytest.mark.parametrize("causal", [False, True])
def test_cute_backward_with_the_lse_gradient(causal, monkeypatch):
    """A loss that uses the LSE output too: the CuTe backward's gradients against float64 within 2x the Triton
    backward's error (a fused same-dtype baseline that takes the LSE term the same way)."""
    from fa_backend.ops import cute_flash, cute_flash_attention

    q, k, v = _qkv(1, 8, 2, 300, 333, 128)
    w = torch.randn(300, 128, device="cuda")
    scale = 128 ** -0.5

    def grads(flag):
        monkeypatch.setattr(cute_flash, "CUTE_BACKWARD", flag)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = cute_flash_attention(*leaves, None, causal, True)
        return torch.autograd.grad((out.float() * w).sum() + 0.5 * lse.sum(), leaves)

    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = _scores_ref(ref_leaves[0], ref_leaves[1], scale, causal)
    out = torch.softmax(s, -1) @ ref_leaves[2].repeat_interleave(4, dim=1)
    ref = torch.autograd.grad((out * w.double()).sum() + 0.5 * torch.logsumexp(s, -1).sum(), ref_leaves)
    for name, ours, base, truth in zip(("dq", "dk", "dv"), grads(True), grads(False), ref):
        assert_within_bar(name, ours, base, truth)


@pytest.mark.parametrize("d,causal,dout_layout", [(64, True, "bshd"), (96, False, "bhsd"), (128, False, "bshd"),
                                                   (128, True, "bhsd"), (192, True, "bhsd"), (256, False, "bshd")])
def test_prepared_backward_runs_what_flash_bwd_runs(d, causal, dout_layout, monkeypatch):
    """The prepared backward launch (ops.cute_flash._BACKWARD_LAUNCHES: prepared by the first call of a signature,
    taken by the next) against flash_bwd's general path with the same variant: dK and dV bitwise (each key
    block's sums in a fixed order), dQ (fp32 adds in arrival order) within the 2x bar of the float64 gradient,
    of the general path's dQ error. dO in (b, h, s, d) or (b, s, h, d) memory."""
    from fa_backend.kernels.cute.flash_bwd import BackwardLaunch, flash_bwd
    from fa_backend.ops import cute_flash

    monkeypatch.setattr(cute_flash, "_BACKWARD_LAUNCHES", {})
    b, hq, hkv, sq, sk = 2, 8, 2, 300, 333
    for _ in range(2):
        q, k, v = _qkv(b, hq, hkv, sq, sk, d)
        out, lse, _ = cute_flash.cute_flash_fwd(q, k, v, None, causal)
        dout = torch.randn(b, sq, hq, d, device="cuda", dtype=q.dtype).transpose(1, 2) if dout_layout == "bshd" \
            else torch.randn_like(out)
        prepared = cute_flash._cute_backward(q, k, v, out, lse, dout, None, None, causal, False)
        general = flash_bwd(dout, q, k, v, out, lse, None, causal, **cute_flash.BACKWARD_VARIANTS.get(d, {}))
        assert torch.equal(prepared[1], general[1]) and torch.equal(prepared[2], general[2])
        ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = attention_math(ref_leaves[0], *(t.repeat_interleave(hq // hkv, dim=1) for t in ref_leaves[1:]),
                             is_causal=causal)
        ref_dq = torch.autograd.grad(ref, ref_leaves[0], dout.double())[0]
        assert_within_bar("dq (prepared, against the general path's error)", prepared[0], general[0], ref_dq)
    assert [type(launch) for launch in cute_flash._BACKWARD_LAUNCHES.values()] == [BackwardLaunch]


def test_cute_backward_negative_scale(cute_backward):
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(1, 4, 2, 200, 260, 64)
    check_attention(lambda q, k, v: cute_flash_attention(q, k, v, -0.2)[0], q, k, v, scale=-0.2)
    assert len(cute_backward) == 1


@pytest.mark.parametrize("d,causal", [(128, True), (128, False), (64, True), (192, False), (256, True)])
def test_deterministic_mode_runs_the_deterministic_cute_backward(cute_backward, d, causal, deterministic_algorithms):
    """Under torch.use_deterministic_algorithms the op's backward is the CuTe kernel's deterministic variant at
    d=64 / 128 / 192 / 256: the same bits on every run, and the bits flash_bwd(..., deterministic=True) gives."""
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.ops import cute_flash, cute_flash_attention

    q, k, v = _qkv(2, 8, 2, 1024, 1024, d, grad=True)
    dout = torch.randn(2, 8, 1024, d, device="cuda", dtype=torch.bfloat16)
    outs = [cute_flash_attention(q, k, v, None, causal) for _ in range(3)]
    runs = [torch.autograd.grad(out, (q, k, v), dout) for out, _ in outs]
    assert len(cute_backward) == 3
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)
    out, lse = outs[0]
    direct = flash_bwd(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), None, causal,
                       deterministic=True, **cute_flash.BACKWARD_VARIANTS[d])
    for a, b in zip(runs[0], direct):
        assert torch.equal(a, b)


def test_deterministic_mode_at_d96_takes_the_triton_backward(cute_backward, deterministic_algorithms):
    """d=96's CuTe backward (one warpgroup) has no deterministic variant: the Triton backward runs."""
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(1, 8, 2, 256, 256, 96, grad=True)
    runs = [torch.autograd.grad(cute_flash_attention(q, k, v, None, True)[0].sum(), (q, k, v)) for _ in range(2)]
    assert cute_backward == []
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_inputs_tma_cannot_read_are_copied():
    from fa_backend.ops import cute_flash_attention

    wide = torch.randn(2, 4, 200, 72, device="cuda", dtype=torch.bfloat16)
    q = wide[..., 1:65]  # offset of one element: not 16-byte aligned
    k, v = (torch.randn(2, 4, 200, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    check_attention(lambda q, k, v: cute_flash_attention(q, k, v)[0], q, k, v, grad=False)


def test_negative_scale_is_exact():
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(1, 2, 2, 128, 128, 64)
    check_attention(lambda q, k, v: cute_flash_attention(q, k, v, -0.2)[0], q, k, v, scale=-0.2, grad=False)


def test_a_variant_that_fails_to_compile_runs_the_triton_forward(clean, monkeypatch):
    from fa_backend.dispatch import select
    from fa_backend.dispatch.call import AttentionCall
    from fa_backend.kernels.cute import _compile_cache, flash_fwd_ws
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(1, 8, 2, 512, 512, 128)
    key = flash_fwd_ws.fastest_variant_key(torch.bfloat16, 128, False, False)
    monkeypatch.delitem(_compile_cache.CACHE._compiled, key, raising=False)  # built by an earlier test
    monkeypatch.setitem(_compile_cache.CACHE._failed, key, "DSLRuntimeError: injected by the test")
    out = cute_flash_attention(q, k, v)[0]
    assert fa_backend.stats()["runs"] == {"triton": 1}
    ref = attention_math(q.double(), *(t.double().repeat_interleave(4, dim=1) for t in (k, v)))
    assert (out.double() - ref).abs().max().item() < 2e-2
    decision = select(AttentionCall.from_tensors(q, k, v, enable_gqa=True))
    assert [r.code.value for r in decision.rejected["cute"]] == ["compile_failed"]
    # the next backend: our Triton kernels, passed over on sm90 for GQA (measured slower than cuDNN), then torch
    assert decision.backend == "torch" and [r.code.value for r in decision.rejected["triton"]] == ["slower"]


@pytest.mark.parametrize("d", [64, 128])
def test_routed_gqa_call_runs_cute_and_matches_the_op(clean, d):
    # non-causal GQA at d=64 / 128: no measured rule passes the CuTe kernels over (dispatch/preference.py)
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(2, 16, 4, 2048, 2048, d)
    direct = cute_flash_attention(q, k, v, None, False, False)[0]
    fa_backend.reset_stats()
    with fa_backend.enabled():
        routed = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert fa_backend.stats()["runs"] == {"cute": 1}
    assert torch.equal(routed, direct)


@pytest.mark.parametrize("d,causal", [(128, True), (64, True), (192, False), (256, True)])
def test_routed_gqa_call_prefers_cudnn_where_measured_faster(clean, d, causal):
    # the GQA rules' premise: PyTorch gives these GQA calls to cuDNN on this torch (else ours runs after all)
    q, k, v = _qkv(2, 16, 4, 2048, 2048, d)
    assert pytorch_choice(q, k, v, is_causal=causal, enable_gqa=True) == "cudnn_attention"
    with fa_backend.enabled():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert fa_backend.stats()["runs"] == {"torch": 1}


@pytest.mark.parametrize("d,causal", [(128, False), (192, True), (256, True)])
def test_routed_plain_call_prefers_cudnn(clean, d, causal):
    q, k, v = _qkv(2, 16, 16, 2048, 2048, d)
    with fa_backend.enabled():
        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert fa_backend.stats()["runs"] == {"torch": 1}


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("d,causal", [(128, True), (64, True), (64, False)])
def test_routed_mha_call_runs_cute_from_2k_tokens(clean, cute_backward, grad, d, causal):
    """MHA from 2k tokens, causal at d=128 and both ways at d=64: the CuTe forward and backward were measured faster
    than cuDNN's (a training step too), so the routed call runs ours, with gradients through the CuTe backward; at 1k
    tokens (not timed) cuDNN keeps it."""
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(2, 16, 16, 2048, 2048, d, grad=grad)
    direct = cute_flash_attention(q, k, v, None, causal)[0]
    fa_backend.reset_stats()
    with fa_backend.enabled():
        routed = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        if grad:
            routed.sum().backward()
        assert fa_backend.stats()["runs"] == {"cute": 1}
        assert torch.equal(routed, direct) and len(cute_backward) == int(grad)
        fa_backend.reset_stats()
        short = [t[:, :, :1024].detach().requires_grad_(grad) for t in (q, k, v)]
        F.scaled_dot_product_attention(*short, is_causal=causal)
    assert fa_backend.stats()["runs"] == {"torch": 1}
    assert not grad or not q.grad.isnan().any()


def test_compiled_routing_forward_and_backward(clean):
    q, k, v = _qkv(2, 16, 4, 1024, 1024, 64, grad=True)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    def f(q, k, v):  # non-causal: causal GQA goes to cuDNN (a measured rule)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    fa_backend.enable()
    out = torch.compile(f, fullgraph=True, backend=backend)(q, k, v)
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    fa_backend.disable()
    assert any("fa_backend.cute_flash_fwd" in t for t in graphs[0])
    assert fa_backend.stats()["runs"].get("cute") == 1
    qd, kd, vd = (t.detach().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (qd, kd, vd))
    assert (out - ref).abs().max().item() < 2e-2
    for g, r in zip(grads, ref_grads):
        assert (g - r).abs().max().item() < 5e-2 * max(1.0, r.abs().max().item())


@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, True)])
def test_fast_call_path_gives_the_same_outputs(d, causal, monkeypatch):
    """kernels/cute/_fast_call.py (pointers, sizes and strides; integers marshalled once per shape): bitwise the
    tensor convention's outputs, on strided and GQA inputs, twice per shape (the second call from the cache)."""
    from fa_backend.kernels.cute import _fast_call
    from fa_backend.ops import cute_flash_attention

    q = torch.randn(2, 300, 8, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # (b, s, h, d) memory
    k, v = (torch.randn(2, 2, 333, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(_fast_call, "ENABLED", False)
    ref = cute_flash_attention(q, k, v, None, causal, True)
    monkeypatch.setattr(_fast_call, "ENABLED", True)
    for _ in range(2):
        out, lse = cute_flash_attention(q, k, v, None, causal, True)
        assert torch.equal(out, ref[0]) and torch.equal(lse, ref[1])
    q2 = torch.randn(1, 4, 100, d, device="cuda", dtype=torch.bfloat16)  # another shape: another cache entry
    monkeypatch.setattr(_fast_call, "ENABLED", False)
    ref2 = cute_flash_attention(q2, k[:1], v[:1], None, causal, True)
    monkeypatch.setattr(_fast_call, "ENABLED", True)
    out2 = cute_flash_attention(q2, k[:1], v[:1], None, causal, True)
    assert torch.equal(out2[0], ref2[0]) and torch.equal(out2[1], ref2[1])


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_key_mask_forward_and_gradients_within_bar(d, dtype, cute_backward):
    """A key-padding mask through the op: the CuTe forward and (d = 64, 128, 256: KEY_MASK_BACKWARD) the CuTe
    backward's key-mask variant; at d = 96 the Triton backward with the same mask. One sequence is fully masked (out 0, zero
    gradients)."""
    from fa_backend.ops import cute_flash_attention
    from tests.reference import check_features

    q, k, v = _qkv(3, 8, 2, 333, 400, d, dtype)
    lengths = torch.tensor([400, 123, 0], device="cuda")
    mask = (torch.arange(400, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    out = check_features(lambda q, k, v: cute_flash_attention(q, k, v, None, False, False, mask)[0], q, k, v,
                         attn_mask=mask)
    assert out[2].abs().max().item() == 0.0
    assert len(cute_backward) == (0 if d == 96 else 1)


def test_routed_key_padding_call_runs_cute(clean):
    """SDPA with a bool key-padding mask goes to the CuTe kernels when routing is on (forward and backward)."""
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(4, 16, 16, 2048, 2048, 128, grad=True)
    mask = (torch.rand(4, 1, 1, 2048, device="cuda") > 0.1)
    direct = cute_flash_attention(q, k, v, None, False, False, mask)[0]
    fa_backend.reset_stats()
    with fa_backend.enabled():
        routed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        routed.sum().backward()
    assert fa_backend.stats()["runs"] == {"cute": 1}
    assert torch.equal(routed, direct)
    assert q.grad is not None and not q.grad.isnan().any()


@pytest.mark.parametrize("hkv", [16, 4])
def test_routed_d192_call_runs_cute_with_gradients_and_cudnn_without(clean, cute_backward, hkv):
    """d=192, MHA or GQA: a call with gradients runs the CuTe kernels (their backward, flash_bwd_wide's, beat
    cuDNN's, and a training step with it); the same call without gradients stays on cuDNN (faster forward)."""
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(2, 16, hkv, 2048, 2048, 192, grad=True)
    direct = cute_flash_attention(q, k, v, None, True)[0]
    fa_backend.reset_stats()
    with fa_backend.enabled():
        routed = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != 16)
        routed.sum().backward()
        assert fa_backend.stats()["runs"] == {"cute": 1}
        assert torch.equal(routed, direct) and len(cute_backward) == 1
        fa_backend.reset_stats()
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hkv != 16)
    assert fa_backend.stats()["runs"] == {"torch": 1}
    assert not q.grad.isnan().any()


@pytest.mark.parametrize("case", ["causal", "key_mask", "dropout_keep_bits", "gqa_lse"])
def test_eager_twin_matches_the_op_bit_for_bit(case):
    """cute_flash_attention on plain tensors in eager mode runs the op's autograd.Function twin (no
    fa_backend::cute_flash_fwd / _bwd dispatch): the same out, lse, dK and dV, bit for bit, as the op with its
    registered autograd (dQ within a bf16 ulp: its adds' order varies run to run); with dropout the same rng_state,
    and the twin's backward reads the saved keep bits too."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fa_backend.ops import cute_flash, new_rng_state

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    hkv = 2 if case == "gqa_lse" else 4
    q, k, v = _qkv(2, 4, hkv, 1000, 1000, 128, grad=True)
    mask = torch.rand(2, 1, 1, 1000, device="cuda") > 0.3 if case == "key_mask" else None
    p = 0.1 if case == "dropout_keep_bits" else 0.0
    rng = new_rng_state() if p else None
    causal = case != "key_mask"
    keep = bool(p) and cute_flash.save_keep_bits(q, k, v, None, mask, p, causal)
    assert keep == (case == "dropout_keep_bits")
    dout = torch.randn(2, 4, 1000, 128, device="cuda", dtype=torch.bfloat16)
    dlse = torch.randn(2, 4, 1000, device="cuda") if case == "gqa_lse" else None

    out, lse, _ = cute_flash.cute_flash_fwd(q, k, v, None, causal, False, mask, p, rng, keep)
    grads = torch.autograd.grad((out, lse) if dlse is not None else out, (q, k, v),
                                (dout, dlse) if dlse is not None else dout)
    ops = Ops()
    with ops:
        out2, lse2 = cute_flash.cute_flash_attention(q, k, v, None, causal, False, mask, p, rng)
        grads2 = torch.autograd.grad((out2, lse2) if dlse is not None else out2, (q, k, v),
                                     (dout, dlse) if dlse is not None else dout)
    assert not [n for n in ops.names if n.startswith("fa_backend.cute_flash")], ops.names
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert torch.equal(grads[1], grads2[1]) and torch.equal(grads[2], grads2[2])
    # dQ: fp32 block adds from several CTAs in no fixed order, then rounded: at most one bf16 ulp apart
    torch.testing.assert_close(grads2[0], grads[0], rtol=2**-7, atol=1e-5)
