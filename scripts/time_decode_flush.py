"""Decode timings under two L2 flushes (GPU): how much of a small decode call's measured time is the flush's.

triton.testing.do_bench flushes L2 between runs by zeroing a 256 MB buffer, which leaves up to L2's size of dirty
lines that the timed call then writes back while it reads K and V. This script times CUDA-graph replays of
flash_attn_with_kvcache (at the heuristic's splits and at forced ones) and of cuDNN's SDPA on the same call, with
the flush either zeroing that buffer (do_bench's) or reading it (clean lines), medians of REPS replays each.

    python3 scripts/time_decode_flush.py [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa_backend
from fa_backend.kernels.triton import _launch, decode

HQ, D, REPS = 32, 128, 200
FLUSH = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")


def _graph(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def _time(g, flush: str) -> float:
    """Median microseconds of REPS replays of graph g, each after the flush."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(REPS)]
    for _ in range(10):
        g.replay()
    sink = torch.zeros((), dtype=torch.int64, device="cuda")
    for i in range(REPS):
        if flush == "zero":
            FLUSH.zero_()
        else:
            sink += FLUSH.sum()  # read: L2 left holding clean lines
        starts[i].record()
        g.replay()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--splits", type=int, nargs="*", default=[0, 16, 32, 64])
    args = parser.parse_args()
    FLUSH.random_(0, 100)
    shapes = [(1, 8, L) for L in (1024, 4096, 8192, 16384, 32768)] + \
             [(1, 32, L) for L in (1024, 4096, 8192, 16384, 32768)] + \
             [(8, 32, 1024), (8, 32, 2048), (64, 8, 1024), (64, 32, 1024), (64, 8, 2048)]
    rows = []
    print(f"{'b':>3} {'hkv':>3} {'L':>6} {'MB':>7} {'flush':>5} {'cudnn':>7} " +
          " ".join(f"{'s' + str(s):>7}" for s in args.splits) + "   (us; TB/s best ours, cudnn; best / cudnn)")
    for b, hkv, L in shapes:
        q = torch.randn(b, 1, HQ, D, dtype=torch.bfloat16, device="cuda")
        kc = torch.randn(b, L, hkv, D, dtype=torch.bfloat16, device="cuda")
        vc = torch.randn(b, L, hkv, D, dtype=torch.bfloat16, device="cuda")
        sl = torch.full((b,), L, dtype=torch.int32, device="cuda")
        nbytes = 2 * kc.numel() * 2
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hkv != HQ)

        graphs = {"cudnn": _graph(cudnn)}
        ref = cudnn().transpose(1, 2)
        for s in args.splits:
            fn = lambda s=s: fa_backend.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, num_splits=s)
            err = (fn().float() - ref.float()).abs().max().item()
            assert err < 2e-2, (b, hkv, L, s, err)
            graphs[f"s{s}"] = _graph(fn)
        heur = decode.num_splits_heuristic(b, hkv, 1, L, decode.decode_config(D)[0], _launch.sm_count(q.device))
        for flush in ("zero", "read"):
            us = {name: _time(g, flush) for name, g in graphs.items()}
            ours = min(v for k, v in us.items() if k != "cudnn")
            rows.append(dict(batch=b, hkv=hkv, seqlen=L, kv_mb=nbytes / 1e6, flush=flush, heuristic_splits=heur,
                             us=us))
            print(f"{b:>3} {hkv:>3} {L:>6} {nbytes / 1e6:>7.1f} {flush:>5} {us['cudnn']:>7.1f} " +
                  " ".join(f"{us['s' + str(s)]:>7.1f}" for s in args.splits) +
                  f"   {nbytes / ours / 1e6:.2f} {nbytes / us['cudnn'] / 1e6:.2f} {us['cudnn'] / ours:.2f}"
                  f"  (heuristic s{heur}: {us['cudnn'] / us['s0']:.2f})", flush=True)
        del graphs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
