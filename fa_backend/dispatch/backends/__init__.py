"""Backends in priority order; each answers why_not(call) -> list[Reason] and runs eligible calls."""

from .base import Backend
from .cute import CuteBackend
from .pytorch import MathBackend, TorchBackend, pytorch_choice
from .triton import TritonBackend

BACKENDS: dict[str, type[Backend]] = {b.NAME: b for b in (CuteBackend, TritonBackend, TorchBackend, MathBackend)}
PRIORITY: tuple[str, ...] = tuple(BACKENDS)

__all__ = ["BACKENDS", "PRIORITY", "Backend", "CuteBackend", "MathBackend", "TorchBackend", "TritonBackend",
           "pytorch_choice"]
