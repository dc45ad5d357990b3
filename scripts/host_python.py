"""Python host time of the Triton launchers (`flash_fwd`, `flash_bwd`) with every kernel launch stubbed out (runs on
the CPU: no GPU, no interpreter). What it measures is the launchers' own Python (checks, tile choice, allocation,
descriptors), not Triton's launch: device capabilities read as (9, 0), so the sm90 paths (TMA, warp-specialized
kernels) are the ones taken, and `_launch.launch` does nothing. For comparing two trees on one machine, e.g.
    PYTHONPATH=/tmp/old_tree python scripts/host_python.py; python scripts/host_python.py
(alternate them: the CPU host drifts).
Usage: python scripts/host_python.py [--shape D,CAUSAL,SEQLEN ...] [--rounds R] [--calls N] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import statistics
import time

import torch


def _stub_device() -> None:
    from fa_backend.kernels.triton import _launch, _tma, _ws

    _tma.device_capability = _ws.device_capability = lambda device: (9, 0)
    _launch.launch = lambda kernel, grid, args, kwargs: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", default=None,
                        help="D,CAUSAL,SEQLEN (CAUSAL 0 / 1; batch 16384 / seqlen, heads 2048 // d); "
                             "default 128,0,512 and 128,1,512")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--profile", action="store_true", help="also cProfile's top functions of each backward")
    args = parser.parse_args()
    _stub_device()
    fwd_mod = importlib.import_module("fa_backend.kernels.triton.flash_fwd")
    bwd_mod = importlib.import_module("fa_backend.kernels.triton.flash_bwd")
    for spec in args.shape or ["128,0,512", "128,1,512"]:
        d, causal, s = (int(x) for x in spec.split(","))
        b, h = 16384 // s, 2048 // d
        q, k, v, out, dout = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(5))
        lse = torch.randn(b, h, s)
        scale = d ** -0.5
        calls = {"fwd": lambda: fwd_mod.flash_fwd(q, k, v, scale, bool(causal), False),
                 "bwd": lambda: bwd_mod.flash_bwd(dout, q, k, v, out, lse, scale, bool(causal), False)}
        for name, call in calls.items():
            for _ in range(args.calls // 2):
                call()
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.calls):
                    call()
                times.append((time.perf_counter() - start) / args.calls * 1e6)
            print(f"d={d} causal={causal} s={s} {name}: {min(times):.1f} min / {statistics.median(times):.1f} median "
                  "µs per call (launches stubbed)", flush=True)
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls * 10):
                calls["bwd"]()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
