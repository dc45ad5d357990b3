"""Unequal head dims on the GPU (MLA: q / k at 192, v at 128): the CuTe forward (the op, and each warp-specialised
variant alone), our Triton kernels, and PyTorch's backends forced one at a time (cuDNN, efficient, flash: whichever
accepts the call), forward and optionally forward + backward, in one process.

    python3 scripts/bench_head_dim_v.py [--d 192] [--dv 128] [--heads 16] [--kv-heads N] [--seqlens 2048 8192 16384]
        [--causal no yes] [--runners ...] [--backward] [--json FILE]

bf16, batch = 16384 / seqlen; TFLOP/s: 2 b h s^2 (d + dv) forward (halved when causal), 2.5x that backward;
triton.testing.do_bench medians.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench
from _records import write_records  # scripts/_records.py

RUNNERS = ("cute", "ws_serial", "ws_overlap", "ws_pingpong", "triton", "cudnn", "efficient", "flash")
PEERS = ("cudnn", "efficient", "flash")


def _fn(name: str, causal: bool, gqa: bool = False):
    from fa_backend.ops import cute_flash_attention, triton_flash_attention

    if name == "cute":
        return lambda q, k, v: cute_flash_attention(q, k, v, None, causal, False)[0]
    if name.startswith("ws_"):  # the kernel alone (no autograd)
        from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws

        kw = dict(overlap=name == "ws_overlap", pingpong=name == "ws_pingpong")
        return lambda q, k, v: flash_fwd_ws(q, k, v, None, causal, False, **kw)[0]
    if name == "triton":
        return lambda q, k, v: triton_flash_attention(q, k, v, None, causal)[0]
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
               "flash": SDPBackend.FLASH_ATTENTION}[name]

    def sdpa(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return sdpa


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, default=192)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="K / V heads (GQA); default: --heads")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=RUNNERS)
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    d, dv, h = args.d, args.dv, args.heads
    hkv = h if args.kv_heads is None else args.kv_heads
    records = []
    for causal in (c == "yes" for c in args.causal):
        for s in args.seqlens:
            b = max(1, 16384 // s)
            flops = 2 * b * h * s * s * (d + dv) / (2 if causal else 1)
            q = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
            k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
            v = torch.randn(b, hkv, s, dv, device="cuda", dtype=torch.bfloat16, requires_grad=args.backward)
            row = {}
            for name in args.runners:
                rec = dict(runner=name, d=d, dv=dv, causal=causal, seqlen=s, batch=b, heads=h, kv_heads=hkv)
                try:
                    fn = _fn(name, causal, hkv != h)
                    with torch.no_grad():
                        ms = do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
                    rec["fwd_tflops"] = flops / ms * 1e-9
                    if args.backward and not name.startswith("ws_"):
                        out = fn(q, k, v)
                        dout = torch.randn_like(out)
                        ms_bwd = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                          warmup=25, rep=100, return_mode="median")
                        rec["bwd_tflops"] = 2.5 * flops / ms_bwd * 1e-9
                        rec["step_ms"] = ms + ms_bwd
                except Exception as e:  # a backend refusing the call is reported, not fatal
                    rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                records.append(rec)
                row[name] = rec
                torch.cuda.empty_cache()
            cells = "  ".join(f"{n} " + (f"{r['fwd_tflops']:4.0f}" if "fwd_tflops" in r else "  - ")
                              + (f"/{r['bwd_tflops']:4.0f}" if "bwd_tflops" in r else "") for n, r in row.items())
            best = max((row[n].get("fwd_tflops", 0) for n in PEERS if n in row), default=0)
            ratio = row.get("cute", {}).get("fwd_tflops", 0) / best if best else float("nan")
            print(f"d={d} dv={dv} h={h}:{hkv} causal={int(causal)} s={s:5d}: {cells}  cute/best-peer fwd {ratio:.2f}",
                  flush=True)
            for n, r in row.items():
                if "error" in r and s == args.seqlens[0]:
                    print(f"  {n}: {r['error']}", flush=True)
    write_records(args.json, records)


if __name__ == "__main__":
    main()
