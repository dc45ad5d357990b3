"""The correctness rule itself (tests/reference.py) must be able to fail."""

from __future__ import annotations

import pytest
import torch

from tests.reference import assert_within_bar, rounding_floor


def test_rounding_floor_is_half_an_ulp_of_the_largest_value():
    ref = torch.tensor([0.1, -2.05, 1.0], dtype=torch.float64)
    assert rounding_floor(ref, torch.float16) == 0.5 * 2.0 ** -10 * 2.0  # |2.05| is in [2, 4)
    assert rounding_floor(ref, torch.bfloat16) == 0.5 * 2.0 ** -7 * 2.0
    assert rounding_floor(torch.zeros(3, dtype=torch.float64), torch.float16) == 0.0


def test_bar_rejects_errors_beyond_twice_the_baseline():
    ref = torch.randn(64, 16, dtype=torch.float64)
    same = ref.half()  # PyTorch-like: one rounding
    ulp_top = 2 * rounding_floor(ref, torch.float16)
    assert_within_bar("ok", ref.half(), same, ref)
    worse = (ref + 3 * ulp_top).half()  # three ulps of the largest value off everywhere
    with pytest.raises(AssertionError, match="max error"):
        assert_within_bar("bad", worse, same, ref)
    with pytest.raises(AssertionError, match="non-finite"):
        assert_within_bar("nan", torch.full_like(same, float("nan")), same, ref)
