"""A cheap host path into the compiled CuTe forwards: raw pointers plus runtime sizes and strides, marshalled once per
argument shape.

The default call converts each tensor with `from_dlpack(...).mark_layout_dynamic(...)` and the DSL then builds
its argument list: 79 µs per forward call on the CPU machine (`tests/kernels/cute/test_fast_call.py` times it).
Passing pointers and 20 integers instead costs as much (76 µs: the DSL converts each Python int), so `FastCall`
marshals the integers once per distinct (sizes, strides, scale, stream) and, per call, only splices the five
tensor addresses into a copy of that list (`FastCall.execution_args`), then runs the compiled program. The
device code is the forward kernel's own: built from the same dynamic layouts, its PTX differs only in three
generic-to-global address conversions that a global pointer does not need (the compile test checks that).

Off by default (`ENABLED`): it has not run on a GPU yet. It uses two methods of the DSL's JIT executor,
`generate_execution_args` and `run_compiled_program` (nvidia-cutlass-dsl 4.8.1); where they are missing the
plain call runs instead.
"""

from __future__ import annotations

from typing import Any

import torch

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402
from cutlass.cute.runtime import make_ptr  # noqa: E402

# Read at each forward call (flash_fwd._run): True takes this path.
ENABLED = False
N_POINTERS = 5  # q, k, v, o, lse


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


def _pointer(t: torch.Tensor | int, dtype: type, align: int) -> Any:
    address = t if isinstance(t, int) else t.data_ptr()
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def example_args(dtype: type) -> tuple:
    """Arguments for cute.compile(PointerForward(kernel), ...): their types make the signature."""
    pointers = [_pointer(16, dtype, 16) for _ in range(4)] + [_pointer(16, Float32, 4)]
    return (*pointers, *[Int32(1)] * 6, *[Int64(1)] * 14, Float32(1.0))


def scalars(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> tuple:
    """The integer arguments of PointerForward for these tensors."""
    b, hq, sq, d = q.shape
    return (b, hq, k.shape[1], sq, k.shape[2], d, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *o.stride()[:3], *lse.stride()[:2])


class FastCall:
    """Calls a function compiled from PointerForward with tensors, marshalling its integers once per shape."""

    def __init__(self, compiled: Any, dtype: type):
        self.compiled = compiled
        self.dtype = dtype
        self.supported = all(hasattr(compiled, m) for m in ("generate_execution_args", "run_compiled_program"))
        self._cache: dict[tuple, tuple[list, Any]] = {}

    def execution_args(self, q, k, v, o, lse, scale_log2: float, stream: Any) -> tuple[list, list]:
        """(the compiled program's argument list, the pointer objects it refers to: keep them alive until the
        program has run)."""
        pointers = [_pointer(t, self.dtype, 16) for t in (q, k, v, o)] + [_pointer(lse, Float32, 4)]
        ints = scalars(q, k, v, o, lse)
        key = (ints, scale_log2, int(stream))
        cached = self._cache.get(key)
        if cached is None:
            exe_args, adapted = self.compiled.generate_execution_args(*pointers, *ints, Float32(scale_log2), stream)
            # each pointer is one entry at the front (checked once per shape: a DSL that marshals them otherwise
            # takes the plain path)
            if any(len(p.__c_pointers__()) != 1 for p in pointers) or len(exe_args) < N_POINTERS:
                raise RuntimeError("unexpected argument marshalling")
            cached = self._cache[key] = (list(exe_args), (adapted, stream))  # what the list points into
        args = list(cached[0])
        args[:N_POINTERS] = [p.__c_pointers__()[0] for p in pointers]
        return args, pointers

    def __call__(self, q, k, v, o, lse, scale_log2: float, stream: Any) -> None:
        if not self.supported:
            self.compiled(*(_pointer(t, self.dtype, 16) for t in (q, k, v, o)), _pointer(lse, Float32, 4),
                          *scalars(q, k, v, o, lse), Float32(scale_log2), stream)
            return
        args, pointers = self.execution_args(q, k, v, o, lse, scale_log2, stream)
        self.compiled.run_compiled_program(args)
        del pointers  # alive until here
