"""Where the host time of one tiny attention call goes (GPU; issue 6's host-overhead report).

One call of b=1, h=1, s=16, d=64, bf16 is host-bound: its wall time per call (a loop of calls, synchronised
at the ends; the variants interleaved round by round, min and median over rounds) is the host cost. Measured layer by layer, each with the fast launch path
(`fa_backend.kernels.triton._launch`) on and off:
  sdpa              F.scaled_dot_product_attention, not routed (PyTorch's own pick)
  routed            the same call with fa_backend.enable() (default order)
  routed_triton     the same call restricted to our Triton kernels (sdpa_backends(["triton"])): 16 queries, no
                    grad: the split-KV decode kernel (with grad: the dense kernels)
  attention         fa_backend.attention (our op's eager twin, no routing)
  decode_direct     the split-KV decode kernel's eager path (what a routed call with <= 16 queries runs)
  custom_op         torch.ops.fa_backend.triton_flash_fwd (the torch.library boundary, as compiled code calls it)
  flash_fwd         kernels.triton.flash_fwd (allocation, launch configuration, launch)
  launch            the forward kernel's launch alone, with prepared arguments
  empty             allocating out and lse alone
  torch_flash_op    PyTorch's flash kernel through its own op (torch._scaled_dot_product_flash_attention),
  torch_cudnn_op    ... cuDNN (torch._scaled_dot_product_cudnn_attention), torch_efficient_op: ... efficient:
                    what each of PyTorch's kernels costs without SDPA's own kernel choice
and a forward + backward step (requires_grad) through fa_backend.attention and through SDPA.
--profile prints cProfile's top functions (by own time) of the routed and direct decode paths and of the
routed default path.
Usage: python scripts/host_breakdown.py [--json FILE] [--n CALLS] [--rounds R] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

import fa_backend
from fa_backend.kernels import triton as kernels
from fa_backend.kernels._layout import new_attention_output
from fa_backend.kernels.triton import _launch
from fa_backend.ops.triton_decode import sdpa_decode


def _context(routing: str | None):
    if routing is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(fa_backend.enabled())
    if routing == "triton":
        stack.enter_context(fa_backend.sdpa_backends(["triton"]))
    return stack


def interleaved_us(variants: list[tuple], n: int, rounds: int) -> dict[str, tuple[float, float]]:
    """{name: (min, median)} wall µs per call; variants are (name, fast_launch, routing, fn, calls_scale),
    run round by round in turn so that host drifts hit all alike."""
    samples: dict[str, list[float]] = {v[0]: [] for v in variants}
    for r in range(rounds + 1):
        for name, fast, routing, fn, scale in variants:
            _launch.FAST_LAUNCH = fast
            calls = max(1, int(n * scale))
            with _context(routing):
                if r == 0:  # warm-up round: compile, fill caches
                    for _ in range(50):
                        fn()
                    continue
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                torch.cuda.synchronize()
                samples[name].append((time.perf_counter() - t0) / calls * 1e6)
    return {name: (min(v), statistics.median(v)) for name, v in samples.items()}


def _captured_launch(q):
    """(kernel, grid, args, kwargs) of the forward kernel's launch for q."""
    seen = []
    real = _launch.launch
    _launch.launch = lambda kernel, grid, args, kwargs: seen.append((kernel, grid, args, kwargs)) or real(
        kernel, grid, args, kwargs)
    try:
        kernels.flash_fwd(q, q, q, 0.125, False, False)
    finally:
        _launch.launch = real
    return seen[0]


def _torch_ops(q) -> list[tuple]:
    """Variants calling PyTorch's fused kernels through their own ops (those that accept q)."""
    ops = {
        "torch_flash_op": lambda: torch._scaled_dot_product_flash_attention(q, q, q)[0],
        "torch_cudnn_op": lambda: torch._scaled_dot_product_cudnn_attention(q, q, q, None, False)[0],
        "torch_efficient_op": lambda: torch._scaled_dot_product_efficient_attention(q, q, q, None, False)[0],
    }
    runnable = []
    for name, fn in ops.items():
        try:
            fn()
            torch.cuda.synchronize()
        except (RuntimeError, AttributeError, TypeError) as e:
            print(f"{name}: not runnable here ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        runnable.append((name, False, None, fn, 1))
    return runnable


def profile(n: int) -> None:
    """cProfile's view of the routed decode call, the direct decode call and the routed default call."""
    import cProfile
    import pstats

    q = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    cases = [("routed_triton (decode)", "triton", lambda: F.scaled_dot_product_attention(q, q, q)),
             ("decode_direct", None, lambda: sdpa_decode(q, q, q, None, False, False, None)),
             ("routed (default order)", "default", lambda: F.scaled_dot_product_attention(q, q, q))]
    for name, routing, fn in cases:
        with _context(routing):
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(n):
                fn()
            prof.disable()
            torch.cuda.synchronize()
        print(f"--- cProfile: {name}, {n} calls (own time, µs per call)")
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:14]
        for (file, line, func), (_, ncalls, tottime, cumtime, _) in rows:
            print(f"{tottime / n * 1e6:8.2f} {cumtime / n * 1e6:8.2f}  {ncalls / n:4.1f}x  "
                  f"{file.rsplit('/', 2)[-1] if file != '~' else ''}:{line} {func}")


def measure(n: int, rounds: int) -> dict[str, tuple[float, float]]:
    q = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    qg = q.clone().requires_grad_()
    kernel, grid, args, kwargs = _captured_launch(q)

    def sdpa():
        return F.scaled_dot_product_attention(q, q, q)

    def step_ours():
        fa_backend.attention(qg, qg, qg).sum().backward()

    def step_sdpa():
        F.scaled_dot_product_attention(qg, qg, qg).sum().backward()

    variants = [
        ("sdpa", False, None, sdpa, 1), ("sdpa_fwd_bwd", False, None, step_sdpa, 0.25),
        *_torch_ops(q),
        ("empty", False, None, lambda: (new_attention_output(q, 64),
                                        torch.empty((1, 1, 16), dtype=torch.float32, device="cuda")), 1),
        ("launch_jit", False, None, lambda: kernel[grid](*args, **kwargs), 1),
        ("launch_fast", True, None, lambda: _launch.launch(kernel, grid, args, kwargs), 1),
        ("routed", False, "default", sdpa, 1),
    ]
    for fast in (False, True):
        tag = "fast" if fast else "jit"
        variants += [
            (f"flash_fwd_{tag}", fast, None, lambda: kernels.flash_fwd(q, q, q, 0.125, False, False), 1),
            (f"custom_op_{tag}", fast, None, lambda: torch.ops.fa_backend.triton_flash_fwd(q, q, q), 1),
            (f"attention_{tag}", fast, None, lambda: fa_backend.attention(q, q, q), 1),
            (f"decode_direct_{tag}", fast, None, lambda: sdpa_decode(q, q, q, None, False, False, None), 1),
            (f"attention_fwd_bwd_{tag}", fast, None, step_ours, 0.25),
            (f"routed_triton_{tag}", fast, "triton", sdpa, 1),
            (f"routed_triton_fwd_bwd_{tag}", fast, "triton", step_sdpa, 0.25),
        ]
    return interleaved_us(variants, n, rounds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--n", type=int, default=1000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    q = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    print("PyTorch's own pick for this call:", torch._fused_sdp_choice(q, q, q))
    default_fast = _launch.FAST_LAUNCH
    res = measure(args.n, args.rounds)
    _launch.FAST_LAUNCH = default_fast
    print(f"{'':<28} {'min':>8} {'median':>8}  (µs per call, {args.rounds} interleaved rounds of {args.n})")
    for name, (lo, med) in res.items():
        print(f"{name:<28} {lo:8.1f} {med:8.1f}")
    if args.profile:
        profile(2000)
    if args.json:
        import triton

        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "us_per_call_min_median": res}, f, indent=1)


if __name__ == "__main__":
    main()
