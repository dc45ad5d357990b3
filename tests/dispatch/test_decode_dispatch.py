"""Decode calls in the dispatcher (metadata only): the call's kind, which triton kernel runs, and the
measured preference for PyTorch's cuDNN kernel over our split-KV decode kernel on the H200."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fa_backend.dispatch import AttentionCall, ReasonCode, select
from fa_backend.dispatch.backends import TritonBackend
from fa_backend.dispatch.preference import PREFERENCES
from fa_backend.dispatch.select import faster_peer

# One generation step on sm90: bf16, d=128, MHA, one query over a 4096-row cache, no mask (the measured class).
STEP = AttentionCall(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=8, heads_q=32, heads_kv=32,
                     seqlen_q=1, seqlen_k=4096, head_dim=128, head_dim_v=128)
DECODE_RULE = next(r for r in PREFERENCES if r.backend == "triton_decode")


def test_kind_and_description():
    assert STEP.kind == "decode" and STEP.describe().endswith(", decode)")
    for sq in (0, 16):
        assert dataclasses.replace(STEP, seqlen_q=sq).kind == "decode"
    dense = dataclasses.replace(STEP, seqlen_q=17)
    assert dense.kind == "dense" and "decode" not in dense.describe()
    assert dataclasses.replace(STEP, ranks=(3, 4, 4)).kind == "dense"


@pytest.mark.parametrize("changes,code", [
    ({"seqlen_q": 17}, ReasonCode.SEQ_LEN),
    ({"requires_grad": True}, ReasonCode.GRAD),
    ({"dropout_p": 0.1}, ReasonCode.DROPOUT),
    ({"head_dim_v": 64}, ReasonCode.HEAD_DIM),
    ({"kv_last_dim_contiguous": False}, ReasonCode.LAYOUT),
], ids=["sq17", "grad", "dropout", "dv", "strided_kv"])
def test_what_keeps_a_call_off_the_decode_kernel(changes, code):
    call = dataclasses.replace(STEP, **changes)
    assert TritonBackend.why_not(call) == []  # the dense kernel still runs it
    kernel, reasons = TritonBackend.kernel_for(call)
    assert kernel == "triton" and [r.code for r in reasons] == [code]
    decision = select(call, ("triton",))
    assert decision.kernel == "triton" and decision.kernel_rejected == reasons


def test_every_reason_is_listed():
    call = dataclasses.replace(STEP, requires_grad=True, dropout_p=0.1, kv_last_dim_contiguous=False)
    assert [r.code for r in TritonBackend.decode_why_not(call)] == [ReasonCode.GRAD, ReasonCode.DROPOUT,
                                                                   ReasonCode.LAYOUT]


def test_measured_class_prefers_cudnn_with_the_decode_evidence():
    decision = select(STEP)
    assert decision.backend == "torch"
    (reason,) = decision.rejected["triton"]
    assert reason.code is ReasonCode.SLOWER
    assert "split-KV decode kernel 0.25-2.33x cuDNN in eager calls" in reason.message
    assert faster_peer("triton", STEP) is DECODE_RULE
    assert faster_peer("triton", dataclasses.replace(STEP, dtype=torch.float16)) is DECODE_RULE
    assert faster_peer("triton", dataclasses.replace(STEP, heads_kv=8, enable_gqa=True)) is DECODE_RULE  # GQA too


def test_users_order_runs_the_decode_kernel():
    decision = select(STEP, ("triton", "torch"))
    assert (decision.backend, decision.kernel, decision.kernel_rejected) == ("triton", "triton_decode", ())


@pytest.mark.parametrize("changes", [
    {"heads_kv": 8, "enable_gqa": True, "seqlen_q": 4},  # GQA with several queries: unmeasured
    {"capability": (8, 0)},
    {"head_dim": 64, "head_dim_v": 64, "heads_kv": 8, "enable_gqa": True},
    {"is_causal": True},  # top-left causal with sq != sk: outside the measured class
], ids=["gqa_sq4", "sm80", "d64_gqa", "causal"])
def test_outside_the_measured_class_the_decode_kernel_runs(changes):
    call = dataclasses.replace(STEP, **changes)
    decision = select(call)
    assert (decision.backend, decision.kernel) == ("triton", "triton_decode")


@pytest.mark.parametrize("changes", [
    {"head_dim": 64, "head_dim_v": 64},
    {"mask_kind": "bool", "mask_shape": (8, 1, 1, 4096)},
    {"requires_grad": True},
], ids=["d64", "mask_d128", "grad"])
def test_dense_rules_still_cover_what_they_covered(changes):
    # Rules about "triton" as a whole are consulted after the decode rule: these calls go to cuDNN as
    # before decode routing existed, with the dense evidence.
    call = dataclasses.replace(STEP, **changes)
    rule = faster_peer("triton", call)
    assert rule is not None and rule.backend == "triton"
    assert select(call).backend == "torch"


def test_decode_rule_is_the_measured_class_only():
    # sm90, fp16/bf16, d=128, no mask, no dropout; not for the dense kernel's calls.
    assert DECODE_RULE.capabilities == frozenset({(9, 0)}) and DECODE_RULE.head_dims == frozenset({128})
    assert DECODE_RULE.dtypes == frozenset({torch.float16, torch.bfloat16})
    assert not DECODE_RULE.masks and not DECODE_RULE.dropout
    assert faster_peer("triton", dataclasses.replace(STEP, seqlen_q=17)) is not DECODE_RULE
