"""Sweep the split-KV decode kernel's launch configuration on the GPU (one query token, bf16, hq=32, d=128).

For each shape (batch, KV heads, cache length) every (BLOCK_N, num_warps, num_stages) of the grid below is
timed with each number of splits, with the split merge fused into the decode launch or as its own launch
(--fused), as CUDA-graph replays (GPU time, L2 flushed: bench_decode's --graph
timing), next to PyTorch's cuDNN SDPA on the same call. Kernels are compiled first in parallel processes
(they fill Triton's disk cache), then timed in this process. Prints, per shape, the best configurations and
the heuristic's, as TB/s of K+V read and the ratio to cuDNN; --json writes every timing.

    python scripts/tune_decode.py [--json FILE] [--workers 12] [--shapes 1,8,4096 ...] [--configs 64,4,3 ...]
                                  [--splits 0 8 16] [--fused on off]
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import time

import torch

HQ, D = 32, 128
SHAPES = [(1, 8, 4096), (1, 8, 16384), (1, 32, 4096), (1, 32, 32768), (8, 8, 4096), (64, 8, 16384)]
KERNEL_CONFIGS = [(bn, w, s) for bn in (32, 64, 128) for w, s in ((4, 2), (4, 4), (8, 3))]
SPLITS = (0, 8, 16, 32, 64)  # 0: the heuristic


def _set_config(cfg, fused: bool = True) -> None:
    from fa_backend.kernels.triton import decode

    decode.decode_config = lambda d, num_splits=0, cfg=cfg: cfg
    decode.FUSED_MERGE = fused
    decode._PLANS.clear()


def _inputs(b, hkv, L):
    q = torch.randn(b, 1, HQ, D, dtype=torch.bfloat16, device="cuda")
    kc = torch.randn(b, L, hkv, D, dtype=torch.bfloat16, device="cuda")
    vc = torch.randn(b, L, hkv, D, dtype=torch.bfloat16, device="cuda")
    return q, kc, vc, torch.full((b,), L, dtype=torch.int32, device="cuda")


def _warm(jobs) -> int:
    """Compile each (hkv, kernel config, splits) once (a worker process)."""
    import fa_backend

    done = 0
    for hkv, cfg, splits, fused in jobs:
        _set_config(cfg, fused)
        q, kc, vc, sl = _inputs(1, hkv, 4096)
        try:
            fa_backend.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl, num_splits=splits or 16)
            done += 1
        except Exception as e:  # a config that does not compile (shared memory, registers): reported later
            print(f"warm {hkv} {cfg} {splits} fused={fused}: {type(e).__name__}: {str(e).splitlines()[0][:80]}", flush=True)
    torch.cuda.synchronize()
    return done


def _graph_ms(fn) -> float:
    from fa_backend.bench_decode import MODE, _bench

    MODE["graph"] = True
    fn()
    return _bench(fn)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--shapes", nargs="*", help="batch,hkv,cache_len (default: SHAPES)")
    parser.add_argument("--configs", nargs="*", help="BLOCK_N,num_warps,num_stages (default: KERNEL_CONFIGS)")
    parser.add_argument("--splits", type=int, nargs="*", default=list(SPLITS), help="0: the heuristic")
    parser.add_argument("--fused", nargs="*", default=["on"], choices=["on", "off"],
                        help="the split merge in the decode launch (on) or as its own launch (off)")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in t.split(",")) for t in args.shapes] if args.shapes else SHAPES
    configs = [tuple(int(x) for x in t.split(",")) for t in args.configs] if args.configs else KERNEL_CONFIGS
    fused_modes = [f == "on" for f in args.fused]
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa_backend
    from fa_backend.kernels.triton import decode

    heuristic_cfg = decode.decode_config(D)
    t0 = time.time()
    hkvs = sorted({hkv for _, hkv, _ in shapes})
    jobs = [(hkv, cfg, s, f) for hkv in hkvs for cfg in configs for s in args.splits for f in fused_modes]
    chunks = [jobs[i::args.workers] for i in range(args.workers)]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        compiled = sum(pool.map(_warm, chunks))
    print(f"compiled {compiled}/{len(jobs)} variants in {time.time() - t0:.0f} s", flush=True)

    records = []
    for b, hkv, L in shapes:
        q, kc, vc, sl = _inputs(b, hkv, L)
        kv_bytes = 2 * kc.numel() * kc.element_size()
        qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=hkv != HQ)

        cudnn_ms = _graph_ms(cudnn)
        rows = []
        for cfg, splits, fused in itertools.product(list(dict.fromkeys([heuristic_cfg] + configs)), args.splits,
                                                    fused_modes):
            _set_config(cfg, fused)
            try:
                ms = _graph_ms(lambda: fa_backend.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl,
                                                                          num_splits=splits))
            except Exception as e:
                print(f"  {cfg} splits={splits} fused={fused}: {type(e).__name__}", flush=True)
                continue
            plan = next(iter(decode._PLANS.values()))
            rows.append({"batch": b, "hkv": hkv, "seqlen": L, "block_n": cfg[0], "num_warps": cfg[1],
                         "num_stages": cfg[2], "splits_arg": splits, "splits": plan[1]["NUM_SPLITS"], "ms": ms,
                         "tbps": kv_bytes / ms / 1e9, "cudnn_ms": cudnn_ms, "vs_cudnn": cudnn_ms / ms,
                         "fused": fused and plan[1]["NUM_SPLITS"] > 1,
                         "current": cfg == heuristic_cfg and splits == 0 and fused == fused_modes[0]})
        rows.sort(key=lambda r: r["ms"])
        current = next((r for r in rows if r["current"]), None)
        now = (f"{current['tbps']:.2f} TB/s ({current['vs_cudnn']:.2f}x, splits {current['splits']})"
               if current else "not timed")
        print(f"b={b} hkv={hkv} L={L}: cuDNN {kv_bytes / cudnn_ms / 1e9:.2f} TB/s; current {now}", flush=True)
        for fused in (True, False):  # the best of each merge mode, side by side
            best = next((r for r in rows if r["fused"] == fused and r["splits"] > 1), None)
            if best:
                print(f"   best {'fused' if fused else 'merge'}: splits={best['splits']} {best['tbps']:.2f} TB/s "
                      f"({best['vs_cudnn']:.2f}x cuDNN)", flush=True)
        for r in rows[:8]:
            print(f"   BN={r['block_n']:<3} w={r['num_warps']} st={r['num_stages']} splits={r['splits']:<3} "
                  f"{'fused' if r['fused'] else 'merge'} "
                  f"{r['tbps']:.2f} TB/s ({r['vs_cudnn']:.2f}x cuDNN)", flush=True)
        records += rows
        q = kc = vc = qt = kt = vt = None  # free the cache before the next shape
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
