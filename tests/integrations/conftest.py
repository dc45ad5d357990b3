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
