"""Measured speed preferences: PyTorch's cuDNN kernel runs where it was measured faster than ours."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fa_backend.dispatch import AttentionCall, ReasonCode, select
from fa_backend.dispatch.preference import slower_than_peer

# sm90, bf16, d=128, MHA, no mask: PyTorch picks cuDNN, measured faster than our Triton on the H200
PLAIN = AttentionCall(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=2, heads_q=8, heads_kv=8,
                      seqlen_q=2048, seqlen_k=2048, head_dim=128, head_dim_v=128, is_causal=True)


def test_default_order_prefers_the_measured_faster_kernel():
    decision = select(PLAIN)
    assert decision.backend == "torch"
    (reason,) = decision.rejected["triton"]
    assert reason.code is ReasonCode.SLOWER
    assert "cuDNN" in reason.message and "sdpa_backends(['triton'" in reason.message


def test_users_order_is_followed_as_given():
    assert select(PLAIN, ("triton", "torch")).backend == "triton"


@pytest.mark.parametrize("changes", [
    {"capability": (8, 0)},
    {"dtype": torch.float16, "head_dim": 96, "head_dim_v": 96},
    {"head_dim": 256, "head_dim_v": 256},
    {"heads_kv": 2, "enable_gqa": True},
    {"seqlen_k": 4096},  # causal with sq != sk: top-left, not measured
    {"mask_kind": "bool", "mask_shape": (2048, 2048), "is_causal": False, "head_dim": 64, "head_dim_v": 64},
    {"dropout_p": 0.1, "head_dim": 64, "head_dim_v": 64},
], ids=["sm80", "d96", "d256", "gqa", "causal_sq_ne_sk", "mask_d64", "dropout_d64"])
def test_outside_the_measured_class_ours_runs(changes):
    call = dataclasses.replace(PLAIN, **changes)
    assert slower_than_peer("triton", call) is None
    decision = select(call)
    assert all(r.code is not ReasonCode.SLOWER for rs in decision.rejected.values() for r in rs)


def test_cudnn_switched_off_means_no_preference():
    previous = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert select(PLAIN).backend == "triton"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(previous)


@pytest.mark.parametrize("changes", [
    {"mask_kind": "bool", "mask_shape": (2, 1, 1, 2048), "is_causal": False},
    {"mask_kind": "additive", "mask_shape": (2048, 2048), "mask_dtype": torch.bfloat16, "is_causal": False},
    {"dropout_p": 0.1},
], ids=["key_padding", "additive", "dropout"])
def test_masks_and_dropout_at_d128_prefer_cudnn(changes):
    decision = select(dataclasses.replace(PLAIN, **changes))
    assert decision.backend == "torch"
    assert [r.code for r in decision.rejected["triton"]] == [ReasonCode.SLOWER]


@pytest.mark.parametrize("pytorch_picks,ours_after_all", [("cudnn_attention", False), ("efficient_attention", True)])
def test_eager_router_checks_pytorchs_actual_pick(monkeypatch, pytorch_picks, ours_after_all):
    # The evidence is about cuDNN: if PyTorch would run another kernel for these tensors (cuDNN refuses
    # them), the preference does not hold and our kernel runs.
    from fa_backend.integrations import sdpa

    monkeypatch.setattr(sdpa, "pytorch_choice", lambda *a, **k: pytorch_picks)
    q = torch.empty(2, 8, 2048, 128)
    call = dataclasses.replace(PLAIN, mask_kind="bool", mask_shape=(2, 1, 1, 2048), is_causal=False)
    assert sdpa._preferred_kernel_refuses(select(call), call, q, q, q, None, 0.0, False, None, False) is ours_after_all
