"""Dropout forward (and optionally backward) on the GPU: the CuTe forward with dropout against cuDNN's, the
efficient backend's and our Triton forward's with the same dropout_p, plus the CuTe forward without dropout (what the
draws cost), all in one process.

    python3 scripts/bench_dropout.py [--dims 128 64] [--seqlens 2048 8192] [--causal no yes] [--p 0.1] [--backward]
        [--runners ...] [--keep-bits-budget X] [--json FILE]

cute: the op (its variant: flash_fwd_ws.fastest_kwargs; with --backward at d=128 its forward saves the keep bits
within kernels/keep_bits.KEEP_BITS_BUDGET and the backward reads them); cute_drawn: the op with the budget 0 (the
backward draws the mask again); cute_serial / cute_overlap / cute_pingpong: one forward variant alone (forward
only: the kernel has no autograd). With --backward, fwd_grad_tflops: the forward with gradients enabled (what a
training step's forward runs: ours then saves the bits). --keep-bits-budget: kernels/keep_bits.KEEP_BITS_BUDGET for
the run (2.0 saves the bits at 16k tokens too).

bf16, batch = 16384 / seqlen, heads = 2048 / d; TFLOP/s: 4 b h s^2 d forward (halved when causal), 2.5x that
backward; triton.testing.do_bench medians. Each call draws a fresh RNG state, as SDPA calls do.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
from _records import write_records  # scripts/_records.py

RUNNERS = ("cute", "cute_drawn", "cute_no_dropout", "cute_serial", "cute_overlap", "cute_pingpong", "cudnn", "efficient", "triton")


def _fn(name: str, p: float, causal: bool):
    import fa_backend
    from fa_backend.ops import cute_flash_attention

    if name == "cute":
        return lambda q, k, v: cute_flash_attention(q, k, v, None, causal, False, dropout_p=p)[0]
    if name == "cute_drawn":
        from fa_backend.kernels import keep_bits

        def drawn(q, k, v):
            budget, keep_bits.KEEP_BITS_BUDGET = keep_bits.KEEP_BITS_BUDGET, 0.0
            try:
                return cute_flash_attention(q, k, v, None, causal, False, dropout_p=p)[0]
            finally:
                keep_bits.KEEP_BITS_BUDGET = budget
        return drawn
    if name == "cute_no_dropout":
        return lambda q, k, v: cute_flash_attention(q, k, v, None, causal, False)[0]
    if name in ("cute_serial", "cute_overlap", "cute_pingpong"):  # one forward variant alone, a fresh RNG state a call
        from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws
        from fa_backend.ops import new_rng_state
        from fa_backend.ops.cute_flash import _dropout_args

        kw = dict(overlap=name == "cute_overlap", pingpong=name == "cute_pingpong")
        return lambda q, k, v: flash_fwd_ws(q, k, v, None, causal, dropout=_dropout_args(q, p, new_rng_state()),
                                            **kw)[0]
    if name == "triton":
        return lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal, dropout_p=p)
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p)
    return sdpa


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--keep-bits-budget", type=float)
    parser.add_argument("--json")
    args = parser.parse_args()
    from fa_backend.kernels import keep_bits

    if args.keep_bits_budget is not None:
        keep_bits.KEEP_BITS_BUDGET = args.keep_bits_budget
    records = []
    for d in args.dims:
        for causal in (c == "yes" for c in args.causal):
            for s in args.seqlens:
                b, h = max(1, 16384 // s), max(1, 2048 // d)
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
                           for _ in range(3))
                row = {}
                for name in args.runners:
                    rec = dict(runner=name, d=d, causal=causal, seqlen=s, batch=b, heads=h, p=args.p,
                               keep_bits_budget=keep_bits.KEEP_BITS_BUDGET,
                               # where cute saves bits (a causal call's in the causal layout)
                               keep_period=keep_bits.keep_period(b, h, h, s, s, d, d, 2, 0 if causal else None))
                    try:
                        fn = _fn(name, args.p, causal)
                        with torch.no_grad():
                            ms = do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
                        rec["fwd_tflops"] = flops / ms * 1e-9
                        if args.backward:
                            ms = do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
                            rec["fwd_grad_tflops"] = flops / ms * 1e-9
                            out = fn(q, k, v)
                            dout = torch.randn_like(out)
                            ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                          warmup=25, rep=100, return_mode="median")
                            rec["bwd_tflops"] = 2.5 * flops / ms * 1e-9
                    except Exception as e:  # a backend refusing the call is reported, not fatal
                        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                    records.append(rec)
                    row[name] = rec
                    torch.cuda.empty_cache()
                cells = "  ".join(f"{n} {r.get('fwd_tflops', float('nan')):5.0f}"
                                  + (f"/{r['fwd_grad_tflops']:4.0f}/{r['bwd_tflops']:4.0f}" if "bwd_tflops" in r
                                     else "") for n, r in row.items())
                best = max((row[n].get("fwd_tflops", 0) for n in ("cudnn", "efficient") if n in row), default=0)
                ratio = row.get("cute", {}).get("fwd_tflops", 0) / best if best else float("nan")
                print(f"d={d} causal={int(causal)} s={s:5d}: {cells}  cute/best-peer fwd {ratio:.2f}", flush=True)
    write_records(args.json, records)


if __name__ == "__main__":
    main()
