"""Choosing a backend: the first eligible one in priority order (or in the user's restriction)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .backends import BACKENDS, PRIORITY
from .call import AttentionCall
from .preference import slower_than_peer
from .reasons import BackendUnsupportedError, Reason


@dataclasses.dataclass(frozen=True)
class Decision:
    """The backend that runs, the reasons of every backend tried before it, and whether the
    candidate list was restricted by the user (sdpa_backends)."""

    backend: str
    rejected: Mapping[str, tuple[Reason, ...]]
    restricted: bool = False


def select(call: AttentionCall, allowed: tuple[str, ...] | None = None, preferences: bool = True) -> Decision:
    """First eligible backend of `allowed` (default: all, in priority order).

    In the default order an eligible backend that a measured rule (dispatch/preference.py) finds
    slower than PyTorch's kernel for this call is passed over with reason `slower`; a user's order
    is followed as given. Raises BackendUnsupportedError listing every reason of every allowed
    backend when none is eligible; with the default order that cannot happen, `math` accepts
    everything.
    """
    rejected: dict[str, tuple[Reason, ...]] = {}
    for name in allowed if allowed is not None else PRIORITY:
        reasons = BACKENDS[name].why_not(call)
        if not reasons and allowed is None and preferences:
            slower = slower_than_peer(name, call)
            reasons = [slower] if slower is not None else reasons
        if not reasons:
            return Decision(name, rejected, allowed is not None)
        rejected[name] = tuple(reasons)
    raise BackendUnsupportedError(call.describe(), rejected)
