"""Describing calls and deciding which backend may run them."""

from .call import AttentionCall, describe_call, validate
from .reasons import BackendUnsupportedError, Reason, ReasonCode

__all__ = ["AttentionCall", "BackendUnsupportedError", "Reason", "ReasonCode", "describe_call", "validate"]
