"""Run one attention forward+backward on the GPU and compare with fp32 math (debugging aid).

    python scripts/debug_case.py --d 40 --dv 24 --causal [--tile 128 64 8 3]
    python scripts/debug_case.py --matrix      # a batch of cases, each in its own process
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def run_case(args) -> None:
    import torch

    import fa_backend
    from fa_backend.kernels.triton import _configs
    from tests.reference import attention_math

    torch.manual_seed(0)
    q = torch.randn(1, 2, args.sq, args.d, device="cuda", dtype=torch.float16)
    k = torch.randn(1, 1, args.sk, args.d, device="cuda", dtype=torch.float16)
    v = torch.randn(1, 1, args.sk, args.dv, device="cuda", dtype=torch.float16)
    fwd = _configs.TileConfig(*args.tile) if args.tile else None
    with _configs.override(fwd=fwd):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fa_backend.attention(*leaves, is_causal=args.causal, causal_alignment="bottom_right")
        torch.cuda.synchronize()
        ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
        ref = attention_math(*ref_leaves, is_causal=args.causal, bottom_right=True)
        err = (out.float() - ref).abs().max().item()
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dout)
        torch.cuda.synchronize()
        ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
        gerr = [(g.float() - r).abs().max().item() for g, r in zip(grads, ref_grads)]
    print(f"d={args.d} dv={args.dv} causal={args.causal} tile={args.tile}: out err {err:.2e} "
          f"grad errs {' '.join(f'{e:.2e}' for e in gerr)}")


def matrix() -> None:
    cases = []
    for d, dv in [(40, 24), (40, 40), (24, 24), (64, 24), (40, 32), (32, 24), (16, 24), (8, 8), (40, 16), (64, 48)]:
        for causal in (False, True):
            cases.append(["--d", str(d), "--dv", str(dv)] + (["--causal"] if causal else []))
    for tile in (["128", "64", "4", "3"], ["128", "64", "4", "1"], ["64", "64", "4", "3"], ["64", "32", "4", "1"],
                 ["128", "64", "8", "3"]):
        cases.append(["--d", "40", "--dv", "24", "--tile"] + tile)
    procs = [(c, subprocess.Popen([sys.executable, __file__] + c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))) for c in cases]
    for c, p in procs:
        out = p.communicate()[0].strip().splitlines()
        last = [line for line in out if line.startswith("d=") or "Error" in line or "error" in line]
        print(" ".join(c), "->", (last[-1] if last else out[-1] if out else "no output")[:300])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, default=40)
    parser.add_argument("--dv", type=int, default=24)
    parser.add_argument("--sq", type=int, default=29)
    parser.add_argument("--sk", type=int, default=35)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--tile", type=int, nargs=4)
    parser.add_argument("--matrix", action="store_true")
    a = parser.parse_args()
    matrix() if a.matrix else run_case(a)
