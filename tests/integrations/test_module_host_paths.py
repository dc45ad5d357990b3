"""The host-bound module paths of integrations/modules.py: same results as PyTorch's own forward, taken
only where they apply.

float32 inputs: our Triton kernels take fp16/bf16 only, so the dispatcher's decision for these calls is
PyTorch's kernel on every machine, which is when these paths are taken.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import fa_backend
from fa_backend.integrations import modules
from tests.conftest import DEVICE

pytestmark = pytest.mark.usefixtures("clean_state")


def _spy(monkeypatch, name):
    """Counts calls of modules.<name> that return something other than None."""
    real, calls = getattr(modules, name), []

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        if result is not None:
            calls.append(1)
        return result

    monkeypatch.setattr(modules, name, spy)
    return calls


def _grads(m, x):
    return [x.grad] + [p.grad for p in m.parameters()]


@pytest.mark.parametrize("heads", [1, 3])  # odd head counts: PyTorch's fused fast path never runs them
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("training", [False, True])
def test_host_bound_self_attention_takes_the_lean_path_and_matches(monkeypatch, heads, batch_first, training):
    calls = _spy(monkeypatch, "_lean_self_attention")
    m = nn.MultiheadAttention(24 * heads, heads, dropout=0.0, batch_first=batch_first).to(DEVICE).train(training)
    x0 = torch.randn(3, 10, 24 * heads, device=DEVICE)
    if not batch_first:
        x0 = x0.transpose(0, 1).contiguous()
    results = []
    for routed in (False, True):
        m.zero_grad()
        x = x0.clone().requires_grad_(training)
        with torch.set_grad_enabled(training), (fa_backend.enabled() if routed else contextlib.nullcontext()):
            out, weights = m(x, x, x, need_weights=False)
            if training:
                (out * torch.linspace(-1, 1, out.numel(), device=DEVICE).view_as(out)).sum().backward()
        assert weights is None
        results.append((out.detach(), _grads(m, x) if training else []))
    assert calls == [1]
    torch.testing.assert_close(results[1][0], results[0][0])
    for routed_grad, ref_grad in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(routed_grad, ref_grad)
    assert fa_backend.stats()["runs"] == {"torch": 1}


def test_lean_path_applies_dropout_in_training_only(monkeypatch):
    calls = _spy(monkeypatch, "_lean_self_attention")
    m = nn.MultiheadAttention(32, 1, dropout=0.5, batch_first=True).to(DEVICE)
    x = torch.randn(2, 16, 32, device=DEVICE)
    with fa_backend.enabled():
        m.train()
        a, b = (m(x, x, x, need_weights=False)[0] for _ in range(2))
        m.eval()
        c, d = (m(x, x, x, need_weights=False)[0] for _ in range(2))
    assert calls == [1] * 4
    assert not torch.equal(a, b)  # fresh dropout masks
    assert torch.equal(c, d)
    with torch.no_grad():
        torch.testing.assert_close(c, m(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("form", ["key_padding_mask", "attn_mask", "cross", "need_weights", "bias_kv"])
def test_lean_path_leaves_other_forms_to_pytorch(monkeypatch, form):
    calls = _spy(monkeypatch, "_lean_self_attention")
    m = nn.MultiheadAttention(32, 1, batch_first=True, add_bias_kv=form == "bias_kv").to(DEVICE).eval()
    x, mem = torch.randn(2, 16, 32, device=DEVICE), torch.randn(2, 12, 32, device=DEVICE)
    kwargs = {"need_weights": form == "need_weights"}
    args = (x, mem, mem) if form == "cross" else (x, x, x)
    if form == "key_padding_mask":
        kwargs["key_padding_mask"] = torch.rand(2, 16, device=DEVICE) > 0.3
    if form == "attn_mask":
        kwargs["attn_mask"] = torch.rand(16, 16, device=DEVICE) > 0.3
    with torch.no_grad():
        ref = m(*args, **kwargs)[0]
        with fa_backend.enabled():
            out = m(*args, **kwargs)[0]
    assert calls == []
    torch.testing.assert_close(out, ref, equal_nan=True)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_calls_pytorchs_fused_op_directly(monkeypatch, norm_first, activation):
    calls = _spy(monkeypatch, "_encoder_layer_fused_args")
    layer = nn.TransformerEncoderLayer(32, 2, 64, activation=activation, norm_first=norm_first,
                                       batch_first=True).to(DEVICE).eval()
    x = torch.randn(2, 12, 32, device=DEVICE)
    with torch.no_grad():
        ref = layer(x)
        with fa_backend.enabled():
            out = layer(x)
    assert calls == [1]
    assert torch.equal(out, ref)
    assert fa_backend.stats()["runs"] == {"torch": 1}


@pytest.mark.parametrize("module", ["encoder_layer", "mha"])
def test_fused_paths_ask_the_router_nothing(monkeypatch, module):
    """The routed module paths' checks read tensors with the router's handler off: each read through it
    costs a __torch_function__ round trip (it made routing on 0.85x of off for TransformerEncoderLayer(512, 16)
    eval on the H200, host-bound: 2026-11-30)."""
    from fa_backend.integrations.sdpa import SDPARouter

    seen = []
    real = SDPARouter.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        seen.append(getattr(func, "__name__", str(func)))
        return real(self, func, types, args, kwargs)

    m = (nn.TransformerEncoderLayer(32, 2, 64, batch_first=True) if module == "encoder_layer"
         else nn.MultiheadAttention(32, 2, batch_first=True)).to(DEVICE).eval()
    x = torch.randn(2, 12, 32, device=DEVICE)
    call = (lambda: m(x)) if module == "encoder_layer" else (lambda: m(x, x, x, need_weights=False))
    with torch.no_grad(), fa_backend.enabled():
        call()  # first call: memoises the checks
        monkeypatch.setattr(SDPARouter, "__torch_function__", counting)
        call()
    assert seen == []
    assert fa_backend.stats()["runs"] == {"torch": 2}


@pytest.mark.parametrize("where", ["linear1", "self_attn.out_proj"])
def test_encoder_layer_with_hooks_keeps_pytorchs_forward(monkeypatch, where):
    calls = _spy(monkeypatch, "_encoder_layer_fused_args")
    layer = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True).to(DEVICE).eval()
    seen = []
    if where == "linear1":
        layer.linear1.register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    else:  # nested two levels down (PyTorch's Python path uses out_proj's weights directly: it never fires)
        layer.self_attn.out_proj.register_forward_pre_hook(lambda mod, inp: seen.append(None))
    x = torch.randn(2, 12, 32, device=DEVICE)
    with torch.no_grad():
        ref = layer(x)
        with fa_backend.enabled():
            out = layer(x)
    assert calls == []
    assert len(seen) == (2 if where == "linear1" else 0)  # as PyTorch's Python path runs it, routed or not
    assert torch.equal(out, ref)


@pytest.mark.parametrize("change", ["grad_enabled", "training", "masks", "odd_heads", "subclass_parameter"])
def test_encoder_layer_direct_call_only_where_pytorch_takes_its_fast_path(monkeypatch, change):
    calls = _spy(monkeypatch, "_encoder_layer_fused_args")
    layer = nn.TransformerEncoderLayer(30 if change == "odd_heads" else 32, 3 if change == "odd_heads" else 2, 64,
                                       dropout=0.0, batch_first=True).to(DEVICE).eval()
    x = torch.randn(2, 12, layer.self_attn.embed_dim, device=DEVICE)
    kwargs = {}
    if change == "training":
        layer.train()
    if change == "masks":
        kwargs["src_key_padding_mask"] = torch.rand(2, 12, device=DEVICE) > 0.3
        kwargs["src_key_padding_mask"][:, 0] = False
    if change == "subclass_parameter":
        class Marked(nn.Parameter):
            pass

        layer.linear2.weight = Marked(layer.linear2.weight.detach().clone())
    with torch.set_grad_enabled(change == "grad_enabled"):
        ref = layer(x, **kwargs)
        with fa_backend.enabled():
            out = layer(x, **kwargs)
    assert calls == []
    torch.testing.assert_close(out, ref, equal_nan=True)


def test_hook_search_reaches_nested_modules_and_skips_empty_slots():
    layer = nn.TransformerEncoderLayer(32, 2, 64)
    layer.register_module("extra", None)
    assert not modules._any_forward_hooks(layer)
    handle = layer.self_attn.out_proj.register_forward_pre_hook(lambda mod, inp: None)
    assert modules._any_forward_hooks(layer)
    handle.remove()
    layer.register_forward_hook(lambda mod, inp, out: None)
    assert modules._any_forward_hooks(layer)
