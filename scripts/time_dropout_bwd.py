"""Timing experiment for the CuTe dropout backward (d=128) against the same kernel without dropout, in one process;
with --rounds, the drawing warps' Philox cut to that many rounds (wrong masks: for timing only, to see whether the
draws bound the kernel).

    FA_BACKEND_CUTE_CACHE_DIR=$(mktemp -d) python3 scripts/time_dropout_bwd.py [--rounds 1] [--seqlens 2048 8192]

(with --rounds, a fresh DSL disk cache: the reduced-round build must not be served from, or left in, the real one). bf16, batch =
16384 / seqlen, 16 heads, p = 0.1; backward TFLOP/s = 2.5 x 4 b h s^2 d / time (do_bench medians).
"""

from __future__ import annotations

import argparse

import torch
from triton.testing import do_bench


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=None, help="Philox rounds of the reduced variant (timing only)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    from fa_backend.kernels.cute import _dropout
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest
    from fa_backend.ops import new_rng_state
    from fa_backend.ops.cute_flash import _dropout_args

    if args.rounds is not None:
        _dropout.ROUNDS = args.rounds  # before any compile: philox4x32 reads it while tracing
    for s in args.seqlens:
        b, h, d = 16384 // s, 16, 128
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        drop = _dropout_args(q, 0.1, new_rng_state())
        out, lse = flash_fwd_fastest(q, k, v, None, args.causal, dropout=drop)
        dout = torch.randn_like(out)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if args.causal else 1)
        kw = dict(causal=args.causal, wgs=2, warp_specialized=True)
        label = "dropout" + ("" if args.rounds is None else f", {args.rounds} Philox rounds")
        cells = {"no dropout": lambda: flash_bwd(dout, q, k, v, out, lse, **kw),
                 label: lambda: flash_bwd(dout, q, k, v, out, lse, dropout=drop, **kw)}
        row = {}
        for name, fn in cells.items():
            row[name] = flops / do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e-9
        print(f"s={s} causal={int(args.causal)}: " + "  ".join(f"{n} {t:.0f}" for n, t in row.items()), flush=True)


if __name__ == "__main__":
    main()
