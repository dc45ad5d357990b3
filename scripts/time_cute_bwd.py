"""Times the CuTe backward kernel (flash_bwd, warp-specialised) and cuDNN's backward in one process: a quick A/B
tool for kernel changes that environment variables switch (one process per setting).

Usage: python scripts/time_cute_bwd.py [--dims D ...] [--seqlens S ...] [--label TEXT] [--regs] [--json FILE]
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 192])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--label", default="")
    parser.add_argument("--no-cudnn", action="store_true")
    parser.add_argument("--regs", action="store_true",
                        help="also the kernel with dK / dV stored from registers (tma_store=False), as "
                             "cute_regs")
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
