"""The `triton` backend: our Triton FlashAttention kernels and their declared limits."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from ..call import AttentionCall
from ..reasons import Reason, ReasonCode


@functools.cache
def _triton_missing() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "the `triton` package is not installed (pip install triton)"
    return None


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class TritonBackend:
    """Limits of fa_backend/kernels/triton, as data; `why_not` returns every failing rule."""

    NAME = "triton"
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MULTIPLE = 8
    MAX_HEAD_DIM = 256
    MIN_CAPABILITY = (8, 0)
    SUPPORTS_GQA = True
    SUPPORTS_HEAD_DIM_V_NE_HEAD_DIM = True
    SUPPORTS_BACKWARD = True
    IS_DETERMINISTIC = True

    @classmethod
    def why_not(cls, call: AttentionCall) -> list[Reason]:
        reasons: list[Reason] = []
        missing = _triton_missing()
        if missing:
            reasons.append(Reason(ReasonCode.NOT_INSTALLED, missing))
        if call.device_type == "cuda":
            cap = call.capability
            if cap is not None and cap < cls.MIN_CAPABILITY:
                reasons.append(Reason(ReasonCode.CAPABILITY,
                                      f"requires compute capability >= {cls.MIN_CAPABILITY}, the GPU has {cap}"))
        elif not (call.device_type == "cpu" and _interpreter_on()):
            reasons.append(Reason(ReasonCode.DEVICE,
                                  f"device={call.device_type} (supported: cuda; cpu only under TRITON_INTERPRET=1)"))
        if call.dtype not in cls.SUPPORTED_DTYPES:
            reasons.append(Reason(ReasonCode.DTYPE,
                                  f"dtype={call.dtype} (supported: torch.float16, torch.bfloat16; inputs are never downcast)"))
        for name, dim in (("head_dim", call.head_dim), ("head_dim_v", call.head_dim_v)):
            if dim % cls.HEAD_DIM_MULTIPLE or not 0 < dim <= cls.MAX_HEAD_DIM:
                reasons.append(Reason(ReasonCode.HEAD_DIM,
                                      f"{name}={dim} (supported: multiples of {cls.HEAD_DIM_MULTIPLE} up to {cls.MAX_HEAD_DIM})"))
        return reasons
