"""The split-column forward (head dims 129-192 on 128 + 64 columns, 65-96 on 64 + 32) against the general kernel's
256- / 128-wide tiles and PyTorch's (GPU, sm90): TFLOP/s of the forward.

For each head dim, causal mode and seqlen (bf16, batch = 16384 / seqlen, heads = 2048 // d): `flash_fwd` with
`flash_fwd_split` in each tile of --tiles (BLOCK_M, BLOCK_N, warps, stages), `flash_fwd` with it off (the general
`_attn_fwd`), the warp-specialized kernel where it runs (d=96 non-causal), cuDNN and flash SDPA; do_bench medians;
each output checked against cuDNN's first. The split rows run at every length (MIN_SEQ_K off).

    python3 scripts/time_fwd_split.py [--dims 192] [--causal no yes] [--seqlens 2048 4096 8192 16384] [--json F]
                                      [--tiles 128,64,8,2 128,64,8,3]  [--dims 96 192]
                                      [--dims 128 --extra-class 128:64,64]
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

from fa_backend.kernels.triton import flash_fwd_split, flash_fwd_ws
from fa_backend.kernels.triton.flash_fwd import flash_fwd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="*", default=[192])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--tiles", nargs="*", default=[], help="default: the table's tile (TILES)")
    parser.add_argument("--block-major", action="store_true",
                        help="causal rows: also each tile with its launch in head-major (`_hm`) and block-major "
                             "(`_bm`) order; unsuffixed rows run the module's default (CAUSAL_BLOCK_MAJOR)")
    parser.add_argument("--extra-class", metavar="D:A,B",
                        help="time a class SPLITS does not hold, e.g. 128:64,64 (d=128 on two 64-column tiles; "
                             "its tile: the first of --tiles, else 128 x 64 x 8 x 3)")
    parser.add_argument("--json")
    args = parser.parse_args()
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    splits_before, tiles_orig = dict(flash_fwd_split.SPLITS), dict(flash_fwd_split.TILES)
    if args.extra_class:
        top, widths = args.extra_class.split(":")
        flash_fwd_split.SPLITS[int(top)] = tuple(int(x) for x in widths.split(","))
        flash_fwd_split.TILES.setdefault(int(top), tiles[0] if tiles else (128, 64, 8, 3))
    min_seq_k = flash_fwd_split.MIN_SEQ_K
    flash_fwd_split.MIN_SEQ_K = {}
    tiles_before = dict(flash_fwd_split.TILES)
    block_major_before = flash_fwd_split.CAUSAL_BLOCK_MAJOR
    rows = []
    for d in args.dims:
        top = flash_fwd_split.split_widths(d, d, flash_fwd_split.SPLITS)[0]
        for causal in (c == "yes" for c in args.causal):
            for s in args.seqlens:
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                           for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)

                def ours(tile=None, ws=False, block_major=None):
                    flash_fwd_split.ENABLED = tile is not None
                    flash_fwd_split.TILES[top] = tile or tiles_before[top]
                    flash_fwd_split.CAUSAL_BLOCK_MAJOR = (  # None: the module's default order
                        block_major_before if block_major is None
                        else frozenset(flash_fwd_split.SPLITS) if block_major else frozenset())
                    flash_fwd_ws.ENABLED = ws
                    return flash_fwd(q, k, v, d ** -0.5, causal, False)[0]

                fns = {f"split_{'x'.join(map(str, t))}": (lambda t=t: ours(t))
                       for t in tiles or [tiles_before[top]]}
                if args.block_major and causal:
                    for order, on in (("hm", False), ("bm", True)):
                        for t in tiles or [tiles_before[top]]:
                            fns[f"split_{'x'.join(map(str, t))}_{order}"] = lambda t=t, on=on: ours(t, block_major=on)
                fns["general"] = ours
                if d in flash_fwd_ws.WS_TILES and not causal:
                    fns["ws"] = lambda: ours(ws=True)
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                    def run(be=be):
                        with sdpa_kernel(be):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    fns[name] = run
                ref = fns["cudnn"]().float()
                res = {}
                for name, fn in fns.items():
                    try:
                        err = (fn().float() - ref).abs().max().item()
                        ms = triton.testing.do_bench(fn, warmup=50, rep=300)
                        res[name] = dict(tflops=flops / ms / 1e9, ms=ms, max_diff_vs_cudnn=err)
                    except Exception as e:  # noqa: BLE001 - a tile that does not build: reported
                        res[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
                rows.append(dict(d=d, causal=causal, seqlen=s, batch=b, heads=h, results=res))
                fl = res["sdpa_flash"]["tflops"]
                print(f"d={d} causal={int(causal)} s={s}: " + "  ".join(
                    f"{n} {r['tflops']:.0f} ({r['tflops'] / fl:.3f}x flash, diff {r['max_diff_vs_cudnn']:.1e})"
                    if "tflops" in r else f"{n} {r['error']}" for n, r in res.items()), flush=True)
                del q, k, v
    flash_fwd_split.ENABLED = flash_fwd_ws.ENABLED = True
    flash_fwd_split.CAUSAL_BLOCK_MAJOR = block_major_before
    flash_fwd_split.TILES.clear()
    flash_fwd_split.TILES.update(tiles_orig)
    flash_fwd_split.SPLITS.clear()
    flash_fwd_split.SPLITS.update(splits_before)
    flash_fwd_split.MIN_SEQ_K = min_seq_k
    write_records(args.json, rows)


if __name__ == "__main__":
    main()
