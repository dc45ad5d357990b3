"""Which GPU a CuTe kernel is compiled for, and the `cute.compile` options that say so.

The DSL needs no GPU to compile: the target comes from the `--gpu-arch` option (or CUTE_DSL_ARCH);
without either and without a GPU it assumes sm_100a.
"""

from __future__ import annotations

import os

ARCH_ENV = "FA_BACKEND_CUTE_ARCH"


def arch_for(capability: tuple[int, int]) -> str:
    """The DSL target for a compute capability: (9, 0) -> "sm_90a" (the "a" target has wgmma and
    setmaxnreg; the DSL rejects wgmma for plain "sm_90"). FA_BACKEND_CUTE_ARCH overrides it."""
    override = os.environ.get(ARCH_ENV, "").strip()
    if override:
        return override
    major, minor = capability
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def compile_options(arch: str, dump_dir: str | None = None) -> str:
    """`cute.compile(..., options=...)` for `arch`; with `dump_dir`, the PTX and cubin are written there
    too (the compiled function's `__ptx__` then holds the PTX text)."""
    options = f"--gpu-arch {arch}"
    if dump_dir is not None:
        options += f" --keep-ptx --keep-cubin --dump-dir {dump_dir}"
    return options
