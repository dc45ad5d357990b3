"""What a bool key mask costs the CuTe kernels (H200): the op's forward and backward kernels called directly, with
no mask, a key-padding mask and a random 10 % key mask, on (b, h, s, d)-contiguous and on (b, s, h, d)-memory
inputs (bench --features' layout). bf16, batch 16384 / s, heads 2048 / d; TFLOP/s count the full matrix.

    python3 scripts/bench_key_mask.py [--dims 128 64] [--seqlens 2048 8192] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from triton.testing import do_bench

from fa_backend.kernels.cute.flash_bwd import flash_bwd
from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
from fa_backend.ops.cute_flash import BACKWARD_VARIANTS, key_words


def masks(b: int, s: int) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    lengths = torch.randint(s // 2, s + 1, (b, 1, 1, 1), generator=gen)
    return {"none": None, "key_padding": (torch.arange(s) < lengths).cuda(),
            "random_keys": (torch.rand(b, 1, 1, s, generator=gen) >= 0.1).cuda()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--json")
    args = parser.parse_args()
    records = []
    for d in args.dims:
        for s in args.seqlens:
            b, h = 16384 // s, 2048 // d
            flops = 4 * b * h * s * s * d
            for layout in ("bhsd", "bshd"):
                if layout == "bhsd":
                    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                else:
                    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                               for _ in range(3))
                for name, mask in masks(b, s).items():
                    words = None if mask is None else key_words(mask, b, h, s)
                    out, lse = flash_fwd_fastest(q, k, v, key_words=words)
                    dout = torch.randn_like(out)
                    fwd = do_bench(lambda: flash_fwd_fastest(q, k, v, key_words=words), warmup=25, rep=100,
                                   return_mode="median")
                    bwd = do_bench(lambda: flash_bwd(dout, q, k, v, out, lse, key_words=words,
                                                     **BACKWARD_VARIANTS[d]), warmup=25, rep=100, return_mode="median")
                    rec = dict(d=d, seqlen=s, layout=layout, mask=name, fwd_tflops=flops / fwd * 1e-9,
                               bwd_tflops=2.5 * flops / bwd * 1e-9)
                    records.append(rec)
                    print(f"d={d:3d} s={s:5d} {layout} {name:>11}: fwd {rec['fwd_tflops']:5.0f} bwd "
                          f"{rec['bwd_tflops']:5.0f} TFLOP/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
