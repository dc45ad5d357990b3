"""Three launches of the warp-specialised CuTe forward for Nsight Compute to profile the last (GPU):
`PROFILE_SCRIPT=scripts/profile_cute_fwd.py PROFILE_ARGS="--persistent" bash scripts/gpu_check.sh cute_profile`.
bf16, batch = 16384 / seqlen, heads = 2048 / d, seqlen 2048 (the cells where a tile's fixed cost shows); the
overlap variant unless --pingpong."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--pingpong", action="store_true")
    parser.add_argument("--persistent", action="store_true")
    args = parser.parse_args()
    b, h, s, d = 16384 // args.seqlen, 2048 // args.d, args.seqlen, args.d
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):  # compile, then warm launches; ncu --launch-skip picks the last
        flash_fwd_ws(q, k, v, causal=args.causal, overlap=not args.pingpong, pingpong=args.pingpong,
                     persistent=args.persistent)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
