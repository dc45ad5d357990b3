"""The warp-specialized dK / dV kernel against the general one and cuDNN's backward (GPU, sm90): TFLOP/s of the
whole backward (bf16, non-causal MHA, batch = 16384 / seqlen, heads = 2048 / d; 2.5x the forward's FLOPs).

`ours` times `flash_bwd` (delta, dK / dV, dQ) with `flash_bwd_ws` on and off; cuDNN and SDPA-flash their SDPA
backward through autograd (retain_graph). Each gradient is compared with cuDNN's first.

    python3 scripts/time_bwd_ws.py [--dims 128 96] [--seqlens 1024 2048 4096 8192 16384] [--tile 64,128,4,2]
                                   [--json F]

--tile: the WS tile (BLOCK_M, BLOCK_N, warps, stages) for every head dim given, in WS_TILES or not (an
experiment, e.g. d=64: 64 x 128 x 4 warps x 2 stages compiles for sm90 at 168 registers, no spills, 82 KB).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(__file__))

from _records import write_records  # noqa: E402

from fa_backend.kernels.triton import flash_bwd_ws
from fa_backend.kernels.triton.flash_bwd import flash_bwd
from fa_backend.kernels.triton.flash_fwd import flash_fwd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="*", default=[128])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tile")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.tile:
        flash_bwd_ws.WS_TILES.update({d: tuple(int(x) for x in args.tile.split(",")) for d in args.dims})
    rows = []
    for d in args.dims:
        for s in args.seqlens:
            b, h = 16384 // s, 2048 // d
            q, k, v, do = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                           for _ in range(4))
            flops = 2.5 * 4 * b * h * s * s * d
            out, lse = flash_fwd(q, k, v, d ** -0.5, False, False)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref_out = F.scaled_dot_product_attention(*leaves)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                flash_out = F.scaled_dot_product_attention(*leaves)
            ref = torch.autograd.grad(ref_out, leaves, do, retain_graph=True)

            def ours(ws):
                flash_bwd_ws.ENABLED = ws
                return flash_bwd(do, q, k, v, out, lse, d ** -0.5, False, False)

            res = {}
            for name, fn in (("ws", lambda: ours(True)), ("general", lambda: ours(False)),
                             ("cudnn", lambda: torch.autograd.grad(ref_out, leaves, do, retain_graph=True)),
                             ("sdpa_flash", lambda: torch.autograd.grad(flash_out, leaves, do, retain_graph=True))):
                grads = fn()
                # (a tensor max: Python's max() drops a NaN that is not first)
                diff = torch.stack([(g.float() - r.float()).abs().max() for g, r in zip(grads, ref)]).max().item()
                ms = triton.testing.do_bench(fn, warmup=30, rep=200)
                res[name] = dict(tflops=flops / ms / 1e9, ms=ms, max_diff_vs_cudnn=diff)
            rows.append(dict(d=d, seqlen=s, batch=b, heads=h, results=res))
            cud = res["cudnn"]["tflops"]
            print(f"d={d} s={s}: " + "  ".join(f"{n} {r['tflops']:.0f} ({r['tflops'] / cud:.3f}, diff "
                                                f"{r['max_diff_vs_cudnn']:.1e})" for n, r in res.items()), flush=True)
    flash_bwd_ws.ENABLED = True
    write_records(args.json, rows)


if __name__ == "__main__":
    main()
