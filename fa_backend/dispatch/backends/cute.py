"""The `cute` backend: placeholder until fa_backend's CuTe DSL kernels exist (issue 7)."""

from __future__ import annotations

import importlib.util

from ..call import AttentionCall
from ..reasons import Reason, ReasonCode
from .base import Backend

_DSL_INSTALLED = importlib.util.find_spec("cutlass") is not None  # probed once, at import
_MESSAGE = "fa_backend's CuTe DSL kernels are not built yet; " + (
    "nvidia-cutlass-dsl is installed" if _DSL_INSTALLED else
    "nvidia-cutlass-dsl is not installed either (pip install -e '.[cute]')")


class CuteBackend(Backend):
    NAME = "cute"

    @classmethod
    def why_not(cls, call: AttentionCall) -> list[Reason]:
        return [Reason(ReasonCode.NOT_INSTALLED, _MESSAGE)]

    @classmethod
    def run(cls, call, sdpa, *args):
        raise RuntimeError("the cute backend has no kernels yet")
