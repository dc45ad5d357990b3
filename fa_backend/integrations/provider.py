"""fa_backend as a PyTorch flash-attention provider (`torch.nn.attention` registry, torch >= 2.11).

    import fa_backend.integrations.provider as provider
    handle = provider.activate()          # or: with provider.activate(): ...
    ...                                   # SDPA calls that PyTorch sends to FLASH run our Triton kernels
    handle.remove()                       # PyTorch's kernels (and its cuDNN setting) are back

What it does. `activate()` registers the impl "fa_backend" with
`torch.nn.attention.register_flash_attention_impl` (if not done yet) and activates it with
`torch.nn.attention.activate_flash_attention_impl("fa_backend")`. The registry then calls our register
function, which overrides, for the CUDA dispatch key (`torch.library.Library("aten", "IMPL")`,
`with_keyset=True`), the two ops PyTorch runs when its SDPA selector picks FLASH:
`aten::_scaled_dot_product_flash_attention` and `aten::_scaled_dot_product_flash_attention_backward`.
Those ops are also what the C++ fast paths of `nn.MultiheadAttention` / `nn.TransformerEncoderLayer`,
Inductor graphs and context-parallel ring attention call, none of which a Python-level router sees.
Importing this module (or fa_backend) registers and activates nothing: PyTorch's registry asks
providers not to activate on import. `torch.nn.attention.activate_flash_attention_impl("fa_backend")`
works too once `register()` has run, and `torch.nn.attention.restore_flash_attention_impl()` undoes it.

Which calls run our kernels. A forward call runs our Triton kernels when dropout_p == 0,
return_debug_mask is False and `TritonBackend.why_not` has nothing against the call (fp16/bf16, head
dims multiples of 8 up to 256, sm80+, ...), and the value head dim equals the query's (the op's output
has the query's shape). Every other call goes to the kernel that was registered before ours (PyTorch's
FlashAttention-2), captured with `torch.library.get_kernel` and called with `call_boxed`; each distinct
fallback reason is logged once (INFO, logger "fa_backend.dispatch"). The backward takes the same
decision from the same metadata (dtypes, shapes, device, dropout_p): a forward run by us is
differentiated by us, a forward run by PyTorch by PyTorch. (return_debug_mask is not known to the
backward; it needs no rule there, since FlashAttention-2 raises for a debug mask without dropout, and
dropout alone already sends both directions to PyTorch.) The decision reads no mutable state, not even
`fa_backend.sdpa_backends(...)`: autograd runs CUDA backwards in its own threads, where a
thread-local restriction set around the forward is not visible. Causal calls use bottom-right
alignment, like FlashAttention-2 (>= 2.1) behind this op; it equals SDPA's top-left one when
seqlen_q == seqlen_k, the only causal case PyTorch's selector sends to FLASH.

cuDNN first (torch 2.11 on Hopper). PyTorch picks at most one fused backend per call, in its priority
order. In aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, `priority_order()` initialises the
order lazily, on the first SDPA call, to [CUDNN, FLASH, EFFICIENT, MATH] on sm90/sm100 when
cuDNN > 9.15 (`check_prefer_cudnn_attention`, opt-out env TORCH_CUDNN_SDPA_DEPRIORITIZED read once);
measured on an H200 with torch 2.11: every bf16/fp16 call went to cuDNN and a flash-only override
received no call. With `prefer_over_cudnn=True` (the default, also when the registry activates us
directly) we therefore turn cuDNN SDPA off with the public `torch.backends.cuda.enable_cudnn_sdp(False)`
while active; FLASH is then the first enabled backend. Deactivation turns it back on only if it was on
before and is still off (a user who changed it in between keeps their setting). Rejected alternative:
reordering the priority (`torch._C._set_sdp_priority_order`, what `sdpa_kernel(..., set_priority=True)`
uses) would keep cuDNN for the calls FLASH cannot take (masks), but it is a private function and the
lazy initialisation above overwrites an order set before the process's first SDPA call, so it would
silently not work in the common "activate, then run the model" sequence. Consequence of our choice:
while active, calls FLASH cannot take (attn_mask, head dims > 256, fp32) go to PyTorch's
memory-efficient or math kernels instead of cuDNN. Pass `prefer_over_cudnn=False` to leave cuDNN on
(then select FLASH yourself, e.g. `sdpa_kernel(SDPBackend.FLASH_ATTENTION)`).

torch.compile chooses the SDPA backend while tracing and does not guard on these settings: activate
before compiling (or call `torch._dynamo.reset()` after activating), else compiled code keeps calling
the backend chosen at trace time. `torch.nn.attention.sdpa_kernel(...)` blocks restore every backend
flag on exit, including the cuDNN flag we turned off if the block was entered before `activate()`.

Outputs follow PyTorch's meta kernels (torch/_meta_registrations.py), so Inductor's stride asserts hold:
out = `torch.empty_like(query)` (same strides as a dense query), logsumexp fp32 (b, h, seqlen_q)
contiguous, cum_seq_q/k None, max_q/max_k Python ints, rng_state uint64 (2,) and unused uint64 () zeros
on the query's device, debug mask `empty(0)` of the query's dtype; gradients are `empty_like` their
inputs.

Availability: the registry exists from torch 2.11; elsewhere `register()` is a no-op that returns
False and `unavailable_reason()` says why. On a PyTorch build without CUDA (no CUDA kernel to fall back
to) `register()` still works and `activate()` raises RuntimeError. ROCm builds are not supported.
"""

from __future__ import annotations

import collections
import logging
import math
import warnings

import torch

from .. import _logging
from .._device import precompute_capabilities
from ..dispatch import counters
from ..dispatch.backends.triton import TritonBackend
from ..dispatch.call import AttentionCall
from ..dispatch.reasons import Reason, ReasonCode

NAME = "fa_backend"
FORWARD_OP = "_scaled_dot_product_flash_attention"
BACKWARD_OP = "_scaled_dot_product_flash_attention_backward"
# The dispatch key we override. Tests on CPU-only builds point it at "Meta" to exercise the
# registration/fallback machinery without CUDA; nothing else should change it.
_DISPATCH_KEY = "CUDA"

_LOG = _logging.DISPATCH_LOGGER
_STATS: collections.Counter = collections.Counter()
_ACTIVATION = {"prefer_over_cudnn": True}  # read by the register function (the registry passes no args)
_STATE: dict = {"registered": False, "override": None}


# --- availability -----------------------------------------------------------------------------------

def _registry():
    """torch.nn.attention if it has the provider registry, else None."""
    attention = torch.nn.attention
    names = ("register_flash_attention_impl", "activate_flash_attention_impl",
             "restore_flash_attention_impl", "current_flash_attention_impl", "list_flash_attention_impls")
    return attention if all(hasattr(attention, n) for n in names) else None


def unavailable_reason(for_activation: bool = False) -> str | None:
    """Why this torch cannot register (or, with for_activation, activate) the provider; None if it can."""
    if _registry() is None:
        return (f"torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl "
                "(the flash-attention provider registry appeared in torch 2.11)")
    if not for_activation:
        return None
    if not hasattr(torch.library, "get_kernel"):
        return f"torch {torch.__version__} has no torch.library.get_kernel (needed to fall back to PyTorch's kernels)"
    if getattr(torch.version, "hip", None):
        return "ROCm builds of PyTorch are not supported by the provider path"
    for op in (FORWARD_OP, BACKWARD_OP):
        try:
            torch.library.get_kernel(f"aten::{op}", _DISPATCH_KEY)
        except Exception as e:  # noqa: BLE001 - any failure means there is nothing to override/fall back to
            return (f"the provider path overrides PyTorch's CUDA FlashAttention kernels and needs a CUDA build of "
                    f"PyTorch; this one (torch {torch.__version__}) has no {_DISPATCH_KEY} kernel for aten::{op} ({e})")
    return None


# --- the decision ------------------------------------------------------------------------------------

def why_not(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dropout_p: float = 0.0,
            return_debug_mask: bool = False) -> list[Reason]:
    """Every reason our Triton kernels cannot run this flash-op call; [] means they run it.

    Metadata only (dtype, shapes, device, flags). The backward asks with its own dropout_p and
    return_debug_mask=False, and gets the forward's answer (see the module docstring).
    """
    call = AttentionCall.from_tensors(query, key, value, dropout_p=dropout_p, enable_gqa=True,
                                      causal_alignment="bottom_right")
    reasons = list(TritonBackend.why_not(call))
    if dropout_p > 0:
        # aten's flash op carries dropout through its Philox seed/offset (rng_state) contract, which
        # the backward and PyTorch's own tests rely on; our kernels draw their own mask, so dropout
        # stays with PyTorch's kernel on this path.
        reasons.append(Reason(ReasonCode.DROPOUT, f"dropout_p={dropout_p} on PyTorch's flash op (its Philox "
                                                  "seed/offset contract is not implemented; supported: 0.0 there)"))
    if return_debug_mask:
        reasons.append(Reason(ReasonCode.DROPOUT, "return_debug_mask=True (the dropout debug mask comes from "
                                                  "PyTorch's FlashAttention-2 only)"))
    if call.ranks == (4, 4, 4) and call.head_dim_v != call.head_dim:
        reasons.append(Reason(ReasonCode.HEAD_DIM, f"head_dim_v={call.head_dim_v} != head_dim={call.head_dim} "
                                                   "(this op's output has the query's shape)"))
    return reasons


_DECISIONS: dict = {}


def _decide(query, key, value, dropout_p, return_debug_mask) -> tuple[Reason, ...]:
    """why_not, memoised on the metadata it reads (a few microseconds instead of ~15 per call)."""
    k = (type(query), type(key), type(value), query.device, query.dtype, key.dtype, value.dtype,
         tuple(query.shape), tuple(key.shape), tuple(value.shape), float(dropout_p), bool(return_debug_mask))
    reasons = _DECISIONS.get(k)
    if reasons is None:
        if len(_DECISIONS) > 4096:
            _DECISIONS.clear()
        reasons = _DECISIONS[k] = tuple(why_not(query, key, value, dropout_p=dropout_p,
                                                return_debug_mask=return_debug_mask))
    return reasons


def forward_decision(args: dict) -> tuple[Reason, ...]:
    """The decision for a forward call, from its arguments by name ([] / () = our kernels)."""
    return _decide(args["query"], args["key"], args["value"], args["dropout_p"], args["return_debug_mask"])


def backward_decision(args: dict) -> tuple[Reason, ...]:
    """The decision for a backward call, from its arguments by name: the forward's decision."""
    return _decide(args["query"], args["key"], args["value"], args["dropout_p"], False)


def _note_fallback(op: str, reasons, query, key, value) -> None:
    direction = "backward" if op == BACKWARD_OP else "forward"
    _STATS[f"fallback_{direction}"] += 1
    for r in reasons:
        _STATS[f"fallback_{direction}:{r.code.value}"] += 1
    codes = tuple(r.code.value for r in reasons)
    what = (query.device.type, query.dtype, query.shape[-1:], value.shape[-1:])
    _logging.log_once(("provider", op, codes, what), _LOG, logging.INFO,
                      "provider: aten::%s for q=%s k=%s v=%s (%s, %s) runs PyTorch's kernel: %s", op,
                      tuple(query.shape), tuple(key.shape), tuple(value.shape), query.dtype, query.device.type,
                      "; ".join(map(str, reasons)))


# --- running our kernels -----------------------------------------------------------------------------

def _scale(query: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(query.size(-1)) if scale is None else float(scale)


def new_forward_outputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple:
    """The 9 outputs of aten::_scaled_dot_product_flash_attention, allocated as its meta kernel does.

    (out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask); out and
    logsumexp are uninitialised, rng_state/unused are zeros (no dropout ran). FlashAttention-2 puts
    rng_state/unused on the CUDA device; the meta kernel reports them on "meta", so they follow query.
    """
    b, h, sq = query.size(0), query.size(1), query.size(2)
    out = torch.empty_like(query)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=query.device)
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=query.device)
    unused = torch.zeros((), dtype=torch.uint64, device=query.device)
    debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, sq, key.size(2), rng_state, unused, debug_mask


class _DeviceGuard:
    """Make the query's CUDA device current (the dispatcher sets no device guard for Python kernels)."""

    def __init__(self, t: torch.Tensor):
        self.index = t.device.index if t.device.type == "cuda" else None
        self.prev = None

    def __enter__(self):
        if self.index is not None:
            current = torch.cuda.current_device()
            if current != self.index:
                self.prev = current
                torch.cuda.set_device(self.index)

    def __exit__(self, *exc):
        if self.prev is not None:
            torch.cuda.set_device(self.prev)


def run_forward(query, key, value, is_causal: bool = False, scale: float | None = None) -> tuple:
    """Our kernels as aten::_scaled_dot_product_flash_attention (inputs must pass `why_not`)."""
    from ..kernels.triton import flash_fwd

    outputs = new_forward_outputs(query, key, value)
    with _DeviceGuard(query):
        flash_fwd(query, key, value, _scale(query, scale), bool(is_causal), True, out=outputs[0], lse=outputs[1])
    return outputs


def run_backward(grad_out, query, key, value, out, logsumexp, is_causal: bool = False,
                 scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Our kernels as aten::_scaled_dot_product_flash_attention_backward: (dq, dk, dv), empty_like inputs."""
    from ..kernels.triton import flash_bwd

    with _DeviceGuard(query):
        return flash_bwd(grad_out, query, key, value, out, logsumexp.contiguous(), _scale(query, scale),
                         bool(is_causal), True)


# --- the override ------------------------------------------------------------------------------------

def _binder(op_name: str):
    """(args, kwargs) -> {argument name: value}, defaults from the installed torch's schema."""
    schema = getattr(torch.ops.aten, op_name).default._schema
    names = [a.name for a in schema.arguments]
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}

    def bind(args, kwargs) -> dict:
        values = dict(defaults)
        values.update(zip(names, args))
        values.update(kwargs)
        return values

    return bind


_BINDERS: dict = {}


def bind_args(op_name: str, args, kwargs) -> dict:
    """The arguments of a call to aten::<op_name> by schema name, defaults filled in."""
    bind = _BINDERS.get(op_name)
    if bind is None:
        bind = _BINDERS[op_name] = _binder(op_name)
    return bind(args, kwargs)


def _destroy(library) -> None:
    """Deregister a Library's kernels now (dropping the last reference would do it too, later)."""
    destroy = getattr(library, "_destroy", None)
    if destroy is not None:
        destroy()


class _Override:
    """Our kernels for the flash ops under one dispatch key, in front of the kernels found there.

    Also the handle PyTorch's registry keeps (it calls `remove()`); it owns the torch.library.Library
    and the cuDNN change.
    """

    def __init__(self, dispatch_key: str = "CUDA"):
        self.dispatch_key = dispatch_key
        # Captured before our registration: calling torch.ops.aten.<op> from its own override recurses.
        self.orig_forward = torch.library.get_kernel(f"aten::{FORWARD_OP}", dispatch_key)
        self.orig_backward = torch.library.get_kernel(f"aten::{BACKWARD_OP}", dispatch_key)
        self.library = None
        self.cudnn_turned_off = False

    @property
    def installed(self) -> bool:
        return self.library is not None

    def forward(self, keyset, *args, **kwargs):
        a = bind_args(FORWARD_OP, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        reasons = forward_decision(a)
        if reasons:
            _note_fallback(FORWARD_OP, reasons, q, k, v)
            return self.orig_forward.call_boxed(keyset, *args, **kwargs)
        _STATS["forward"] += 1
        counters.record_run("triton")
        return run_forward(q, k, v, a["is_causal"], a["scale"])

    def backward(self, keyset, *args, **kwargs):
        a = bind_args(BACKWARD_OP, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        reasons = backward_decision(a)
        if reasons:
            _note_fallback(BACKWARD_OP, reasons, q, k, v)
            return self.orig_backward.call_boxed(keyset, *args, **kwargs)
        _STATS["backward"] += 1
        return run_backward(a["grad_out"], q, k, v, a["out"], a["logsumexp"], a["is_causal"], a["scale"])

    def install(self, prefer_over_cudnn: bool) -> _Override:
        library = torch.library.Library("aten", "IMPL", self.dispatch_key)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
                library.impl(FORWARD_OP, self.forward, self.dispatch_key, with_keyset=True)
                library.impl(BACKWARD_OP, self.backward, self.dispatch_key, with_keyset=True)
        except BaseException:
            _destroy(library)
            raise
        self.library = library
        if prefer_over_cudnn and torch.backends.cuda.cudnn_sdp_enabled():
            torch.backends.cuda.enable_cudnn_sdp(False)
            self.cudnn_turned_off = True
        return self

    def remove(self) -> None:
        """Give the flash ops back to the kernels registered before ours and undo the cuDNN change."""
        library, self.library = self.library, None
        if library is not None:
            _destroy(library)
        if self.cudnn_turned_off:
            self.cudnn_turned_off = False
            if not torch.backends.cuda.cudnn_sdp_enabled():
                torch.backends.cuda.enable_cudnn_sdp(True)
        if _STATE["override"] is self:
            _STATE["override"] = None


def _register_fn() -> _Override:
    """What PyTorch's registry calls on activate_flash_attention_impl("fa_backend")."""
    problem = unavailable_reason(for_activation=True)
    if problem:
        raise RuntimeError(f"cannot activate the fa_backend flash-attention provider: {problem}")
    previous = _STATE["override"]
    if previous is not None:  # installed outside the registry: never stack two of ours
        previous.remove()
    precompute_capabilities()
    override = _Override(_DISPATCH_KEY).install(bool(_ACTIVATION["prefer_over_cudnn"]))
    _STATE["override"] = override
    return override


# --- public API ----------------------------------------------------------------------------------------

def register() -> bool:
    """Register "fa_backend" with torch.nn.attention's provider registry (idempotent; activates nothing).

    Returns False, logging why once, where the installed torch has no registry.
    """
    problem = unavailable_reason()
    if problem:
        _logging.log_once(("provider", "unavailable"), _LOG, logging.INFO, "provider not registered: %s", problem)
        return False
    registry = _registry()
    if not _STATE["registered"] or NAME not in registry.list_flash_attention_impls():
        registry.register_flash_attention_impl(NAME, register_fn=_register_fn)
        _STATE["registered"] = True
    return True


class ProviderHandle:
    """Returned by `activate()`: `remove()` (or the end of a `with` block) gives PyTorch its kernels back."""

    def __init__(self, override: _Override):
        self._override = override

    @property
    def active(self) -> bool:
        return self._override.installed

    def remove(self) -> None:
        """Restore PyTorch's flash kernels (torch.nn.attention.restore_flash_attention_impl) and cuDNN setting."""
        if not self._override.installed:
            return
        registry = _registry()
        if registry is not None and registry.current_flash_attention_impl() == NAME:
            registry.restore_flash_attention_impl()
        self._override.remove()

    def __enter__(self) -> ProviderHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<fa_backend provider handle, {'active' if self.active else 'removed'}>"


def activate(prefer_over_cudnn: bool = True) -> ProviderHandle:
    """Make PyTorch's FLASH SDPA path run fa_backend's kernels; see the module docstring.

    prefer_over_cudnn: turn cuDNN SDPA off while active so that FLASH is chosen where PyTorch would
    pick cuDNN first (torch 2.11 on Hopper); restored by `remove()`/`deactivate()`.
    Raises RuntimeError where the provider cannot work (no registry, no CUDA build, ROCm).
    """
    problem = unavailable_reason(for_activation=True)
    if problem:
        raise RuntimeError(f"cannot activate the fa_backend flash-attention provider: {problem}")
    register()
    _ACTIVATION["prefer_over_cudnn"] = bool(prefer_over_cudnn)
    try:
        _registry().activate_flash_attention_impl(NAME)
    finally:
        _ACTIVATION["prefer_over_cudnn"] = True
    override = _STATE["override"]
    if override is None:  # pragma: no cover - the registry always calls our register function
        raise RuntimeError("activating the fa_backend provider installed nothing")
    return ProviderHandle(override)


def deactivate() -> None:
    """Give PyTorch its flash kernels and cuDNN setting back (idempotent)."""
    registry = _registry()
    if registry is not None and registry.current_flash_attention_impl() == NAME:
        registry.restore_flash_attention_impl()
    override = _STATE["override"]
    if override is not None:
        override.remove()


def is_active() -> bool:
    """Whether our kernels currently sit in front of PyTorch's flash ops."""
    override = _STATE["override"]
    return override is not None and override.installed


def stats() -> dict:
    """Calls seen by the override: {"forward": n, "backward": n, "fallback_forward": n,
    "fallback_forward:<reason code>": n, ...} (reset with reset_stats())."""
    return dict(_STATS)


def reset_stats() -> None:
    _STATS.clear()


__all__ = ["NAME", "ProviderHandle", "activate", "backward_decision", "bind_args", "deactivate", "forward_decision", "is_active",
           "new_forward_outputs", "register", "reset_stats", "run_backward", "run_forward", "stats",
           "unavailable_reason", "why_not"]
