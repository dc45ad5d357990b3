"""The fast launch path (fa_backend.kernels.triton._launch.launch) on the GPU: bitwise the JIT path's results.

Dense forward and backward (plain, causal, GQA, odd head dims, every feature, kernels with host TMA descriptors),
varlen forward and backward, and launches under a CUDA graph. Each case runs once on the JIT path, then three
times on the fast path (first: JIT + cache fill, then the cached launches, with strides, lengths and pointers of
new tensors). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

from fa_backend.kernels.triton import _desc_launch, _launch
from fa_backend.ops import new_rng_state, triton_flash_attention, triton_varlen_attention

pytestmark = pytest.mark.gpu

DENSE = [
    dict(b=2, hq=8, hkv=8, sq=300, sk=300, d=64, causal=False, feats={}),
    dict(b=1, hq=16, hkv=4, sq=1000, sk=1000, d=128, causal=True, feats={}),
    dict(b=3, hq=4, hkv=2, sq=77, sk=513, d=96, causal=True, feats={}),
    dict(b=2, hq=4, hkv=4, sq=256, sk=256, d=128, causal=False,
         feats={"window_left": 64, "window_right": 0, "softcap": 30.0}),
    dict(b=2, hq=4, hkv=4, sq=200, sk=260, d=64, causal=False, feats={"dropout_p": 0.2, "mask": "key_padding"}),
    dict(b=2, hq=4, hkv=1, sq=128, sk=128, d=64, causal=True, feats={"alibi": True}),
    # host TMA descriptors (_desc_launch: encodings cached per address and tile): the split forward and backward
    dict(b=2, hq=4, hkv=2, sq=1100, sk=1100, d=96, causal=True, feats={}, descriptors=True),
    dict(b=1, hq=4, hkv=4, sq=600, sk=700, d=160, causal=False, feats={}, descriptors=True),
]


def _dense_inputs(c, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(c["b"], c["hq"], c["sq"], c["d"], device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(c["b"], c["hkv"], c["sk"], c["d"], device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(c["b"], c["hkv"], c["sk"], c["d"], device="cuda", dtype=dtype, generator=gen)
    kw = {k_: v_ for k_, v_ in c["feats"].items() if k_ not in ("mask", "alibi")}
    if c["feats"].get("mask") == "key_padding":
        kw["attn_mask"] = torch.rand(c["b"], 1, 1, c["sk"], device="cuda", generator=gen) > 0.3
    if c["feats"].get("alibi"):
        kw["alibi_slopes"] = torch.rand(c["hq"], device="cuda", generator=gen)
    if "dropout_p" in kw:
        kw["rng_state"] = new_rng_state()
    return [t.requires_grad_() for t in (q, k, v)], kw


def _dense_run(qkv, kw, causal):
    out, lse = triton_flash_attention(*qkv, is_causal=causal, **kw)
    grads = torch.autograd.grad((out, lse), qkv, (torch.ones_like(out), torch.ones_like(lse)))
    return [out, lse, *grads]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(DENSE)))
def test_dense_fast_launch_is_bitwise_the_jit_path(monkeypatch, case, dtype):
    c = DENSE[case]
    monkeypatch.setattr(_launch, "_FAST", {})
    monkeypatch.setattr(_desc_launch, "_ENCODED", {})
    for seed in range(4):
        qkv, kw = _dense_inputs(c, dtype, seed)
        monkeypatch.setattr(_launch, "FAST_LAUNCH", False)
        ref = _dense_run(qkv, kw, c["causal"])
        monkeypatch.setattr(_launch, "FAST_LAUNCH", True)
        got = _dense_run(qkv, kw, c["causal"])
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
            assert torch.equal(a, b), (name, seed)
    assert _launch._FAST, "nothing was cached: the fast path never ran"
    if c.get("descriptors"):
        assert _desc_launch._ENCODED, "no descriptor was encoded by the fast path"


def test_varlen_fast_launch_is_bitwise_the_jit_path(monkeypatch):
    monkeypatch.setattr(_launch, "_FAST", {})
    for seed in range(4):
        gen = torch.Generator().manual_seed(seed)
        lens = torch.randint(0, 700, (6,), generator=gen).tolist()
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        total = sum(lens)
        q = torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        results = []
        for fast in (False, True):
            monkeypatch.setattr(_launch, "FAST_LAUNCH", fast)
            out, lse = triton_varlen_attention(q, k, v, cu, cu, max(lens), max(lens), is_causal=True)
            grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
            results.append([out, lse, *grads])
        for a, b in zip(*results):
            assert torch.equal(a, b), seed
    assert _launch._FAST


def test_fast_launch_under_cuda_graph(monkeypatch):
    monkeypatch.setattr(_launch, "FAST_LAUNCH", True)
    q, k, v = (torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref, _ = triton_flash_attention(q, k, v, is_causal=True)  # JIT path + cache fill
    triton_flash_attention(q, k, v, is_causal=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = triton_flash_attention(q, k, v, is_causal=True)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    expected, _ = triton_flash_attention(q, k, v, is_causal=True)
    assert torch.equal(out, expected) and not torch.equal(out, ref)
