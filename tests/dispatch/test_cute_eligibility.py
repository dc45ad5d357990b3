"""The cute backend's declared limits: one rejected case per rule, its messages, its measured-speed rules and
what it routes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fa_backend.dispatch import AttentionCall, ReasonCode, select
from fa_backend.dispatch.backends import CuteBackend
from fa_backend.dispatch.backends import cute as cute_backend

# Eligible where the DSL is installed (non-causal GQA at d=128: no measured rule passes it over for cuDNN).
OK = AttentionCall(device_type="cuda", capability=(9, 0), dtype=torch.bfloat16, batch=2, heads_q=8, heads_kv=2,
                   seqlen_q=1024, seqlen_k=2048, head_dim=128, head_dim_v=128, enable_gqa=True)
# GQA at d=96, where no measured rule passes over our Triton kernels either: shows the backend after cute.
OK96 = dataclasses.replace(OK, head_dim=96, head_dim_v=96)


@pytest.fixture
def enabled(monkeypatch):
    """As if the DSL were installed and the kernels enabled: why_not then reports the limits only."""
    monkeypatch.setattr(cute_backend, "DSL_MISSING", None)
    monkeypatch.setattr(cute_backend, "KERNELS_ENABLED", True)


def _codes(**changes):
    return [r.code for r in CuteBackend.why_not(dataclasses.replace(OK, **changes))]


def test_eligible_call_has_no_reason_and_is_routed(enabled):
    assert _codes() == []
    assert select(OK).backend == "cute"


def test_cudnn_rule_passes_over_cute_without_gqa(enabled):
    decision = select(dataclasses.replace(OK, heads_kv=8, enable_gqa=False))
    assert decision.backend == "torch"
    assert [r.code for r in decision.rejected["cute"]] == [ReasonCode.SLOWER]
    assert "cuDNN" in decision.rejected["cute"][0].message


@pytest.mark.parametrize("changes,says", [({"is_causal": True, "seqlen_q": 2048}, "GQA"),
                                          ({"head_dim": 256, "head_dim_v": 256}, "d=256")])
def test_cudnn_rules_pass_over_cute_for_causal_or_large_gqa(enabled, changes, says):
    decision = select(dataclasses.replace(OK, **changes))
    assert decision.backend == "torch"
    assert [r.code for r in decision.rejected["cute"]] == [ReasonCode.SLOWER]
    assert says in decision.rejected["cute"][0].message


def test_host_bound_rule_passes_over_cute(enabled):
    decision = select(dataclasses.replace(OK, batch=1, seqlen_q=64, seqlen_k=64))
    assert decision.backend == "torch"
    assert [r.code for r in decision.rejected["cute"]] == [ReasonCode.SLOWER]
    assert "host-bound" in decision.rejected["cute"][0].message


def test_turned_off_routes_nothing(enabled, monkeypatch):
    monkeypatch.setattr(cute_backend, "KERNELS_ENABLED", False)
    assert _codes() == [ReasonCode.NOT_INSTALLED]
    assert "turned off" in CuteBackend.why_not(OK)[0].message
    assert select(OK96).backend == "triton"


def test_grad_needs_the_triton_backward(enabled, monkeypatch):
    assert _codes(requires_grad=True) == []
    monkeypatch.setattr(cute_backend, "TRITON_MISSING", "the `triton` package is not installed (pip install triton)")
    assert _codes(requires_grad=True) == [ReasonCode.GRAD]


@pytest.mark.parametrize("changes,code", [
    ({"device_type": "cpu", "capability": None}, ReasonCode.DEVICE),
    ({"same_device": False}, ReasonCode.DEVICE),
    ({"capability": (8, 0)}, ReasonCode.CAPABILITY),
    ({"capability": (10, 0)}, ReasonCode.CAPABILITY),
    ({"capability": (12, 0)}, ReasonCode.CAPABILITY),
    ({"dtype": torch.float32}, ReasonCode.DTYPE),
    ({"same_dtype": False}, ReasonCode.DTYPE),
    ({"head_dim": 80, "head_dim_v": 80}, ReasonCode.HEAD_DIM),
    ({"head_dim": 32, "head_dim_v": 32}, ReasonCode.HEAD_DIM),
    ({"head_dim_v": 64}, ReasonCode.HEAD_DIM),
    ({"mask_kind": "bool", "mask_shape": (1024, 2048), "mask_dtype": torch.bool}, ReasonCode.MASK),
    ({"mask_kind": "additive", "mask_shape": (1024, 2048), "mask_dtype": torch.bfloat16}, ReasonCode.MASK),
    ({"dropout_p": 0.01}, ReasonCode.DROPOUT),  # 32-bit draws: the Triton kernels only
    ({"dropout_p": 1.0}, ReasonCode.DROPOUT),
    ({"enable_gqa": False}, ReasonCode.GQA),
    ({"heads_q": 6, "heads_kv": 4}, ReasonCode.GQA),
    ({"ranks": (3, 3, 3)}, ReasonCode.LAYOUT),
    ({"subclass": True}, ReasonCode.LAYOUT),
    ({"shapes_consistent": False}, ReasonCode.LAYOUT),
    ({"tma_aligned": False}, ReasonCode.LAYOUT),
    ({"seqlen_q": 0}, ReasonCode.SEQ_LEN),
    ({"seqlen_q": 16}, ReasonCode.SEQ_LEN),  # a decode call: the split-KV decode kernel's
    ({"batch": 0}, ReasonCode.SEQ_LEN),
    ({"seqlen_k": 0}, ReasonCode.SEQ_LEN),
])
def test_each_limit_gives_its_reason(enabled, changes, code):
    assert _codes(**changes) == [code]


@pytest.mark.parametrize("d", sorted(CuteBackend.SUPPORTED_HEAD_DIMS))
@pytest.mark.parametrize("dtype", sorted(CuteBackend.SUPPORTED_DTYPES, key=str))
@pytest.mark.parametrize("causal,alignment", [(False, "top_left"), (True, "top_left"), (True, "bottom_right")])
def test_declared_support_is_accepted(enabled, d, dtype, causal, alignment):
    assert _codes(head_dim=d, head_dim_v=d, dtype=dtype, is_causal=causal, causal_alignment=alignment,
                  capability=(9, 0)) == []


@pytest.mark.parametrize("p", [0.1, 0.0625, 0.5, 0.9375, 2**-16 * 300])
def test_dropout_with_16_bit_draws_is_accepted(enabled, p):
    # the forward draws 16-bit halves (kernels/cute/_dropout.py): every p in [1/16, 15/16] and multiples of 2**-16
    assert _codes(dropout_p=p) == []
    assert _codes(dropout_p=p, requires_grad=True, heads_kv=4) == []  # the Triton backward, GQA


def test_gqa_and_plain_mha_are_accepted(enabled):
    assert _codes(heads_kv=8, enable_gqa=False) == []
    assert _codes(heads_q=16, heads_kv=1) == []


def test_causal_alignments_are_data(enabled, monkeypatch):
    monkeypatch.setattr(CuteBackend, "CAUSAL_ALIGNMENTS", frozenset({"top_left"}))
    assert _codes(is_causal=True, causal_alignment="bottom_right") == [ReasonCode.MASK]
    assert _codes(is_causal=False, causal_alignment="bottom_right") == []


def test_every_failing_rule_is_reported(enabled):
    codes = _codes(dtype=torch.float32, head_dim=100, capability=(8, 0), dropout_p=0.01, tma_aligned=False)
    assert codes == [ReasonCode.CAPABILITY, ReasonCode.DTYPE, ReasonCode.HEAD_DIM, ReasonCode.HEAD_DIM,
                     ReasonCode.DROPOUT, ReasonCode.LAYOUT]


def test_messages_name_limit_and_value(enabled):
    def message(**changes):
        (r,) = CuteBackend.why_not(dataclasses.replace(OK, **changes))
        return r.message

    assert message(head_dim=80, head_dim_v=80) == "head_dim=80 (supported: 64, 96, 128, 192, 256)"
    assert message(head_dim_v=64) == ("head_dim_v=64 != head_dim=128 (supported: equal head dims, or head_dim / "
                                      "head_dim_v 192 / 128)")
    assert message(capability=(10, 0)) == "compute capability (10, 0) (supported: 9.x, Hopper)"
    assert message(dtype=torch.float32) == "dtype=torch.float32 (supported: torch.bfloat16, torch.float16)"
    assert message(dropout_p=0.01).startswith("dropout_p=0.01 needs 32-bit random draws (supported: dropout_p whose")
    assert message(dropout_p=1.0) == "dropout_p=1.0 (supported: 0 <= dropout_p < 1)"
    assert message(device_type="mps", capability=None) == "device=mps (supported: cuda)"


def test_mla_head_dims_are_eligible_and_routed_by_their_measured_rules(enabled):
    """q / k at 192 with v at 128 (MLA): the CuTe kernels take it; without a causal mask they run it with or without
    gradients; causal calls with gradients, and causal calls without them up to 2k queries, go to cuDNN (measured
    rules; the Triton kernels, next in line, are passed over too)."""
    mla = dataclasses.replace(OK, head_dim=192, head_dim_v=128, heads_kv=8, enable_gqa=False)
    assert CuteBackend.why_not(mla) == []
    assert select(mla).backend == "cute"
    assert select(dataclasses.replace(mla, requires_grad=True)).backend == "cute"
    causal = dataclasses.replace(mla, is_causal=True, seqlen_q=2048, seqlen_k=2048)
    for call in (dataclasses.replace(causal, requires_grad=True), causal):
        decision = select(call)
        assert decision.backend == "torch"
        assert [r.code for r in decision.rejected["cute"]] == [ReasonCode.SLOWER]
        assert [r.code for r in decision.rejected["triton"]] == [ReasonCode.SLOWER]
        assert "v 128" in decision.rejected["cute"][0].message
    assert select(dataclasses.replace(causal, seqlen_q=8192, seqlen_k=8192)).backend == "cute"
    gqa = dataclasses.replace(causal, heads_kv=2, enable_gqa=True, requires_grad=True)  # measured at 16:4 too
    assert select(gqa).backend == "torch"
    assert select(dataclasses.replace(gqa, is_causal=False)).backend == "cute"
    assert _codes(head_dim=192, head_dim_v=64) == [ReasonCode.HEAD_DIM]
    assert _codes(head_dim=128, head_dim_v=192) == [ReasonCode.HEAD_DIM]


def test_not_installed_message_when_dsl_missing(monkeypatch):
    monkeypatch.setattr(cute_backend, "DSL_MISSING", "nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')")
    (r,) = CuteBackend.why_not(OK)
    assert r.code is ReasonCode.NOT_INSTALLED
    assert r.message == "nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')"


def test_not_installed_comes_first_with_the_limits(monkeypatch):
    monkeypatch.setattr(cute_backend, "DSL_MISSING", "nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')")
    codes = _codes(device_type="cpu", capability=None, dtype=torch.float32)
    assert codes == [ReasonCode.NOT_INSTALLED, ReasonCode.DEVICE, ReasonCode.DTYPE]


@pytest.mark.skipif(cute_backend.DSL_MISSING is not None, reason="needs the CuTe DSL (the variant key)")
def test_a_variant_that_failed_to_compile_is_reported(enabled):
    from fa_backend.kernels.cute import _compile_cache, flash_fwd_ws

    key = flash_fwd_ws.fastest_variant_key(torch.bfloat16, 96, False, False)
    _compile_cache.CACHE._failed[key] = "DSLRuntimeError: boom"
    try:
        (r,) = CuteBackend.why_not(OK96)
        assert r.code is ReasonCode.COMPILE_FAILED and "boom" in r.message
        assert _codes(is_causal=True, head_dim=96, head_dim_v=96) == []  # other variants are not affected
        assert select(OK96).backend == "triton"
    finally:
        _compile_cache.CACHE.clear()


@pytest.mark.skipif(cute_backend.DSL_MISSING is not None, reason="needs the CuTe DSL (compiles one variant)")
@pytest.mark.parametrize("fast", [False, True])
def test_the_key_asked_about_is_the_variant_the_op_compiles(fast, monkeypatch, tmp_path):
    """With the cheap call path on (the default) the op compiles the pointer convention, a variant of its own: its
    failure must be the one the dispatcher reports."""
    from fa_backend.kernels.cute import _compile_cache, _fast_call, flash_fwd_ws

    monkeypatch.setenv("FA_BACKEND_CUTE_CACHE_DIR", str(tmp_path / "dsl-cache"))
    monkeypatch.setattr(_fast_call, "ENABLED", fast)
    _compile_cache.CACHE.clear()
    try:
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 64, True, False, **flash_fwd_ws.FASTEST[64, True],
                                          pointer_args=fast)
        assert list(_compile_cache.CACHE._compiled) == [flash_fwd_ws.fastest_variant_key(torch.bfloat16, 64, True,
                                                                                         False)]
    finally:
        _compile_cache.CACHE.clear()


def test_run_refuses_what_it_cannot_run_with_every_reason():
    from fa_backend.dispatch.reasons import BackendUnsupportedError

    q = torch.randn(1, 2, 64, 32)
    with pytest.raises(BackendUnsupportedError) as e:
        CuteBackend.run(AttentionCall.from_tensors(q, q, q), None, q, q, q, None, 0.0, False, None, False)
    assert "device=cpu" in str(e.value) and "head_dim=32" in str(e.value)


def test_explain_lists_every_cute_reason_and_counters_count_them():
    import fa_backend

    q = torch.empty(1, 2, 64, 32, dtype=torch.float32)
    ex = fa_backend.explain(q, q, q)
    expected = ([ReasonCode.NOT_INSTALLED] if cute_backend.DSL_MISSING else []) + [
        ReasonCode.DEVICE, ReasonCode.DTYPE, ReasonCode.HEAD_DIM]
    assert [r.code for r in ex.reasons["cute"]] == expected
    fa_backend.reset_stats()
    with fa_backend.enabled():
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    # counters summarise a backend that is not installed by that reason alone (integrations/sdpa._passed_over)
    counted = expected[:1] if cute_backend.DSL_MISSING else expected
    assert [k for k in fa_backend.stats()["fallbacks"] if k.startswith("cute:")] == [f"cute:{c.value}" for c in counted]


def test_head_dim_96_runs_cute_without_grad_and_cudnn_with_it(enabled):
    # d=96 (measured on the H200): the CuTe forward beats cuDNN's at 8k and matches it at 2k, its backward does
    # not; our Triton kernels are slower than cuDNN both ways, so a training call goes to PyTorch (cuDNN).
    mha96 = dataclasses.replace(OK, heads_kv=8, enable_gqa=False, head_dim=96, head_dim_v=96)
    assert select(mha96).backend == "cute"
    decision = select(dataclasses.replace(mha96, requires_grad=True))
    assert decision.backend == "torch"
    assert [r.code for r in decision.rejected["cute"]] == [ReasonCode.SLOWER]
    assert "d=96" in decision.rejected["cute"][0].message and "backward" in decision.rejected["cute"][0].message
    assert [r.code for r in decision.rejected["triton"]] == [ReasonCode.SLOWER]
    assert select(dataclasses.replace(mha96, requires_grad=True, capability=(8, 0))).backend == "triton"  # no cute


KEY_MASK = dict(mask_kind="bool", mask_shape=(2, 1, 1, 2048), mask_dtype=torch.bool, mask_key_only=True)


def test_bool_key_masks_are_accepted(enabled):
    """Key padding (b, 1, 1, sk) and per-head key masks run on the CuTe kernels (packed 32 keys per word)."""
    assert _codes(**KEY_MASK) == []
    assert _codes(**{**KEY_MASK, "mask_shape": (2, 8, 1, 2048)}) == []


@pytest.mark.parametrize("changes", [
    {"mask_key_only": False, "mask_shape": (2, 1, 1024, 2048)},  # varies along the queries
    {"mask_kind": "additive", "mask_dtype": torch.bfloat16},
    {"is_causal": True},  # with is_causal: left to PyTorch, as the Triton backend does
    {"mask_shape": (3, 1, 1, 2048)},  # does not broadcast to the batch
    {"mask_same_device": False},
])
def test_other_masks_give_a_mask_reason(enabled, changes):
    codes = _codes(**{**KEY_MASK, **changes})
    assert codes and all(c in (ReasonCode.MASK, ReasonCode.DEVICE) for c in codes)


def test_key_only_is_read_from_the_mask_tensor():
    q = torch.randn(2, 4, 64, 64)
    k = v = torch.randn(2, 4, 80, 64)
    describe = lambda m: AttentionCall.from_tensors(q, k, v, m).mask_key_only  # noqa: E731
    assert describe(torch.ones(2, 1, 1, 80, dtype=torch.bool))
    assert describe(torch.ones(80, dtype=torch.bool))
    assert describe(torch.ones(2, 1, 1, 80, dtype=torch.bool).expand(2, 4, 64, 80))  # stride 0 on the queries
    assert not describe(torch.ones(2, 1, 64, 80, dtype=torch.bool))
