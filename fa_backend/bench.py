"""`python -m fa_backend bench`: TFLOP/s of our kernels against PyTorch's SDPA backends (GPU).

All numbers of one table come from one process on one GPU: ratios within a run are comparable,
absolute figures across runs are not. Timings are CUDA-event medians (triton.testing.do_bench)
after warm-up, on random data.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

PEERS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
def calls_per_sample(seqlen: int) -> int:
    """Calls per timed sample: the host enqueues several calls back to back, as a model's eager loop
    does, so per-call Python overhead overlaps GPU work instead of sitting inside every sample (only
    the first call's host time remains, spread over the sample). Short sequences get more calls."""
    return 16 if seqlen <= 2048 else 4


@dataclasses.dataclass
class Record:
    backend: str
    d: int
    causal: bool
    seqlen: int
    batch: int
    heads: int
    dtype: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    error: str | None = None


def attention_flops(batch: int, heads: int, sq: int, sk: int, d: int, causal: bool) -> float:
    """Forward FLOPs (two GEMMs, 2 FLOPs per MAC), halved for causal; backward is 2.5x this."""
    flops = 4.0 * batch * heads * sq * sk * d
    return flops / 2 if causal else flops


def _runner(backend: str, causal: bool) -> tuple[Callable, contextlib.AbstractContextManager]:
    if backend == "triton":
        import fa_backend

        return (lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal)), contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ctx = sdpa_kernel(getattr(SDPBackend, PEERS[backend]))
    return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), ctx


def _inputs(batch: int, heads: int, seqlen: int, d: int, dtype: torch.dtype):
    # (b, s, h, d) memory viewed as (b, h, s, d): the layout a model's projections produce.
    return [torch.randn(batch, seqlen, heads, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
            for _ in range(3)]


def bench_one(backend: str, d: int, causal: bool, seqlen: int, dtype: torch.dtype, backward: bool,
              tokens: int = 16384, width: int = 2048) -> Record:
    from triton.testing import do_bench

    batch, heads = max(1, tokens // seqlen), max(1, width // d)
    rec = Record(backend, d, causal, seqlen, batch, heads, str(dtype).replace("torch.", ""))
    fn, ctx = _runner(backend, causal)
    q, k, v = _inputs(batch, heads, seqlen, d, dtype)
    flops = attention_flops(batch, heads, seqlen, seqlen, d, causal)
    try:
        with ctx:
            out = fn(q, k, v)
            repeat = calls_per_sample(seqlen)
            rec.fwd_ms = do_bench(lambda: [fn(q, k, v) for _ in range(repeat)],
                                  warmup=25, rep=100, return_mode="median") / repeat
            rec.fwd_tflops = flops / rec.fwd_ms * 1e-9
            if backward:
                dout = torch.randn_like(out)
                grad = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
                rec.bwd_ms = do_bench(lambda: [grad() for _ in range(repeat)],
                                      warmup=25, rep=100, return_mode="median") / repeat
                rec.bwd_tflops = 2.5 * flops / rec.bwd_ms * 1e-9
    except RuntimeError as e:  # a peer that refuses this shape (e.g. head dim) is reported, not fatal
        rec.error = str(e).splitlines()[0][:120]
    return rec


def peak_memory(seqlens: list[int], d: int = 64, batch: int = 2, heads: int = 16,
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Peak extra memory (MiB) of one forward + backward, ours vs PyTorch's math backend."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import fa_backend

    rows = []
    for s in seqlens:
        row = {"seqlen": s, "batch": batch, "heads": heads, "d": d}
        for name in ("triton", "math"):
            q, k, v = _inputs(batch, heads, s, d, dtype)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            if name == "triton":
                out = fa_backend.attention(q, k, v, is_causal=True)
            else:
                with sdpa_kernel(SDPBackend.MATH):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out.backward(torch.randn_like(out))
            torch.cuda.synchronize()
            row[f"{name}_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            del q, k, v, out
            torch.cuda.empty_cache()
        rows.append(row)
    return rows


def _per_call_us(fn, n: int, sync) -> float:
    """Median over 7 rounds of the wall time per call of `fn` called n times back to back."""
    import time

    for _ in range(100):
        fn()
    rounds = []
    for _ in range(7):
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
        sync()
    return sorted(rounds)[3]


def host_overhead(device: str = "cuda", n: int = 2000) -> dict[str, float]:
    """Eager wall time per tiny call (µs): b=1, h=1, s=16, d=64, so the host is the bottleneck.

    On CUDA (bf16): our op directly, the same call through routed F.scaled_dot_product_attention
    (default order, where a measured preference may pick PyTorch's kernel, and restricted to our
    Triton kernel), and PyTorch's own SDPA. On CPU (fp32, falls back to PyTorch): SDPA unrouted and routed.
    """
    import fa_backend

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q = torch.randn(1, 1, 16, 64, device=device, dtype=dtype)
    qg = q.clone().requires_grad_()
    sdpa = lambda: F.scaled_dot_product_attention(q, q, q)  # noqa: E731
    result = {"F.scaled_dot_product_attention (not routed)": _per_call_us(sdpa, n, sync)}
    if device == "cuda":
        result["fa_backend.attention (direct)"] = _per_call_us(lambda: fa_backend.attention(q, q, q), n, sync)
        result["fa_backend.attention (direct, requires_grad)"] = _per_call_us(
            lambda: fa_backend.attention(qg, qg, qg), n, sync)
        from .ops.triton_decode import sdpa_decode  # what a routed call with <= 16 queries runs

        result["split-KV decode kernel (direct, what routed 16-query calls run)"] = _per_call_us(
            lambda: sdpa_decode(q, q, q, None, False, False, None), n, sync)
    with fa_backend.enabled():
        result["F.scaled_dot_product_attention (routed)"] = _per_call_us(sdpa, n, sync)
        if device == "cuda":
            with fa_backend.sdpa_backends(["triton"]):
                result["F.scaled_dot_product_attention (routed, sdpa_backends(['triton']))"] = _per_call_us(
                    sdpa, n, sync)
    return result


def environment() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(0)), "sms": props.multi_processor_count,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def _fmt(x: float | None) -> str:
    return f"{x:7.1f}" if x is not None else "      -"


def print_table(records: list[Record], backends: list[str], out=sys.stdout) -> None:
    groups = sorted({(r.d, r.causal) for r in records})
    for d, causal in groups:
        rows = [r for r in records if r.d == d and r.causal == causal]
        seqlens = sorted({r.seqlen for r in rows})
        for direction in ("fwd", "bwd"):
            if all(getattr(r, f"{direction}_tflops") is None for r in rows):
                continue
            peers = [b for b in backends if b != "triton"]
            head = " ".join(f"{b:>9}" for b in backends) + "".join(f"  /{p:<9}" for p in peers)
            print(f"\n{direction} TFLOP/s, d={d}, causal={causal}\n seqlen {head}", file=out)
            for s in seqlens:
                by = {r.backend: getattr(r, f"{direction}_tflops") for r in rows if r.seqlen == s}
                ours = by.get("triton")
                cells = " ".join(f"  {_fmt(by.get(b))}" for b in backends)
                ratios = "".join(f"  {ours / by[p]:9.2f}x" if ours and by.get(p) else "           -" for p in peers)
                print(f"{s:7d} {cells}{ratios}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa_backend bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    parser.add_argument("--backends", nargs="+", default=["triton", "flash", "cudnn", "efficient"])
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--fwd-only", action="store_true")
    parser.add_argument("--memory", action="store_true", help="also report peak memory vs the math backend")
    parser.add_argument("--overhead", action="store_true", help="also report host time per tiny eager call")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only the host-time report (works without a GPU: the CPU fallback path)")
    parser.add_argument("--json", help="write the records (and environment) to this file")
    parser.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    parser.add_argument("--features", action="store_true",
                        help="masks and dropout instead (fa_backend.bench_features): causal given as an explicit "
                             "mask, key padding, dropout 0.1, against the efficient and cuDNN backends "
                             "(default dims 128, seqlens 2k-16k)")
    args = parser.parse_args(argv)
    if args.overhead_only:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        for name, us in host_overhead(device).items():
            print(f"  {name:48} {us:7.1f} us per call ({device})")
        return 0
    if not torch.cuda.is_available():
        print("bench needs a CUDA GPU (use --overhead-only on CPU)", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.features:
        from . import bench_features

        dims = args.dims if args.dims != [64, 128] else [128]
        seqlens = [s for s in args.seqlens if s >= 2048]
        backends = [b for b in args.backends if b in ("triton", *bench_features.PEERS)]
        feats = bench_features.run(dims=dims, seqlens=seqlens, backends=backends, dtype=dtype,
                                   backward=not args.fwd_only)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": environment(), "features": [dataclasses.asdict(r) for r in feats]}, f,
                          indent=1)
        return 0
    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    env = environment()
    print(json.dumps(env))
    records = []
    for d in args.dims:
        for causal in causals:
            for s in args.seqlens:
                for backend in args.backends:
                    rec = bench_one(backend, d, causal, s, dtype, backward=not args.fwd_only)
                    torch.cuda.empty_cache()
                    records.append(rec)
                    print(f"  {backend:>9} d={d} causal={causal:d} s={s:5d}: fwd {_fmt(rec.fwd_tflops)} "
                          f"bwd {_fmt(rec.bwd_tflops)} TFLOP/s{'  ' + rec.error if rec.error else ''}", flush=True)
    print_table(records, args.backends)
    result = {"environment": env, "records": [dataclasses.asdict(r) for r in records]}
    if args.memory:
        result["memory"] = peak_memory([1024, 2048, 4096])
        print("\npeak extra memory of fwd+bwd (MiB), causal, b=2 h=16 d=64 bf16")
        for row in result["memory"]:
            print(f"  s={row['seqlen']:5d}: triton {row['triton_mib']:8.1f}   math {row['math_mib']:8.1f}")
    if args.overhead:
        result["host_overhead_us"] = host_overhead()
        print("\nhost time per tiny eager call (b=1 h=1 s=16 d=64 bf16)")
        for name, us in result["host_overhead_us"].items():
            print(f"  {name:48} {us:7.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        from .bench_report import plot

        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
