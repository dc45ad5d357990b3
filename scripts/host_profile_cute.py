"""Where the host time of one CuTe op forward goes on a GPU machine: cProfile over many calls of
ops.cute_flash_attention (the eager path SDPA routing takes), without and with gradients, then the same calls'
issue time without the profiler.

    python3 scripts/host_profile_cute.py [--seqlen 2048] [--causal] [--calls 200] [--top 30] [--backward] [--unprepared]

bf16, d=128, batch = 16384 / seqlen, 16 heads. The GPU runs the kernels meanwhile, so the profile holds what a
training step's host pays per attention call (a synchronizing call would show as time in its wait). --backward: the
same for the backward (torch.autograd.grad of one forward's out, the graph retained), instead of the forward.
--unprepared: without the backward's prepared launches (ops/cute_flash._BACKWARD_LAUNCHES), every backward through
flash_bwd's general path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--p", type=float, default=0.0)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--unprepared", action="store_true")
    args = parser.parse_args()
    from fa_backend.ops import cute_flash, cute_flash_attention

    if args.unprepared:
        cute_flash._backward_key = lambda *a, **kw: None

    s, d = args.seqlen, 128
    q, k, v = (torch.randn(16384 // s, 16, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def call():
        return cute_flash_attention(q, k, v, None, args.causal, False, dropout_p=args.p)[0]

    if args.backward:
        out = call()
        dout = torch.randn_like(out)

        def call():  # noqa: F811 - the backward of that forward, again and again
            return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    for grad in ((True,) if args.backward else (False, True)):
        with torch.set_grad_enabled(grad):
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call()
            issue = (time.perf_counter() - t0) / args.calls * 1e6
            torch.cuda.synchronize()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.calls):
                call()
            profile.disable()
            torch.cuda.synchronize()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(args.top)
        what = "backward" if args.backward else f"grad={grad}"
        print(f"=== {what}: issue {issue:.0f} us per call (no profiler); cProfile by own time, {args.calls} calls")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:12000])
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.top)
        print(f"=== {what}: by cumulative time")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:12000])


if __name__ == "__main__":
    main()
