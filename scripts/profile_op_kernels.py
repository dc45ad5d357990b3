"""Which CUDA kernels one training call runs and their GPU time: our ops (forward, then the autograd backward)
against SDPA's cuDNN backend on the same call, under torch.profiler (a diagnostic: how much of a backward call
is the kernel and how much the passes around it, delta, dQ's zeroing and conversion).

    python3 scripts/profile_op_kernels.py [--seqlens 2048] [--causal yes] [--p 0.1 0.0] [--calls 5]
                                          [--dims 128] [--runners cute cudnn]

--runners: `cute` (the CuTe op), `triton` (the Triton op), `cudnn`. bf16, batch = 16384 / seqlen, heads = 2048 / d,
a fresh RNG state per call. Per runner and phase: each kernel's
name, launches per call and GPU microseconds per call (the mean over --calls profiled calls after a warm-up), and
the phase's sum; then the forward's host time per call with and without gradients (50 calls issued, timed before
and after the closing synchronize: "issue" is the host's time, "wall" includes the GPU's).
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _phases(fwd, calls: int) -> dict[str, dict[str, list]]:
    """{phase: {kernel name: [launches, GPU us]}} summed over `calls` forward + backward calls."""
    out = {"fwd": collections.defaultdict(lambda: [0, 0.0]), "bwd": collections.defaultdict(lambda: [0, 0.0])}
    for _ in range(2):  # warm-up: compiles, allocator
        o = fwd()
        o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    for phase in ("fwd", "bwd"):
        for _ in range(calls):
            o = fwd()
            dout = torch.randn_like(o)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                if phase == "fwd":
                    o = fwd()
                else:
                    o.backward(dout)
                torch.cuda.synchronize()
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    out[phase][e.name[:80]][0] += 1
                    out[phase][e.name[:80]][1] += e.device_time_total
    return out


def _host(fwd, grad: bool, n: int = 50) -> tuple[float, float]:
    """(issue, wall) microseconds per forward call."""
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            fwd()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fwd()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048])
    parser.add_argument("--causal", nargs="+", default=["yes"], choices=["no", "yes"])
    parser.add_argument("--p", type=float, nargs="+", default=[0.1, 0.0])
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--runners", nargs="+", default=["cute", "cudnn"], choices=["cute", "triton", "cudnn"])
    args = parser.parse_args()
    for d in args.dims:
        for s in args.seqlens:
            for causal in (c == "yes" for c in args.causal):
                for p in args.p:
                    _profile_shape(args, d, s, causal, p)


def _profile_shape(args: argparse.Namespace, d: int, s: int, causal: bool, p: float) -> None:
    """Print each runner's kernels and GPU time per forward and backward call on one shape."""
    from fa_backend.ops import cute_flash_attention, triton_flash_attention
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def cute():
        return cute_flash_attention(q, k, v, None, causal, False, dropout_p=p)[0]

    def triton():
        return triton_flash_attention(q, k, v, None, causal, False, dropout_p=p)[0]

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)

    runners = dict(cute=cute, triton=triton, cudnn=cudnn)
    for name, fn in ((n, runners[n]) for n in args.runners):
        for phase, kernels in _phases(fn, args.calls).items():
            total = sum(us for _, us in kernels.values()) / args.calls
            print(f"d={d} s={s} causal={int(causal)} p={p} {name} {phase}: {total:.0f} us", flush=True)
            for kname, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
                print(f"    {us / args.calls:8.1f} us  x{n / args.calls:.0f}  {kname}")
        for grad in (False, True):
            issue, wall = _host(fn, grad)
            print(f"  {name} fwd host, grad={grad}: issue {issue:.0f} us, wall {wall:.0f} us per call",
                  flush=True)


if __name__ == "__main__":
    main()
