"""fa_backend.attention: argument checking and the errors a user sees."""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend import BackendUnsupportedError, ReasonCode
from tests.conftest import DEVICE


def _t(*shape, dtype=torch.float16):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def test_fp32_is_refused_with_the_dtype_named():
    q = _t(1, 2, 8, 16, dtype=torch.float32)
    with pytest.raises(BackendUnsupportedError, match=r"dtype=torch\.float32") as info:
        fa_backend.attention(q, q, q)
    assert isinstance(info.value, RuntimeError)  # NotImplementedError is a RuntimeError
    assert [r.code for r in info.value.rejected["triton"]] == [ReasonCode.DTYPE]


def test_every_reason_is_listed():
    q = _t(1, 2, 8, 12, dtype=torch.float32)
    with pytest.raises(BackendUnsupportedError) as info:
        fa_backend.attention(q, q, q)
    codes = [r.code for r in info.value.rejected["triton"]]
    assert codes == [ReasonCode.DTYPE, ReasonCode.HEAD_DIM, ReasonCode.HEAD_DIM]
    assert "head_dim=12 (supported: multiples of 8 up to 256)" in str(info.value)


@pytest.mark.parametrize("d", [264, 320])
def test_head_dim_over_256(d):
    q = _t(1, 1, 4, d)
    with pytest.raises(BackendUnsupportedError, match=f"head_dim={d}"):
        fa_backend.attention(q, q, q)


@pytest.mark.parametrize("make,match", [
    (lambda: (_t(2, 8, 16), _t(2, 8, 16), _t(2, 8, 16)), "got 3-D shape"),
    (lambda: (_t(1, 2, 8, 16), _t(1, 2, 8, 16, dtype=torch.bfloat16), _t(1, 2, 8, 16)), "same dtype"),
    (lambda: (_t(1, 2, 8, 16), _t(2, 2, 8, 16), _t(2, 2, 8, 16)), "same batch size"),
    (lambda: (_t(1, 2, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 9, 16)), "key and value with the same heads and seqlen"),
    (lambda: (_t(1, 2, 8, 16), _t(1, 2, 8, 32), _t(1, 2, 8, 16)), "same head_dim"),
    (lambda: (_t(1, 3, 8, 16), _t(1, 2, 8, 16), _t(1, 2, 8, 16)), r"multiple of key/value heads \(2\)"),
])
def test_malformed_input_raises_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        fa_backend.attention(*make())


def test_bad_causal_alignment():
    q = _t(1, 1, 4, 16)
    with pytest.raises(ValueError, match="causal_alignment"):
        fa_backend.attention(q, q, q, is_causal=True, causal_alignment="lower_right")


def test_direct_op_call_is_checked_too():
    q = _t(1, 2, 8, 16, dtype=torch.float32)
    with pytest.raises(BackendUnsupportedError, match="dtype"):
        torch.ops.fa_backend.triton_flash_fwd(q, q, q)


def test_meta_tensors_trace_without_running():
    q = torch.empty(2, 4, 128, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, 256, 64, dtype=torch.bfloat16, device="meta")
    v = torch.empty(2, 2, 256, 32, dtype=torch.bfloat16, device="meta")
    with pytest.raises(BackendUnsupportedError, match="device=meta"):
        fa_backend.attention(q, k, v)
