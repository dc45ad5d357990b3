"""The sm90 CuTe forward on the H200: outputs and LSE against the float64 reference (the project's 2x rule),
partial tiles, GQA, both causal alignments, strided inputs, and input errors. Needs the DSL and a Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.reference import assert_within_bar, attention_math, attention_same_dtype

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.cute,
              pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}"),
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]


def _qkv(b, hq, hkv, sq, sk, d, dtype, dv=None):
    return (torch.randn(b, hq, sq, d, device="cuda", dtype=dtype), torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype),
            torch.randn(b, hkv, sk, d if dv is None else dv, device="cuda", dtype=dtype))


def check_forward(run, dtype, d, causal, bottom_right, b, hq, hkv, sq, sk, dv=None):
    """run(q, k, v, causal=, bottom_right=) -> (out, lse) against the float64 reference: out within the
    project's bar, the LSE to 1e-3, and rows that see no key with O = 0 and LSE = -inf. dv: v's head dim (d if
    None)."""
    q, k, v = _qkv(b, hq, hkv, sq, sk, d, dtype, dv)
    out, lse = run(q, k, v, causal=causal, bottom_right=bottom_right)
    assert out.shape == (b, hq, sq, v.shape[-1])
    kr, vr = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    ref = attention_math(q.double(), kr.double(), vr.double(), is_causal=causal, bottom_right=bottom_right)
    same = attention_same_dtype(q, kr, vr, is_causal=causal, bottom_right=bottom_right)
    assert not out.isnan().any()
    assert_within_bar("out", out, same, ref)
    scores = (q.double() @ kr.double().transpose(-1, -2)) * d ** -0.5
    if causal:
        i, j = torch.arange(sq, device="cuda")[:, None], torch.arange(sk, device="cuda")[None, :]
        scores = scores.masked_fill(j > i + (sk - sq if bottom_right else 0), float("-inf"))
    lse_ref = torch.logsumexp(scores, -1)
    seen = lse_ref > float("-inf")
    torch.testing.assert_close(lse[seen].double(), lse_ref[seen], atol=1e-3, rtol=1e-3)
    assert (lse[~seen] == float("-inf")).all() and (out[~seen] == 0).all()  # rows that see no key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 100, 333), (2, 2, 1, 333, 100)])
def test_forward_within_bar(dtype, d, causal, bottom_right, b, hq, hkv, sq, sk):
    from fa_backend.kernels.cute.flash_fwd import flash_fwd

    check_forward(flash_fwd, dtype, d, causal, bottom_right, b, hq, hkv, sq, sk)


def check_strided(run, seqlen: int) -> None:
    """run(q, k, v) on strided views of a packed (b, s, 3, h, d) projection output, against the reference."""
    qkv = torch.randn(2, seqlen, 3, 4, 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    out, _ = run(q, k, v)
    ref = attention_math(q.double(), k.double(), v.double())
    assert_within_bar("out", out, attention_same_dtype(q, k, v), ref)


def test_strided_inputs():
    from fa_backend.kernels.cute.flash_fwd import flash_fwd

    check_strided(flash_fwd, 200)


def test_inputs_it_cannot_take_are_value_errors():
    from fa_backend.kernels.cute.flash_fwd import flash_fwd

    q, k, v = _qkv(1, 2, 2, 64, 64, 80, torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        flash_fwd(q, k, v)
    q, k, v = _qkv(1, 2, 2, 64, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="scale"):
        flash_fwd(q, k, v, scale=-0.1)
    with pytest.raises(ValueError, match="strides"):  # head_dim not contiguous
        flash_fwd(q.transpose(2, 3).contiguous().transpose(2, 3), k, v)
