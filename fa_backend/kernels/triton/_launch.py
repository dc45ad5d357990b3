"""Host-side helpers shared by the Triton launchers."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _compile_options(version: str | None = None) -> dict:
    """Compile options every launch names. FMA contraction is asked for explicitly from Triton 3.9 on, which warns
    that its default turns it off in 3.10: the kernels' tiles and timings assume it (an exp2 argument is one FMA
    per score). Nothing before 3.9, where it is the default: compiled kernels and their cache keys stay as they
    are."""
    if version is None:
        try:
            import triton
        except ImportError:
            return {}
        version = triton.__version__
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return {}
    return {"enable_fp_fusion": True} if (major, minor) >= (3, 9) else {}


COMPILE_OPTIONS = _compile_options()


def pad_head_dim(d: int) -> int:
    """Tile width for a head dim: Triton tiles are powers of two and tl.dot needs K >= 16."""
    return max(16, 1 << (d - 1).bit_length())  # next power of two (triton.next_power_of_2 is a JIT call)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host ints (triton.cdiv goes through Triton's JIT call machinery: µs per call)."""
    return -(-a // b)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 132 (an H100 / H200) off the GPU, where only the
    shape of what depends on it matters."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


_SM_COUNTS: dict[int, int] = {}


def tile_dims(d: int, dv: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_DV) for head dims d and dv.

    When both dims need column masks and pad to different widths (e.g. d=40 -> 64, dv=24 -> 32),
    Triton 3.6 produced wrong forward outputs on sm90 with 64-key tiles (seen on an H200; the
    interpreter was right). Both are then padded to the wider tile, a combination that tested
    correct.
    """
    block_d, block_dv = pad_head_dim(d), pad_head_dim(dv)
    if block_d != d and block_dv != dv and block_d != block_dv:
        block_d = block_dv = max(block_d, block_dv)
    return block_d, block_dv


def grid_1d(n_programs: int) -> tuple[int]:
    """A 1-D launch grid; axis 0 allows 2**31 - 1 programs, unlike the 65535 of axes 1 and 2."""
    if n_programs >= 2**31:
        raise ValueError(f"attention launch needs {n_programs} programs, more than the 2**31 - 1 a grid allows")
    return (n_programs,)


# Test hook: fill every output buffer with NaN before the kernels run, so that an element a
# kernel fails to write shows up as NaN instead of as stale memory. Off in normal use.
POISON_OUTPUTS = os.environ.get("FA_BACKEND_DEBUG_POISON", "0") == "1"


def poison(*tensors) -> None:
    if POISON_OUTPUTS:
        for t in tensors:
            t.fill_(float("nan"))


# Fast launches: JITFunction.run binds and specialises every argument, hashes a cache key and builds
# launch metadata on every call, tens of µs of Python for a ~50-argument kernel; that bounds small
# attention calls and decode steps. `launch` does that work once per key of the arguments'
# specialisation classes, then calls the compiled kernel's launcher directly. The launcher's calling
# convention is Triton's own (CompiledKernel.run as JITFunction.run calls it), so the fast path is on
# by default only for the Triton versions it was validated on (bitwise against the JIT path on an
# H200: tests/kernels/triton/test_fast_launch_gpu.py); FA_BACKEND_FAST_LAUNCH=1 / 0 forces it on / off.
_VALIDATED_TRITON = ("3.6.",)


def _fast_launch_default() -> bool:
    env = os.environ.get("FA_BACKEND_FAST_LAUNCH")
    if env is not None:
        return env == "1"
    try:
        import triton
    except ImportError:
        return False
    return triton.__version__.startswith(_VALIDATED_TRITON)


FAST_LAUNCH = _fast_launch_default()


def _int_class(a: int) -> tuple[int, int]:
    """Triton's type (0: i32, 1: i64, 2: u64, else by value) and divisibility class (2: == 1, 1: % 16 == 0)."""
    if -0x80000000 <= a <= 0x7FFFFFFF:
        width = 0
    elif -0x8000000000000000 <= a <= 0x7FFFFFFFFFFFFFFF:
        width = 1
    elif 0 <= a <= 0xFFFFFFFFFFFFFFFF:
        width = 2
    else:
        return a, a
    return width, 2 if a == 1 else 0 if a & 15 else 1


_INT_CLASSES: dict = {}  # int -> _int_class(int): strides, sizes and lengths repeat from call to call


def spec_key(args) -> tuple | None:
    """What Triton's JIT specialises runtime arguments on (triton 3.6 native_specialize_impl), one entry per
    argument: None, float (fp32) and bool (u1) by type; an int by its integer type (i32 / i64 / u64 by
    range) and class (== 1, a constant; divisible by 16; other); a tensor by dtype and 16-byte alignment; a host
    TMA descriptor by its dtype and block shape (and padding).
    Stricter than the JIT (do_not_specialize ints are classed too), never looser; None for an argument of
    another type."""
    key = []
    ints = _INT_CLASSES
    for a in args:
        t = type(a)
        if t is int:
            c = ints.get(a)
            if c is None:
                c = _int_class(a)
                if len(ints) < 65536:
                    ints[a] = c
            key.append(c)
        elif t is float or t is bool or a is None:
            key.append(t)
        elif isinstance(a, torch.Tensor):
            key.append((a.dtype, not a.data_ptr() & 15))
        elif t.__name__ == "TensorDescriptor":  # a host TMA descriptor (_tma.head_tiles): its dtype and block
            key.append((t, a.base.dtype, tuple(a.block_shape), a.padding))
        else:
            return None  # another type (a NumPy scalar, ...): the JIT path specialises it
    return tuple(key)


_FAST: dict = {}
_LAYOUTS: dict = {}
_PARAM_NAMES: dict = {}
_INTERPRET = interpreting()  # fixed before the kernels are defined (the interpreter replaces them)


def _current_device_and_stream():
    from triton.runtime import driver

    device = driver.active.get_current_device()
    return device, driver.active.get_current_stream(device)


def _hooks_active() -> bool:
    """Launch hooks installed (a profiler): keep the JIT path, which builds their metadata. Triton 3.6's
    defaults are empty HookChains, which the JIT path still calls on every launch."""
    from triton import knobs

    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


_MISSING = object()


def _layout(kernel) -> tuple | None:
    """(name, is_constexpr, default) of each kernel parameter, or None when the kernel does not look like a
    triton 3.6 JITFunction."""
    entry = _LAYOUTS.get(id(kernel))
    if entry is None:
        params = getattr(kernel, "params", None)
        if params is None:
            return None
        entry = tuple((p.name, bool(p.is_constexpr), p.default if getattr(p, "has_default", False) else _MISSING)
                      for p in params)
        _LAYOUTS[id(kernel)] = entry
        _PARAM_NAMES[id(kernel)] = frozenset(name for name, _, _ in entry)
    return entry


def _bind(layout: tuple, names: frozenset, args: tuple, kwargs: dict):
    """Every parameter's value in signature order (defaults filled in, as the JIT binds them), the runtime
    ones, the constexpr ones and the remaining keywords (compile options); None if a parameter is missing
    or a positional argument lands on a constexpr."""
    kw_names = tuple(kwargs)
    plan_key = (id(layout), len(args), kw_names)
    plan = _BIND_PLANS.get(plan_key)
    if plan is None:
        plan = _bind_plan(layout, names, len(args), kw_names)
        if len(_BIND_PLANS) >= 4096:
            _BIND_PLANS.clear()
        _BIND_PLANS[plan_key] = plan
    if plan is False:
        return None
    tail_spec, runtime_tail, const_tail, option_names = plan
    tail = [kwargs[name] if from_kw else default for name, from_kw, default in tail_spec]
    values = [*args, *tail]
    runtime = [*args, *[tail[j] for j in runtime_tail]]
    return values, runtime, tuple([tail[j] for j in const_tail]), tuple([(n, kwargs[n]) for n in option_names])


# (id(layout), number of positional arguments, keyword names in call order) -> what `_bind` does with such a
# call, worked out once (a call site passes the same names every time): the per-call work is then a few list
# builds instead of a walk over every parameter (~60 for the decode kernel).
_BIND_PLANS: dict = {}


def _bind_plan(layout: tuple, names: frozenset, n_args: int, kw_names: tuple):
    """(tail spec, runtime indices into the tail, constexpr indices, option names) or False (unbindable)."""
    if n_args > len(layout) or any(is_constexpr for _, is_constexpr, _ in layout[:n_args]):
        return False
    tail_spec, runtime_tail, const_tail = [], [], []
    for j, (name, is_constexpr, default) in enumerate(layout[n_args:]):
        if name in kw_names:
            tail_spec.append((name, True, None))
        elif default is not _MISSING:
            tail_spec.append((name, False, default))
        else:
            return False
        (const_tail if is_constexpr else runtime_tail).append(j)
    option_names = tuple(n for n in kw_names if n not in names)
    return tuple(tail_spec), tuple(runtime_tail), tuple(const_tail), option_names


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """kernel[grid](*args, **kwargs), with runtime arguments positional or by keyword and every constexpr
    (then compile options) by keyword. With FAST_LAUNCH, repeated launches with the same specialisation
    skip the JIT's per-call work."""
    if COMPILE_OPTIONS:
        kwargs = {**kwargs, **COMPILE_OPTIONS}
    if not FAST_LAUNCH or _INTERPRET:
        kernel[grid](*args, **kwargs)
        return
    layout = _layout(kernel)
    bound = None if layout is None else _bind(layout, _PARAM_NAMES[id(kernel)], args, kwargs)
    hooks = _hooks_active()
    if bound is None or hooks:
        kernel[grid](*args, **kwargs)
        return
    values, runtime, consts, options = bound
    spec = spec_key(runtime)
    if spec is None:
        kernel[grid](*args, **kwargs)
        return
    device, stream = _current_device_and_stream()
    key = (id(kernel), device, spec, consts, options)
    entry = _FAST.get(key)
    if entry is None:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        if compiled is not None and hasattr(compiled, "run"):
            from . import _desc_launch  # (imports Triton's runtime: not at module import)

            if len(_FAST) >= 4096:
                _FAST.clear()
            _FAST[key] = (compiled, _desc_launch.plan(compiled))
        return
    compiled, with_descriptors = entry
    gx, gy, gz = grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1
    if with_descriptors is not None:  # host TMA descriptors: encoded once per address and tile
        with_descriptors(compiled, gx, gy, gz, stream, values)
    else:
        compiled.run(gx, gy, gz, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)
