"""Time the tile candidates of each Triton kernel on the GPU and print the best per head dim.

Kernels are compiled in parallel worker processes first (they share Triton's disk cache), then
timed one by one in this process. dK/dV candidates are timed with the table's dQ tile and vice
versa: the two backward kernels are separate launches, so their times add.

    python scripts/tune_triton.py --dims 64 128 256 --seqlens 4096 --json tune.json
    python scripts/tune_triton.py --dims 96 --kernels dkdv dq --causal yes --seqlens 2048 8192

A head dim between the tables' widths (96) is timed at its own size on its padded width's tiles. The forward is
also timed as routed (no tile pinned: the warp-specialized kernel where it applies), in the same process.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _jobs(dims: list[int], kernels: list[str], match: list[str] | None = None,
          causal_modes: tuple[bool, ...] = (False, True)):
    """(kernel, d, causal, tile) to time: the table's tile first, then the candidates (those whose repr holds
    every string of `match`, when given). A head dim between the tables' widths (96) takes its padded width's
    table and candidates, as the kernels do."""
    from fa_backend.kernels.triton import _configs as C

    jobs = []
    for d in dims:
        width = C._width(d, d)
        for causal in causal_modes:
            base = C.bwd_table(causal)[width]
            plan = {"fwd": (C.fwd_table(causal)[width], C.fwd_candidates(width)),
                    "dkdv": (base.dkdv, C.dkdv_candidates(width)),
                    "dq": (base.dq, C.dq_candidates(width))}
            for kind in kernels:
                table, candidates = plan[kind]
                chosen = [c for c in candidates if not match or all(m in repr(c) for m in match)]
                if kind == "fwd":  # the forward as routed (the warp-specialized kernel where it applies)
                    jobs.append((kind, d, causal, None))
                jobs.extend((kind, d, causal, cfg) for cfg in dict.fromkeys([table] + chosen))
    return jobs


def _override(kind, d, causal, cfg):
    """The tables overridden with this candidate; cfg None: nothing pinned (the call as routed)."""
    import contextlib

    from fa_backend.kernels.triton import _configs as C

    if cfg is None:
        return contextlib.nullcontext()
    base = C.bwd_table(causal)[C._width(d, d)]
    if kind == "fwd":
        return C.override(fwd=cfg)
    if kind == "dkdv":
        return C.override(bwd=C.BwdConfig(cfg, base.dq))
    return C.override(bwd=C.BwdConfig(base.dkdv, cfg))


def _inputs(d, seqlen, tokens=16384, width=2048, group=1):
    """q, k, v of the standard shape (batch = tokens / seqlen, heads = width / d); `group` query heads per K/V
    head (GQA)."""
    import torch

    b, h = max(1, tokens // seqlen), max(1, width // d)
    return [torch.randn(b, seqlen, heads, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            for heads in (h, max(1, h // group), max(1, h // group))]


def _run(kind, d, causal, cfg, q, k, v):
    import torch

    import fa_backend

    with _override(kind, d, causal, cfg):
        out = fa_backend.attention(q, k, v, is_causal=causal)
        if kind != "fwd":
            torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def _compile_worker(jobs):
    """Compile (run once on a small input of the same specialisation) and report failures."""
    import torch

    failed = []
    for kind, d, causal, cfg in jobs:
        try:
            q, k, v = _inputs(d, 256, tokens=256)
            _run(kind, d, causal, cfg, q, k, v)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a failing candidate is reported, not fatal
            failed.append(((kind, d, causal, cfg), f"{type(e).__name__}: {str(e)[:160]}"))
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[4096])
    parser.add_argument("--kernels", nargs="+", default=["fwd", "dkdv", "dq"])
    parser.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--match", nargs="+", help="only candidates whose repr holds these strings, e.g. tma=True")
    parser.add_argument("--group", type=int, default=1, help="GQA: query heads per key/value head (timed shapes)")
    parser.add_argument("--causal", choices=("both", "no", "yes"), default="both")
    parser.add_argument("--json")
    args = parser.parse_args()

    import torch
    from triton.testing import do_bench

    from fa_backend.bench import attention_flops, calls_per_sample

    causal_modes = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    jobs = _jobs(args.dims, args.kernels, args.match, causal_modes)
    t0 = time.time()
    chunks = [jobs[i::args.workers] for i in range(args.workers)]
    with mp.get_context("spawn").Pool(args.workers) as pool:
        failures = [f for part in pool.map(_compile_worker, chunks) for f in part]
    print(f"compiled {len(jobs)} variants in {time.time() - t0:.0f} s; {len(failures)} failed", flush=True)
    bad = {job for job, _ in failures}
    for job, err in failures:
        print(f"  FAILED {job}: {err}")

    results = []
    for seqlen, (kind, d, causal, cfg) in ((s, job) for s in args.seqlens for job in jobs):
        if (kind, d, causal, cfg) in bad:
            continue
        q, k, v = _inputs(d, seqlen, group=args.group)
        flops = attention_flops(q.shape[0], q.shape[1], seqlen, seqlen, d, causal)
        if kind == "fwd":
            def fn():
                _run(kind, d, causal, cfg, q, k, v)
        else:
            with _override(kind, d, causal, cfg):
                out = __import__("fa_backend").attention(q, k, v, is_causal=causal)
            dout = torch.randn_like(out)

            def fn():
                with _override(kind, d, causal, cfg):
                    torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        # several calls per sample, as `bench` times them: short calls' host time then overlaps GPU work instead of
        # sitting in every sample (forty-ninth session, one call per sample at 512 keys: one configuration read
        # 128.7 and 168.2 TFLOP/s in two groups of the same run)
        repeat = calls_per_sample(seqlen)
        ms = do_bench(lambda: [fn() for _ in range(repeat)], warmup=20, rep=60, return_mode="median") / repeat
        tflops = (flops if kind == "fwd" else 2.5 * flops) / ms * 1e-9
        results.append({"kernel": kind, "d": d, "causal": causal, "seqlen": seqlen,
                        "config": "routed" if cfg is None else list(cfg.__dict__.values()), "ms": ms,
                        "tflops": tflops})
        label = cfg or "as routed"
        print(f"{kind:4} d={d:3} causal={causal:d} s={seqlen:5d} {label}: {ms:7.3f} ms {tflops:6.1f} TFLOP/s"
              f"{'  (fwd+bwd kernels)' if kind != 'fwd' else ''}", flush=True)

    print("\nbest per kernel (and the table's current tile):")
    for kind in ("fwd", "dkdv", "dq"):
        for d in args.dims:
            for causal in (False, True):
                for seqlen in args.seqlens:
                    rows = [r for r in results if (r["kernel"], r["d"], r["causal"], r["seqlen"]) == (kind, d, causal, seqlen)]
                    routed = [r for r in rows if r["config"] == "routed"]
                    rows = [r for r in rows if r["config"] != "routed"]
                    if rows:
                        best = min(rows, key=lambda r: r["ms"])
                        print(f"  {kind:4} d={d:3} causal={causal:d} s={seqlen:5d}: {best['config']} "
                              f"{best['tflops']:.1f} TFLOP/s (table {rows[0]['config']}: {rows[0]['tflops']:.1f}"
                              + (f"; as routed {routed[0]['tflops']:.1f})" if routed else ")"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
