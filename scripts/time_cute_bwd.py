"""Times the CuTe backward kernel (flash_bwd, warp-specialised) and cuDNN's backward in one process: a quick A/B
tool for kernel changes that environment variables switch (one process per setting).

Usage: python scripts/time_cute_bwd.py [--dims D ...] [--seqlens S ...] [--label TEXT] [--regs] [--op [--rounds R]]
       [--json FILE]
bf16, batch 16384 / s, heads 2048 / d; TFLOP/s = 2.5 * 4 b h s^2 d (halved for causal) / time (do_bench median).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

VARIANTS = {64: dict(wgs=2, warp_specialized=True, tile_m=128), 128: dict(wgs=2, warp_specialized=True),
            192: dict(wgs=2, warp_specialized=True), 256: dict(wgs=2, warp_specialized=True)}


def _op_rounds(row: dict, q, k, v, dout, causal: bool, kw: dict, flops: float, rounds: int) -> None:
    """The kernel (flash_bwd on the op's own forward outputs) and the op's backward through autograd, in turn, in
    TFLOP/s per round; then the op backward's kernels under torch.profiler."""
    import collections

    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.ops import cute_flash

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = cute_flash.cute_flash_attention(*leaves, None, causal)
    plain = [t.detach() for t in leaves]
    kernel = lambda: flash_bwd(dout, *plain, o.detach(), lse.detach(), causal=causal, **kw)  # noqa: E731
    op = lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True)  # noqa: E731
    row["kernel_rounds"], row["op_rounds"] = [], []
    for _ in range(rounds):
        for name, fn in (("kernel_rounds", kernel), ("op_rounds", op)):
            row[name].append(round(flops / triton.testing.do_bench(fn, warmup=20, rep=200) / 1e9, 1))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            op()
        torch.cuda.synchronize()
    per = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.name[:70]] += e.device_time_total / 5
    for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
        print(f"    op bwd kernel {us:8.1f} us  {name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 192])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--label", default="")
    parser.add_argument("--no-cudnn", action="store_true")
    parser.add_argument("--regs", action="store_true",
                        help="also the kernel with dK / dV stored from registers (tma_store=False), as "
                             "cute_regs")
    parser.add_argument("--op", action="store_true",
                        help="also the op's backward through autograd (cute_flash_attention, as routing runs it), "
                             "timed in turn with the kernel over --rounds rounds, and the op backward's kernels "
                             "(torch.profiler, GPU us per call)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

    records = []
    for d in args.dims:
        for causal in (False, True):
            for s in args.seqlens:
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                dout = torch.randn_like(q)
                out, lse = flash_fwd_ws(q, k, v, causal=causal)
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                kw = VARIANTS[d]
                ms = triton.testing.do_bench(lambda: flash_bwd(dout, q, k, v, out, lse, causal=causal, **kw),
                                             warmup=20, rep=200)
                row = dict(label=args.label, d=d, causal=causal, seqlen=s, cute=flops / ms / 1e9)
                if args.op:
                    _op_rounds(row, q, k, v, dout, causal, kw, flops, args.rounds)
                if args.regs:
                    ms = triton.testing.do_bench(lambda: flash_bwd(dout, q, k, v, out, lse, causal=causal,
                                                                   tma_store=False, **kw), warmup=20, rep=200)
                    row["cute_regs"] = flops / ms / 1e9
                if not args.no_cudnn:
                    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                    ms = triton.testing.do_bench(lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True),
                                                 warmup=20, rep=200)
                    row["cudnn"] = flops / ms / 1e9
                records.append(row)
                if args.op:
                    print(f"  kernel rounds {row['kernel_rounds']}  op rounds {row['op_rounds']}", flush=True)
                print(f"{args.label:10s} d={d:3d} causal={int(causal)} s={s:5d}  cute {row['cute']:6.1f}"
                      + (f"  cute_regs {row['cute_regs']:6.1f}" if "cute_regs" in row else "")
                      + (f"  cudnn {row['cudnn']:6.1f}  ratio {row['cute'] / row['cudnn']:.2f}" if "cudnn" in row
                         else ""), flush=True)
                del q, k, v, dout, out, lse
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
