"""How much of a CuTe kernel's time is per CTA rather than per step: the main kernel's GPU time (torch.profiler)
with the CTA count held and the steps per CTA doubled.

    python3 scripts/cta_fixed_cost.py [--dims 128 64] [--base 2048]

Backward (flash_bwd, the op's variant): a CTA owns a key block and steps over the query blocks, so seqlen_q = base,
2 base, 4 base at seqlen_k = base keeps the grid and doubles the steps. Forward (flash_fwd_ws, the op's variant): a
CTA owns a query block and steps over key blocks, so seqlen_k varies at seqlen_q = base. Non-causal, bf16, batch =
16384 / base, heads = 2048 / d. Per CTA and step: time(n) = waves * (fixed + n * step); the fit over the three
lengths gives `fixed` in steps (what a CTA spends outside its steps' throughput: launch, prologue, epilogue, the
pipeline's fill and drain) and its share of the base-length call.
"""

from __future__ import annotations

import argparse
import collections

import torch


def _kernel_us(fn, calls: int = 10) -> float:
    """Mean GPU microseconds per call of the longest kernel `fn` launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name] += e.device_time_total
    return max(per.values()) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--base", type=int, default=2048)
    args = parser.parse_args()
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import fastest_kwargs, flash_fwd_ws
    from fa_backend.ops.cute_flash import BACKWARD_VARIANTS

    s0 = args.base
    for d in args.dims:
        b, h = 16384 // s0, 2048 // d
        for direction in ("bwd", "fwd"):
            times = []
            for n in (1, 2, 4):
                sq, sk = (n * s0, s0) if direction == "bwd" else (s0, n * s0)
                q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(b, h, sk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
                fkw = fastest_kwargs(d, False)
                if direction == "fwd":
                    us = _kernel_us(lambda: flash_fwd_ws(q, k, v, **fkw))
                else:
                    out, lse = flash_fwd_ws(q, k, v, **fkw)
                    dout = torch.randn_like(out)
                    bkw = BACKWARD_VARIANTS[d]
                    us = _kernel_us(lambda: flash_bwd(dout, q, k, v, out, lse, **bkw))
                times.append(us)
                print(f"d={d} {direction} sq={sq} sk={sk}: {us:.1f} us", flush=True)
            # least squares of t(n) = a + c n over n = 1, 2, 4 (in base-length steps): fixed = a / c base steps
            ns = (1.0, 2.0, 4.0)
            mn, mt = sum(ns) / 3, sum(times) / 3
            c = sum((x - mn) * (y - mt) for x, y in zip(ns, times)) / sum((x - mn) ** 2 for x in ns)
            a = mt - c * mn
            print(f"d={d} {direction}: per base length {c:.1f} us, fixed {a:.1f} us = {a / c:.3f} of the base "
                  f"length's steps; fixed share of the base call {a / times[0]:.1%}", flush=True)


if __name__ == "__main__":
    main()
