"""nn.MultiheadAttention / nn.TransformerEncoderLayer with routing on: routed, same results, no copies."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fa_backend
from tests.conftest import DEVICE

DT = torch.float16
pytestmark = pytest.mark.usefixtures("clean_state", "no_speed_preferences")


def _runs():
    return fa_backend.stats()["runs"]


def _mha(embed=32, heads=2, **kw):
    torch.manual_seed(torch.seed() % 2**31)
    return nn.MultiheadAttention(embed, heads, **kw).to(DEVICE, DT)


def _x(*shape):
    return torch.randn(*shape, dtype=DT, device=DEVICE)


def _both(fn):
    """fn() unrouted, then routed (fresh counters); returns (reference, routed)."""
    ref = fn()
    fa_backend.reset_stats()
    with fa_backend.enabled():
        out = fn()
    return ref, out


FORMS = {
    "self_batch_first": (dict(batch_first=True), lambda x, m: (x, x, x)),
    "self_seq_first": (dict(), lambda x, m: (x, x, x)),
    "cross_key_is_value": (dict(batch_first=True), lambda x, m: (x, m, m)),
    "cross_distinct": (dict(batch_first=True), lambda x, m: (x, m, m + 1)),
    "separate_kdim_vdim": (dict(batch_first=True, kdim=16, vdim=24), lambda x, m: (x, m[..., :16], m[..., :24])),
    "no_bias": (dict(batch_first=True, bias=False), lambda x, m: (x, x, x)),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("training", [False, True])
def test_forms_are_routed_to_the_kernel_and_match(form, training):
    kw, args = FORMS[form]
    mha = _mha(**kw).train(training)
    x, mem = _x(2, 24, 32), _x(2, 40, 32)
    if not kw.get("batch_first"):
        x, mem = x.transpose(0, 1).contiguous(), mem.transpose(0, 1).contiguous()
    with torch.set_grad_enabled(training):
        ref, out = _both(lambda: mha(*args(x, mem), need_weights=False)[0])
    assert _runs() == {"triton": 1}
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_gradients_match_pytorch():
    mha = _mha(batch_first=True).train()
    x = _x(2, 24, 32).requires_grad_()

    def grads():
        out = mha(x, x, x, need_weights=False)[0]
        return torch.autograd.grad(out.float().square().sum(), (x, mha.in_proj_weight, mha.out_proj.weight))

    ref, routed = _both(grads)
    assert _runs() == {"triton": 1}
    for a, b in zip(routed, ref):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


MASKS = {
    "key_padding_bool": lambda b, sq, sk: dict(key_padding_mask=torch.rand(b, sk, device=DEVICE) < 0.3),
    "attn_float_2d": lambda b, sq, sk: dict(attn_mask=torch.randn(sq, sk, dtype=DT, device=DEVICE)),
    "attn_bool_3d": lambda b, sq, sk: dict(attn_mask=torch.rand(b * 2, sq, sk, device=DEVICE) < 0.3),
    "attn_and_padding": lambda b, sq, sk: dict(attn_mask=torch.randn(sq, sk, dtype=DT, device=DEVICE),
                                               key_padding_mask=torch.rand(b, sk, device=DEVICE) < 0.3),
    "causal_hint": lambda b, sq, sk: dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(sq, DEVICE, DT),
                                          is_causal=True),
    "causal_hint_and_padding": lambda b, sq, sk: dict(
        attn_mask=nn.Transformer.generate_square_subsequent_mask(sq, DEVICE, DT), is_causal=True,
        key_padding_mask=torch.rand(b, sk, device=DEVICE) < 0.3),
}


@pytest.mark.parametrize("mask", MASKS)
def test_masks_are_merged_as_pytorch_does(mask):
    mha = _mha(batch_first=True).eval()
    x = _x(2, 24, 32)
    kw = MASKS[mask](2, 24, 24)
    with torch.no_grad():
        ref, out = _both(lambda: mha(x, x, x, need_weights=False, **kw)[0])
    assert sum(_runs().values()) == 1
    if mask == "causal_hint":
        assert _runs() == {"triton": 1}  # no mask left: PyTorch passes is_causal=True to SDPA
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3, equal_nan=True)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_transformer_encoder_layer_is_routed(norm_first, training):
    layer = nn.TransformerEncoderLayer(32, 2, dim_feedforward=64, dropout=0.0, batch_first=True,
                                       norm_first=norm_first).to(DEVICE, DT).train(training)
    x = _x(2, 24, 32)
    with torch.set_grad_enabled(training):
        ref, out = _both(lambda: layer(x))
    assert _runs() == {"triton": 1}
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)


def test_transformer_encoder_with_padding_is_routed():
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 2,
                                enable_nested_tensor=False).to(DEVICE, DT).eval()
    x = _x(2, 24, 32)
    pad = torch.zeros(2, 24, dtype=torch.bool, device=DEVICE)
    pad[1, 20:] = True
    with torch.no_grad():
        ref, out = _both(lambda: enc(x, src_key_padding_mask=pad))
    assert sum(_runs().values()) == 2
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("kw", [dict(add_bias_kv=True), dict(add_zero_attn=True)], ids=["bias_kv", "zero_attn"])
def test_other_forms_run_pytorchs_function_with_the_inner_call_routed(kw):
    mha = _mha(batch_first=True, **kw).eval()
    x = _x(2, 24, 32)
    with torch.no_grad():
        ref, out = _both(lambda: mha(x, x, x, need_weights=False)[0])
    assert sum(_runs().values()) == 1
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_need_weights_is_left_alone():
    mha = _mha(batch_first=True)
    x = _x(2, 8, 32)
    with fa_backend.enabled():
        _, weights = mha(x, x, x, need_weights=True)
    assert weights is not None and _runs() == {}


def test_pytorchs_errors_are_kept():
    mha = _mha(batch_first=True)
    x = _x(2, 8, 32)
    bad = torch.zeros(3, 8, dtype=torch.bool, device=DEVICE)
    with pytest.raises(Exception) as native:
        mha(x, x, x, need_weights=False, key_padding_mask=bad)
    with fa_backend.enabled(), pytest.raises(Exception) as routed:
        mha(x, x, x, need_weights=False, key_padding_mask=bad)
    assert type(routed.value) is type(native.value) and str(routed.value) == str(native.value)
    with pytest.raises(RuntimeError, match="Need attn_mask"), fa_backend.enabled():
        mha(x, x, x, need_weights=False, is_causal=True)


# --- torch.compile ----------------------------------------------------------------------------------

@pytest.mark.parametrize("training", [False, True])
def test_compiled_multihead_attention_is_routed(training):
    mha = _mha(batch_first=True).train(training)
    x = _x(2, 24, 32)

    def fn(x):
        return mha(x, x, x, need_weights=False)[0]

    with torch.set_grad_enabled(training):
        ref = fn(x)
        with fa_backend.enabled():
            explained = torch._dynamo.explain(fn)(x)
            torch._dynamo.reset()
            fa_backend.reset_stats()
            out = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    assert explained.graph_break_count == 0
    assert _runs() == {"triton": 1}
    assert fa_backend.stats()["traced"] == {"triton (skipped cute:not_installed)": 1}
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)


def test_compiled_other_forms_are_reported(caplog):
    mha = _mha(batch_first=True, add_bias_kv=True).eval()
    x = _x(2, 8, 32)
    caplog.set_level(logging.INFO, logger="fa_backend")
    with fa_backend.enabled(), torch.no_grad():
        out = torch.compile(lambda x: mha(x, x, x, need_weights=False)[0], fullgraph=True, backend="eager")(x)
        ref = mha(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    assert any("multi_head_attention_forward:not routed under torch.compile (bias_k/bias_v/add_zero_attn)"
               in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("form", ["self_batch_first", "self_seq_first", "cross_key_is_value"])
def test_common_forms_make_no_layout_copies(form, monkeypatch):
    # The direct form: Q, K, V reach the dispatcher as views of the in-projection's output and
    # PyTorch's own function (with its contiguous() copies) is not used.
    from fa_backend.integrations import mha as mha_mod
    from fa_backend.integrations import sdpa as sdpa_mod

    seen = []
    original = sdpa_mod.route_sdpa

    def spy(fn, args, kwargs):
        seen.append(args)
        return original(fn, args, kwargs)

    monkeypatch.setattr(sdpa_mod, "route_sdpa", spy)
    monkeypatch.setattr(mha_mod, "_run_patched", lambda *a: pytest.fail("PyTorch's function was used"))
    kw, args = FORMS[form]
    mha = _mha(**kw).eval()
    x, mem = _x(2, 24, 32), _x(2, 40, 32)
    if not kw.get("batch_first"):
        x, mem = x.transpose(0, 1).contiguous(), mem.transpose(0, 1).contiguous()
    with torch.no_grad(), fa_backend.enabled():
        mha(*args(x, mem), need_weights=False)
    (q, k, v), = seen
    assert q.shape == (2, 2, 24, 16) and k.shape == v.shape == (2, 2, 40 if "cross" in form else 24, 16)
    if form != "cross_key_is_value":
        assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    else:
        assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


# --- PyTorch's fused inference fast path ------------------------------------------------------------

def _ops_run(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("module", ["mha", "encoder_layer"])
def test_fast_path_is_kept_when_pytorchs_kernel_would_run_anyway(module):
    # float32: our Triton kernels take fp16/bf16 only, so the dispatcher picks PyTorch's kernel and
    # the module's own fused C++ path (which the router's presence would otherwise switch off) runs.
    if module == "mha":
        m = nn.MultiheadAttention(32, 2, batch_first=True).to(DEVICE).eval()
        fn, fused = (lambda x: m(x, x, x, need_weights=False)[0]), "aten::_native_multi_head_attention"
    else:
        m = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True).to(DEVICE).eval()
        fn, fused = m, "aten::_transformer_encoder_layer_fwd"
    x = torch.randn(2, 24, 32, device=DEVICE)
    with torch.no_grad():
        ref = fn(x)
        with fa_backend.enabled():
            fa_backend.reset_stats()
            assert fused in _ops_run(lambda: fn(x))
            out = fn(x)
    assert torch.equal(out, ref)
    assert _runs() == {"torch": 2}
    assert fa_backend.stats()["fallbacks"] == {"cute:not_installed": 2, "triton:dtype": 2}
    if module == "mha":  # the whole return value is the module's own: (output, None)
        with torch.no_grad(), fa_backend.enabled():
            routed = m(x, x, x, need_weights=False)
        with torch.no_grad():
            unrouted = m(x, x, x, need_weights=False)
        assert routed[1] is None and unrouted[1] is None and torch.equal(routed[0], unrouted[0])


def test_fast_path_is_not_kept_when_our_kernel_runs():
    m = _mha(batch_first=True).eval()
    x = _x(2, 24, 32)
    with torch.no_grad(), fa_backend.enabled():
        assert "aten::_native_multi_head_attention" not in _ops_run(lambda: m(x, x, x, need_weights=False))
    assert _runs() == {"triton": 1}


def test_fast_path_guard_is_inert_without_routing():
    m = nn.MultiheadAttention(32, 2, batch_first=True).to(DEVICE).eval()
    x = torch.randn(2, 24, 32, device=DEVICE)
    with fa_backend.enabled():
        pass  # installs the guard
    with torch.no_grad():
        assert "aten::_native_multi_head_attention" in _ops_run(lambda: m(x, x, x, need_weights=False))
    assert _runs() == {}
