"""Fixtures of the op tests."""

import pytest
import torch

import fa_backend


@pytest.fixture
def clean():
    """Routing off, statistics and Dynamo's caches reset, before and after the test."""
    fa_backend.disable()
    fa_backend.reset_stats()
    torch._dynamo.reset()
    yield
    fa_backend.disable()
    torch._dynamo.reset()
