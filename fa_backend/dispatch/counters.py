"""Counters: which backend ran how often, and every fallback reason.

Eager calls are counted when routed; our Triton ops count themselves at run time (custom ops run on
every call, compiled or not): "triton" for the dense kernel, "triton_decode" for the split-KV decode
kernel (routed decode calls and flash_attn_with_kvcache). A routed decode call kept off the decode
kernel counts "triton_decode:<reason>" among the fallbacks. Decisions taken while tracing for torch.compile are counted
once per compilation under "traced", since compiled graphs run no Python.
"""

from __future__ import annotations

import collections

_RUNS: collections.Counter = collections.Counter()
_FALLBACKS: collections.Counter = collections.Counter()
_TRACED: collections.Counter = collections.Counter()


def record_run(backend: str) -> None:
    _RUNS[backend] += 1


def record_call(backend: str | None, fallback_keys: tuple[str, ...], n: int = 1) -> None:
    """n routed calls: their backend's runs (None: counted elsewhere) and their "backend:reason" keys."""
    if backend is not None:
        _RUNS[backend] += n
    for key in fallback_keys:
        _FALLBACKS[key] += n


# Tallies that count calls on a cached decision (an object with `run_key`, `fallback_keys` and an int
# `calls`): bumping one int per call instead of a Counter entry per reason; folded in when read.
_TALLIES: dict[int, object] = {}


def defer(tally) -> None:
    """Count `tally.calls` into the counters whenever they are read, until `release(tally)`."""
    _TALLIES[id(tally)] = tally


def fold() -> None:
    """Move the deferred calls into the counters."""
    for tally in list(_TALLIES.values()):
        n = tally.calls
        if n:
            tally.calls -= n
            record_call(tally.run_key, tally.fallback_keys, n)


def release(tallies) -> None:
    """Fold these tallies' calls in and stop tracking them (their cache is being dropped)."""
    for tally in tallies:
        if _TALLIES.pop(id(tally), None) is not None and tally.calls:
            n = tally.calls
            tally.calls -= n
            record_call(tally.run_key, tally.fallback_keys, n)


def record_traced(backend: str, skipped: str) -> None:
    _TRACED[backend if not skipped else f"{backend} (skipped {skipped})"] += 1


def stats() -> dict:
    """{"runs": {backend: n}, "fallbacks": {"backend:reason": n}, "traced": {...}, "routing": {...},
    "provider": {...}} (provider: PyTorch's flash ops overridden by fa_backend.integrations.provider)."""
    from ..integrations import provider
    from .state import ROUTING, allowed_backends, routing_active

    fold()
    return {
        "runs": dict(_RUNS),
        "fallbacks": dict(_FALLBACKS),
        "traced": dict(_TRACED),
        "routing": {"enabled": ROUTING["enabled"], "active_in_this_thread": routing_active(),
                    "allowed_backends": allowed_backends()},
        "provider": {"active": provider.is_active(), **provider.stats()},
    }


def reset_stats() -> None:
    from ..integrations import provider

    provider.reset_stats()
    fold()
    _RUNS.clear()
    _FALLBACKS.clear()
    _TRACED.clear()
