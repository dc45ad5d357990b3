"""Eligibility as data: AttentionCall from metadata, one rejected case per reason code, selection."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fa_backend
from fa_backend.dispatch import AttentionCall, BackendUnsupportedError, ReasonCode, select
from fa_backend.dispatch.backends import BACKENDS, PRIORITY, CuteBackend, TorchBackend, TritonBackend
from fa_backend.dispatch.backends import triton as triton_backend

OK = AttentionCall(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=2, heads_q=8, heads_kv=2,
                   seqlen_q=1024, seqlen_k=2048, head_dim=128, head_dim_v=128, enable_gqa=True)


def _codes(backend=TritonBackend, **changes):
    return [r.code for r in backend.why_not(dataclasses.replace(OK, **changes))]


def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def test_priority_order():
    assert PRIORITY == ("cute", "triton", "torch", "math")
    assert set(BACKENDS) == set(PRIORITY)


def test_call_is_built_from_metadata_only():
    q, k, v = _meta(2, 8, 100, 64), _meta(2, 2, 300, 64), _meta(2, 2, 300, 32)
    mask = torch.empty(1, 8, 100, 300, dtype=torch.bool, device="meta")
    call = AttentionCall.from_tensors(q, k, v, mask, 0.1, False, 0.5, True)
    assert (call.batch, call.heads_q, call.heads_kv, call.seqlen_q, call.seqlen_k) == (2, 8, 2, 100, 300)
    assert (call.head_dim, call.head_dim_v, call.gqa_group) == (64, 32, 4)
    assert (call.mask_kind, call.mask_shape, call.dropout_p, call.scale) == ("bool", (1, 8, 100, 300), 0.1, 0.5)
    assert call.device_type == "meta" and call.capability is None and call.shapes_consistent
    additive = AttentionCall.from_tensors(q, k, v, _meta(100, 300))
    assert additive.mask_kind == "additive"
    three_d = AttentionCall.from_tensors(_meta(8, 100, 64), _meta(8, 300, 64), _meta(8, 300, 64))
    assert three_d.ranks == (3, 3, 3) and not three_d.shapes_consistent


def test_requires_grad_follows_grad_mode():
    q = torch.randn(1, 1, 4, 8, requires_grad=True)
    assert AttentionCall.from_tensors(q, q, q).requires_grad
    with torch.no_grad():
        assert not AttentionCall.from_tensors(q, q, q).requires_grad


def test_eligible_call_has_no_reason():
    assert _codes() == []


@pytest.mark.parametrize("changes,code", [
    ({"dtype": torch.float32}, ReasonCode.DTYPE),
    ({"same_dtype": False}, ReasonCode.DTYPE),
    ({"head_dim": 100}, ReasonCode.HEAD_DIM),
    ({"head_dim_v": 320}, ReasonCode.HEAD_DIM),
    ({"capability": (7, 5)}, ReasonCode.CAPABILITY),
    ({"device_type": "mps", "capability": None}, ReasonCode.DEVICE),
    ({"same_device": False}, ReasonCode.DEVICE),
    ({"mask_kind": "additive", "mask_shape": (1024, 2048), "mask_dtype": torch.float64}, ReasonCode.MASK),
    ({"mask_kind": "additive", "mask_shape": (1024, 2048), "mask_dtype": torch.float16}, ReasonCode.MASK),
    ({"mask_kind": "bool", "mask_shape": (1000, 2048), "mask_dtype": torch.bool}, ReasonCode.MASK),
    ({"mask_kind": "bool", "mask_shape": (1, 2, 8, 1024, 2048), "mask_dtype": torch.bool}, ReasonCode.MASK),
    ({"mask_kind": "bool", "mask_shape": (2048,), "mask_dtype": torch.bool, "is_causal": True}, ReasonCode.MASK),
    ({"mask_kind": "additive", "mask_shape": (1024, 2048), "mask_dtype": torch.bfloat16,
      "mask_requires_grad": True}, ReasonCode.GRAD),
    ({"mask_kind": "bool", "mask_shape": (2048,), "mask_dtype": torch.bool, "mask_same_device": False},
     ReasonCode.DEVICE),
    ({"dropout_p": 1.0}, ReasonCode.DROPOUT),
    ({"enable_gqa": False}, ReasonCode.GQA),
    ({"heads_q": 6, "heads_kv": 4}, ReasonCode.GQA),
    ({"ranks": (3, 3, 3)}, ReasonCode.LAYOUT),
    ({"subclass": True}, ReasonCode.LAYOUT),
    ({"shapes_consistent": False}, ReasonCode.LAYOUT),
])
def test_triton_rejections(changes, code):
    assert _codes(**changes) == [code]


def test_triton_not_installed(monkeypatch):
    monkeypatch.setattr(triton_backend, "TRITON_MISSING", "the `triton` package is not installed")
    assert _codes() == [ReasonCode.NOT_INSTALLED]


def test_messages_name_limit_and_value():
    (r,) = TritonBackend.why_not(dataclasses.replace(OK, head_dim=320, head_dim_v=128))
    assert r.message == "head_dim=320 (supported: multiples of 8 up to 256)"
    (r,) = TritonBackend.why_not(dataclasses.replace(OK, enable_gqa=False))
    assert "heads_q=8 != heads_kv=2" in r.message and "enable_gqa=True" in r.message
    (r,) = TritonBackend.why_not(dataclasses.replace(OK, dropout_p=1.0))
    assert r.message == "dropout_p=1.0 (supported: 0 <= dropout_p < 1)"
    (r,) = TritonBackend.why_not(dataclasses.replace(OK, mask_kind="additive", mask_shape=(2048,),
                                                     mask_dtype=torch.float64))
    assert "attn_mask dtype=torch.float64" in r.message and "torch.float32" in r.message


@pytest.mark.parametrize("changes", [
    {"mask_kind": "bool", "mask_shape": (2, 1, 1, 2048), "mask_dtype": torch.bool},  # key padding
    {"mask_kind": "bool", "mask_shape": (1024, 2048), "mask_dtype": torch.bool},
    {"mask_kind": "additive", "mask_shape": (1, 8, 1024, 2048), "mask_dtype": torch.bfloat16},
    {"mask_kind": "additive", "mask_shape": (2, 8, 1, 1), "mask_dtype": torch.float32},
    {"mask_kind": "additive", "mask_shape": (2048,), "mask_dtype": torch.float32, "mask_requires_grad": False},
    {"dropout_p": 0.1},
    {"dropout_p": 0.1, "mask_kind": "bool", "mask_shape": (2, 1, 1, 2048), "mask_dtype": torch.bool,
     "requires_grad": True},
])
def test_triton_accepts_masks_and_dropout(changes):
    assert _codes(**changes) == []


def test_call_describes_the_mask():
    q, k = _meta(2, 8, 100, 64), _meta(2, 2, 300, 64)
    mask = torch.empty(2, 1, 1, 300, dtype=torch.float32, device="meta", requires_grad=True)
    call = AttentionCall.from_tensors(q, k, k, mask, enable_gqa=True)
    assert (call.mask_dtype, call.mask_requires_grad, call.mask_same_device, call.mask_broadcastable) == (
        torch.float32, True, True, True)
    with torch.no_grad():
        assert not AttentionCall.from_tensors(q, k, k, mask, enable_gqa=True).mask_requires_grad
    assert ReasonCode.GRAD in [r.code for r in TritonBackend.why_not(call)]


def test_cute_needs_only_the_dsl_here():
    from fa_backend.dispatch.backends import cute

    assert _codes(CuteBackend) == ([ReasonCode.NOT_INSTALLED] if cute.DSL_MISSING else [])


def test_torch_backend_needs_a_real_device():
    assert _codes(TorchBackend) == []
    assert _codes(TorchBackend, device_type="meta", capability=None) == [ReasonCode.DEVICE]


def test_select_takes_first_eligible_and_keeps_reasons():
    decision = select(dataclasses.replace(OK, dtype=torch.float32))
    assert decision.backend == "torch"
    assert [r.code for r in decision.rejected["triton"]] == [ReasonCode.DTYPE]
    assert list(decision.rejected) == ["cute", "triton"]
    assert select(dataclasses.replace(OK, device_type="meta", capability=None)).backend == "math"


def test_restricted_selection_raises_with_every_reason():
    call = dataclasses.replace(OK, dtype=torch.float32, head_dim=100)
    with pytest.raises(BackendUnsupportedError) as info:
        select(call, ("cute", "triton"))
    err = info.value
    assert isinstance(err, RuntimeError)
    assert [r.code for r in err.rejected["triton"]] == [ReasonCode.DTYPE, ReasonCode.HEAD_DIM]
    text = str(err)
    assert "`cute` is not supported because" in text and "head_dim=100" in text and "dtype=torch.float32" in text


def test_explain_on_meta_tensors():
    q, k = _meta(2, 8, 128, 64), _meta(2, 2, 128, 64)
    ex = fa_backend.explain(q, k, k, enable_gqa=True, is_causal=True)
    assert ex.backend == "math"
    assert [r.code for r in ex.reasons["triton"]] == [ReasonCode.DEVICE]
    assert [r.code for r in ex.reasons["torch"]] == [ReasonCode.DEVICE]
    text = str(ex)
    assert "math    RUNS" in text and "[device] device=meta" in text


def test_explain_lists_disabled_backends():
    q = torch.randn(1, 2, 8, 16)
    with fa_backend.sdpa_backends(["math"]):
        ex = fa_backend.explain(q, q, q)
    assert ex.backend == "math"
    assert ex.reasons["torch"][0].code is ReasonCode.DISABLED_BY_USER
    assert ex.order[0] == "math"


def test_sdpa_backends_validates_names():
    with pytest.raises(ValueError, match="unknown backend 'flash'; available: cute, triton, torch, math"):
        with fa_backend.sdpa_backends(["flash"]):
            pass
    with pytest.raises(ValueError, match="at least one"):
        with fa_backend.sdpa_backends([]):
            pass


def test_cpu_only_under_interpreter(monkeypatch):
    monkeypatch.setattr(triton_backend, "INTERPRETER", False)
    assert _codes(device_type="cpu", capability=None) == [ReasonCode.DEVICE]
    monkeypatch.setattr(triton_backend, "INTERPRETER", True)
    assert _codes(device_type="cpu", capability=None) == []


@pytest.mark.parametrize("d", [8, 40, 96, 112, 160, 192, 248, 256])
def test_head_dims_multiple_of_8_up_to_256(d):
    assert _codes(head_dim=d, head_dim_v=d) == []
