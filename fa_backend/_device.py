"""GPU facts looked up once per process: each CUDA device's compute capability."""

from __future__ import annotations

import torch

_CAPABILITIES: dict[tuple[str, int], tuple[int, int]] = {}


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (looked up once, then read from a dict); None elsewhere."""
    if device.type != "cuda":
        return None
    key = (device.type, device.index if device.index is not None else 0)
    cap = _CAPABILITIES.get(key)
    if cap is None:
        cap = _CAPABILITIES[key] = tuple(torch.cuda.get_device_capability(key[1]))
    return cap


def precompute_capabilities() -> None:
    """Fill the capability cache for every visible GPU (so traced code only reads a dict)."""
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            device_capability(torch.device("cuda", i))
