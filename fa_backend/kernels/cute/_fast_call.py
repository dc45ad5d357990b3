"""A cheap host path into the compiled CuTe kernels (forwards and backward): raw pointers plus runtime sizes and
strides, marshalled once per argument shape.

The default call converts each tensor with `from_dlpack(...).mark_layout_dynamic(...)` and the DSL then builds
its argument list: 79 µs per forward call on the CPU machine (`tests/kernels/cute/test_fast_call.py` times it).
Passing pointers and 20 integers instead costs as much (76 µs: the DSL converts each Python int), so `FastCall`
marshals the integers once per distinct (sizes, strides, scale, stream) and, per call, only splices the five
tensor addresses into a copy of that list (`FastCall.execution_args`), then runs the compiled program. The
device code is the forward kernel's own: built from the same dynamic layouts, its PTX differs only in three
generic-to-global address conversions that a global pointer does not need (the compile test checks that).

The backward takes the same path (PointerBackward; its host marshalling was 9 tensor conversions). On by
default (`ENABLED`) since its GPU tests passed on the H200 (bitwise the tensor convention's outputs); host time
per small forward call there: 120 -> 53 µs (`scripts/bench_cute.py --host`). It uses two methods of the DSL's
JIT executor, `generate_execution_args` and `run_compiled_program` (nvidia-cutlass-dsl 4.8.1); where they are
missing the plain call runs instead.
"""

from __future__ import annotations

from typing import Any

import torch

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.runtime import make_ptr

# Read at each call (flash_fwd._run, flash_bwd.flash_bwd): True takes this path.
ENABLED = True
MAX_KEYS = 256  # marshalled argument lists kept per compiled variant


class PointerForward:
    """jit wrapper of a forward kernel variant: its SDPA-layout tensors from raw pointers and runtime sizes and
    strides (unit head_dim stride, every other size and stride dynamic, as flash_fwd._dynamic marks them)."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    @cute.jit
    def __call__(self, pq: cute.Pointer, pk: cute.Pointer, pv: cute.Pointer, po: cute.Pointer, plse: cute.Pointer,
                 b: Int32, hq: Int32, hkv: Int32, sq: Int32, sk: Int32, d: Int32,
                 qs0: Int64, qs1: Int64, qs2: Int64, ks0: Int64, ks1: Int64, ks2: Int64,
                 vs0: Int64, vs1: Int64, vs2: Int64, os0: Int64, os1: Int64, os2: Int64, ls0: Int64, ls1: Int64,
                 scale_log2: Float32, stream: Any):
        mQ = cute.make_tensor(pq, cute.make_layout((b, hq, sq, d), stride=(qs0, qs1, qs2, 1)))
        mK = cute.make_tensor(pk, cute.make_layout((b, hkv, sk, d), stride=(ks0, ks1, ks2, 1)))
        mV = cute.make_tensor(pv, cute.make_layout((b, hkv, sk, d), stride=(vs0, vs1, vs2, 1)))
        mO = cute.make_tensor(po, cute.make_layout((b, hq, sq, d), stride=(os0, os1, os2, 1)))
        mLSE = cute.make_tensor(plse, cute.make_layout((b, hq, sq), stride=(ls0, ls1, 1)))
        self.kernel(mQ, mK, mV, mO, mLSE, scale_log2, stream)


class PointerBackward:
    """jit wrapper of flash_bwd's kernel, as PointerForward: q, k, v, dO, LSE, delta, dK, dV and the dQ accumulator
    (its four sizes given: rows or chunks) from raw pointers and runtime sizes and strides."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    @cute.jit
    def __call__(self, pq: cute.Pointer, pk: cute.Pointer, pv: cute.Pointer, pdo: cute.Pointer, plse: cute.Pointer,
                 pdelta: cute.Pointer, pdk: cute.Pointer, pdv: cute.Pointer, pdq: cute.Pointer,
                 b: Int32, hq: Int32, hkv: Int32, sq: Int32, sk: Int32, d: Int32, dq1: Int32, dq2: Int32,
                 dq3: Int32, qs0: Int64, qs1: Int64, qs2: Int64, ks0: Int64, ks1: Int64, ks2: Int64, vs0: Int64,
                 vs1: Int64, vs2: Int64, os0: Int64, os1: Int64, os2: Int64, ls0: Int64, ls1: Int64, es0: Int64,
                 es1: Int64, dks0: Int64, dks1: Int64, dks2: Int64, dvs0: Int64, dvs1: Int64, dvs2: Int64,
                 dqs0: Int64, dqs1: Int64, dqs2: Int64, scale_log2: Float32, scale: Float32, stream: Any):
        mQ = cute.make_tensor(pq, cute.make_layout((b, hq, sq, d), stride=(qs0, qs1, qs2, 1)))
        mK = cute.make_tensor(pk, cute.make_layout((b, hkv, sk, d), stride=(ks0, ks1, ks2, 1)))
        mV = cute.make_tensor(pv, cute.make_layout((b, hkv, sk, d), stride=(vs0, vs1, vs2, 1)))
        mdO = cute.make_tensor(pdo, cute.make_layout((b, hq, sq, d), stride=(os0, os1, os2, 1)))
        mLSE = cute.make_tensor(plse, cute.make_layout((b, hq, sq), stride=(ls0, ls1, 1)))
        mDelta = cute.make_tensor(pdelta, cute.make_layout((b, hq, sq), stride=(es0, es1, 1)))
        mdK = cute.make_tensor(pdk, cute.make_layout((b, hkv, sk, d), stride=(dks0, dks1, dks2, 1)))
        mdV = cute.make_tensor(pdv, cute.make_layout((b, hkv, sk, d), stride=(dvs0, dvs1, dvs2, 1)))
        mdQ = cute.make_tensor(pdq, cute.make_layout((b, dq1, dq2, dq3), stride=(dqs0, dqs1, dqs2, 1)))
        self.kernel(mQ, mK, mV, mdO, mLSE, mDelta, mdK, mdV, mdQ, scale_log2, scale, stream)


def _pointer(t: torch.Tensor | int, dtype: type, align: int) -> Any:
    address = t if isinstance(t, int) else t.data_ptr()
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def forward_pointer_types(dtype: type) -> list[tuple[type, int]]:
    """(element type, alignment) of PointerForward's pointers: q, k, v, o, then the fp32 LSE."""
    return [(dtype, 16)] * 4 + [(Float32, 4)]


def backward_pointer_types(dtype: type) -> list[tuple[type, int]]:
    """(element type, alignment) of PointerBackward's pointers."""
    return [(dtype, 16)] * 4 + [(Float32, 4)] * 2 + [(dtype, 16)] * 2 + [(Float32, 16)]


def example_args(dtype: type) -> tuple:
    """Arguments for cute.compile(PointerForward(kernel), ...) up to the stream: their types make the signature."""
    return (*(_pointer(16, t, a) for t, a in forward_pointer_types(dtype)), *[Int32(1)] * 6, *[Int64(1)] * 14,
            Float32(1.0))


def backward_example_args(dtype: type) -> tuple:
    """Arguments for cute.compile(PointerBackward(kernel), ...) up to the stream."""
    return (*(_pointer(16, t, a) for t, a in backward_pointer_types(dtype)), *[Int32(1)] * 9, *[Int64(1)] * 25,
            Float32(1.0), Float32(1.0))


def scalars(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> tuple:
    """The integer arguments of PointerForward for these tensors."""
    b, hq, sq, d = q.shape
    return (b, hq, k.shape[1], sq, k.shape[2], d, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *o.stride()[:3], *lse.stride()[:2])


def backward_scalars(q, k, v, do, lse, delta, dk, dv, dqacc) -> tuple:
    """The integer arguments of PointerBackward for these tensors."""
    b, hq, sq, d = q.shape
    return (b, hq, k.shape[1], sq, k.shape[2], d, *dqacc.shape[1:], *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2], *delta.stride()[:2], *dk.stride()[:3],
            *dv.stride()[:3], *dqacc.stride()[:3])


class FastCall:
    """Calls a function compiled from PointerForward or PointerBackward with tensors, marshalling its integers and
    floats once per distinct value and only the tensors' addresses per call."""

    def __init__(self, compiled: Any, pointer_types: list[tuple[type, int]]):
        self.compiled = compiled
        self.pointer_types = pointer_types
        self.supported = all(hasattr(compiled, m) for m in ("generate_execution_args", "run_compiled_program"))
        self._cache: dict[tuple, tuple[list, Any]] = {}

    def _pointers(self, tensors) -> list:
        return [_pointer(t, ty, align) for t, (ty, align) in zip(tensors, self.pointer_types, strict=True)]

    def execution_args(self, tensors, ints: tuple, floats: tuple, stream: Any) -> tuple[list, list]:
        """(the compiled program's argument list, the pointer objects it refers to: keep them alive until the
        program has run)."""
        pointers = self._pointers(tensors)
        key = (ints, floats, int(stream))
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= MAX_KEYS:  # shapes that keep changing: start over rather than grow
                self._cache.clear()
            exe_args, adapted = self.compiled.generate_execution_args(*pointers, *ints, *map(Float32, floats), stream)
            # each pointer is one entry at the front (checked once per key)
            if any(len(p.__c_pointers__()) != 1 for p in pointers) or len(exe_args) < len(pointers):
                raise RuntimeError("unexpected argument marshalling")
            cached = self._cache[key] = (list(exe_args), (adapted, stream))  # what the list points into
        args = list(cached[0])
        args[:len(pointers)] = [p.__c_pointers__()[0] for p in pointers]
        return args, pointers

    def __call__(self, tensors, ints: tuple, floats: tuple, stream: Any) -> None:
        if not self.supported:
            self.compiled(*self._pointers(tensors), *ints, *map(Float32, floats), stream)
            return
        args, pointers = self.execution_args(tensors, ints, floats, stream)
        self.compiled.run_compiled_program(args)
        del pointers  # alive until here


# id of a compiled pointer-convention variant (alive in _compile_cache.CACHE for the process) -> its FastCall
_CALLERS: dict[int, FastCall] = {}


def caller(compiled: Any, pointer_types: list[tuple[type, int]]) -> FastCall:
    """The FastCall of a compiled variant, made on first use."""
    fast = _CALLERS.get(id(compiled))
    if fast is None:
        fast = _CALLERS[id(compiled)] = FastCall(compiled, pointer_types)
    return fast

