"""Routed SDPA decode calls on the GPU at real sizes (bf16 and fp16): the split-KV decode kernel with masks,
top-left causal and GQA, forced with sdpa_backends(["triton"]) and in the default order (the measured
preference), under torch.compile and CUDA-graph capture. Skipped without CUDA.

Same rule as the CPU tests (tests/integrations/test_sdpa_decode_routing.py): float64 reference, 2x the error
of PyTorch's same-dtype computation; outputs poisoned (NaN) before each launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fa_backend
from fa_backend.dispatch import ReasonCode
from fa_backend.dispatch.backends import pytorch_choice
from fa_backend.ops.triton_decode import sdpa_decode
from tests.cuda_graphs import capture
from tests.reference import check_features

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_state", "poisoned")]
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _qkv(b, hq, hkv, sq, sk, d=128, dtype=torch.bfloat16):
    return (torch.randn(b, hq, sq, d, device="cuda", dtype=dtype), torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype),
            torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype))


def _mask(form, b, sq, sk, dtype):
    """Key padding (bool (b, 1, 1, sk)) or a Hugging Face generation mask (additive (b, 1, sq, sk): the dtype's
    minimum on left padding and on keys after each query, the new queries being the last sq positions)."""
    pad = torch.randint(0, sk // 4, (b,), device="cuda")
    j = torch.arange(sk, device="cuda")
    if form == "key_padding":
        return (j[None, :] >= pad[:, None])[:, None, None, :]
    i = torch.arange(sq, device="cuda")[:, None] + sk - sq
    keep = (j[None, :] <= i)[None, None] & (j >= pad[:, None, None, None])
    return torch.zeros(keep.shape, device="cuda", dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def _sdpa(**kw):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)
    return fn


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("form", ["none", "key_padding", "hf_additive", "causal"])
@pytest.mark.parametrize("hkv", [8, 32])
@pytest.mark.parametrize("b,sk", [(1, 1024), (1, 8192), (8, 1024), (8, 8192)])
def test_forced_decode_real_size(b, sk, hkv, form, dtype):
    sq = 1 if form in ("none", "key_padding") else 4
    q, k, v = _qkv(b, 32, hkv, sq, sk, dtype=dtype)
    kw = {"is_causal": True} if form == "causal" else {} if form == "none" else {"attn_mask": _mask(form, b, sq, sk,
                                                                                                       dtype)}
    with fa_backend.enabled(), fa_backend.sdpa_backends(["triton"]):
        check_features(_sdpa(**kw), q, k, v, grad=False, **kw)
    assert fa_backend.stats()["runs"] == {"triton_decode": 1}


@pytest.mark.parametrize("hkv", [8, 32])  # 8: the keys are split (merge kernel); 32: one split
def test_forced_triton_is_the_decode_kernel_bitwise_and_stable(hkv):
    q, k, v = _qkv(8, 32, hkv, 1, 8192)
    mask = _mask("key_padding", 8, 1, 8192, torch.bfloat16)
    # a routed eager call runs the decode kernel's eager path, which skips the LSE: compared bitwise with that
    # path; the op (torch.compile's and subclasses' path) computes the LSE too, a separately compiled variant
    # of the merge kernel whose reductions may round differently
    eager = sdpa_decode(q, k, v, mask, False, False, None)
    op = torch.ops.fa_backend.triton_sdpa_decode(q, k, v, mask, False, False, None)[0]
    fa_backend.reset_stats()
    with fa_backend.enabled(), fa_backend.sdpa_backends(["triton"]):
        outs = [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True) for _ in range(3)]
    assert fa_backend.stats()["runs"] == {"triton_decode": 3}
    for out in outs:
        assert torch.equal(out, eager)
    torch.testing.assert_close(op, eager, rtol=2**-7, atol=0)  # at most one bf16 rounding step apart


@pytest.mark.parametrize("hkv", [8, 32])
def test_default_order_follows_the_measured_preference(hkv):
    # sm90, bf16, d=128, no mask, one query (MHA or GQA): cuDNN where PyTorch would run cuDNN for the
    # tensors (the eager router checks); our decode kernel otherwise.
    q, k, v = _qkv(8, 32, hkv, 1, 4096)
    explanation = fa_backend.explain(q, k, v, enable_gqa=True)
    preferred = HOPPER and torch.backends.cuda.cudnn_sdp_enabled()
    if preferred:
        assert explanation.backend == "torch"
        (reason,) = explanation.reasons["triton"]
        assert reason.code is ReasonCode.SLOWER and "split-KV decode" in reason.message
    else:
        assert explanation.backend == "triton" and explanation.kernels["triton"] == "triton_decode"
    with fa_backend.enabled():
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    cudnn = pytorch_choice(q, k, v, enable_gqa=True) == "cudnn_attention"
    assert fa_backend.stats()["runs"] == ({"torch": 1} if preferred and cudnn else {"triton_decode": 1})


def test_compiled_decode_step_matches_eager():
    q, k, v = _qkv(8, 32, 8, 1, 4096)
    mask = _mask("hf_additive", 8, 1, 4096, torch.bfloat16)

    def step(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2).flatten(2)

    fa_backend.enable()
    with fa_backend.sdpa_backends(["triton"]):
        eager = step(q, k, v, mask)
        compiled = torch.compile(step, fullgraph=True)(q, k, v, mask)
    # the graph holds the op (which computes the LSE too): bitwise its result; within one bf16 rounding step of
    # the eager path (see test_forced_triton_is_the_decode_kernel_bitwise_and_stable)
    op = torch.ops.fa_backend.triton_sdpa_decode(q, k, v, mask, False, False, None)[0]
    assert torch.equal(compiled, op.transpose(1, 2).flatten(2))
    torch.testing.assert_close(compiled, eager, rtol=2**-7, atol=0)
    assert fa_backend.stats()["traced"] == {"triton_decode": 1}  # restricted: nothing else was tried


def test_cuda_graph_of_a_routed_decode_step():
    # A static-cache server captures its decode step: the routed call makes no device sync and replays
    # the same kernels.
    q, k, v = _qkv(8, 32, 8, 1, 4096)
    mask = _mask("key_padding", 8, 1, 4096, torch.bfloat16)
    static_q = q.clone()
    fa_backend.enable()
    with fa_backend.sdpa_backends(["triton"]):
        def step():
            return F.scaled_dot_product_attention(static_q, k, v, attn_mask=mask, enable_gqa=True)

        graph, static_out = capture(step)
        for _ in range(2):
            static_q.copy_(torch.randn_like(q))
            eager = step()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, eager)


def test_opcheck_gpu():
    q, k, v = _qkv(2, 32, 8, 3, 1000)
    mask = _mask("hf_additive", 2, 3, 1000, torch.bfloat16)
    torch.library.opcheck(torch.ops.fa_backend.triton_sdpa_decode.default, (q, k, v, mask, False, False, None))
    torch.library.opcheck(torch.ops.fa_backend.triton_sdpa_decode.default, (q, k, v, None, True, False, 0.1))
