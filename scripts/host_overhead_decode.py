"""Host (Python) cost of one flash_attn_with_kvcache call, measured on a machine without a GPU.

Every Triton launch goes through JITFunction.run's Python path as on an sm90 GPU (argument binding and
specialization with the CUDA backend, the kernel-cache key) up to the driver call, which is replaced
by a no-op; tensors live on the CPU. What remains is our Python (checks, allocations, heuristics)
plus Triton's per-launch Python, the part that makes small decode calls host-bound on the H200.
Not measured: the C launcher and the CUDA driver (a few µs per launch), CUDA's caching allocator.

    python scripts/host_overhead_decode.py [--calls 500] [--fast-launch]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET: the JIT path is measured"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime import jit as _jit

LAUNCHES: Counter = Counter()
_BINDERS: dict = {}


def _stub_run(self, *args, grid, warmup, **kwargs):
    """JITFunction.run up to the driver launch (binder + specialization + cache key + grid)."""
    kwargs["debug"] = kwargs.get("debug", self.debug) or _jit.knobs.runtime.debug
    kwargs["instrumentation_mode"] = _jit.knobs.compilation.instrumentation_mode
    entry = _BINDERS.get(self)
    if entry is None:
        backend = make_backend(GPUTarget("cuda", 90, 32))
        entry = _BINDERS[self] = ({}, backend, _jit.create_function_from_signature(self.signature, self.params,
                                                                                    backend))
    key_cache, _backend, binder = entry
    bound_args, specialization, options = binder(*args, **kwargs)
    _jit.compute_cache_key(key_cache, specialization, options)
    for (name, _), (val, globals_dict) in self.used_global_vals.items():
        globals_dict.get(name)
    if callable(grid):
        grid = grid(bound_args)
    tuple(bound_args.values())
    LAUNCHES[self.__name__] += 1
    return _FakeCompiled(self.__name__)


class _FakeCompiled:
    """What JITFunction.run returns, with the driver's launcher replaced by a counter (for --fast-launch)."""

    function = packed_metadata = None

    def __init__(self, name):
        self.name = name

    def run(self, *args):
        LAUNCHES[self.name] += 1


def _time(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    runs = []
    for _ in range(15):  # CPU time of this process, best of 15: robust to other load on the machine
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        runs.append((time.process_time() - t0) / calls * 1e6)
    return min(runs)


def cases():
    import fa_backend

    b, L, hq, hkv, d = 1, 4096, 32, 8, 128
    dt = torch.float16
    q = torch.randn(b, 1, hq, d, dtype=dt)
    kc, vc = torch.randn(b, L + 64, hkv, d, dtype=dt), torch.randn(b, L + 64, hkv, d, dtype=dt)
    k, v = torch.randn(b, 1, hkv, d, dtype=dt), torch.randn(b, 1, hkv, d, dtype=dt)
    sl = torch.full((b,), L, dtype=torch.int32)
    cos, sin = torch.randn(L + 64, d // 2, dtype=dt), torch.randn(L + 64, d // 2, dtype=dt)
    page = 64
    kp = torch.randn(b * (L + 64) // page, page, hkv, d, dtype=dt)
    vp = torch.randn_like(kp)
    bt = torch.arange(b * (L + 64) // page, dtype=torch.int32).reshape(b, -1)
    f = fa_backend.flash_attn_with_kvcache
    return {
        "contiguous, no append (tensor seqlens)": lambda: f(q, kc, vc, cache_seqlens=sl),
        "contiguous, no append (int seqlens)": lambda: f(q, kc, vc, cache_seqlens=L),
        "append + rotary, causal": lambda: f(q, kc, vc, k, v, cos, sin, cache_seqlens=sl, causal=True),
        "paged 64, no append": lambda: f(q, kp, vp, cache_seqlens=sl, block_table=bt),
        "paged 64, append": lambda: f(q, kp, vp, k, v, cache_seqlens=sl, block_table=bt),
    }


def _python_calls(fn, calls: int = 100) -> float:
    """Python-level function calls per call (cProfile's count): a load-independent measure."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    return pstats.Stats(prof).total_calls / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--fast-launch", action="store_true",
                        help="FA_BACKEND_FAST_LAUNCH=1: the JIT's per-call work skipped after the first launch")
    args = parser.parse_args()
    _jit.JITFunction.run = _stub_run
    if args.fast_launch:
        from fa_backend.kernels.triton import _launch

        _launch.FAST_LAUNCH = True
        _launch._current_device_and_stream = lambda: (0, 0)
    torch.set_num_threads(1)
    print(f"# b=1 L=4096 hq=32 hkv=8 d=128, CPU tensors, Triton launches stubbed at the driver; "
          f"best of 15 x {args.calls} calls (process CPU time); fast launch {'on' if args.fast_launch else 'off'}")
    for name, fn in cases().items():
        LAUNCHES.clear()
        fn()
        launches = dict(LAUNCHES)
        us = _time(fn, args.calls)
        print(f"{name:42s} {us:7.1f} us/call  {_python_calls(fn):5.0f} py calls  launches {launches}", flush=True)


if __name__ == "__main__":
    main()
