"""Compile-only: the pointer calling convention of the CuTe forward (kernels/cute/_fast_call.py) runs the same device
code as the tensor one, and FastCall's argument list (integers marshalled once per shape, pointers spliced in per
call) holds what the DSL's own marshalling of the same call holds, for a fraction of its host time. Running it
needs an H200 (tests/ops/test_cute_flash_gpu.py)."""

from __future__ import annotations

import ctypes
import glob
import re
import time

import pytest
import torch

from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING

pytestmark = [pytest.mark.cute, pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}")]


@pytest.fixture(autouse=True)
def _private_dsl_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("FA_BACKEND_CUTE_CACHE_DIR", str(tmp_path / "dsl-cache"))


def _device_code(ptx: str) -> list[str]:
    """The kernel's PTX with its name and register numbers dropped."""
    body = ptx[ptx.index(".entry"):]
    body = re.sub(r"kernel_cutlass_kernel\S*?(_param_\d+)", r"K\1", body)
    body = re.sub(r"%(rd|r|p|f|fd|rs|h)\d+", r"%\1", body)
    return [line for line in body.splitlines() if not re.match(r"\s*\.reg ", line)]


def _straight_line_runs(lines: list[str]) -> list[list[str]]:
    """The device code without generic-to-global conversions, cut at every label, branch, barrier and inline-asm
    marker, each run sorted: two compiles that differ only in the order of independent instructions between those
    points (register numbers are already dropped, so the order carries nothing else) compare equal."""
    runs, run = [], []
    for line in lines:
        if "cvta.to.global" in line:
            continue
        if re.match(r"\s*(\$L|@|bra|bar\.|ret|//)", line) or "inline asm" in line or line.strip() in ("{", "}"):
            runs.append(sorted(run) + [line])
            run = []
        else:
            run.append(line)
    return runs + [sorted(run)]


def test_device_code_matches_the_tensor_convention(tmp_path):
    from fa_backend.kernels.cute import flash_fwd_ws

    codes = {}
    for pointer_args in (False, True):
        out = tmp_path / str(pointer_args)
        out.mkdir()
        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 128, True, True, "sm_90a", str(out), overlap=True,
                                          pointer_args=pointer_args)
        codes[pointer_args] = _device_code(open(glob.glob(str(out / "*.ptx"))[0]).read())
    tensor, pointer = codes[False], codes[True]
    extra = [line for line in tensor if line not in pointer]
    # a global-space pointer needs no generic-to-global conversion; nothing else differs
    assert extra and all("cvta.to.global.u64" in line for line in extra)
    assert [line for line in tensor if "cvta.to.global" not in line] == \
        [line for line in pointer if "cvta.to.global" not in line]


def _values(args: list) -> list[int]:
    """The low 32 bits each argument pointer points at (addresses, sizes, strides, the scale's bits)."""
    return [ctypes.c_uint32.from_address(a.value if isinstance(a, ctypes.c_void_p) else a).value for a in args]


def test_fast_call_marshals_what_the_dsl_does_once_per_shape():
    from cuda.bindings import driver
    from cutlass import Float32

    from fa_backend.kernels.cute import _fast_call, flash_fwd_ws
    from fa_backend.kernels.cute.flash_fwd import _DTYPES, _dynamic

    compiled = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 64, False, consumers=3, pointer_args=True)
    call = _fast_call.FastCall(compiled, _fast_call.forward_pointer_types(_DTYPES[torch.bfloat16]))
    assert call.supported
    stream = driver.CUstream(0)

    def tensors(b, hq, hkv, s):
        q = torch.randn(b, s, hq, 64, dtype=torch.bfloat16).transpose(1, 2)  # strided: (b, s, h, d) memory
        k, v = (torch.randn(b, hkv, s + 3, 64, dtype=torch.bfloat16) for _ in range(2))
        return q, k, v, torch.empty(b, hq, s, 64, dtype=torch.bfloat16), torch.empty(b, hq, s)

    def fresh(q, k, v, o, lse, scale):
        ptrs = [_fast_call._pointer(t, _DTYPES[torch.bfloat16], 16) for t in (q, k, v, o)]
        ptrs.append(_fast_call._pointer(lse, Float32, 4))
        args, keep = compiled.generate_execution_args(*ptrs, *_fast_call.scalars(q, k, v, o, lse), Float32(scale),
                                                      stream)
        return _values(args)

    first = tensors(2, 8, 2, 100)
    again = tensors(2, 8, 2, 100)  # same shapes, other memory: the cached integers, new pointers
    other = tensors(1, 4, 4, 37)
    for ts in (first, again, other):
        args, keep = call.execution_args(ts, _fast_call.scalars(*ts), (0.25,), stream)
        assert _values(args) == fresh(*ts, 0.25)
    assert len(call._cache) == 2
    args, keep = call.execution_args(first, _fast_call.scalars(*first), (0.5,), stream)  # a new scale: a new entry
    assert _values(args) == fresh(*first, 0.5) and len(call._cache) == 3
    for i in range(_fast_call.MAX_KEYS):  # a bounded cache: shapes that keep changing start it over
        call.execution_args(other, _fast_call.scalars(*other), (1.0 + i,), stream)
    assert len(call._cache) <= _fast_call.MAX_KEYS

    # host time per call: this path against the tensor convention's conversions and marshalling
    tensor_fn = flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, 64, False, consumers=3)
    q, k, v, o, lse = again

    def tensor_call():
        tensor_fn.generate_execution_args(*(_dynamic(t) for t in (q, k, v, o)), _dynamic(lse, align=4),
                                          Float32(0.25), stream)

    def fast_call():
        call.execution_args((q, k, v, o, lse), _fast_call.scalars(q, k, v, o, lse), (0.25,), stream)

    # the minimum of interleaved rounds, as docs/benchmarks.md's host times: a round that another process (pytest-xdist's
    # other worker compiling) slows down does not decide (one round under load read 36.5 against 99.6 us, 6.4 / 75.3
    # alone)
    rounds = {"tensor": [], "fast": []}
    for _ in range(5):
        for name, fn in (("tensor", tensor_call), ("fast", fast_call)):
            t0 = time.perf_counter()
            for _ in range(200):
                fn()
            rounds[name].append((time.perf_counter() - t0) / 200 * 1e6)
    times = {name: min(values) for name, values in rounds.items()}
    print(f"host µs per call: tensor convention {times['tensor']:.1f}, fast call {times['fast']:.1f}")
    assert times["fast"] < times["tensor"] / 3


def test_backward_pointer_convention_compiles_to_the_same_device_code(tmp_path):
    from fa_backend.kernels.cute import flash_bwd

    codes = {}
    for pointer_args in (False, True):
        out = tmp_path / str(pointer_args)
        out.mkdir()
        flash_bwd.compile_flash_bwd(torch.bfloat16, 128, True, True, "sm_90a", str(out), pointer_args=pointer_args)
        codes[pointer_args] = _device_code(open(glob.glob(str(out / "*.ptx"))[0]).read())
    tensor, pointer = codes[False], codes[True]
    # the same instructions; with the stmatrix dS store the two compiles order two independent descriptor adds
    # differently, so each straight-line run is compared as a set of lines
    assert len(tensor) - sum("cvta.to.global" in line for line in tensor) == \
        len(pointer) - sum("cvta.to.global" in line for line in pointer)
    assert _straight_line_runs(tensor) == _straight_line_runs(pointer)
