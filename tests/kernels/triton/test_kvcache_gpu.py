"""flash_attn_with_kvcache at real sizes on the GPU (bf16 and fp16), and a CUDA-graph decode step.

Same checks as the CPU tests (tests/kernels/triton/test_kvcache.py: float64 reference, 2x rule, cache
contents after the append, poisoned outputs). Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import fa_backend
from tests.cuda_graphs import capture
from tests.kernels.triton.test_kvcache import _rotary, _to_paged, check_kvcache

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("poisoned")]

DTYPES = [torch.bfloat16, torch.float16]


def _decode_case(b, L, hq, hkv, d, dtype, s_new=1, sq=1, s_cache=None):
    s_cache = L + s_new if s_cache is None else s_cache
    q = torch.randn(b, sq, hq, d, dtype=dtype, device="cuda")
    kc = torch.randn(b, s_cache, hkv, d, dtype=dtype, device="cuda")
    vc = torch.randn(b, s_cache, hkv, d, dtype=dtype, device="cuda")
    k = torch.randn(b, s_new, hkv, d, dtype=dtype, device="cuda")
    v = torch.randn(b, s_new, hkv, d, dtype=dtype, device="cuda")
    # Lengths spread over [L/2, L] so that batch entries differ.
    sl = torch.randint(L // 2, L + 1, (b,), dtype=torch.int32, device="cuda")
    return q, kc, vc, k, v, sl


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hkv", [8, 32])
@pytest.mark.parametrize("b,L", [(1, 32768), (8, 8192), (64, 2048), (4, 1000)])
def test_decode_real_size(b, L, hkv, dtype):
    q, kc, vc, k, v, sl = _decode_case(b, L, 32, hkv, 128, dtype)
    cos, sin = _rotary(L + 8, 128, dtype)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, rotary_cos=cos, rotary_sin=sin, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", [64, 256])
@pytest.mark.parametrize("hkv", [8, 32])
def test_paged_real_size(page_size, hkv, dtype):
    b, L = 8, 8192
    q, kc, vc, k, v, sl = _decode_case(b, L, 32, hkv, 128, dtype, s_cache=L + page_size)
    kp, bt = _to_paged(kc, page_size)
    vp = torch.randn_like(kp)
    vp[bt.flatten().long()] = vc.reshape(-1, page_size, hkv, 128)
    out_paged, _ = check_kvcache(q, kp, vp, k, v, cache_seqlens=sl, block_table=bt)
    out_contig, _ = check_kvcache(q, kc, vc, k, v, cache_seqlens=sl)
    # Same key tiles, same summation order: equal bits. (Unsplit contiguous launches read 128-key tiles,
    # pages of 64 keys 64-key ones: then only the float64 bar above applies.)
    from fa_backend.kernels.triton import decode

    paged_n = decode.launch_constants(q, kp, bt)["BLOCK_N"]
    if paged_n == decode.launch_constants(q, kc)["BLOCK_N"]:
        assert torch.equal(out_paged, out_contig)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_splits", [1, 5, 0])
def test_splits_real_size(num_splits, dtype):
    q, kc, vc, k, v, sl = _decode_case(2, 16384, 32, 8, 128, dtype)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, num_splits=num_splits)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_dims_gpu(d):
    q, kc, vc, k, v, sl = _decode_case(4, 3000, 32, 8, d, torch.bfloat16, s_new=4, sq=4)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, causal=True)


def test_features_gpu():
    b, L = 4, 4096
    q, kc, _vc, k, v, sl = _decode_case(b, L, 32, 8, 128, torch.bfloat16, s_new=2, sq=2, s_cache=L + 256)
    kp, bt = _to_paged(kc, 256)
    cos, sin = _rotary(L + 256, 64, torch.bfloat16)
    check_kvcache(q, kp, torch.randn_like(kp), k, v, cache_seqlens=sl, block_table=bt, rotary_cos=cos, rotary_sin=sin,
                  rotary_interleaved=False, causal=True, window_size=(1024, -1), softcap=30.0,
                  alibi_slopes=torch.rand(b, 32, device="cuda"),
                  cache_leftpad=torch.randint(0, 100, (b,), dtype=torch.int32, device="cuda"))


def test_cuda_graph_decode_step():
    b, L, hq, hkv, d = 8, 4096, 32, 8, 128
    dtype = torch.bfloat16
    q, kc, vc, k, v, sl = _decode_case(b, L, hq, hkv, d, dtype, s_cache=L + 16)
    cos, sin = _rotary(L + 16, d, dtype)
    static = [t.clone() for t in (q, k, v, sl)]

    def step():
        return fa_backend.flash_attn_with_kvcache(static[0], kc, vc, static[1], static[2], cos, sin,
                                                  cache_seqlens=static[3], causal=True)

    graph, static_out = capture(step, warmup=2)
    for _ in range(3):
        new = _decode_case(b, L, hq, hkv, d, dtype, s_cache=L + 16)
        for dst, src in zip(static, (new[0], new[3], new[4], new[5])):
            dst.copy_(src)
        kc_eager, vc_eager = kc.clone(), vc.clone()
        eager = fa_backend.flash_attn_with_kvcache(static[0], kc_eager, vc_eager, static[1], static[2], cos, sin,
                                                   cache_seqlens=static[3], causal=True)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)


def test_opcheck_gpu():
    q, kc, vc, k, v, sl = _decode_case(2, 500, 8, 2, 128, torch.bfloat16, s_cache=600)
    torch.library.opcheck(torch.ops.fa_backend.triton_kv_append.default,
                          (kc, vc, k, v, sl, None, None, None, None, True))
    torch.library.opcheck(torch.ops.fa_backend.triton_decode_fwd.default,
                          (q, kc, vc, sl, 1, None, None, None, None, None, True, True, None, 0.1, -1, 0, 0.0, 0))


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("int_seqlens", [False, True])
def test_cuda_graph_pure_decode(paged, int_seqlens):
    # Pure decode over the cache (no append), split keys + merge, captured and replayed: equal to eager.
    b, L, hq, hkv, d = 1, 4096, 32, 8, 128
    q, kc, vc, _, _, sl = _decode_case(b, L, hq, hkv, d, torch.bfloat16, s_new=0)
    bt = None
    if paged:
        kc, bt = _to_paged(kc, 64)
        vc = torch.randn_like(kc)
    seqlens = int(sl[0]) if int_seqlens else sl
    static_q = q.clone()

    def step():
        return fa_backend.flash_attn_with_kvcache(static_q, kc, vc, cache_seqlens=seqlens, block_table=bt,
                                                  return_softmax_lse=True)

    graph, (static_out, static_lse) = capture(step)
    for _ in range(2):
        static_q.copy_(torch.randn_like(q))
        out, lse = step()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, out) and torch.equal(static_lse, lse)


@pytest.mark.parametrize("graph", [False, True])
def test_bench_decode_smoke(graph, tmp_path):
    import json

    from fa_backend import bench_decode

    out = tmp_path / "decode.json"
    args = ["--batch", "1", "--seqlens", "1024", "--hkv", "8", "--layouts", "contiguous", "paged64", "--json",
            str(out)] + (["--graph"] if graph else [])
    assert bench_decode.main(args) == 0
    res = json.loads(out.read_text())
    assert res["mode"] == ("graph" if graph else "eager")
    assert len(res["rows"]) == 2 and all(r["ours_us"] > 0 for r in res["rows"])


@pytest.mark.parametrize("paged", [False, True])
def test_fast_launch_matches_jit_path(monkeypatch, paged):
    # FA_BACKEND_FAST_LAUNCH=1: launches after the first skip the JIT's per-call work; results must be bitwise
    # those of the JIT path, for append + rotary + splits, pure decode, int seqlens, and under a CUDA graph.
    from fa_backend.kernels.triton import _launch

    b, L, hq, hkv, d = 2, 4096, 32, 8, 128
    q, kc, vc, k, v, sl = _decode_case(b, L, hq, hkv, d, torch.bfloat16, s_cache=L + 64)
    cos, sin = _rotary(L + 64, d, torch.bfloat16)
    bt = None
    if paged:
        kc, bt = _to_paged(kc, 64)
        vc = torch.randn_like(kc)
    calls = [{"k": k, "v": v, "rotary_cos": cos, "rotary_sin": sin, "causal": True, "cache_seqlens": sl},
             {"cache_seqlens": sl}, {"cache_seqlens": L - 3, "num_splits": 1}, {"cache_seqlens": sl, "num_splits": 7}]

    def run_all():
        kc_, vc_ = kc.clone(), vc.clone()
        outs = [fa_backend.flash_attn_with_kvcache(q, kc_, vc_, block_table=bt, return_softmax_lse=True, **kw)
                for kw in calls]
        return outs, kc_, vc_

    monkeypatch.setattr(_launch, "FAST_LAUNCH", False)
    ref, ref_k, ref_v = run_all()
    monkeypatch.setattr(_launch, "FAST_LAUNCH", True)
    for _ in range(3):  # first: JIT path + cache fill; then the cached launches
        outs, k2, v2 = run_all()
        assert torch.equal(k2, ref_k) and torch.equal(v2, ref_v)
        for (o, lse), (o_ref, lse_ref) in zip(outs, ref):
            assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
    assert _launch._FAST, "nothing was cached"
    static_q = q.clone()

    def step():  # the variant of calls[1], already compiled and cached (the capture must not compile)
        return fa_backend.flash_attn_with_kvcache(static_q, kc, vc, cache_seqlens=sl, block_table=bt,
                                                  return_softmax_lse=True)

    graph, (static_out, _) = capture(step)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, ref[1][0])


@pytest.mark.parametrize("b,hkv,L", [(1, 8, 16384), (2, 32, 4096)])
def test_fused_merge_back_to_back(monkeypatch, b, hkv, L):
    # The last-arriving split reads the others' partials (workspace poisoned with NaN before every launch):
    # many launches in a row, each with fresh queries, each equal to the separate merge launch's result up to
    # rounding, and no NaN (a partial read before its writer published it). Arrival counters end at zero.
    from fa_backend.kernels.triton import decode

    q, kc, vc, _, _, sl = _decode_case(b, L, 32, hkv, 128, torch.bfloat16, s_new=0)
    for _ in range(40):
        q = torch.randn_like(q)
        outs = []
        for fused in (True, False):
            monkeypatch.setattr(decode, "FUSED_MERGE", fused)
            outs.append(fa_backend.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, num_splits=16,
                                                           return_softmax_lse=True))
        (out, lse), (out_ref, lse_ref) = outs
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out, out_ref)
        torch.testing.assert_close(lse, lse_ref)
    torch.cuda.synchronize()
    assert decode.arrival_counters(q.device, 1).abs().sum().item() == 0
