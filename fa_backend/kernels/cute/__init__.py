"""fa_backend's CuTe DSL kernels (nvidia-cutlass-dsl), Hopper sm90 first.

Importing this package never imports `cutlass`: `_availability` reads package metadata only, and
`_compile_cache` holds compiled kernels per variant. Modules that build kernels (`probe_kernels`,
`flash_fwd`, `flash_fwd_ws`, `flash_bwd`) import the DSL and are imported only when a kernel is compiled.
"""

from ._availability import DSL_AVAILABLE, DSL_MISSING, DSL_VERSION

__all__ = ["DSL_AVAILABLE", "DSL_MISSING", "DSL_VERSION"]
