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


def record_launch_kwargs(monkeypatch, *kernels: str) -> dict[str, list[dict]]:
    """Wrap `_launch.launch` so that each launch of the named kernels records its keyword arguments (name -> list,
    in launch order); the launches still run."""
    kws: dict[str, list[dict]] = {name: [] for name in kernels}
    real = _launch.launch

    def launch(kernel, grid, args, kw):
        if kernel.fn.__name__ in kws:
            kws[kernel.fn.__name__].append(kw)
        return real(kernel, grid, args, kw)

    monkeypatch.setattr(_launch, "launch", launch)
    return kws
