"""Backends as declared limits: each answers why_not(call) -> list[Reason]."""

from .triton import TritonBackend

__all__ = ["TritonBackend"]
