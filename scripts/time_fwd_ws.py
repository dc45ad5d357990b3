"""The warp-specialized forward against the general one and PyTorch's (GPU, sm90): TFLOP/s of the forward.

For each head dim, causal mode and seqlen (bf16, batch = 16384 / seqlen, heads = 2048 / d): `flash_fwd` with
`flash_fwd_ws` in each tile of --tiles (BLOCK_M, BLOCK_N, warps, stages; causal calls on its opt-in causal variant,
`flash_fwd_ws.CAUSAL_ENABLED`), `flash_fwd` with it off (the general `_attn_fwd`), cuDNN and flash SDPA; do_bench
medians; each output checked against cuDNN's first.

    python3 scripts/time_fwd_ws.py [--dims 64 128] [--seqlens 512 1024 2048 4096 8192 16384] [--json F]
                                   [--tiles 128,128,4,2 128,128,4,3] [--causal no yes] [--persistent]

--persistent also times each tile on the persistent kernel (`flash_fwd_ws.PERSISTENT`; causal calls with
`flash_fwd_ws.CAUSAL_PERSISTENT`): `wsp_...`.
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
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", default=["no"], choices=["no", "yes"])
    parser.add_argument("--gqa", type=int, default=1, help="query heads per KV head")
    parser.add_argument("--tiles", nargs="*", default=["128,128,4,2"])
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tiles]
    switches = (flash_fwd_ws.ENABLED, flash_fwd_ws.CAUSAL_ENABLED, flash_fwd_ws.PERSISTENT,
                flash_fwd_ws.CAUSAL_PERSISTENT)
    flash_fwd_split.ENABLED = False  # (d=96's 64 + 32 split goes first: this script times the two others)
    rows = []
    for d in args.dims:
        for causal in (c == "yes" for c in args.causal):
            for s in args.seqlens:
                b, h = 16384 // s, 2048 // d
                q = torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                k, v = (torch.randn(b, s, h // args.gqa, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
                        for _ in range(2))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)

                def ours(tile=None, persistent=False):
                    flash_fwd_ws.ENABLED = flash_fwd_ws.CAUSAL_ENABLED = tile is not None
                    flash_fwd_ws.PERSISTENT = flash_fwd_ws.CAUSAL_PERSISTENT = persistent
                    if tile is not None:
                        flash_fwd_ws.WS_TILES[d] = tile
                        flash_fwd_ws.MIN_SEQ_K = {}  # timed at every length
                        flash_fwd_ws.PERSISTENT_ONLY = frozenset()  # and on both kernels
                    return flash_fwd(q, k, v, d ** -0.5, causal, False)[0]

                fns = {f"ws_{'x'.join(map(str, t))}": (lambda t=t: ours(t)) for t in tiles}
                if args.persistent:
                    fns.update({f"wsp_{'x'.join(map(str, t))}": (lambda t=t: ours(t, True)) for t in tiles})
                fns["general"] = ours
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                    def run(be=be):
                        with sdpa_kernel(be):
                            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                                  enable_gqa=args.gqa > 1)
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
                cud = res["cudnn"]["tflops"]
                print(f"d={d} causal={int(causal)} s={s}: " + "  ".join(
                    f"{n} {r['tflops']:.0f} ({r['tflops'] / cud:.3f}, diff {r['max_diff_vs_cudnn']:.1e})"
                    if "tflops" in r else f"{n} {r['error']}" for n, r in res.items()), flush=True)
                del q, k, v
    (flash_fwd_ws.ENABLED, flash_fwd_ws.CAUSAL_ENABLED, flash_fwd_ws.PERSISTENT,
     flash_fwd_ws.CAUSAL_PERSISTENT) = switches
    write_records(args.json, rows)


if __name__ == "__main__":
    main()
