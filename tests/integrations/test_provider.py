"""The PyTorch flash-attention provider (fa_backend.integrations.provider), on CPU.

A CPU-only PyTorch has no CUDA kernel for the flash ops, so the registration / fallback machinery
is exercised on the Meta dispatch key instead (`_DISPATCH_KEY` patched): the same code path, with
PyTorch's meta kernels as the "original" kernels we fall back to. Our kernels themselves run through
Triton's interpreter on CPU (or on the GPU when there is one).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.attention as tna

from fa_backend import _logging
from fa_backend.dispatch import ReasonCode, counters
from fa_backend.integrations import provider
from tests.conftest import DEVICE
from tests.reference import assert_within_bar, attention_math, attention_same_dtype

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FWD = torch.ops.aten._scaled_dot_product_flash_attention.default
BWD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default

needs_registry = pytest.mark.skipif(provider.unavailable_reason() is not None,
                                    reason=str(provider.unavailable_reason()))


def _qkv(device, dtype=torch.float16, b=1, hq=2, hkv=2, sq=24, sk=40, d=32, dv=None, layout="bhsd"):
    """(b, h, s, d) tensors; layout "bshd" = (b, s, h, d) memory viewed as (b, h, s, d)."""
    dv = d if dv is None else dv
    shapes = ((b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, dv))
    if layout == "bhsd":
        return [torch.randn(s, dtype=dtype, device=device) for s in shapes]
    if layout == "bshd":
        return [torch.randn(s[0], s[2], s[1], s[3], dtype=dtype, device=device).transpose(1, 2) for s in shapes]
    if layout == "sliced":  # not dense: every other position of a longer sequence
        return [torch.randn(s[0], s[1], 2 * s[2], s[3], dtype=dtype, device=device)[:, :, ::2] for s in shapes]
    raise ValueError(layout)


@pytest.fixture
def fresh():
    """Provider off, counters and log-once memory empty, cuDNN flag restored after the test."""
    provider.deactivate()
    provider.reset_stats()
    counters.reset_stats()
    _logging.reset_once()
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    provider.deactivate()
    torch.backends.cuda.enable_cudnn_sdp(cudnn)


@pytest.fixture
def meta_key(monkeypatch, fresh):
    """Install on the Meta dispatch key (works on CPU-only builds; PyTorch's meta kernels become the fallback)."""
    if torch.cuda.is_available():
        # CUDA builds (torch 2.11 seen) register Python meta kernels for these ops, which a second Python
        # override may not replace; test_provider_gpu.py exercises the real CUDA override there.
        pytest.skip("Meta-key simulation is for CPU-only PyTorch builds")
    monkeypatch.setattr(provider, "_DISPATCH_KEY", "Meta")
    yield


def _meta_call(sq=16, causal=True):
    q = torch.empty(2, 4, sq, 64, dtype=torch.float16, device="meta")
    return FWD(q, q, q, 0.0, causal, scale=0.125)


# --- registration ---------------------------------------------------------------------------------

@needs_registry
def test_register_lists_the_impl_once():
    assert provider.register() is True
    assert provider.register() is True
    impls = tna.list_flash_attention_impls()
    assert impls.count(provider.NAME) == 1


def test_register_without_registry_is_a_noop(monkeypatch, fresh):
    monkeypatch.delattr(torch.nn.attention, "register_flash_attention_impl")
    assert provider.register() is False
    assert "register_flash_attention_impl" in provider.unavailable_reason()
    with pytest.raises(RuntimeError, match="2.11"):
        provider.activate()
    assert not provider.is_active()


@needs_registry
def test_importing_fa_backend_activates_nothing():
    code = (
        "import json, torch, torch.nn.attention as A\n"
        "before = [A.current_flash_attention_impl(), torch.backends.cuda.cudnn_sdp_enabled()]\n"
        "import fa_backend, fa_backend.integrations.provider as p\n"
        "after = [A.current_flash_attention_impl(), torch.backends.cuda.cudnn_sdp_enabled()]\n"
        "print(json.dumps({'before': before, 'after': after, 'active': p.is_active()}))\n"
    )
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["before"] == result["after"]
    assert result["after"][0] != provider.NAME
    assert result["active"] is False


@needs_registry
@pytest.mark.skipif(provider.unavailable_reason(for_activation=True) is None, reason="this torch has CUDA kernels")
def test_activate_without_cuda_raises_and_changes_nothing(fresh):
    before = (tna.current_flash_attention_impl(), torch.backends.cuda.cudnn_sdp_enabled())
    with pytest.raises(RuntimeError, match="needs a CUDA build"):
        provider.activate()
    provider.register()
    with pytest.raises(RuntimeError, match="needs a CUDA build"):
        tna.activate_flash_attention_impl(provider.NAME)  # PyTorch's own entry point, same answer
    assert (tna.current_flash_attention_impl(), torch.backends.cuda.cudnn_sdp_enabled()) == before
    assert not provider.is_active()


# --- activation round trips (Meta dispatch key) ------------------------------------------------------

@needs_registry
@pytest.mark.parametrize("cudnn_before", [True, False])
@pytest.mark.parametrize("prefer_over_cudnn", [True, False])
def test_activate_remove_round_trip(meta_key, cudnn_before, prefer_over_cudnn):
    torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
    previous = tna.current_flash_attention_impl()
    reference = _meta_call()  # PyTorch's meta kernel, before we are installed

    handle = provider.activate(prefer_over_cudnn=prefer_over_cudnn)
    assert handle.active and provider.is_active()
    assert tna.current_flash_attention_impl() == provider.NAME
    assert torch.backends.cuda.cudnn_sdp_enabled() is (cudnn_before and not prefer_over_cudnn)

    result = _meta_call()  # reaches our kernel, which falls back (meta is no device of ours) without recursing
    assert provider.stats() == {"fallback_forward": 1, "fallback_forward:device": 1}
    assert [getattr(x, "shape", x) for x in result] == [getattr(x, "shape", x) for x in reference]

    handle.remove()
    assert not handle.active and not provider.is_active()
    assert tna.current_flash_attention_impl() == previous
    assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_before
    _meta_call()
    assert provider.stats()["fallback_forward"] == 1  # no longer intercepted
    handle.remove()  # idempotent


@needs_registry
def test_pytorch_restore_and_context_manager_undo_everything(meta_key):
    provider.activate()
    assert torch.backends.cuda.cudnn_sdp_enabled() is False
    tna.restore_flash_attention_impl()  # PyTorch's entry point calls our handle's remove()
    assert not provider.is_active() and torch.backends.cuda.cudnn_sdp_enabled() is True
    _meta_call()
    assert provider.stats() == {}

    with provider.activate():
        assert provider.is_active() and tna.current_flash_attention_impl() == provider.NAME
        _meta_call()
    assert not provider.is_active() and tna.current_flash_attention_impl() is None
    assert torch.backends.cuda.cudnn_sdp_enabled() is True
    assert provider.stats()["fallback_forward"] == 1


@needs_registry
def test_activating_twice_does_not_stack(meta_key):
    provider.activate()
    provider.activate()  # the registry removes the first override before installing the second
    _meta_call()
    assert provider.stats()["fallback_forward"] == 1  # one override in front of PyTorch, not two
    provider.deactivate()
    assert torch.backends.cuda.cudnn_sdp_enabled() is True  # the value before the first activation
    _meta_call()
    assert provider.stats()["fallback_forward"] == 1


@needs_registry
def test_a_users_cudnn_choice_made_while_active_is_kept(meta_key):
    provider.activate()
    torch.backends.cuda.enable_cudnn_sdp(True)
    provider.deactivate()
    assert torch.backends.cuda.cudnn_sdp_enabled() is True
    provider.activate()
    torch.backends.cuda.enable_cudnn_sdp(False)  # turned off again by the user: we only restore "on"
    provider.deactivate()
    assert torch.backends.cuda.cudnn_sdp_enabled() is True


@needs_registry
def test_backward_op_is_intercepted_too(meta_key):
    provider.activate()
    q = torch.empty(2, 4, 16, 64, dtype=torch.float16, device="meta")
    out, lse, _, _, mq, mk, seed, offset, _ = FWD(q, q, q, 0.0, True)
    grads = BWD(q, q, q, q, out, lse, None, None, mq, mk, 0.0, True, seed, offset, scale=0.125)
    assert provider.stats()["fallback_backward"] == 1
    assert [g.shape for g in grads] == [q.shape] * 3


# --- the decision --------------------------------------------------------------------------------------

CASES = {  # name -> (qkv overrides, call flags, expected reason code or None)
    "eligible": ({}, {}, None),
    "dropout": ({}, {"dropout_p": 0.1}, ReasonCode.DROPOUT),
    "fp32": ({"dtype": torch.float32}, {}, ReasonCode.DTYPE),
    "head_dim_320": ({"d": 320}, {}, ReasonCode.HEAD_DIM),
    "debug_mask": ({}, {"return_debug_mask": True}, ReasonCode.DROPOUT),
    "head_dim_v_differs": ({"dv": 16}, {}, ReasonCode.HEAD_DIM),
}


@pytest.mark.parametrize("device", [DEVICE, "meta"])
@pytest.mark.parametrize("case", list(CASES))
def test_decision_per_reason(case, device):
    overrides, flags, expected = CASES[case]
    q, k, v = _qkv(device, **overrides)
    reasons = provider.why_not(q, k, v, **flags)
    codes = {r.code for r in reasons}
    want = set() if expected is None else {expected}
    if device == "meta":
        want.add(ReasonCode.DEVICE)  # our kernels never run on meta tensors
    assert codes == want, [str(r) for r in reasons]
    if case == "debug_mask":
        assert any("return_debug_mask" in str(r) for r in reasons)
    args = provider.bind_args(provider.FORWARD_OP, (q, k, v), flags)
    assert provider.forward_decision(args) == tuple(reasons)


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("debug_mask", "head_dim_v_differs")])
def test_backward_takes_the_forwards_decision(case):
    """Decided from the backward's own arguments (as autograd passes them), the answer is the forward's."""
    overrides, flags, _ = CASES[case]
    q, k, v = _qkv("meta", **overrides)
    fwd_args = provider.bind_args(provider.FORWARD_OP, (q, k, v, flags.get("dropout_p", 0.0), True), {"scale": 0.1})
    out, lse, cq, ck, mq, mk, seed, offset, _ = FWD(q, k, v, flags.get("dropout_p", 0.0), True, scale=0.1)
    bwd_args = provider.bind_args(provider.BACKWARD_OP, (torch.empty_like(out), q, k, v, out, lse, cq, ck, mq, mk,
                                                         flags.get("dropout_p", 0.0), True, seed, offset),
                                  {"scale": 0.1})
    assert provider.backward_decision(bwd_args) == provider.forward_decision(fwd_args)
    # and the same holds on a device our kernels run on
    q, k, v = _qkv(DEVICE, **overrides)
    fwd_args.update(query=q, key=k, value=v)
    bwd_args.update(query=q, key=k, value=v)
    assert provider.backward_decision(bwd_args) == provider.forward_decision(fwd_args)


def test_bind_args_fills_schema_defaults():
    q = torch.empty(1, 1, 8, 16, device="meta")
    assert provider.bind_args(provider.FORWARD_OP, (q, q, q), {}) | {"query": None, "key": None, "value": None} == {
        "query": None, "key": None, "value": None, "dropout_p": 0.0, "is_causal": False,
        "return_debug_mask": False, "scale": None}
    got = provider.bind_args(provider.FORWARD_OP, (q, q), {"value": q, "is_causal": True, "scale": 0.5})
    assert got["value"] is q and got["is_causal"] is True and got["scale"] == 0.5


def test_each_fallback_reason_is_logged_once(meta_key, caplog):
    override = provider._Override("Meta")  # not installed: call its kernels directly
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
    q = torch.empty(1, 2, 16, 64, dtype=torch.float16, device="meta")
    q32 = q.float()
    with caplog.at_level(logging.INFO, logger="fa_backend.dispatch"):
        for _ in range(3):
            override.forward(keyset, q, q, q, 0.0, False)
        override.forward(keyset, q32, q32, q32, 0.0, False)
    records = [r.getMessage() for r in caplog.records if "provider" in r.getMessage()]
    assert len(records) == 2, records
    assert "[device]" in records[0] and "[dtype]" in records[1]
    assert provider.stats()["fallback_forward"] == 4


# --- outputs: the meta kernel's contract, and numerics --------------------------------------------------

def _describe(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device.type)
    return (type(x).__name__, x)


@pytest.mark.parametrize("layout", ["bhsd", "bshd", "sliced"])
@pytest.mark.parametrize("hkv", [4, 2])
def test_forward_outputs_match_the_meta_kernel(layout, hkv):
    q, k, v = _qkv("meta", b=2, hq=4, hkv=hkv, sq=24, sk=40, d=64, layout=layout)
    ours = provider.new_forward_outputs(q, k, v)
    theirs = FWD(q, k, v, 0.0, True, scale=0.2)
    assert len(ours) == len(theirs) == 9
    assert [_describe(x) for x in ours] == [_describe(x) for x in theirs]
    if layout == "bshd":  # the out layout follows the query's, as empty_like does
        assert ours[0].transpose(1, 2).is_contiguous()


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal,sq,sk", [(False, 24, 40), (True, 24, 40), (True, 40, 40), (True, 40, 24)])
def test_run_forward_and_backward_match_math(layout, causal, sq, sk):
    """Our kernels as the flash op: out in the meta layout, bottom-right causal (FlashAttention-2's)."""
    q, k, v = _qkv(DEVICE, b=1, hq=4, hkv=2, sq=sq, sk=sk, d=32, layout=layout)
    scale = 0.3
    out, lse, *rest = provider.run_forward(q, k, v, causal, scale)
    meta = FWD(*(t.to("meta") if t.is_contiguous() else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                            device="meta") for t in (q, k, v)),
               0.0, causal, scale=scale)
    assert [_describe(x)[:4] for x in (out, lse, *rest)] == [_describe(x)[:4] for x in meta]

    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_math(*leaves64, is_causal=causal, bottom_right=True, scale=scale)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    same = attention_same_dtype(*leaves, is_causal=causal, bottom_right=True, scale=scale)
    if causal and sq > sk:  # rows with no visible key: ours (and FlashAttention-2) give 0, math gives NaN
        visible = torch.arange(sq, device=q.device) >= sq - sk
        ref, same, out_cmp = ref[:, :, visible], same[:, :, visible], out[:, :, visible]
        assert (out[:, :, ~visible] == 0).all()
    else:
        out_cmp = out
    assert_within_bar("out", out_cmp, same, ref)

    # lse: natural-log sum-exp of the scaled scores, fp32 (b, h, sq)
    kk = k.double().repeat_interleave(2, dim=1)
    scores = scale * q.double() @ kk.transpose(-1, -2)
    if causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse_ref = torch.logsumexp(scores, dim=-1)
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse[finite].double() - lse_ref[finite]).abs().max().item() < 1e-2

    if causal and sq > sk:
        return  # math's NaN rows make its gradients useless as a reference
    dout = torch.randn_like(out)
    dq, dk, dv = provider.run_backward(dout, q, k, v, out, lse, causal, scale)
    for g, t in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == t.shape and g.stride() == torch.empty_like(t).stride() and g.dtype == t.dtype
    ref_grads = torch.autograd.grad(ref, leaves64, dout.double())
    same_grads = torch.autograd.grad(same, leaves, dout)
    for name, g, gs, gr in zip(("dq", "dk", "dv"), (dq, dk, dv), same_grads, ref_grads):
        assert_within_bar(name, g, gs, gr)


@pytest.mark.usefixtures("poisoned")
def test_override_kernels_run_ours_when_eligible(fresh):
    """The registered kernels themselves, called as the dispatcher would (args by position and name)."""
    override = provider._Override("Meta")  # not installed; Meta kernels are the fallback
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)
    q, k, v = _qkv(DEVICE, b=1, hq=2, hkv=2, sq=32, sk=32, d=32, layout="bshd")
    outputs = override.forward(keyset, q, k, v, 0.0, True, scale=0.25)
    outputs_kw = override.forward(keyset, q, k, v, is_causal=True, scale=0.25)
    assert provider.stats() == {"forward": 2}
    assert counters.stats()["runs"].get("triton") == 2
    assert torch.equal(outputs[0], outputs_kw[0])
    ref = attention_math(q.double(), k.double(), v.double(), is_causal=True, scale=0.25)
    assert (outputs[0].double() - ref).abs().max().item() < 1e-2
    assert outputs[2] is None and outputs[3] is None and outputs[4:6] == (32, 32)
    assert outputs[6].dtype == torch.uint64 and outputs[6].cpu().tolist() == [0, 0] and outputs[8].numel() == 0

    out, lse = outputs[0], outputs[1]
    grads = override.backward(keyset, torch.ones_like(out), q, k, v, out, lse, None, None, 32, 32, 0.0, True,
                              outputs[6], outputs[7], scale=0.25)
    assert provider.stats() == {"forward": 2, "backward": 1}
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]

    # dropout: PyTorch's kernel (here the meta one) runs, ours is not counted
    qm, km, vm = (t.to("meta") for t in (q.contiguous(), k.contiguous(), v.contiguous()))
    override.forward(keyset, qm, km, vm, 0.1, True)
    assert provider.stats()["forward"] == 2 and counters.stats()["runs"].get("triton") == 2
    assert provider.stats()["fallback_forward:dropout"] == 1


# --- through the dispatcher and autograd, eager and compiled (CPU dispatch key) ------------------------

@pytest.fixture
def cpu_key(monkeypatch, fresh):
    """Stand-in CPU kernels for the flash ops (PyTorch has none), with ours installed in front of them."""
    calls = []

    def stand_in_forward(query, key, value, *args, **kwargs):
        calls.append("forward")
        return provider.new_forward_outputs(query, key, value)

    def stand_in_backward(grad_out, query, key, value, *args, **kwargs):
        calls.append("backward")
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)

    stand_ins = torch.library.Library("aten", "IMPL", "CPU")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stand_ins.impl(provider.FORWARD_OP, stand_in_forward, "CPU")
        stand_ins.impl(provider.BACKWARD_OP, stand_in_backward, "CPU")
    monkeypatch.setattr(provider, "_DISPATCH_KEY", "CPU")
    torch._dynamo.reset()
    try:
        yield calls
    finally:
        provider.deactivate()
        stand_ins._destroy()
        torch._dynamo.reset()


@needs_registry
@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors reach our kernels only under the Triton interpreter")
@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_through_dispatcher_autograd_and_inductor(cpu_key, layout):
    calls = cpu_key

    def attn(q, k, v, dropout_p=0.0):
        return FWD(q, k, v, dropout_p, True, scale=0.2)[0]

    q, k, v = _qkv("cpu", b=1, hq=4, hkv=2, sq=32, sk=48, d=32, layout=layout)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # registration warns nothing
        provider.activate()
    out = attn(*leaves)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    assert provider.stats() == {"forward": 1, "backward": 1} and calls == []

    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attention_math(*ref_leaves, is_causal=True, bottom_right=True, scale=0.2)
    same_leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    same = attention_same_dtype(*same_leaves, is_causal=True, bottom_right=True, scale=0.2)
    assert_within_bar("out", out, same, ref)
    for name, g, gs, gr in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(same, same_leaves, dout),
                               torch.autograd.grad(ref, ref_leaves, dout.double())):
        assert_within_bar(name, g, gs, gr)

    compiled = torch.compile(attn)  # Inductor: extern call to the op, stride asserts on its outputs
    out_c = compiled(*leaves)
    grads_c = torch.autograd.grad(out_c, leaves, dout)
    assert provider.stats() == {"forward": 2, "backward": 2} and calls == []
    assert torch.equal(out_c, out)  # our kernels are deterministic
    for g, g_c in zip(grads, grads_c):
        assert torch.equal(g, g_c)

    attn(*leaves, dropout_p=0.1)  # not ours: the kernel registered before ours runs
    assert calls == ["forward"] and provider.stats()["forward"] == 2
    assert provider.stats()["fallback_forward:dropout"] == 1
