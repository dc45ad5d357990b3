"""What every backend provides: a stable NAME, why_not(call) and run(...)."""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from ..call import AttentionCall
from ..reasons import Reason


class Backend:
    """Backends are classes with classmethods only; limits are class attributes (data)."""

    NAME: ClassVar[str]
    # Human labels of the backend's kernels, by kernel name, for a backend with more than one.
    KERNEL_LABELS: ClassVar[dict[str, str]] = {}

    @classmethod
    def why_not(cls, call: AttentionCall) -> list[Reason]:
        """Every reason this backend cannot run `call`; empty when it can."""
        raise NotImplementedError

    @classmethod
    def kernel_for(cls, call: AttentionCall) -> tuple[str, tuple[Reason, ...]]:
        """The kernel this backend would run `call` on (its key in stats()["runs"]; measured-speed rules
        may name it) and every reason its preferred kernel for the call is not that one (empty when it
        is). A backend with one kernel returns its own name."""
        return cls.NAME, ()

    @classmethod
    def eager_runner(cls, call: AttentionCall, kernel: str | None):
        """A callable taking run()'s arguments after `call`, for eager calls described by `call` that this
        backend runs on `kernel` (the router caches it with its decision, so per-call work that only
        depends on the description is done once)."""
        return functools.partial(cls.run, call)

    @classmethod
    def run(cls, call: AttentionCall, sdpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool, scale: float | None,
            enable_gqa: bool) -> torch.Tensor:
        """Run an eligible call. `sdpa` is the intercepted PyTorch function (used by fallbacks)."""
        raise NotImplementedError
