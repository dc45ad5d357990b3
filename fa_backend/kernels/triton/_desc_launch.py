"""Fast launches of kernels that take host TMA descriptors (`_tma.head_tiles`): each descriptor encoded once per
address, shape, strides and tile, and the arguments handed to Triton's C launcher directly.

Triton 3.6 wraps the C launcher of such a kernel in a Python loop over every argument
(`driver.wrap_handle_tensordesc`) that encodes each descriptor again (cuTensorMapEncodeTiled) on every launch: on
an H100 host the backward's four descriptors raised its host time from ~126 to ~163 µs per call. An encoded
descriptor is a pure function of (address, shape, strides, element type, tile, swizzle, padding), so the encoding
is cached under exactly that key; no tensor is referenced by the cache."""

from __future__ import annotations

from triton.runtime import _allocation

_ENCODED: dict = {}  # (address, tile key, padding, *shape, *strides) -> the launcher's arguments for one descriptor
_MAX_ENCODED = 4096
_BASE_ARGS = 13  # Triton 3.6's launcher: grid (3), stream, function, cooperative, pdl, two scratches, four metadata


class DescriptorLaunch:
    """How to launch one compiled kernel whose arguments include host descriptors (built by `plan`)."""

    __slots__ = ("runner", "raw", "encode", "descs")

    def __init__(self, runner, raw, encode, descs: tuple):
        self.runner = runner  # the compiled kernel's CudaLauncher (scratch sizes, cooperative / PDL flags)
        self.raw = raw  # Triton's C launcher, without the per-argument Python wrapper
        self.encode = encode  # Triton's make_tensordesc_arg (fills the CUtensorMap)
        self.descs = descs  # (position in the bound arguments, Triton's metadata, its hashable key), last first

    def __call__(self, compiled, gx: int, gy: int, gz: int, stream: int, values: list) -> None:
        args = list(values)
        encoded = _ENCODED
        for pos, meta, tile in self.descs:  # last first: splicing keeps the earlier positions valid
            d = args[pos]
            key = (d.base.data_ptr(), tile, d.padding, *d.shape, *d.strides)
            enc = encoded.get(key)
            if enc is None:
                enc = self.encode(d, meta)
                if len(encoded) >= _MAX_ENCODED:
                    encoded.clear()
                encoded[key] = enc
            args[pos:pos + 1] = enc
        run = self.runner
        programs = gx * gy * gz * run.num_ctas
        scratch = profile = None
        if run.global_scratch_size > 0:
            scratch = _allocation._allocator.get()(programs * run.global_scratch_size, run.global_scratch_align,
                                                   stream)
        if run.profile_scratch_size > 0:
            profile = _allocation._profile_allocator.get()(programs * run.profile_scratch_size,
                                                           run.profile_scratch_align, stream)
        self.raw(gx, gy, gz, stream, compiled.function, run.launch_cooperative_grid, run.launch_pdl, scratch, profile,
                 compiled.packed_metadata, None, None, None, *args)


def plan(compiled) -> DescriptorLaunch | None:
    """A DescriptorLaunch for a compiled kernel that takes host descriptors; None when it takes none or its launcher
    is not laid out as Triton 3.6's (`compiled.run` then launches it, encoding on every call)."""
    runner = getattr(compiled, "run", None)
    inner = getattr(runner, "launch", None)
    code, cells = getattr(inner, "__code__", None), getattr(inner, "__closure__", None)
    if code is None or cells is None or set(code.co_freevars) != {"launcher", "tensordesc_indices",
                                                                 "tensordesc_meta"}:
        return None  # no descriptor argument (the C launcher itself), or another Triton's wrapper
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells)))
    encode = inner.__globals__.get("make_tensordesc_arg")
    metas = free["tensordesc_meta"]
    if (encode is None or inner.__globals__.get("_BASE_ARGS_FORMAT_LEN") != _BASE_ARGS
            or len(metas) != len(free["tensordesc_indices"]) or any(m is None for m in metas)
            or not all(hasattr(runner, a) for a in ("num_ctas", "global_scratch_size", "global_scratch_align",
                                                     "profile_scratch_size", "profile_scratch_align",
                                                     "launch_cooperative_grid", "launch_pdl"))):
        return None
    descs = tuple((pos, meta, (meta["swizzle"], meta["elem_size"], meta["elem_type"], tuple(meta["block_size"]),
                               meta["fp4_padded"]))
                  for pos, meta in zip(sorted(free["tensordesc_indices"]), metas))
    return DescriptorLaunch(runner, free["launcher"], encode, descs[::-1])
