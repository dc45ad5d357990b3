"""Describing calls and deciding which backend may run them."""

from .call import AttentionCall, validate
from .counters import reset_stats, stats
from .explain import Explanation, explain
from .reasons import BackendUnsupportedError, Reason, ReasonCode
from .select import Decision, select
from .state import sdpa_backends

__all__ = ["AttentionCall", "BackendUnsupportedError", "Decision", "Explanation", "Reason", "ReasonCode", "explain",
           "reset_stats", "sdpa_backends", "select", "stats", "validate"]
