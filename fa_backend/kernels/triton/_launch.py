"""Host-side helpers shared by the Triton launchers."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def pad_head_dim(d: int) -> int:
    """Tile width for a head dim: Triton tiles are powers of two and tl.dot needs K >= 16."""
    return max(16, 1 << (d - 1).bit_length())  # next power of two (triton.next_power_of_2 is a JIT call)


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


# Opt-in fast launches (FA_BACKEND_FAST_LAUNCH=1): JITFunction.run binds and specialises every argument
# and hashes a cache key on every call, tens of µs of Python for a ~30-argument kernel, which is what
# bounds small decode calls. `launch` does that work once per key of the arguments' specialisation classes
# and then calls the compiled kernel's launcher directly. Off by default until validated on a GPU
# (tests/kernels/triton/test_kvcache_gpu.py compares it bitwise with the JIT path).
FAST_LAUNCH = os.environ.get("FA_BACKEND_FAST_LAUNCH", "0") == "1"


def spec_key(args) -> tuple:
    """What Triton's JIT specialises runtime arguments on (triton 3.6 native_specialize_impl), one entry per
    argument: None, float (fp32) and bool (u1) by type; a tensor by dtype and 16-byte alignment; an int in
    i32 range by class (2: == 1, a constant; 1: divisible by 16; 0: other), beyond it by value.
    Stricter than the JIT (do_not_specialize ints are classed too), never looser."""
    key = []
    for a in args:
        t = type(a)
        if t is int:
            if -0x80000000 <= a <= 0x7FFFFFFF:
                key.append(2 if a == 1 else 0 if a & 15 else 1)
            else:
                key.append(a)
        elif t is float or t is bool or a is None:
            key.append(t)
        else:
            key.append((a.dtype, not a.data_ptr() & 15))
    return tuple(key)


_FAST: dict = {}
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


def launch(kernel, grid: tuple, args: tuple, kwargs: dict) -> None:
    """kernel[grid](*args, **kwargs), runtime arguments positional and every constexpr (then options) by
    keyword. With FAST_LAUNCH, repeated launches with the same specialisation skip the JIT's per-call work."""
    if not FAST_LAUNCH or _INTERPRET:
        kernel[grid](*args, **kwargs)
        return
    hooks = _hooks_active()
    device, stream = _current_device_and_stream()
    key = (id(kernel), device, spec_key(args), tuple(kwargs.items()))
    entry = _FAST.get(key)
    if entry is None or hooks:
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        params = getattr(kernel, "params", None)
        if compiled is None or params is None or hooks:
            return
        consts = tuple(kwargs[p.name] for p in params[len(args):] if p.is_constexpr and p.name in kwargs)
        if len(args) + len(consts) != len(params) or any(p.is_constexpr for p in params[:len(args)]):
            return  # not the layout this fast path assumes: stay on the JIT path
        if len(_FAST) >= 4096:
            _FAST.clear()
        _FAST[key] = (compiled, consts)
        return
    compiled, consts = entry
    compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                 compiled.function, compiled.packed_metadata, None, None, None, *args, *consts)
