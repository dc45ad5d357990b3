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


@pytest.fixture
def deterministic_algorithms():
    """torch.use_deterministic_algorithms(True, warn_only=True) for the test, the previous setting restored after."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)
