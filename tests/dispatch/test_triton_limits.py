"""The triton backend's declared limits: one rejected case per reason it can give."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fa_backend.dispatch import AttentionCall, ReasonCode
from fa_backend.dispatch.backends import TritonBackend

OK = AttentionCall(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=2, heads_q=8, heads_kv=2,
                   seqlen_q=1024, seqlen_k=2048, head_dim=128, head_dim_v=128)


def _codes(**changes):
    return [r.code for r in TritonBackend.why_not(dataclasses.replace(OK, **changes))]


def test_eligible_call_has_no_reason():
    assert _codes() == []


@pytest.mark.parametrize("d", [8, 40, 96, 112, 160, 192, 248, 256])
def test_head_dims_multiple_of_8_up_to_256(d):
    assert _codes(head_dim=d, head_dim_v=d) == []


@pytest.mark.parametrize("changes,code", [
    ({"dtype": torch.float32}, ReasonCode.DTYPE),
    ({"dtype": torch.float8_e4m3fn}, ReasonCode.DTYPE),
    ({"head_dim": 100}, ReasonCode.HEAD_DIM),
    ({"head_dim_v": 512}, ReasonCode.HEAD_DIM),
    ({"capability": (7, 5)}, ReasonCode.CAPABILITY),
    ({"device_type": "mps", "capability": None}, ReasonCode.DEVICE),
])
def test_rejections(changes, code):
    assert _codes(**changes) == [code]


def test_messages_name_limit_and_value():
    (reason,) = TritonBackend.why_not(dataclasses.replace(OK, capability=(7, 5)))
    assert "(8, 0)" in reason.message and "(7, 5)" in reason.message


def test_cpu_only_under_interpreter(monkeypatch):
    cpu = dataclasses.replace(OK, device_type="cpu", capability=None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _codes(device_type="cpu", capability=None) == [ReasonCode.DEVICE]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert TritonBackend.why_not(cpu) == []
