"""Routing state: the process-wide switch and the per-thread backend restriction.

Plain containers on purpose: torch.compile guards on them, so changing either causes a
recompile instead of a stale decision (a ContextVar would break the graph instead).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from .backends import PRIORITY

ROUTING = {"enabled": False}


class _ThreadState(threading.local):
    def __init__(self):
        self.allowed: tuple[str, ...] | None = None  # set in every thread: guards see one shape


_LOCAL = _ThreadState()
# The TorchFunctionMode class that routes SDPA calls (registered by fa_backend.integrations.sdpa).
ROUTER_TYPES: list[type] = []


def routing_active() -> bool:
    """Whether an SDPA call made now, in this thread, would be routed through the dispatcher."""
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, tuple(ROUTER_TYPES)) and m.active() for m in _get_current_function_mode_stack())


def allowed_backends() -> tuple[str, ...] | None:
    """This thread's restriction (from sdpa_backends), or None for all backends in priority order."""
    return _LOCAL.allowed


def _normalize(backends: str | Sequence[str]) -> tuple[str, ...]:
    names = (backends,) if isinstance(backends, str) else tuple(backends)
    if not names:
        raise ValueError("sdpa_backends() needs at least one backend name")
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"backend names are strings, got {type(name).__name__}: {name!r}")
        if name not in PRIORITY:
            raise ValueError(f"unknown backend {name!r}; available: {', '.join(PRIORITY)}")
    return tuple(dict.fromkeys(names))


@contextlib.contextmanager
def sdpa_backends(backends: str | Sequence[str]) -> Iterator[None]:
    """Restrict routed attention calls to `backends`, tried in the given order.

    Like `torch.nn.attention.sdpa_kernel`: the setting is this thread's, nests (the outer setting
    comes back on exit) and works inside torch.compile. If no listed backend can run a call, it
    raises BackendUnsupportedError with every reason instead of using another backend.
    """
    names = _normalize(backends)
    previous = allowed_backends()
    _LOCAL.allowed = names
    try:
        yield
    finally:
        _LOCAL.allowed = previous
