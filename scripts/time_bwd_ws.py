"""The warp-specialized dK / dV kernel against the general one and cuDNN's backward (GPU, sm90): TFLOP/s of the
whole backward (bf16, MHA, batch = 16384 / seqlen, heads = 2048 / d; 2.5x the forward's FLOPs, halved when causal;
--causal yes: its opt-in causal form, `flash_bwd_ws.CAUSAL_ENABLED`; --gqa N: N query heads per key / value head,
its opt-in GQA form, `flash_bwd_ws.GQA_ENABLED`).

`ours` times `flash_bwd` (delta, dK / dV, dQ) with `flash_bwd_ws` on and off; cuDNN and SDPA-flash their SDPA
backward through autograd (retain_graph). Each gradient is compared with cuDNN's first.

    python3 scripts/time_bwd_ws.py [--dims 128 96] [--seqlens 1024 2048 4096 8192 16384] [--tile 64,128,4,2]
                                   [--causal no yes] [--gqa 4] [--json F]

--tile: the WS tile (BLOCK_M, BLOCK_N, warps, stages) for every head dim given, in WS_TILES or not (an
experiment, e.g. d=64: 64 x 128 x 4 warps x 2 stages compiles for sm90 at 168 registers, no spills, 82 KB).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))

from _bwd_case import backward_case  # noqa: E402
from _records import write_records  # noqa: E402

from fa_backend.kernels.triton import flash_bwd_ws
from fa_backend.kernels.triton.flash_bwd import flash_bwd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="*", default=[128])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tile")
    parser.add_argument("--causal", nargs="+", default=["no"], choices=["no", "yes"])
    parser.add_argument("--gqa", type=int, default=1, help="query heads per key / value head")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.tile:
        flash_bwd_ws.WS_TILES.update({d: tuple(int(x) for x in args.tile.split(",")) for d in args.dims})
    rows = []
    for d, causal, s in ((d, c == "yes", s) for d in args.dims for c in args.causal for s in args.seqlens):
        case = backward_case(d, s, causal, args.gqa)
        q, k, v, do, out, lse, flops, ref = case.q, case.k, case.v, case.do, case.out, case.lse, case.flops, case.ref
        b, h = q.shape[:2]

        def ours(ws):
            flash_bwd_ws.ENABLED = flash_bwd_ws.CAUSAL_ENABLED = flash_bwd_ws.GQA_ENABLED = ws
            return flash_bwd(do, q, k, v, out, lse, d ** -0.5, causal, False)

        res = {}
        for name, fn in (("ws", lambda: ours(True)), ("general", lambda: ours(False)), *case.peers.items()):
            grads = fn()
            # (a tensor max: Python's max() drops a NaN that is not first)
            diff = torch.stack([(g.float() - r.float()).abs().max() for g, r in zip(grads, ref)]).max().item()
            ms = triton.testing.do_bench(fn, warmup=30, rep=200)
            res[name] = dict(tflops=flops / ms / 1e9, ms=ms, max_diff_vs_cudnn=diff)
        rows.append(dict(d=d, causal=causal, seqlen=s, batch=b, heads=h, kv_heads=k.shape[1], results=res))
        cud = res["cudnn"]["tflops"]
        print(f"d={d} causal={int(causal)} s={s}: " + "  ".join(
            f"{n} {r['tflops']:.0f} ({r['tflops'] / cud:.3f}, diff {r['max_diff_vs_cudnn']:.1e})"
            for n, r in res.items()), flush=True)
    flash_bwd_ws.ENABLED, flash_bwd_ws.CAUSAL_ENABLED, flash_bwd_ws.GQA_ENABLED = True, False, False
    write_records(args.json, rows)


if __name__ == "__main__":
    main()
