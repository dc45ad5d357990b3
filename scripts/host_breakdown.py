"""Where the host time of one tiny attention call goes (GPU; issue 6's host-overhead report).

One call of b=1, h=1, s=16, d=64, bf16 is host-bound: its wall time per call (a loop of calls, synchronised
at the ends, median of 7 rounds) is the host cost. Measured layer by layer, each with the fast launch path
(`fa_backend.kernels.triton._launch`) on and off:
  sdpa              F.scaled_dot_product_attention, not routed (PyTorch's own pick)
  routed            the same call with fa_backend.enable() (default order)
  routed_triton     the same call restricted to our Triton kernel (sdpa_backends(["triton"]))
  attention         fa_backend.attention (our op's eager twin, no routing)
  custom_op         torch.ops.fa_backend.triton_flash_fwd (the torch.library boundary, as compiled code calls it)
  flash_fwd         kernels.triton.flash_fwd (allocation, launch configuration, launch)
  launch            the forward kernel's launch alone, with prepared arguments
  empty             allocating out and lse alone
and a forward + backward step (requires_grad) through fa_backend.attention and through SDPA.
Usage: python scripts/host_breakdown.py [--json FILE] [--n N]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

import fa_backend
from fa_backend.kernels import triton as kernels
from fa_backend.kernels._layout import new_attention_output
from fa_backend.kernels.triton import _launch


def per_call_us(fn, n: int) -> float:
    for _ in range(50):
        fn()
    rounds = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return sorted(rounds)[3]


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


def measure(n: int) -> dict[str, float]:
    q = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    qg = q.clone().requires_grad_()
    kernel, grid, args, kwargs = _captured_launch(q)
    sdpa = lambda: F.scaled_dot_product_attention(q, q, q)  # noqa: E731

    def step_ours():
        fa_backend.attention(qg, qg, qg).sum().backward()

    def step_sdpa():
        F.scaled_dot_product_attention(qg, qg, qg).sum().backward()

    res = {"sdpa": per_call_us(sdpa, n), "sdpa_fwd_bwd": per_call_us(step_sdpa, n // 4),
           "empty": per_call_us(lambda: (new_attention_output(q, 64),
                                         torch.empty((1, 1, 16), dtype=torch.float32, device="cuda")), n),
           "launch_jit": per_call_us(lambda: kernel[grid](*args, **kwargs), n)}
    _launch.FAST_LAUNCH = True
    res["launch_fast"] = per_call_us(lambda: _launch.launch(kernel, grid, args, kwargs), n)
    for fast in (False, True):
        _launch.FAST_LAUNCH = fast
        tag = "fast" if fast else "jit"
        res[f"flash_fwd_{tag}"] = per_call_us(lambda: kernels.flash_fwd(q, q, q, 0.125, False, False), n)
        res[f"custom_op_{tag}"] = per_call_us(lambda: torch.ops.fa_backend.triton_flash_fwd(q, q, q), n)
        res[f"attention_{tag}"] = per_call_us(lambda: fa_backend.attention(q, q, q), n)
        res[f"attention_fwd_bwd_{tag}"] = per_call_us(step_ours, n // 4)
        with fa_backend.enabled():
            res[f"routed_{tag}"] = per_call_us(sdpa, n)
            with fa_backend.sdpa_backends(["triton"]):
                res[f"routed_triton_{tag}"] = per_call_us(sdpa, n)
                res[f"routed_triton_fwd_bwd_{tag}"] = per_call_us(step_sdpa, n // 4)
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--n", type=int, default=2000)
    args = parser.parse_args()
    default_fast = _launch.FAST_LAUNCH
    res = measure(args.n)
    _launch.FAST_LAUNCH = default_fast
    for name, us in res.items():
        print(f"{name:<28} {us:8.1f} us")
    if args.json:
        import triton

        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                       "us_per_call": res}, f, indent=1)


if __name__ == "__main__":
    main()
