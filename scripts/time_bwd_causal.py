"""The general backward's causal dK / dV in one masked loop against a masked and an unmasked loop, with cuDNN's and
SDPA-flash's backward (GPU): TFLOP/s of the whole causal backward (bf16, batch = 16384 / seqlen, heads = 2048 / d,
2.5x the causal forward's FLOPs; --group G: G query heads per KV head).

`two_loops` / `one_loop` time `flash_bwd` (delta, dK / dV, dQ) with `flash_bwd.CAUSAL_ONE_LOOP` empty / holding the
head dim's tile; cuDNN and SDPA-flash their SDPA backward through autograd (retain_graph). Each gradient is compared
with cuDNN's first (SDPA-flash's where cuDNN refuses the call), and ratios are to that reference's TFLOP/s.

    python3 scripts/time_bwd_causal.py [--dims 64 128] [--seqlens 1024 2048 4096 8192 16384] [--group 1] [--json F]
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

from fa_backend.kernels.triton._launch import tile_dims
from fa_backend.kernels.triton.flash_fwd import flash_fwd

_FLASH_BWD = sys.modules["fa_backend.kernels.triton.flash_bwd"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--group", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args()
    before = _FLASH_BWD.CAUSAL_ONE_LOOP
    rows = []
    for d in args.dims:
        for s in args.seqlens:
            b, h = 16384 // s, 2048 // d
            hkv = h // args.group
            q, do = (torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2) for _ in range(2))
            k, v = (torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2) for _ in range(2))
            flops = 2.5 * 4 * b * h * s * s * d / 2
            out, lse = flash_fwd(q, k, v, d ** -0.5, True, False)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            gqa = {"enable_gqa": True} if args.group > 1 else {}
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                flash_out = F.scaled_dot_product_attention(*leaves, is_causal=True, **gqa)
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ref_out = F.scaled_dot_product_attention(*leaves, is_causal=True, **gqa)
            except RuntimeError:  # (a cuDNN without this call: SDPA-flash is the reference and the ratios' base)
                ref_out = None
            ref = torch.autograd.grad(flash_out if ref_out is None else ref_out, leaves, do, retain_graph=True)

            def ours(one_loop):
                _FLASH_BWD.CAUSAL_ONE_LOOP = frozenset({tile_dims(d, d)[0]} if one_loop else ())
                return _FLASH_BWD.flash_bwd(do, q, k, v, out, lse, d ** -0.5, True, False)

            fns = {"two_loops": lambda: ours(False), "one_loop": lambda: ours(True),
                   "sdpa_flash": lambda: torch.autograd.grad(flash_out, leaves, do, retain_graph=True)}
            if ref_out is not None:
                fns["cudnn"] = lambda: torch.autograd.grad(ref_out, leaves, do, retain_graph=True)
            base = "sdpa_flash" if ref_out is None else "cudnn"
            res = {}
            for name, fn in fns.items():
                try:
                    grads = fn()
                    # (a tensor max: Python's max() drops a NaN that is not first)
                    diff = torch.stack([(g.float() - r.float()).abs().max() for g, r in zip(grads, ref)]).max().item()
                    ms = triton.testing.do_bench(fn, warmup=30, rep=200)
                    res[name] = dict(tflops=flops / ms / 1e9, ms=ms, max_diff_vs_ref=diff)
                except Exception as e:  # noqa: BLE001 - e.g. a peer without GQA on this torch: reported
                    res[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            rows.append(dict(d=d, causal=True, seqlen=s, batch=b, heads=h, kv_heads=hkv, results=res))
            cud = res[base].get("tflops", float("nan"))
            print(f"d={d} group={args.group} s={s} (x {base}): " + "  ".join(
                f"{n} {r['tflops']:.0f} ({r['tflops'] / cud:.3f}, diff {r['max_diff_vs_ref']:.1e})"
                if "tflops" in r else f"{n} {r['error']}" for n, r in res.items()), flush=True)
            del q, k, v, do, out, lse, leaves, ref_out, flash_out
    _FLASH_BWD.CAUSAL_ONE_LOOP = before
    write_records(args.json, rows)


if __name__ == "__main__":
    main()
