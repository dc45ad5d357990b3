"""Routing unchanged `F.scaled_dot_product_attention` calls through the dispatcher.

A TorchFunctionMode sees every SDPA call made from Python (user code, third-party models,
`torch.ops.aten.scaled_dot_product_attention`), in eager mode and while torch.compile traces, where
Dynamo inlines the mode so that the chosen op lands in the graph with no graph break. Decisions
use metadata only. The mode stack is per thread: `enable()` pushes the router in the calling thread
and in every thread started afterwards; threads that already existed keep running unrouted, and
`fa_backend.stats()["routing"]` tells, for the current thread, whether routing is active.

`nn.MultiheadAttention` / `nn.TransformerEncoderLayer`: with any TorchFunctionMode active PyTorch
skips their fused C++ fast path and runs `F.multi_head_attention_forward`, whose inner SDPA call a
mode cannot see. The router therefore hands `multi_head_attention_forward` to `mha.route_mha`,
which computes the common form itself with the attention routed (eager and compiled).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .. import _logging
from .._device import precompute_capabilities
from ..dispatch import counters as _stats
from ..dispatch.backends import BACKENDS, pytorch_choice
from ..dispatch.backends.pytorch import direct_runner
from ..dispatch.call import AttentionCall
from ..dispatch.reasons import ReasonCode
from ..dispatch.select import Decision, faster_peer, select
from ..dispatch.state import _LOCAL as _LOCAL_STATE
from ..dispatch.state import ROUTER_TYPES, ROUTING, allowed_backends, routing_active
from ..kernels import keep_bits as _keep_bits
from . import mha as _mha
from . import modules as _modules

_SDPA = F.scaled_dot_product_attention
_is_compiling = torch.compiler.is_compiling
_ATEN_SDPA = torch.ops.aten.scaled_dot_product_attention
_ATEN_SDPA_DEFAULT = torch.ops.aten.scaled_dot_product_attention.default
_MHA = F.multi_head_attention_forward
_LOG = _logging.DISPATCH_LOGGER
_LOG_DEBUG = functools.partial(_LOG.isEnabledFor, logging.DEBUG)


def _bind_sdpa(args, kwargs):
    """SDPA's arguments by name: (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)."""
    names = ("attn_mask", "dropout_p", "is_causal")
    defaults = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    q, k, v = args[:3] if len(args) >= 3 else (tuple(args) + tuple(kwargs[n] for n in ("query", "key", "value")[len(args):]))
    values = dict(defaults)
    for name, value in zip(names, args[3:]):
        values[name] = value
    for name in defaults:
        if name in kwargs:
            values[name] = kwargs[name]
    return q, k, v, values["attn_mask"], values["dropout_p"], values["is_causal"], values["scale"], values["enable_gqa"]


@torch.compiler.assume_constant_result
def _note_trace(backend: str, skipped: str) -> bool:
    """Runs once per compilation (its result is baked into the graph): log and count the decision."""
    _stats.record_traced(backend, skipped)
    if skipped:
        _logging.log_once(("traced", backend, skipped), _LOG, logging.INFO,
                          "torch.compile: SDPA call routed to %s; skipped %s", backend, skipped)
    else:
        _LOG.debug("torch.compile: SDPA call routed to %s", backend)
    return True


def _passed_over(call: AttentionCall, decision: Decision) -> dict[str, tuple]:
    """{backend or kernel: reasons} of what the decision passed over: the backends tried before the one that
    runs and, for a decode call that backend runs on another of its kernels, the kernel it did not use
    (e.g. "triton_decode" when the call needs grad; dense calls report none: every training call would).
    A backend that is not installed (or not enabled) is summarised by that reason alone: its other reasons
    are noise in counters and logs until it can run anything (explain() still lists them all)."""
    passed = {name: tuple(r for r in reasons if r.code is ReasonCode.NOT_INSTALLED) or reasons
              for name, reasons in decision.rejected.items()}
    if call.kind == "decode" and decision.kernel_rejected:
        other = [k for k in BACKENDS[decision.backend].KERNEL_LABELS if k != decision.kernel]
        passed["+".join(other)] = decision.kernel_rejected
    return passed


_OWN_OPS = ("cute", "triton")  # backends whose ops count their runs and take autocast-cast inputs


class _Routed:
    """A cached eager decision: what runs, and the counters one such call bumps (tallied in `calls`, folded
    into the counters when they are read)."""

    __slots__ = ("call", "decision", "cast", "run_key", "fallback_keys", "run", "calls")

    def __init__(self, call: AttentionCall, decision: Decision, cast, q=None, k=None, v=None, is_causal=False,
                 scale=None):
        self.call, self.decision, self.cast = call, decision, cast
        # run(sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa): what the decision runs
        direct = (direct_runner(call, q, k, v, is_causal, scale) if decision.backend == "torch" and not cast
                  and q is not None else None)
        self.run = direct or BACKENDS[decision.backend].eager_runner(call, decision.kernel)
        self.calls = 0
        # our ops count their own runs (compiled or not: "cute", "triton" and "triton_decode"), so calls
        # routed to them add none here
        self.run_key = None if decision.backend in _OWN_OPS else decision.backend
        passed = _passed_over(call, decision)
        self.fallback_keys = tuple(f"{name}:{r.code.value}" for name, rs in passed.items() for r in rs)
        ran = decision.kernel or decision.backend
        for name, reasons in passed.items():
            codes = tuple(r.code.value for r in reasons)
            if codes != ("not_installed",):
                key = (name, codes, call.device_type, call.dtype, call.head_dim, call.head_dim_v, call.heads_q,
                       call.heads_kv)
                _logging.log_once(key, _LOG, logging.INFO, "%s skipped for %s: %s; ran %s", name, call.shape_class(),
                                  "; ".join(str(r) for r in reasons), ran)
        _stats.defer(self)

    def count(self) -> None:
        self.calls += 1
        if _LOG_DEBUG():
            self.log()

    def log(self) -> None:
        _LOG.debug("routed %s to %s", self.call.describe(), self.decision.backend)


# Eager decisions keyed on everything the eligibility rules (and PyTorch's kernel checks, for direct runners)
# read; bounded, cleared when full.
_CACHE: dict = {}
_CACHE_LIMIT = 4096
_UNIT = (1,)
_C = torch._C


def _clear_cache() -> None:
    _stats.release([e for e in _CACHE.values() if e])  # count the cached decisions' calls before they go
    _CACHE.clear()


def _describe(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, cast):
    if cast is not None:
        # PyTorch's autocast casts SDPA's inputs to the autocast dtype: decide on what would run.
        q, k, v = (t.to(cast) if t.is_floating_point() else t for t in (q, k, v))
    return AttentionCall.from_tensors(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _preferred_kernel_refuses(decision: Decision, call: AttentionCall, q, k, v, attn_mask, dropout_p, is_causal,
                              scale, enable_gqa) -> bool:
    """True when a measured preference passed over one of our kernels for PyTorch's, but PyTorch
    would not run the kernel that preference is about for these tensors (eager only)."""
    for name, reasons in decision.rejected.items():
        if any(r.code is ReasonCode.SLOWER for r in reasons):
            rule = faster_peer(name, call)
            return rule is not None and pytorch_choice(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                                       enable_gqa) not in rule.choices
    return False


def _autocast_dtype(q) -> torch.dtype | None:
    device = q.device.type
    return torch.get_autocast_dtype(device) if device in ("cuda", "cpu") and torch.is_autocast_enabled(device) else None


# one cheap call says whether any autocast is on (the per-device queries cost more; torch >= 2.4)
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _eager_decision(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> _Routed:
    cast = _autocast_dtype(q) if _ANY_AUTOCAST is None or _ANY_AUTOCAST() else None
    allowed = _LOCAL_STATE.allowed  # allowed_backends(), without the call
    # the mask's strides too: a key mask expanded over the queries (stride 0) and a materialised one of the same
    # shape are different calls to the cute backend (a key mask, or a mask it refuses)
    mask_key = None if attn_mask is None else (type(attn_mask), attn_mask.dtype, attn_mask.shape, attn_mask.stride(),
                                               attn_mask.requires_grad)
    key = (type(q), type(k), type(v), q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.shape, k.shape,
           v.shape, mask_key, dropout_p, is_causal, enable_gqa, allowed, cast, _C._get_cudnn_sdp_enabled(),
           _C._get_mem_efficient_sdp_enabled(), _C._get_flash_sdp_enabled(),
           _C._get_deterministic_algorithms(), _C._get_deterministic_algorithms_warn_only(),  # cuDNN's availability
           torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
           _keep_bits.KEEP_BITS_BUDGET,  # dropout training calls: whether the CuTe forward saves its keep bits
           (q.is_contiguous() and k.is_contiguous() and v.is_contiguous())  # cheaper; implies the next but for
           or (q.stride()[-1:] == _UNIT and k.stride()[-1:] == _UNIT and v.stride()[-1:] == _UNIT))  # a size-1 dim
    entry = _CACHE.get(key)
    if entry is None:
        call = _describe(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, cast)
        decision = select(call, allowed)  # raises when a restriction fits nothing
        if allowed is None and _preferred_kernel_refuses(decision, call, q, k, v, attn_mask, dropout_p, is_causal,
                                                         scale, enable_gqa):
            decision = select(call, allowed, preferences=False)
        entry = _Routed(call, decision, cast, q, k, v, is_causal, scale)
        if len(_CACHE) >= _CACHE_LIMIT:
            _clear_cache()
        _CACHE[key] = entry
    return entry


def route_sdpa(sdpa, args, kwargs) -> torch.Tensor:
    """Decide and run one intercepted SDPA call (`sdpa` is the function that was called)."""
    if not kwargs and len(args) == 3:  # the common call, bound without building dicts
        (q, k, v), attn_mask, dropout_p, is_causal, scale, enable_gqa = args, None, 0.0, False, None, False
    else:
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa = _bind_sdpa(args, kwargs)
    if not _is_compiling():
        entry = _eager_decision(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        entry.calls += 1  # entry.count(), inlined: this path is a tiny call's host time
        if _LOG_DEBUG():
            entry.log()
        if entry.cast is not None and entry.decision.backend in _OWN_OPS:
            q, k, v = (t.to(entry.cast) for t in (q, k, v))
        return entry.run(sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # traced by torch.compile: decided from metadata at trace time, the chosen op lands in the graph
    cast = _autocast_dtype(q)
    call = _describe(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, cast)
    decision = select(call, allowed_backends())
    _note_trace(decision.kernel or decision.backend, ",".join(
        f"{n}:{'+'.join(r.code.value for r in rs)}" for n, rs in _passed_over(call, decision).items()))
    if decision.backend in _OWN_OPS and cast is not None:
        q, k, v = (t.to(cast) for t in (q, k, v))
    return BACKENDS[decision.backend].run(call, sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# --- the mode -----------------------------------------------------------------------------------

class SDPARouter(TorchFunctionMode):
    """Routes SDPA calls while active: process-wide instances follow `enable()`/`disable()`,
    scoped ones (from `enabled()`) are active for as long as they are on the stack."""

    def __init__(self, scoped: bool = False):
        super().__init__()
        self.scoped = scoped

    def active(self) -> bool:
        return self.scoped or ROUTING["enabled"]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA or func is _ATEN_SDPA_DEFAULT or func is _ATEN_SDPA:
            if self.active():
                return route_sdpa(func, args, kwargs)
        elif func is _MHA and self.active():
            return _mha.route_mha(args, kwargs, route_sdpa, _note_trace)
        return func(*args, **kwargs)


ROUTER_TYPES.append(SDPARouter)

# --- switching routing on and off ---------------------------------------------------------------

_PREVIOUS_THREAD_PROFILE = {"hook": None, "installed": False}


def _own_router_on_stack() -> SDPARouter | None:
    for mode in _get_current_function_mode_stack():
        if isinstance(mode, SDPARouter) and not mode.scoped:
            return mode
    return None


def _thread_start_hook(frame, event, arg):
    """Installed with threading.setprofile: runs at the start of every new thread once."""
    previous = _PREVIOUS_THREAD_PROFILE["hook"]
    sys.setprofile(previous)
    if ROUTING["enabled"] and _own_router_on_stack() is None:
        SDPARouter().__enter__()  # stays for the thread's lifetime; inert after disable()
    if previous is not None:
        return previous(frame, event, arg)
    return None


def enable() -> None:
    """Route every SDPA call through fa_backend, process-wide (idempotent).

    Covers the calling thread and threads started from now on; threads that were already running
    are not reached (call `enable()` or use `enabled()` in them).
    """
    precompute_capabilities()
    _modules.install()
    _clear_cache()
    ROUTING["enabled"] = True
    if _own_router_on_stack() is None:
        SDPARouter().__enter__()
    if not _PREVIOUS_THREAD_PROFILE["installed"]:
        _PREVIOUS_THREAD_PROFILE.update(hook=threading.getprofile(), installed=True)
        threading.setprofile(_thread_start_hook)


def disable() -> None:
    """Stop routing (idempotent). Routers left in other threads' mode stacks become inert."""
    ROUTING["enabled"] = False
    _clear_cache()
    stack = _get_current_function_mode_stack()
    if stack and isinstance(stack[-1], SDPARouter) and not stack[-1].scoped:
        stack[-1].__exit__(None, None, None)
    if _PREVIOUS_THREAD_PROFILE["installed"]:
        threading.setprofile(_PREVIOUS_THREAD_PROFILE["hook"])
        _PREVIOUS_THREAD_PROFILE.update(hook=None, installed=False)


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Route SDPA calls made in this thread inside the block (nests with enable())."""
    precompute_capabilities()
    _modules.install()
    if routing_active():
        yield
        return
    with SDPARouter(scoped=True):
        yield


__all__ = ["SDPARouter", "disable", "enable", "enabled", "route_sdpa", "routing_active"]
