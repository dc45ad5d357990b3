"""Decode benchmark (GPU): flash_attn_with_kvcache vs a plain read of K and V vs PyTorch's SDPA backends.

One query token per sequence (bf16, hq=32, d=128), KV cache of L tokens, contiguous or paged. The
metric is achieved bandwidth: bytes of K and V read / median time (triton.testing.do_bench, L2
flushed between runs), in TB/s, next to a plain read of the same bytes measured in the same run
(torch.sum over K and V) and the equivalent SDPA call (q (b, hq, 1, d), k/v (b, hkv, L, d) views of
the cache, enable_gqa=True; heads repeated for a backend that refuses GQA, when memory allows).

Two timing modes. eager (default): each call is timed as issued from Python, so a small call whose host
work outlasts its GPU work measures the host. --graph: each call (ours, every SDPA backend, the plain
read) is captured once in a CUDA graph and the graph's replay is timed (same do_bench, L2 flushed
before each replay, whose host cost hides behind the flush): GPU time without host overhead.

    python -m fa_backend.bench_decode [--graph] [--json F] [--batch 1 8] [--seqlens 1024 65536] [--hkv 8]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys

import torch

HQ, D = 32, 128
SEQLENS = [1024, 4096, 16384, 65536, 131072]
MAX_BYTES = 40e9  # skip points whose cache (or SDPA's repeated copy) would exceed this


MODE = {"graph": False}  # set by main(): time CUDA-graph replays instead of eager calls


def _bench(fn) -> float:
    """Median milliseconds of fn (eager) or of the replay of a CUDA graph holding one call of fn (--graph).
    fn must already have run once (kernels compiled, support checked)."""
    import triton

    if MODE["graph"]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs recommends
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        try:
            return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        finally:
            del graph
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _sdpa_times(q, k, v, budget_bytes: float) -> dict[str, float | str]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res: dict[str, float | str] = {}
    group = q.shape[1] // k.shape[1]
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run(kk=k, vv=v, gqa=group > 1, backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa)
        try:
            run()
            res[name] = _bench(run)
        except RuntimeError as e:
            if group == 1 or 2 * k.numel() * k.element_size() * group > budget_bytes:
                res[name] = f"n/a ({str(e).splitlines()[0][:60]})"
                continue
            try:  # the backend may refuse GQA: repeat the KV heads (extra memory, same bytes per query head)
                kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                run(kr, vr, False)
                res[name] = _bench(functools.partial(run, kr, vr, False))
                res[name + "_note"] = "heads repeated"
                del kr, vr
            except RuntimeError as e2:
                res[name] = f"n/a ({str(e2).splitlines()[0][:60]})"
        torch.cuda.empty_cache()
    return res


def _paged(cache: torch.Tensor, page: int):
    b, s, h, d = cache.shape
    per_seq = s // page
    perm = torch.randperm(b * per_seq, device=cache.device)
    paged = torch.empty(b * per_seq, page, h, d, dtype=cache.dtype, device=cache.device)
    paged[perm] = cache.reshape(b * per_seq, page, h, d)
    return paged, perm.reshape(b, per_seq).to(torch.int32)


def run_point(b: int, L: int, hkv: int, layouts: list[str], with_sdpa: bool) -> list[dict]:
    import fa_backend

    dtype = torch.bfloat16
    kv_bytes = 2 * b * L * hkv * D * 2
    q = torch.randn(b, 1, HQ, D, dtype=dtype, device="cuda")
    kc = torch.randn(b, L, hkv, D, dtype=dtype, device="cuda")
    vc = torch.randn(b, L, hkv, D, dtype=dtype, device="cuda")
    sl = torch.full((b,), L, dtype=torch.int32, device="cuda")
    read = lambda: (kc.sum(dtype=torch.float32), vc.sum(dtype=torch.float32))
    read()
    read_ms = _bench(read)
    sdpa = {}
    if with_sdpa:
        sdpa = _sdpa_times(q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2), MAX_BYTES - kv_bytes)
    rows = []
    for layout in layouts:
        if layout == "contiguous":
            k_, v_, bt = kc, vc, None
        else:
            page = int(layout.removeprefix("paged"))
            if L % page:
                continue
            k_, bt = _paged(kc, page)
            v_ = torch.empty_like(k_)
            v_[bt.flatten().long()] = vc.reshape(-1, page, hkv, D)
        fn = functools.partial(fa_backend.flash_attn_with_kvcache, q, k_, v_, cache_seqlens=sl, block_table=bt)
        fn()
        ms = _bench(fn)
        del fn
        from fa_backend.kernels.triton import _launch, decode

        block_n = decode.decode_config(D)[0]
        splits = decode.num_splits_heuristic(b, hkv, 1, L, block_n, _launch.sm_count(q.device))
        row = {"mode": "graph" if MODE["graph"] else "eager", "hkv": hkv, "batch": b, "seqlen": L, "layout": layout,
               "splits": splits, "kv_gb": kv_bytes / 1e9, "ours_us": ms * 1e3, "ours_tbs": kv_bytes / ms / 1e9,
               "read_tbs": kv_bytes / read_ms / 1e9}
        row["pct_of_read"] = 100 * row["ours_tbs"] / row["read_tbs"]
        for name, val in sdpa.items():
            if isinstance(val, float):
                row[f"sdpa_{name}_us"] = val * 1e3
                row[f"sdpa_{name}_tbs"] = kv_bytes / val / 1e9
            else:
                row[f"sdpa_{name}"] = val
        rows.append(row)
        del k_, v_
        torch.cuda.empty_cache()
    return rows


def _fmt(row: dict) -> str:
    def sd(name):
        v = row.get(f"sdpa_{name}_tbs")
        return f"{v:6.2f}" if v is not None else f"{'n/a':>6}"
    return (f"{row['hkv']:>3} {row['batch']:>3} {row['seqlen']:>7} {row['layout']:>10} {row['splits']:>3} "
            f"{row['ours_us']:>9.1f} {row['ours_tbs']:>6.2f} {row['read_tbs']:>6.2f} {row['pct_of_read']:>5.1f}% "
            f"{sd('cudnn')} {sd('flash')} {sd('efficient')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 8, 64])
    parser.add_argument("--seqlens", type=int, nargs="*", default=SEQLENS)
    parser.add_argument("--hkv", type=int, nargs="*", default=[8, 32])
    parser.add_argument("--layouts", nargs="*", default=["contiguous", "paged64", "paged256"])
    parser.add_argument("--no-sdpa", action="store_true", help="skip PyTorch's SDPA backends")
    parser.add_argument("--graph", action="store_true",
                        help="time CUDA-graph replays (GPU time, no host overhead) instead of eager calls")
    args = parser.parse_args(argv)
    MODE["graph"] = args.graph
    mode = "graph" if args.graph else "eager"
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA GPU", file=sys.stderr)
        return 1
    print(f"# {torch.cuda.get_device_name()}  bf16 hq={HQ} d={D}  one query token; TB/s = K+V bytes / median time; "
          f"mode={mode} ({'CUDA-graph replays: GPU time' if args.graph else 'eager calls: host overhead included'})")
    print(f"{'hkv':>3} {'b':>3} {'L':>7} {'layout':>10} {'spl':>3} {'ours_us':>9} {'TB/s':>6} {'read':>6} "
          f"{'%read':>6} {'cudnn':>6} {'flash':>6} {'effic':>6}")
    rows = []
    for hkv in args.hkv:
        for b in args.batch:
            for L in args.seqlens:
                kv_bytes = 2 * b * L * hkv * D * 2
                if kv_bytes > MAX_BYTES:
                    continue
                try:
                    new = run_point(b, L, hkv, args.layouts, not args.no_sdpa)
                except torch.cuda.OutOfMemoryError:
                    print(f"# skipped hkv={hkv} b={b} L={L}: out of memory")
                    torch.cuda.empty_cache()
                    continue
                for row in new:
                    print(_fmt(row), flush=True)
                rows.extend(new)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "mode": mode, "rows": rows}, f, indent=1,
                      default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
