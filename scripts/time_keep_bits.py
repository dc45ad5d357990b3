"""What saving the dropout keep bits costs the CuTe forward and gives the CuTe backward (d=128), kernels called
directly, in one process:

    python3 scripts/time_keep_bits.py [--seqlens 2048 8192] [--causal no yes] [--directions fwd bwd]
        [--periods 1 2] [--json FILE]

forward: without dropout / with dropout / with dropout saving the bits (kernels/keep_bits.py) of every period-th
row of tiles (--periods, 1: all); backward: without dropout / drawing the mask / reading the saved bits (and
drawing the rest, at a period > 1). bf16, batch = 16384 / seqlen, 16 heads, p = 0.1;
TFLOP/s = 4 b h s^2 d (halved when causal), 2.5x for the backward; triton.testing.do_bench medians.
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench
from _records import write_records  # scripts/_records.py


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--directions", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--periods", type=int, nargs="+", default=[1])
    parser.add_argument("--json")
    args = parser.parse_args()
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.kernels.keep_bits import keep_bits_bytes
    from fa_backend.ops import new_rng_state
    from fa_backend.ops.cute_flash import _dropout_args

    records = []
    for causal in (c == "yes" for c in args.causal):
        for s in args.seqlens:
            b, h, d = 16384 // s, 16, 128
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            drop = _dropout_args(q, 0.1, new_rng_state())
            # a causal call's bits in the causal layout (its rows' visible tiles: kernels/keep_bits.py)
            bits = {n: torch.empty(keep_bits_bytes(b, h, s, s, n, 0 if causal else None), dtype=torch.uint8,
                                   device="cuda")
                    for n in args.periods}
            for n in args.periods:
                out, lse = flash_fwd_fastest(q, k, v, None, causal, dropout=(*drop, bits[n]))
            plain_out, plain_lse = flash_fwd_fastest(q, k, v, None, causal)
            dout = torch.randn_like(out)
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            kw = dict(causal=causal, wgs=2, warp_specialized=True)
            cells = {
                ("fwd", "no dropout"): lambda: flash_fwd_fastest(q, k, v, None, causal),
                ("fwd", "dropout"): lambda: flash_fwd_fastest(q, k, v, None, causal, dropout=drop),
                ("bwd", "no dropout"): lambda: flash_bwd(dout, q, k, v, plain_out, plain_lse, **kw),
                ("bwd", "dropout, drawn"): lambda: flash_bwd(dout, q, k, v, out, lse, dropout=drop, **kw),
            }
            for n in args.periods:
                suffix = "" if n == 1 else f" (period {n})"
                cells[("fwd", "dropout, saving bits" + suffix)] = (
                    lambda n=n: flash_fwd_fastest(q, k, v, None, causal, dropout=(*drop, bits[n])))
                cells[("bwd", "dropout, saved bits" + suffix)] = (
                    lambda n=n: flash_bwd(dout, q, k, v, out, lse, dropout=(*drop, bits[n]), **kw))
            row = []
            for (direction, name), fn in cells.items():
                if direction not in args.directions:
                    continue
                ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                tflops = (2.5 if direction == "bwd" else 1) * flops / ms * 1e-9
                records.append(dict(direction=direction, case=name, causal=causal, seqlen=s, batch=b, heads=h, d=d,
                                    tflops=tflops, ms=ms))
                row.append(f"{direction} {name} {tflops:.0f}")
            print(f"s={s} causal={int(causal)}: " + "  ".join(row), flush=True)
    write_records(args.json, records)


if __name__ == "__main__":
    main()
