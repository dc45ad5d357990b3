"""Is nvidia-cutlass-dsl installed, and which version: probed once, at import, without importing it.

Importing `cutlass` loads the DSL's MLIR libraries (about a second), so the probe reads package metadata
only. The results are module constants: code traced by torch.compile reads them without side effects.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re

DISTRIBUTION = "nvidia-cutlass-dsl"
MIN_VERSION = (4, 8)
INSTALL_HINT = "pip install -e '.[cute]'"


def _major_minor(version: str) -> tuple[int, int]:
    """(4, 8) from "4.8.1" or "4.8.0rc1"; (0, 0) when the version does not start with "major.minor"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else (0, 0)


def probe() -> tuple[str | None, str | None]:
    """(installed version or None, why the DSL cannot be used or None).

    The distribution must be installed and provide the `cutlass` module (the older `nvidia-cutlass`
    package also provides a `cutlass` module, without the DSL: the distribution name tells them apart).
    """
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None, f"{DISTRIBUTION} is not installed ({INSTALL_HINT})"
    if importlib.util.find_spec("cutlass") is None:
        return version, f"{DISTRIBUTION} {version} is installed but its `cutlass` module is not importable"
    if _major_minor(version) < MIN_VERSION:
        wanted = ".".join(map(str, MIN_VERSION))
        return version, f"{DISTRIBUTION} {version} is older than {wanted} ({INSTALL_HINT})"
    return version, None


DSL_VERSION, DSL_MISSING = probe()
DSL_AVAILABLE: bool = DSL_MISSING is None
