"""Choosing a backend: the first eligible one in priority order (or in the user's restriction)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from .backends import BACKENDS, PRIORITY
from .call import AttentionCall
from .preference import FasterPeer, peer_for
from .reasons import BackendUnsupportedError, Reason


@dataclasses.dataclass(frozen=True)
class Decision:
    """The backend that runs, the reasons of every backend tried before it, and whether the
    candidate list was restricted by the user (sdpa_backends).

    `kernel` is the backend's kernel that runs (its key in stats()["runs"]: "triton" is the dense
    kernel, "triton_decode" the split-KV decode kernel); `kernel_rejected` says why the backend's
    preferred kernel for the call is not that one (e.g. a decode call needing grad runs "triton").
    """

    backend: str
    rejected: Mapping[str, tuple[Reason, ...]]
    restricted: bool = False
    kernel: str | None = None
    kernel_rejected: tuple[Reason, ...] = ()


def faster_peer(name: str, call: AttentionCall) -> FasterPeer | None:
    """The measured rule (dispatch/preference.py) that passes over backend `name` for this call: a rule
    about the kernel it would run (e.g. "triton_decode") first, then one about the backend itself."""
    kernel = BACKENDS[name].kernel_for(call)[0]
    rule = peer_for(kernel, call) if kernel != name else None
    return rule if rule is not None else peer_for(name, call)


def slower_reason(name: str, call: AttentionCall) -> Reason | None:
    """The reason (code `slower`) to pass over an eligible backend `name` for this call, or None."""
    rule = faster_peer(name, call)
    return None if rule is None else rule.reason()


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
            slower = slower_reason(name, call)
            reasons = [slower] if slower is not None else reasons
        if not reasons:
            kernel, kernel_rejected = BACKENDS[name].kernel_for(call)
            return Decision(name, rejected, allowed is not None, kernel, kernel_rejected)
        rejected[name] = tuple(reasons)
    raise BackendUnsupportedError(call.describe(), rejected)
