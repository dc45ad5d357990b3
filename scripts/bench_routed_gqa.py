"""A routed GQA training step (forward + backward through F.scaled_dot_product_attention) with fa_backend routing on
and off, on the GPU at hand: what a model that passes enable_gqa=True sees. Prints ms and the on / off ratio, and
which backend the router ran. Other shapes (MHA too: hq == hkv) with --shape; --no-grad: the forward alone, on
tensors without gradients (an inference call).

    python scripts/bench_routed_gqa.py [--json FILE] [--no-grad] [--shape b,hq,hkv,seqlen,d,causal ...]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

import fa_backend
from _records import write_records  # scripts/_records.py

SHAPES = [  # (batch, hq, hkv, seqlen, d, causal): Llama-3-8B-like and Gemma-2-9B-like heads
    (4, 32, 8, 4096, 128, True), (4, 32, 8, 4096, 128, False),
    (4, 16, 8, 4096, 256, True), (4, 16, 8, 4096, 256, False),
]


def step_ms(q, k, v, causal, dout, routed: bool, order: list[str] | None = None) -> float:
    """Median ms of one forward + backward (dout None: the forward alone); `order`: an sdpa_backends restriction
    (e.g. our kernels forced)."""
    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        if dout is not None:
            torch.autograd.grad(out, (q, k, v), dout)

    if not routed:
        return triton.testing.do_bench(step, warmup=10, rep=100)
    with fa_backend.enabled():
        if order is None:
            return triton.testing.do_bench(step, warmup=10, rep=100)
        with fa_backend.sdpa_backends(order):
            return triton.testing.do_bench(step, warmup=10, rep=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--no-grad", action="store_true", help="time the forward of calls without gradients")
    parser.add_argument("--shape", action="append", default=None,
                        help="b,hq,hkv,seqlen,d,causal (repeatable; default: the GQA shapes in SHAPES)")
    args = parser.parse_args()
    shapes = SHAPES if args.shape is None else [
        tuple(int(x) for x in spec.split(",")[:5]) + (spec.split(",")[5] in ("1", "True", "true"),)
        for spec in args.shape]
    rows = []
    for b, hq, hkv, s, d, causal in shapes:
        grad = not args.no_grad
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(2))
        dout = torch.randn_like(q) if grad else None
        fa_backend.reset_stats()
        on = step_ms(q, k, v, causal, dout, True)
        ran = dict(fa_backend.stats()["runs"])
        off = step_ms(q, k, v, causal, dout, False)
        ours = step_ms(q, k, v, causal, dout, True, ["cute", "triton"])  # what ran before the GQA rules
        row = dict(batch=b, hq=hq, hkv=hkv, seqlen=s, d=d, causal=causal, grad=grad, on_ms=on, off_ms=off,
                   ratio=off / on,
                   ours_forced_ms=ours,
                   runs=ran, explain=fa_backend.explain(q, k, v, is_causal=causal, enable_gqa=True).backend)
        rows.append(row)
        print(f"b={b} hq={hq} hkv={hkv} s={s} d={d} causal={int(causal)}: on {on:.3f} ms, off {off:.3f} ms, "
              f"off/on {off / on:.2f}, routed to {row['explain']}; our kernels forced {ours:.3f} ms", flush=True)
    write_records(args.json, rows)


if __name__ == "__main__":
    main()
