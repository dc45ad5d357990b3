"""Shared state handling for the integration tests: routing off, counters and log-once memory empty."""

import pytest
import torch

import fa_backend
from fa_backend import _logging


@pytest.fixture
def clean_state():
    fa_backend.disable()
    fa_backend.reset_stats()
    _logging.reset_once()
    torch._dynamo.reset()
    yield
    fa_backend.disable()
    torch._dynamo.reset()


@pytest.fixture
def no_speed_preferences(monkeypatch):
    """Routing mechanics under test, not speed: no measured preference passes over our kernel. (On a GPU
    the tests' small shapes are host-bound calls, which the preference sends to PyTorch's kernels.)"""
    from fa_backend.dispatch import preference
    from fa_backend.integrations import modules, sdpa

    monkeypatch.setattr(preference, "PREFERENCES", ())
    for memo in (sdpa._CACHE, modules._DECISIONS, modules._FAST_PATH_MEMO, modules._HOST_BOUND_MEMO):
        memo.clear()
    yield
    for memo in (sdpa._CACHE, modules._DECISIONS, modules._FAST_PATH_MEMO, modules._HOST_BOUND_MEMO):
        memo.clear()


@pytest.fixture(autouse=True)
def cute_off(request, monkeypatch):
    """Routing mechanics are tested with the cute backend turned off (reason `not_installed`, as where the
    DSL is missing), so that the reasons and counters these tests expect do not depend on whether
    nvidia-cutlass-dsl is installed. Tests marked `cute` see the backend as it is."""
    if request.node.get_closest_marker("cute") is None:
        from fa_backend.dispatch.backends import cute

        monkeypatch.setattr(cute, "KERNELS_ENABLED", False)
    yield
