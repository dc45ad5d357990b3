"""Times the causal CuTe backward kernel (the op's warp-specialized variant) under another CTA order than
kernels/cute/_schedule.py's default: other L2 section bytes (`--l2-mb`), or block order (`--block-order`: key blocks
of each head in turn, no longest-first). One setting per process, in its own DSL cache (`CUTE_DSL_CACHE_DIR`): the
order is traced into the kernel, and the compile cache's key does not hold it. Also checks that dK / dV are the same
bits on a second launch (they are deterministic in any order; dQ's adds are not).

Forty-fourth session's question: on an H100 the op's d=128 causal backward ran 497-505 TFLOP/s at 16k against
544-546 at 8k, where cuDNN and FlashAttention-4 gain from 8k to 16k (docs/benchmarks.md). A greedy list-scheduling
model of the grid puts either order within 1 % of the ideal makespan at 16k, so the question is L2 reuse:

    bash scripts/gpu_check.sh cute_order      (the DSL installed: cutedsl-prepare.sh part 1 and 2)
    python3 scripts/time_cute_bwd_order.py --l2-mb 160 --dims 128 --seqlens 8192 16384 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))


def _block_order(linear, m_tiles, pairs, section, minimum):
    """_schedule.longest_first's signature, in launch order: every key block of a (batch, head) pair in turn."""
    return m_tiles - 1 - linear % m_tiles, linear // m_tiles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--l2-mb", type=int, help="_schedule.L2_SECTION_BYTES in MiB (default: the module's)")
    parser.add_argument("--block-order", action="store_true", help="no longest-first order")
    parser.add_argument("--dims", type=int, nargs="+", default=[128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch
    import triton

    from fa_backend.kernels.cute import _schedule, flash_bwd_ws
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws
    from time_cute_bwd import VARIANTS  # the op's backward variants (flash_bwd's keywords)

    if args.l2_mb:
        _schedule.L2_SECTION_BYTES = args.l2_mb * 1024 * 1024
    if args.block_order:
        flash_bwd_ws.longest_first = _block_order
    label = "block" if args.block_order else f"{_schedule.L2_SECTION_BYTES >> 20} MiB"
    rows = []
    for d in args.dims:
        for s in args.seqlens:
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            dout = torch.randn_like(q)
            out, lse = flash_fwd_ws(q, k, v, causal=True)

            def run():
                return flash_bwd(dout, q, k, v, out, lse, causal=True, **VARIANTS[d])

            first = run()
            ms = triton.testing.do_bench(run, warmup=20, rep=300)
            again = run()
            same = all(torch.equal(x, y) for x, y in zip(first[1:], again[1:]))
            tflops = 2.5 * 4 * b * h * s * s * d / 2 / ms / 1e9
            rows.append(dict(order=label, d=d, seqlen=s, batch=b, heads=h, tflops=tflops, dkdv_repeat_equal=same))
            print(f"{label:>8} d={d} s={s}: {tflops:6.1f} TFLOP/s (dK / dV the same bits again: {same})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), records=rows), f, indent=1)


if __name__ == "__main__":
    main()
