"""Host time per call of Triton launches with host TMA descriptors: encodings cached (`_desc_launch`, the default)
against Triton 3.6's own per-launch wrapper (GPU; the fiftieth session's A/B in docs/benchmarks.md).

Both modes run in one process, interleaved round by round (each round: the fast-launch cache emptied, two warm-up
calls, then CALLS calls timed from a synchronised start without synchronising: the host's enqueue time, which is
what the descriptors cost). Prints min and median µs per call of each mode per case.
Usage: python scripts/host_descriptors.py [--rounds R] [--calls N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fa_backend.kernels.triton import _desc_launch, _launch
from fa_backend.kernels.triton.flash_bwd import flash_bwd
from fa_backend.kernels.triton.flash_fwd import flash_fwd

# (d, causal, seqlen, direction): the general backward's dK / dV and dQ tiles, the split forward (eight
# descriptors) and the split backward; batch 16384 / seqlen, heads 2048 // d as in the standard sweep
CASES = [(128, True, 512, "bwd"), (128, False, 512, "bwd"), (64, True, 1024, "bwd"), (96, True, 2048, "fwd"),
         (160, False, 1024, "bwd")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    cached_plan = _desc_launch.plan
    for d, causal, s, direction in CASES:
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = d ** -0.5
        out, lse = flash_fwd(q, k, v, scale, causal, False)
        dout = torch.randn_like(out)
        if direction == "fwd":
            def call():
                flash_fwd(q, k, v, scale, causal, False)
        else:
            def call():
                flash_bwd(dout, q, k, v, out, lse, scale, causal, False)
        times: dict[str, list[float]] = {"cached": [], "triton": []}
        try:
            for _ in range(args.rounds):
                for mode in times:
                    _launch._FAST.clear()
                    _desc_launch.plan = cached_plan if mode == "cached" else (lambda compiled: None)
                    call()
                    call()
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        call()
                    times[mode].append((time.perf_counter() - start) / args.calls * 1e6)
                    torch.cuda.synchronize()
        finally:
            _desc_launch.plan = cached_plan
        summary = ", ".join(f"{mode} {min(t):.1f} / {statistics.median(t):.1f}" for mode, t in times.items())
        print(f"d={d} causal={causal} s={s} {direction}: host µs per call (min / median): {summary}", flush=True)


if __name__ == "__main__":
    main()
