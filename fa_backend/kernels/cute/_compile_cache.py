"""Compiled CuTe kernels, one per variant and process; a variant that fails to compile is tried once.

`cute.compile` never caches: it compiles with `compile_only`, which turns the DSL's in-memory and file
caches off (nvidia-cutlass-dsl 4.8.1, `base_dsl/dsl.py`; its log says `module_hash=[None]`). So each
variant is compiled once here and kept, keyed on everything that changes the generated code.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..._logging import LOGGER
from ._availability import DSL_VERSION

CACHE_DIR_ENV = "FA_BACKEND_CUTE_CACHE_DIR"
DSL_CACHE_DIR_ENV = "CUTE_DSL_CACHE_DIR"
_LOG = LOGGER.getChild("cute")


@dataclasses.dataclass(frozen=True)
class CompileKey:
    """Everything that selects generated code. `gqa_ratio` is heads_q // heads_kv; `alignment` is the
    causal alignment ("top_left" / "bottom_right"), "none" when not causal; `tile` the tile config."""

    kernel: str
    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    causal: bool
    alignment: str
    gqa_ratio: int
    tile: tuple[int, ...]
    arch: str


class CompileFailedError(RuntimeError):
    """A variant failed to compile (now or earlier in this process: it is not retried)."""

    def __init__(self, key: CompileKey, message: str):
        self.key, self.message = key, message
        super().__init__(f"CuTe kernel {key.kernel} failed to compile for {key}: {message}")


class CompileCache:
    """key -> compiled kernel, and key -> error message for variants that failed (never retried)."""

    def __init__(self) -> None:
        self._compiled: dict[CompileKey, Any] = {}
        self._failed: dict[CompileKey, str] = {}
        self._lock = threading.Lock()  # one compile at a time: no variant is compiled twice

    def __len__(self) -> int:
        return len(self._compiled)

    def failed_any(self) -> bool:
        """Whether any variant failed to compile in this process (a cheap test before building a key)."""
        return bool(self._failed)

    def failure(self, key: CompileKey) -> str | None:
        """Why `key` failed to compile in this process, or None."""
        return self._failed.get(key)

    def get_or_compile(self, key: CompileKey, build: Callable[[], Any]) -> Any:
        """The compiled kernel for `key`, from `build()` on first use. A failure is logged once (warning
        on logger "fa_backend.cute") and recorded; later calls raise CompileFailedError without building."""
        compiled = self._compiled.get(key)
        if compiled is not None:
            return compiled
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
            if key in self._failed:
                raise CompileFailedError(key, self._failed[key])
            try:
                compiled = build()
            except Exception as e:  # noqa: BLE001 - any DSL error marks the variant as failed
                lines = str(e).strip().splitlines()
                message = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
                self._failed[key] = message
                _LOG.warning("CuTe kernel %s failed to compile for %s (not retried in this process): %s",
                             key.kernel, key, message)
                raise CompileFailedError(key, message) from e
            self._compiled[key] = compiled
            return compiled

    def clear(self) -> None:
        with self._lock:
            self._compiled.clear()
            self._failed.clear()


CACHE = CompileCache()


def enable_dsl_disk_cache() -> str:
    """Point the DSL's own file cache (CUTE_DSL_CACHE_DIR) at fa_backend's directory, unless the user
    set it; returns the directory in use. FA_BACKEND_CUTE_CACHE_DIR chooses ours (default
    $XDG_CACHE_HOME/fa_backend/cute-dsl-<version>, i.e. under ~/.cache).

    The DSL consults this cache for implicit @cute.jit calls only; `cute.compile` bypasses it (see the
    module docstring), so reuse across processes of what CompileCache holds needs an export
    (`export_to_c`), not done yet.
    """
    current = os.environ.get(DSL_CACHE_DIR_ENV)
    if current:
        return current
    path = os.environ.get(CACHE_DIR_ENV, "").strip()
    if not path:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        path = os.path.join(base, "fa_backend", f"cute-dsl-{DSL_VERSION or 'none'}")
    os.makedirs(path, exist_ok=True)
    os.environ[DSL_CACHE_DIR_ENV] = path
    return path
