"""Fixtures of the Triton kernel tests."""

from __future__ import annotations

import pytest

from fa_backend.kernels.triton import _launch, flash_bwd_split, flash_fwd_split


@pytest.fixture
def split_launches(monkeypatch):
    """The split-column kernels (head dims 129-192) switched on; yields the names of the kernels launched, in
    order."""
    monkeypatch.setattr(flash_fwd_split, "ENABLED", True)
    monkeypatch.setattr(flash_bwd_split, "ENABLED", True)
    names = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, args, kw: names.append(kernel.fn.__name__)
                        or real(kernel, grid, args, kw))
    return names
