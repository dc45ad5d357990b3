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

import ctypes
from typing import Any

import torch

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint8
from cutlass.cute.runtime import make_ptr

# Read at each call (flash_fwd._run, flash_bwd.flash_bwd): True takes this path.
ENABLED = True
MAX_KEYS = 256  # marshalled argument lists kept per compiled variant


def _forward_views(kernel, pq, pk, pv, po, plse, b, hq, hkv, sq, sk, d, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1,
                   vs2, os0, os1, os2, ls0, ls1) -> tuple:
    """(q, k, v, o, lse) from pointers, sizes and strides, while tracing a PointerForward* call of `kernel`."""
    dv = _head_dim_v(kernel, d)
    return (_sdpa(pq, (b, hq, sq, d), (qs0, qs1, qs2)), _sdpa(pk, (b, hkv, sk, d), (ks0, ks1, ks2)),
            _sdpa(pv, (b, hkv, sk, dv), (vs0, vs1, vs2)), _sdpa(po, (b, hq, sq, dv), (os0, os1, os2)),
            _sdpa(plse, (b, hq, sq), (ls0, ls1)))


def _backward_views(kernel, pq, pk, pv, pdo, plse, pdelta, pdk, pdv, pdq, b, hq, hkv, sq, sk, d, dq1, dq2, dq3, qs0,
                    qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2, ls0, ls1, es0, es1, dks0, dks1, dks2, dvs0,
                    dvs1, dvs2, dqs0, dqs1, dqs2) -> tuple:
    """(q, k, v, dO, LSE, delta, dK, dV, dQ accumulator) from pointers, sizes and strides, while tracing a
    PointerBackward* call of `kernel`."""
    dv = _head_dim_v(kernel, d)
    return (_sdpa(pq, (b, hq, sq, d), (qs0, qs1, qs2)), _sdpa(pk, (b, hkv, sk, d), (ks0, ks1, ks2)),
            _sdpa(pv, (b, hkv, sk, dv), (vs0, vs1, vs2)), _sdpa(pdo, (b, hq, sq, dv), (os0, os1, os2)),
            _sdpa(plse, (b, hq, sq), (ls0, ls1)), _sdpa(pdelta, (b, hq, sq), (es0, es1)),
            _sdpa(pdk, (b, hkv, sk, d), (dks0, dks1, dks2)), _sdpa(pdv, (b, hkv, sk, dv), (dvs0, dvs1, dvs2)),
            _sdpa(pdq, (b, dq1, dq2, dq3), (dqs0, dqs1, dqs2)))


def _head_dim_v(kernel, d):
    """V's (O's, dO's, dV's) head dim in the traced views: the runtime d where the kernel's head dims agree (the
    traced code of those variants is unchanged), else the kernel's static head_dim_v."""
    return d if kernel.head_dim_v == kernel.head_dim else kernel.head_dim_v


def _sdpa(pointer, shape: tuple, strides: tuple):
    """A tensor at `pointer` with these sizes and strides, the last mode's stride 1."""
    return cute.make_tensor(pointer, cute.make_layout(shape, stride=(*strides, 1)))


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
        views = _forward_views(self.kernel, pq, pk, pv, po, plse, b, hq, hkv, sq, sk, d, qs0, qs1, qs2, ks0, ks1, ks2,
                               vs0, vs1, vs2, os0, os1, os2, ls0, ls1)
        self.kernel(*views, scale_log2, stream)


class PointerForwardKeyMask:
    """PointerForward for a key-mask variant: also the packed key-mask words (b, hq, words) int32 with their
    (batch, head) strides (0 where broadcast)."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    @cute.jit
    def __call__(self, pq: cute.Pointer, pk: cute.Pointer, pv: cute.Pointer, po: cute.Pointer, plse: cute.Pointer,
                 pw: cute.Pointer, b: Int32, hq: Int32, hkv: Int32, sq: Int32, sk: Int32, d: Int32, nw: Int32,
                 qs0: Int64, qs1: Int64, qs2: Int64, ks0: Int64, ks1: Int64, ks2: Int64,
                 vs0: Int64, vs1: Int64, vs2: Int64, os0: Int64, os1: Int64, os2: Int64, ls0: Int64, ls1: Int64,
                 ws0: Int64, ws1: Int64, scale_log2: Float32, stream: Any):
        views = _forward_views(self.kernel, pq, pk, pv, po, plse, b, hq, hkv, sq, sk, d, qs0, qs1, qs2, ks0, ks1, ks2,
                               vs0, vs1, vs2, os0, os1, os2, ls0, ls1)
        mW = cute.make_tensor(pw, cute.make_layout((b, hq, nw), stride=(ws0, ws1, 1)))
        self.kernel(*views, scale_log2, stream, mW)


class PointerForwardDropout:
    """PointerForward for a dropout variant (flash_fwd_ws, dropout=True): also the words pointer and strides of
    PointerForwardKeyMask (read only by a key-mask variant; any address otherwise), the (seed, rng_offset) int64
    pair on the device, the buffer for the saved keep bits (written by keep_bits variants only), the 16-bit keep
    threshold and 1 / (1 - dropout_p). The threshold and scale are constant per
    dropout_p and the pair's address is spliced in per call, so a fresh RNG state per call marshals nothing anew."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    @cute.jit
    def __call__(self, pq: cute.Pointer, pk: cute.Pointer, pv: cute.Pointer, po: cute.Pointer, plse: cute.Pointer,
                 pw: cute.Pointer, prng: cute.Pointer, pbits: cute.Pointer, b: Int32, hq: Int32, hkv: Int32, sq: Int32,
                 sk: Int32, d: Int32, nw: Int32, qs0: Int64, qs1: Int64, qs2: Int64, ks0: Int64, ks1: Int64, ks2: Int64,
                 vs0: Int64, vs1: Int64, vs2: Int64, os0: Int64, os1: Int64, os2: Int64, ls0: Int64, ls1: Int64,
                 ws0: Int64, ws1: Int64, threshold: Int32, scale_log2: Float32, drop_scale: Float32, stream: Any):
        views = _forward_views(self.kernel, pq, pk, pv, po, plse, b, hq, hkv, sq, sk, d, qs0, qs1, qs2, ks0, ks1, ks2,
                               vs0, vs1, vs2, os0, os1, os2, ls0, ls1)
        mW = None
        if cutlass.const_expr(self.kernel.key_mask):
            mW = cute.make_tensor(pw, cute.make_layout((b, hq, nw), stride=(ws0, ws1, 1)))
        mRng = cute.make_tensor(prng, cute.make_layout(2))
        mBits = None
        if cutlass.const_expr(self.kernel.keep_bits):
            mBits = cute.make_tensor(pbits, cute.make_layout(1))  # its first byte: the kernel computes offsets
        self.kernel(*views, scale_log2, stream, mW, mRng, threshold, drop_scale, mBits)


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
        views = _backward_views(self.kernel, pq, pk, pv, pdo, plse, pdelta, pdk, pdv, pdq, b, hq, hkv, sq, sk, d, dq1,
                                dq2, dq3, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2, ls0, ls1, es0,
                                es1, dks0, dks1, dks2, dvs0, dvs1, dvs2, dqs0, dqs1, dqs2)
        self.kernel(*views, scale_log2, scale, stream)


class PointerBackwardKeyMask:
    """PointerBackward for a key-mask variant: also the packed key-mask words (b, hq, words) int32 with their
    (batch, head) strides (0 where broadcast); for the deterministic variant, its turn flags (b, hq, query blocks)
    in the same place."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    @cute.jit
    def __call__(self, pq: cute.Pointer, pk: cute.Pointer, pv: cute.Pointer, pdo: cute.Pointer, plse: cute.Pointer,
                 pdelta: cute.Pointer, pdk: cute.Pointer, pdv: cute.Pointer, pdq: cute.Pointer, pw: cute.Pointer,
                 b: Int32, hq: Int32, hkv: Int32, sq: Int32, sk: Int32, d: Int32, dq1: Int32, dq2: Int32,
                 dq3: Int32, nw: Int32, qs0: Int64, qs1: Int64, qs2: Int64, ks0: Int64, ks1: Int64, ks2: Int64,
                 vs0: Int64, vs1: Int64, vs2: Int64, os0: Int64, os1: Int64, os2: Int64, ls0: Int64, ls1: Int64,
                 es0: Int64, es1: Int64, dks0: Int64, dks1: Int64, dks2: Int64, dvs0: Int64, dvs1: Int64, dvs2: Int64,
                 dqs0: Int64, dqs1: Int64, dqs2: Int64, ws0: Int64, ws1: Int64, scale_log2: Float32, scale: Float32,
                 stream: Any):
        views = _backward_views(self.kernel, pq, pk, pv, pdo, plse, pdelta, pdk, pdv, pdq, b, hq, hkv, sq, sk, d, dq1,
                                dq2, dq3, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2, ls0, ls1, es0,
                                es1, dks0, dks1, dks2, dvs0, dvs1, dvs2, dqs0, dqs1, dqs2)
        mW = cute.make_tensor(pw, cute.make_layout((b, hq, nw), stride=(ws0, ws1, 1)))
        self.kernel(*views, scale_log2, scale, stream, mW)


class PointerBackwardDropout:
    """PointerBackward for a dropout variant: also a words pointer (unread: the variant takes no key mask), the
    (seed, offset) int64 pair on the device, the forward's saved keep bits (read by keep_bits variants only), the
    16-bit keep threshold and 1 / (1 - dropout_p)."""

    def __init__(self, kernel: Any):
        self.kernel = kernel

    @cute.jit
    def __call__(self, pq: cute.Pointer, pk: cute.Pointer, pv: cute.Pointer, pdo: cute.Pointer, plse: cute.Pointer,
                 pdelta: cute.Pointer, pdk: cute.Pointer, pdv: cute.Pointer, pdq: cute.Pointer, pw: cute.Pointer,
                 prng: cute.Pointer, pbits: cute.Pointer, b: Int32, hq: Int32, hkv: Int32, sq: Int32, sk: Int32,
                 d: Int32, dq1: Int32,
                 dq2: Int32, dq3: Int32, qs0: Int64, qs1: Int64, qs2: Int64, ks0: Int64, ks1: Int64, ks2: Int64,
                 vs0: Int64, vs1: Int64, vs2: Int64, os0: Int64, os1: Int64, os2: Int64, ls0: Int64, ls1: Int64,
                 es0: Int64, es1: Int64, dks0: Int64, dks1: Int64, dks2: Int64, dvs0: Int64, dvs1: Int64, dvs2: Int64,
                 dqs0: Int64, dqs1: Int64, dqs2: Int64, threshold: Int32, scale_log2: Float32, scale: Float32,
                 drop_scale: Float32, stream: Any):
        views = _backward_views(self.kernel, pq, pk, pv, pdo, plse, pdelta, pdk, pdv, pdq, b, hq, hkv, sq, sk, d, dq1,
                                dq2, dq3, qs0, qs1, qs2, ks0, ks1, ks2, vs0, vs1, vs2, os0, os1, os2, ls0, ls1, es0,
                                es1, dks0, dks1, dks2, dvs0, dvs1, dvs2, dqs0, dqs1, dqs2)
        mRng = cute.make_tensor(prng, cute.make_layout(2))
        mBits = None
        if cutlass.const_expr(getattr(self.kernel, "keep_bits", False)):
            mBits = cute.make_tensor(pbits, cute.make_layout(1))  # its first byte: the kernel computes offsets
        self.kernel(*views, scale_log2, scale, stream, None, mRng, threshold, drop_scale, mBits)


def _address(t: torch.Tensor | int) -> int:
    return t if isinstance(t, int) else t.data_ptr()


def _pointer(t: torch.Tensor | int, dtype: type, align: int) -> Any:
    address = _address(t)
    return make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def forward_pointer_types(dtype: type, key_mask: bool = False, dropout: bool = False) -> list[tuple[type, int]]:
    """(element type, alignment) of PointerForward's pointers: q, k, v, o, then the fp32 LSE (and, key_mask:
    PointerForwardKeyMask's int32 words; dropout: PointerForwardDropout's words, int64 (seed, rng_offset) and uint8
    keep bits)."""
    if dropout:
        return [(dtype, 16)] * 4 + [(Float32, 4), (Int32, 4), (Int64, 8), (Uint8, 16)]
    return [(dtype, 16)] * 4 + [(Float32, 4)] + ([(Int32, 4)] if key_mask else [])


def backward_pointer_types(dtype: type, key_mask: bool = False, dropout: bool = False) -> list[tuple[type, int]]:
    """(element type, alignment) of PointerBackward's pointers (PointerBackwardKeyMask's with key_mask,
    PointerBackwardDropout's with dropout)."""
    if dropout:
        return backward_pointer_types(dtype, True) + [(Int64, 8), (Uint8, 16)]
    return [(dtype, 16)] * 4 + [(Float32, 4)] * 2 + [(dtype, 16)] * 2 + [(Float32, 16)] + (
        [(Int32, 4)] if key_mask else [])


def example_args(dtype: type, key_mask: bool = False, dropout: bool = False) -> tuple:
    """Arguments for cute.compile(PointerForward(kernel), ...) (PointerForwardKeyMask with key_mask,
    PointerForwardDropout with dropout) up to the stream: their types make the signature."""
    if dropout:
        return (*(_pointer(16, t, a) for t, a in forward_pointer_types(dtype, dropout=True)), *[Int32(1)] * 7,
                *[Int64(1)] * 16, Int32(1), Float32(1.0), Float32(1.0))
    return (*(_pointer(16, t, a) for t, a in forward_pointer_types(dtype, key_mask)),
            *[Int32(1)] * (7 if key_mask else 6), *[Int64(1)] * (16 if key_mask else 14), Float32(1.0))


def backward_example_args(dtype: type, key_mask: bool = False, dropout: bool = False) -> tuple:
    """Arguments for cute.compile(PointerBackward(kernel), ...) (PointerBackwardKeyMask with key_mask,
    PointerBackwardDropout with dropout) up to the stream."""
    if dropout:
        return (*(_pointer(16, t, a) for t, a in backward_pointer_types(dtype, dropout=True)), *[Int32(1)] * 9,
                *[Int64(1)] * 25, Int32(1), Float32(1.0), Float32(1.0), Float32(1.0))
    return (*(_pointer(16, t, a) for t, a in backward_pointer_types(dtype, key_mask)),
            *[Int32(1)] * (10 if key_mask else 9), *[Int64(1)] * (27 if key_mask else 25), Float32(1.0), Float32(1.0))


def scalars(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
            words: torch.Tensor | None = None, threshold: int | None = None) -> tuple:
    """The integer arguments of PointerForward (PointerForwardKeyMask when `words` is given; PointerForwardDropout,
    with or without words, when `threshold` is) for these tensors."""
    b, hq, sq, d = q.shape
    if threshold is not None:
        nw, ws = (words.shape[2], words.stride()[:2]) if words is not None else (0, (0, 0))
        return (b, hq, k.shape[1], sq, k.shape[2], d, nw, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                *o.stride()[:3], *lse.stride()[:2], *ws, threshold)
    if words is None:
        return (b, hq, k.shape[1], sq, k.shape[2], d, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
                *o.stride()[:3], *lse.stride()[:2])
    return (b, hq, k.shape[1], sq, k.shape[2], d, words.shape[2], *q.stride()[:3], *k.stride()[:3], *v.stride()[:3],
            *o.stride()[:3], *lse.stride()[:2], *words.stride()[:2])


def backward_scalars(q, k, v, do, lse, delta, dk, dv, dqacc, words=None, threshold: int | None = None) -> tuple:
    """The integer arguments of PointerBackward (PointerBackwardKeyMask when `words` is given,
    PointerBackwardDropout when `threshold` is) for these tensors."""
    b, hq, sq, d = q.shape
    if threshold is not None:
        return (*backward_scalars(q, k, v, do, lse, delta, dk, dv, dqacc), threshold)
    nw = (words.shape[2],) if words is not None else ()
    ws = tuple(words.stride()[:2]) if words is not None else ()
    return (b, hq, k.shape[1], sq, k.shape[2], d, *dqacc.shape[1:], *nw, *q.stride()[:3], *k.stride()[:3],
            *v.stride()[:3], *do.stride()[:3], *lse.stride()[:2], *delta.stride()[:2], *dk.stride()[:3],
            *dv.stride()[:3], *dqacc.stride()[:3], *ws)


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
        """(the compiled program's argument list, the address cells it refers to: keep them alive until the
        program has run)."""
        key = (ints, floats, int(stream))
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= MAX_KEYS:  # shapes that keep changing: start over rather than grow
                self._cache.clear()
            pointers = self._pointers(tensors)
            exe_args, adapted = self.compiled.generate_execution_args(*pointers, *ints, *map(Float32, floats), stream)
            # each pointer is one entry at the front, the address of a cell holding its address (checked once per
            # key): later calls splice in cells of their own (make_ptr's object was 2 µs per tensor)
            if (any(len(p.__c_pointers__()) != 1 for p in pointers) or len(exe_args) < len(pointers)
                    or any(exe_args[i] != p.__c_pointers__()[0]
                           or (ctypes.c_void_p.from_address(exe_args[i]).value or 0) != _address(t)
                           for i, (p, t) in enumerate(zip(pointers, tensors)))):
                raise RuntimeError("unexpected argument marshalling")
            cached = self._cache[key] = (list(exe_args), (adapted, stream))  # what the list points into
        cells = self._cells(tensors)
        args = list(cached[0])
        args[:len(cells)] = [ctypes.addressof(c) for c in cells]
        return args, cells

    def _cells(self, tensors) -> list[ctypes.c_void_p]:
        """Each tensor's data address in a C cell, ValueError where it breaks its pointer's alignment (as
        make_ptr's assertion would)."""
        cells = []
        for t, (_, align) in zip(tensors, self.pointer_types, strict=True):
            address = _address(t)
            if address % align:
                raise ValueError(f"a {align}-byte aligned data pointer is required, got {address:#x}")
            cells.append(ctypes.c_void_p(address))
        return cells

    def __call__(self, tensors, ints: tuple, floats: tuple, stream: Any) -> None:
        if not self.supported:
            self.compiled(*self._pointers(tensors), *ints, *map(Float32, floats), stream)
            return
        args, cells = self.execution_args(tensors, ints, floats, stream)
        self.compiled.run_compiled_program(args)
        del cells  # alive until here


# id of a compiled pointer-convention variant (alive in _compile_cache.CACHE for the process) -> its FastCall
_CALLERS: dict[int, FastCall] = {}


def caller(compiled: Any, pointer_types: list[tuple[type, int]]) -> FastCall:
    """The FastCall of a compiled variant, made on first use."""
    fast = _CALLERS.get(id(compiled))
    if fast is None:
        fast = _CALLERS[id(compiled)] = FastCall(compiled, pointer_types)
    return fast

