"""Routing SDPA decode calls (seqlen_q <= 16, no grad, no dropout) to the split-KV decode kernel: eager,
restricted, explained, counted, and under torch.compile(fullgraph=True); the rest keeps the dense kernel
or PyTorch, with reasons. CPU: Triton's interpreter, fp16, tiny shapes."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.nn.functional as F

import fa_backend
from tests.conftest import DEVICE
from tests.integrations.test_sdpa_routing_compile import Recorder
from tests.reference import assert_within_bar, attention_ref, check_features

DT = torch.float16
pytestmark = pytest.mark.usefixtures("clean_state", "no_speed_preferences")


def _qkv(b=2, hq=4, hkv=2, sq=1, sk=40, d=32, dv=None):
    return (torch.randn(b, hq, sq, d, dtype=DT, device=DEVICE), torch.randn(b, hkv, sk, d, dtype=DT, device=DEVICE),
            torch.randn(b, hkv, sk, dv or d, dtype=DT, device=DEVICE))


def _runs():
    return fa_backend.stats()["runs"]


def _fallbacks():
    return fa_backend.stats()["fallbacks"]


def _sdpa(**kw):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)
    return fn


def _op(q, k, v, attn_mask=None, is_causal=False):
    return torch.ops.fa_backend.triton_sdpa_decode(q, k, v, attn_mask, is_causal, False, None)[0]


def test_short_query_runs_the_decode_kernel():
    q, k, v = _qkv()
    with fa_backend.enabled():
        out = check_features(_sdpa(), q, k, v, grad=False)
    assert _runs() == {"triton_decode": 1}
    assert "triton_decode:" not in str(_fallbacks())
    fa_backend.reset_stats()
    assert torch.equal(out, _op(q, k, v))  # the op gives the routed result bitwise


@pytest.mark.parametrize("sq", [1, 5, 16])
@pytest.mark.parametrize("form", ["causal", "key_padding", "hf_additive"])
def test_decode_forms_are_routed(sq, form):
    b, sk = 2, 30
    q, k, v = _qkv(b, 4, 2, sq, sk)
    if form == "causal":
        kw = {"is_causal": True}
    elif form == "key_padding":
        kw = {"attn_mask": torch.arange(sk, device=DEVICE)[None, None, None, :] >= torch.tensor(
            [0, 7], device=DEVICE)[:, None, None, None]}
    else:
        keep = torch.rand(b, 1, sq, sk, device=DEVICE) < 0.8
        kw = {"attn_mask": torch.zeros(keep.shape, dtype=DT, device=DEVICE).masked_fill(~keep, float("-inf"))}
    with fa_backend.enabled():
        check_features(_sdpa(**kw), q, k, v, grad=False, **kw)
    assert _runs() == {"triton_decode": 1}


def test_hf_static_cache_generation_loop():
    # A generation loop over a static cache as Hugging Face models run it with SDPA: K/V repeated to the
    # query heads when a mask is passed, a (b, 1, 1, L) additive mask with the dtype's minimum on the left
    # padding and on the rows not written yet; every step is routed to the decode kernel.
    b, h, d, L, prompt = 2, 4, 32, 24, 6
    pad = torch.tensor([0, 3], device=DEVICE)
    k_cache = torch.zeros(b, h, L, d, dtype=DT, device=DEVICE)
    v_cache = torch.zeros(b, h, L, d, dtype=DT, device=DEVICE)
    k_cache[:, :, :prompt] = torch.randn(b, h, prompt, d, dtype=DT, device=DEVICE)
    v_cache[:, :, :prompt] = torch.randn(b, h, prompt, d, dtype=DT, device=DEVICE)
    j = torch.arange(L, device=DEVICE)
    fa_backend.enable()
    for t in range(prompt, prompt + 4):
        k_cache[:, :, t] = torch.randn(b, h, d, dtype=DT, device=DEVICE)
        v_cache[:, :, t] = torch.randn(b, h, d, dtype=DT, device=DEVICE)
        keep = (j[None, :] <= t) & (j[None, :] >= pad[:, None])
        mask = torch.zeros(b, 1, 1, L, dtype=DT, device=DEVICE).masked_fill(~keep[:, None, None, :],
                                                                            torch.finfo(DT).min)
        q = torch.randn(b, h, 1, d, dtype=DT, device=DEVICE)
        with torch.no_grad():
            out = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)
        ref = attention_ref(q.double(), k_cache.double(), v_cache.double(), attn_mask=mask.double())
        pt = attention_ref(q, k_cache, v_cache, attn_mask=mask)
        assert_within_bar(f"step {t}", out, pt, ref)
    assert _runs() == {"triton_decode": 4}


def test_restriction_to_triton_runs_the_decode_kernel():
    q, k, v = _qkv()
    with fa_backend.enabled(), fa_backend.sdpa_backends(["triton"]):
        out = _sdpa()(q, k, v)
        again = _sdpa()(q, k, v)
    assert _runs() == {"triton_decode": 2}
    assert torch.equal(out, again)


@pytest.mark.parametrize("case", ["sq17", "grad", "dropout", "dv", "strided_kv"])
def test_other_short_calls_keep_the_dense_kernel(case):
    q, k, v = _qkv(sq=17 if case == "sq17" else 3, dv=16 if case == "dv" else None)
    kw = {"dropout_p": 0.2} if case == "dropout" else {}
    if case == "grad":
        q.requires_grad_()
    if case == "strided_kv":
        k = torch.randn(2, 2, 40, 64, dtype=DT, device=DEVICE)[..., ::2]
    with fa_backend.enabled():
        explanation = fa_backend.explain(q, k, v, enable_gqa=True, **kw)
        out = _sdpa(**kw)(q, k, v)
    assert _runs() == {"triton": 1}
    assert explanation.backend == "triton" and explanation.kernels["triton"] == "triton"
    code = {"sq17": "seq_len", "grad": "grad", "dropout": "dropout", "dv": "head_dim", "strided_kv": "layout"}[case]
    assert [r.code.value for r in explanation.kernel_reasons["triton"]] == [code]
    decode_fallbacks = {key: n for key, n in _fallbacks().items() if key.startswith("triton_decode:")}
    # Only decode calls (sq <= 16) count a fallback from the decode kernel; every training call would.
    assert decode_fallbacks == ({} if case == "sq17" else {f"triton_decode:{code}": 1})
    if case != "dropout":
        assert torch.equal(out, fa_backend.attention(q, k, v))  # the dense kernel's result, bitwise


def test_eager_decisions_tell_strided_head_dims_apart():
    # Same shapes, K first contiguous then with a strided head dim: the cached decision must not be reused.
    q, k, v = _qkv()
    strided = torch.randn(2, 2, 40, 64, dtype=DT, device=DEVICE)[..., ::2]
    strided.copy_(k)
    with fa_backend.enabled():
        out = _sdpa()(q, k, v)
        out_strided = _sdpa()(q, strided, v)
    assert _runs() == {"triton_decode": 1, "triton": 1} and _fallbacks()["triton_decode:layout"] == 1
    assert torch.equal(out, _op(q, k, v)) and torch.equal(out_strided, fa_backend.attention(q, k, v))


def test_mask_with_causal_goes_to_pytorch():
    # PyTorch decides such a call: torch 2.13's CPU kernel runs it, torch >= 2.14 raises; routed, the same happens
    q, k, v = _qkv(sq=2)
    mask = torch.rand(2, 1, 2, 40, device=DEVICE) < 0.8
    try:
        expected = _sdpa(attn_mask=mask, is_causal=True)(q, k, v)
    except RuntimeError as e:
        expected = e
    fa_backend.reset_stats()
    with fa_backend.enabled():
        if isinstance(expected, RuntimeError):
            with pytest.raises(RuntimeError, match=re.escape(str(expected))):
                _sdpa(attn_mask=mask, is_causal=True)(q, k, v)
        else:
            torch.testing.assert_close(_sdpa(attn_mask=mask, is_causal=True)(q, k, v), expected, atol=0, rtol=0)
    assert _runs() == {"torch": 1} and _fallbacks()["triton:mask"] == 1


def test_decode_kernel_fallback_is_logged_once(caplog):
    q, k, v = _qkv()
    q.requires_grad_()
    caplog.set_level(logging.INFO, logger="fa_backend")
    with fa_backend.enabled():
        for _ in range(2):
            _sdpa()(q, k, v)
    records = [r.getMessage() for r in caplog.records if "triton_decode skipped" in r.getMessage()]
    assert len(records) == 1 and "[grad]" in records[0] and records[0].endswith("ran triton")


def test_explain_decode_call():
    q, k, v = _qkv()
    text = str(fa_backend.explain(q, k, v, enable_gqa=True))
    assert "decode)" in text.splitlines()[0] and "triton (split-KV decode)  RUNS" in text
    text = str(fa_backend.explain(q.requires_grad_(), k, v, enable_gqa=True))
    assert "triton (dense)  RUNS" in text and "(split-KV decode kernel not used: [grad]" in text


def test_explain_on_meta_tensors():
    q, k, v = (torch.empty(8, 32, 1, 128, device="meta", dtype=torch.bfloat16),
               *(torch.empty(8, 8, 4096, 128, device="meta", dtype=torch.bfloat16) for _ in range(2)))
    ex = fa_backend.explain(q, k, v, is_causal=True, enable_gqa=True)
    assert ex.call.kind == "decode" and ex.kernels["triton"] == "triton_decode" and ex.backend == "math"
    assert "triton (split-KV decode)  no: [device] device=meta" in str(ex)
    long = fa_backend.explain(q.expand(8, 32, 17, 128), k, v, enable_gqa=True)
    assert long.call.kind == "dense" and long.kernels["triton"] == "triton"


# ------------------------------------------------------------------------------ torch.compile

def _step(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).flatten(2) * 2


def test_compiled_decode_has_no_graph_break_and_matches_eager():
    q, k, v = _qkv()
    mask = torch.rand(2, 1, 1, 40, device=DEVICE) < 0.8
    fa_backend.enable()
    explained = torch._dynamo.explain(_step)(q, k, v, mask)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    torch._dynamo.reset()
    fa_backend.reset_stats()
    rec = Recorder()
    out = torch.compile(_step, fullgraph=True, backend=rec)(q, k, v, mask)
    (graph,) = rec.graphs
    assert any("fa_backend.triton_sdpa_decode" in t for t in graph)
    assert not any("scaled_dot_product_attention" in t or "triton_flash_fwd" in t for t in graph)
    assert fa_backend.stats()["traced"] == {"triton_decode (skipped cute:not_installed)": 1}
    assert _runs() == {"triton_decode": 1}  # the op counts its own runs, compiled or not
    assert torch.equal(out, _step(q, k, v, mask))


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_decode_steps_with_a_growing_cache(dynamic):
    fa_backend.enable()
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                             fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for sk in (20, 33):
        q, k, v = _qkv(1, 2, 2, 2, sk)
        check_features(compiled, q, k, v, grad=False, is_causal=True)
    assert _runs() == {"triton_decode": 2}


def test_compiled_training_call_with_short_query_uses_the_dense_op():
    q, k, v = _qkv(sq=4)
    q.requires_grad_()
    fa_backend.enable()
    rec = Recorder()
    torch.compile(lambda q, k, v: _step(q, k, v, None), fullgraph=True, backend=rec)(q, k, v)
    assert any("triton_flash_fwd" in t for t in rec.graphs[0])
    assert fa_backend.stats()["traced"] == {"triton (skipped cute:not_installed,triton_decode:grad)": 1}
