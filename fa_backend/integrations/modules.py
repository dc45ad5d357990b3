"""nn.MultiheadAttention / nn.TransformerEncoderLayer while routing is on: routed, and not slower.

A TorchFunctionMode on the stack (the router is one) costs these modules twice: PyTorch turns off
their fused C++ inference fast path (`_native_multi_head_attention`,
`_transformer_encoder_layer_fwd`), and every tensor op of their Python path goes through the mode.
So while routing is active their `forward` (wrapped once, the first time routing is switched on;
the wrappers do nothing while it is off) takes one of three ways:

1. PyTorch's fast path would apply (eval, no grad, no masks, ...) and the dispatcher's decision for
   the module's attention is PyTorch's own kernel anyway (ours ineligible, or measured slower, see
   dispatch/preference.py): the original forward runs with the router lifted off the stack, so the
   fused op runs the same kernel with less host work. For the common `mha(x, x, x, need_weights=False)`
   the wrapper calls that fused op (`torch._native_multi_head_attention`) itself, with the arguments
   PyTorch's forward passes, its checks memoised. Counted and logged as routed to `torch`.
   1b. A host-bound call (dispatch/preference.py's bounds) whose attention runs PyTorch's kernel: the
   original forward, lifted (PyTorch's own Python path is cheaper per call than way 2's).
2. nn.MultiheadAttention in the common form (integrations/mha.py): computed by `mha.mha_forward`
   with the router lifted (no per-op mode cost); its attention goes through the dispatcher.
   nn.TransformerEncoderLayer (exact class) where one of PyTorch's own reasons keeps it off the
   fast path (training, grad, odd heads, ...): its Python forward runs with the router lifted, and
   its self-attention takes way 1 or 2.
3. Anything else, and everything under torch.compile: the original forward with the router on
   the stack (the router handles `F.multi_head_attention_forward`).
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from .._device import device_capability
from ..dispatch import counters as _stats
from ..dispatch.call import AttentionCall
from ..dispatch.preference import TINY_FWD_FLOPS, TINY_KV_BYTES
from ..dispatch.select import select
from ..dispatch.state import ROUTER_TYPES, allowed_backends
from . import mha as _mha

_ORIGINAL: dict[type, object] = {}
_DECISIONS: dict = {}
# The mode stack's own push / pop (torch.overrides._pop_mode_temporarily wraps them in a generator
# context manager, which costs more than the rest of a lifted call's bookkeeping).
_POP = getattr(torch._C, "_pop_torch_function_stack", None)
_PUSH = getattr(torch._C, "_push_on_torch_function_stack", None)
_LIFTED = threading.local()  # set while a module's forward runs with the router lifted off the stack
_NO_MODES = torch._C.DisableTorchFunction
if hasattr(torch._C, "_len_torch_function_stack") and hasattr(torch._C, "_get_function_stack_at"):
    _stack_len, _stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
else:  # pragma: no cover - older torch
    def _stack_len() -> int:
        return len(_get_current_function_mode_stack())

    def _stack_at(i: int):
        return _get_current_function_mode_stack()[i]


def _arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _fast_path_attention(mha: nn.MultiheadAttention, x, masks: tuple) -> AttentionCall | None:
    """The attention call of PyTorch's fast path for this forward, or None if it would not take it."""
    params = mha._parameters  # direct lookups: nn.Module.__getattr__ costs ~1 µs per attribute
    weight, bias = params.get("in_proj_weight"), params.get("in_proj_bias")
    if (mha.training or torch.is_grad_enabled() or not mha.batch_first or mha.num_heads % 2
            or not mha._qkv_same_embed_dim or mha.bias_k is not None or mha.bias_v is not None
            or mha.add_zero_attn or bias is None or weight is None or masks[0] is not None or masks[1] is not None
            or not isinstance(x, torch.Tensor) or x.dim() != 3 or x.is_nested or x.dtype != weight.dtype
            or bias.dtype != x.dtype or x.device.type not in ("cpu", "cuda")
            or torch.is_autocast_enabled() or not torch.backends.mha.get_fastpath_enabled()):
        return None
    b, s, embed = x.shape
    d = embed // mha.num_heads
    return AttentionCall(device_type=x.device.type, capability=device_capability(x.device), dtype=x.dtype, batch=b,
                         heads_q=mha.num_heads, heads_kv=mha.num_heads, seqlen_q=s, seqlen_k=s, head_dim=d,
                         head_dim_v=d)


def _torch_decision(call: AttentionCall | None):
    """The routed record to count when the dispatcher would run PyTorch's kernel for `call`, else None."""
    if call is None:
        return None
    from .sdpa import _Routed

    allowed = allowed_backends()
    key = (call, allowed, torch._C._get_cudnn_sdp_enabled(),
           torch._C._get_deterministic_algorithms(), torch._C._get_deterministic_algorithms_warn_only())
    entry = _DECISIONS.get(key)
    if entry is None:
        if len(_DECISIONS) >= 1024:
            _stats.release([e for e in _DECISIONS.values() if e])
            _DECISIONS.clear()
        try:
            decision = select(call, allowed)
        except RuntimeError:  # a restriction that fits nothing: the routed path raises it
            decision = None
        entry = _DECISIONS[key] = _Routed(call, decision, None) if decision and decision.backend == "torch" else False
    return entry or None


_FAST_PATH_MEMO: dict = {}
_NO_MASKS = (None, None)


def _fast_path_decision(mha: nn.MultiheadAttention, x, masks: tuple):
    """`_torch_decision(_fast_path_attention(...))`, memoised on what both read (host time matters
    most for the small inference calls that take this path)."""
    if not isinstance(x, torch.Tensor) or masks[0] is not None or masks[1] is not None:
        return None
    params = mha._parameters
    weight = params.get("in_proj_weight")
    bias = params.get("in_proj_bias")
    key = (id(mha), type(x), mha.training, torch.is_grad_enabled(), x.shape, x.dtype, x.device, x.is_nested,
           None if weight is None else weight.dtype, None if bias is None else bias.dtype, mha.batch_first,
           mha.num_heads, mha._qkv_same_embed_dim, mha.bias_k is None, mha.bias_v is None, mha.add_zero_attn,
           torch.is_autocast_enabled(), torch.backends.mha.get_fastpath_enabled(),
           allowed_backends(), torch._C._get_cudnn_sdp_enabled(),
           torch._C._get_deterministic_algorithms(), torch._C._get_deterministic_algorithms_warn_only())
    entry = _FAST_PATH_MEMO.get(key)
    if entry is None:
        if len(_FAST_PATH_MEMO) >= 1024:
            _FAST_PATH_MEMO.clear()
        entry = _FAST_PATH_MEMO[key] = _torch_decision(_fast_path_attention(mha, x, masks)) or False
    return entry or None


_make_fx_tracing = getattr(torch.nn.modules.activation, "_is_make_fx_tracing", None)


def _native_self_attention(mha: nn.MultiheadAttention, x: torch.Tensor):
    """What nn.MultiheadAttention.forward(x, x, x, need_weights=False) returns on PyTorch's fast path, for
    a call `_fast_path_decision` has checked (memoised on everything PyTorch's own checks read): the same
    fused op with the same arguments, without re-running those checks in Python on every call."""
    params, out_params = mha._parameters, mha._modules["out_proj"]._parameters
    return torch._native_multi_head_attention(
        x, x, x, mha.embed_dim, mha.num_heads, params["in_proj_weight"], params["in_proj_bias"],
        out_params["weight"], out_params["bias"], None, False, True, None)


def _routing_here() -> str | None:
    """'lifted' inside a module already running with the router lifted, 'top' when an active
    router is the top mode (so it can be lifted), else None (not routing, compiling, other modes)."""
    if _POP is None or torch.compiler.is_compiling():
        return None
    if getattr(_LIFTED, "depth", 0):
        return "lifted"
    depth = _stack_len()
    if depth:
        top = _stack_at(depth - 1)
        if (type(top) in ROUTER_TYPES or isinstance(top, tuple(ROUTER_TYPES))) and top.active():
            return "top"
    return None


def _lifted(where: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) with the router off the stack (already off when `where` is 'lifted')."""
    if where == "lifted":
        return fn(*args, **kwargs)
    state = _LIFTED
    state.depth = getattr(state, "depth", 0) + 1
    mode = _POP()
    try:
        return fn(*args, **kwargs)
    finally:
        _PUSH(mode)
        state.depth -= 1


_MHA_NAMES = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
              "is_causal")
_MHA_DEFAULTS = (None, None, None, None, True, None, True, False)
_MHA_KEYWORDS = tuple(frozenset(_MHA_NAMES[n:]) for n in range(len(_MHA_NAMES) + 1))


def _mha_call(args: tuple, kwargs: dict) -> list | None:
    """nn.MultiheadAttention.forward's arguments in signature order, or None for an unknown form."""
    n = len(args)
    if n > len(_MHA_NAMES) or (kwargs and not kwargs.keys() <= _MHA_KEYWORDS[n]):
        return None  # the original forward reports it
    call = list(args)
    for i in range(n, len(_MHA_NAMES)):
        call.append(kwargs.get(_MHA_NAMES[i], _MHA_DEFAULTS[i]) if kwargs else _MHA_DEFAULTS[i])
    return call


def _mha_arguments(self: nn.MultiheadAttention, call: list) -> dict | None:
    """F.multi_head_attention_forward's arguments for this call if `mha.mha_forward` can run it."""
    query, key, value, key_padding_mask, need_weights, attn_mask, _, is_causal = call
    if need_weights or not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)
                            and isinstance(value, torch.Tensor)):
        return None
    if query.dim() != 3 or query.is_nested or key.is_nested or value.is_nested or torch.is_autocast_enabled():
        return None
    if self.batch_first:  # as the module does: transposed views, keeping which inputs are the same tensor
        if key is value and query is key:
            query = key = value = query.transpose(1, 0)
        elif key is value:
            query, key = query.transpose(1, 0), key.transpose(1, 0)
            value = key
        else:
            query, key, value = query.transpose(1, 0), key.transpose(1, 0), value.transpose(1, 0)
    params, attrs = self._parameters, self.__dict__  # direct lookups: nn.Module.__getattr__ is slow
    out_params = self._modules["out_proj"]._parameters
    a = {
        "query": query, "key": key, "value": value, "embed_dim_to_check": attrs["embed_dim"],
        "num_heads": attrs["num_heads"], "in_proj_weight": params.get("in_proj_weight"),
        "in_proj_bias": params.get("in_proj_bias"), "bias_k": self.bias_k, "bias_v": self.bias_v,
        "add_zero_attn": attrs["add_zero_attn"], "dropout_p": attrs["dropout"],
        "out_proj_weight": out_params["weight"], "out_proj_bias": out_params.get("bias"),
        "training": attrs["training"], "key_padding_mask": key_padding_mask, "need_weights": False,
        "attn_mask": attn_mask, "use_separate_proj_weight": not attrs["_qkv_same_embed_dim"],
        "q_proj_weight": params.get("q_proj_weight"), "k_proj_weight": params.get("k_proj_weight"),
        "v_proj_weight": params.get("v_proj_weight"), "static_k": None, "static_v": None,
        "average_attn_weights": True, "is_causal": is_causal,
    }
    if _mha.direct_form_problem(a) is not None:
        return None
    return a


def _mha_forward_wrapper(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        where = _routing_here()
        if where is None:
            return original(self, *args, **kwargs)
        a = call = None
        with _NO_MODES():  # the checks' own tensor queries need not go through the router
            if (len(args) == 3 and args[0] is args[1] and args[1] is args[2] and len(kwargs) == 1
                    and kwargs.get("need_weights", True) is False):
                routed = _fast_path_decision(self, args[0], _NO_MASKS)  # mha(x, x, x, need_weights=False)
                if (routed is not None and type(args[0]) is torch.Tensor and _make_fx_tracing is not None
                        and not _make_fx_tracing()):
                    # way 1, the common call: PyTorch's fused op directly (its checks are memoised above)
                    if not getattr(_LIFTED, "counted", False):
                        routed.count()
                    return _lifted(where, _native_self_attention, self, args[0])
            else:
                call = _mha_call(args, kwargs)
                if call is None:
                    return original(self, *args, **kwargs)
                query, key, value, key_padding_mask, need_weights, attn_mask = call[:6]
                routed = None
                if query is key and key is value and not need_weights:
                    routed = _fast_path_decision(self, query, (key_padding_mask, attn_mask))
            lean = False
            if routed is None:
                call = call or _mha_call(args, kwargs)
                routed = _host_bound_decision(self, call)  # way 1b when not None
                a = None if routed is not None else _mha_arguments(self, call)
                lean = routed is not None and _lean_form(self, call)
        if routed is not None:  # way 1 (PyTorch's fast path), or 1b (host-bound: PyTorch's kernel)
            if not getattr(_LIFTED, "counted", False):
                routed.count()
            if lean:
                return _lifted(where, _lean_self_attention, self, call[0])  # 1b, self-attention
            return _lifted(where, original, self, *args, **kwargs)
        if a is None:  # way 3
            return original(self, *args, **kwargs) if where == "top" else _unlifted(original, self, *args, **kwargs)
        out, _ = _lifted(where, _mha.mha_forward, a, _route_sdpa())  # way 2
        return (out.transpose(1, 0) if self.batch_first else out), None
    return forward


_HOST_BOUND_MEMO: dict = {}


def _route_sdpa():
    from . import sdpa  # sdpa imports this module; read at call time (tests replace route_sdpa)

    return sdpa.route_sdpa


def _host_bound_decision(mha: nn.MultiheadAttention, call: list):
    """The routed record to count when this call's attention is host-bound (dispatch/preference.py's
    bounds) and the dispatcher runs PyTorch's kernel for it, else None. Such a call gains nothing from
    `mha.mha_forward`, whose Python costs more per call than PyTorch's own path (measured on the CPU
    host: 102 against 82 µs for nn.MultiheadAttention(64, 1) on 16 tokens). Calls with masks: None."""
    query, key, value, key_padding_mask, need_weights, attn_mask, _, is_causal = call
    if (need_weights or attn_mask is not None or key_padding_mask is not None or is_causal
            or not (type(query) is torch.Tensor and type(key) is torch.Tensor and type(value) is torch.Tensor)
            or query.dim() != 3 or key.dim() != 3):
        return None
    params = mha._parameters
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                        or any(p is not None and p.requires_grad for p in params.values()))
    attrs = mha.__dict__
    memo_key = (id(mha), query.shape, key.shape, query.dtype, query.device, attrs["training"], grad,
                allowed_backends(), torch._C._get_cudnn_sdp_enabled(),
                torch._C._get_deterministic_algorithms(), torch._C._get_deterministic_algorithms_warn_only())
    entry = _HOST_BOUND_MEMO.get(memo_key)
    if entry is not None:
        return entry or None
    if len(_HOST_BOUND_MEMO) >= 1024:
        _HOST_BOUND_MEMO.clear()
    (bsz, tgt_len), src_len = query.shape[:2], key.shape[1]
    if not attrs["batch_first"]:
        (tgt_len, bsz), src_len = query.shape[:2], key.shape[0]
    heads, embed = attrs["num_heads"], query.shape[2]
    d = embed // heads
    _HOST_BOUND_MEMO[memo_key] = False
    if (embed % heads == 0 and 4 * bsz * heads * tgt_len * src_len * d < TINY_FWD_FLOPS
            and 2 * bsz * heads * src_len * d * query.element_size() < TINY_KV_BYTES):
        dropout = attrs["dropout"] if attrs["training"] else 0.0
        attention = AttentionCall(device_type=query.device.type, capability=device_capability(query.device),
                                  dtype=query.dtype, batch=bsz, heads_q=heads, heads_kv=heads, seqlen_q=tgt_len,
                                  seqlen_k=src_len, head_dim=d, head_dim_v=d, dropout_p=dropout, requires_grad=grad)
        _HOST_BOUND_MEMO[memo_key] = _torch_decision(attention) or False
    return _HOST_BOUND_MEMO[memo_key] or None


def _lean_form(mha: nn.MultiheadAttention, call: list) -> bool:
    """True for a self-attention call `_lean_self_attention` computes exactly as PyTorch's Python path
    does: query is key is value (a plain batched tensor), no masks, no is_causal, need_weights=False, packed
    in-projection, no bias_k/bias_v, no add_zero_attn, autocast off."""
    query, key, value, key_padding_mask, need_weights, attn_mask, _, is_causal = call
    attrs = mha.__dict__
    return (query is key and key is value and type(query) is torch.Tensor and query.dim() == 3 and not query.is_nested
            and not need_weights and attn_mask is None and key_padding_mask is None and not is_causal
            and attrs["_qkv_same_embed_dim"] and not attrs["add_zero_attn"]
            and mha._parameters.get("in_proj_weight") is not None
            and attrs.get("bias_k", mha._parameters.get("bias_k")) is None
            and attrs.get("bias_v", mha._parameters.get("bias_v")) is None
            and query.shape[-1] == attrs["embed_dim"] and not torch.is_autocast_enabled(query.device.type))


def _lean_self_attention(mha: nn.MultiheadAttention, x: torch.Tensor) -> tuple[torch.Tensor, None]:
    """mha(x, x, x, need_weights=False) for a call `_lean_form` accepts, as the same six tensor ops
    PyTorch's Python path reduces to (packed in-projection, SDPA with PyTorch's own kernel choice, the
    out-projection) without its per-call Python checks and layout copies: way 1b's host-bound calls are
    bounded by exactly that Python. Autograd flows through the ops as usual."""
    attrs, params = mha.__dict__, mha._parameters
    out_params = mha._modules["out_proj"]._parameters
    heads, embed = attrs["num_heads"], attrs["embed_dim"]
    dropout = attrs["dropout"] if attrs["training"] else 0.0
    if attrs["batch_first"]:  # x (b, s, E)
        qkv = F.linear(x, params["in_proj_weight"], params.get("in_proj_bias")).unflatten(-1, (3, heads, -1))
        q, k, v = (qkv.select(2, i).transpose(1, 2) for i in range(3))  # (b, h, s, d) views
        out = F.scaled_dot_product_attention(q, k, v, None, dropout).transpose(1, 2).reshape(x.shape[:2] + (embed,))
    else:  # x (s, b, E)
        qkv = F.linear(x, params["in_proj_weight"], params.get("in_proj_bias")).unflatten(-1, (3, heads, -1))
        q, k, v = (qkv.select(2, i).permute(1, 2, 0, 3) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, None, dropout).permute(2, 0, 1, 3).reshape(x.shape[:2] + (embed,))
    return F.linear(out, out_params["weight"], out_params.get("bias")), None


def _unlifted(fn, *args, **kwargs):
    """fn with the router back on the stack (a module lifted it; this call needs the router's handler)."""
    from .sdpa import SDPARouter

    depth, _LIFTED.depth = _LIFTED.depth, 0
    try:
        with SDPARouter(scoped=True):
            return fn(*args, **kwargs)
    finally:
        _LIFTED.depth = depth


def _encoder_layer_has_no_fast_path(layer: nn.TransformerEncoderLayer, src) -> bool:
    """True when one of PyTorch's own reasons certainly keeps this layer off its fused fast path."""
    attn = layer.self_attn
    if (layer.training or not isinstance(src, torch.Tensor) or src.dim() != 3 or not attn.batch_first
            or attn.in_proj_bias is None or not attn._qkv_same_embed_dim or not layer.activation_relu_or_gelu
            or layer.norm1.eps != layer.norm2.eps or attn.num_heads % 2 == 1 or torch.is_autocast_enabled()
            or not torch.backends.mha.get_fastpath_enabled()):
        return True
    return torch.is_grad_enabled() and (src.requires_grad or any(p.requires_grad for p in layer.parameters()))


_PLAIN_PARAMETER_TYPES = (nn.Parameter, torch.Tensor)
_ENCODER_MEMO: dict = {}


def _any_forward_hooks(module: nn.Module) -> bool:
    """Whether `module` or any submodule has forward (pre-)hooks: PyTorch's check before the fused
    encoder-layer op, without `modules()`' generator and memo (several µs per call)."""
    stack = [module]
    while stack:
        m = stack.pop()
        if m is None:  # a submodule slot set to None
            continue
        if m._forward_hooks or m._forward_pre_hooks:
            return True
        stack.extend(m._modules.values())
    return False


def _encoder_layer_fused_args(layer: nn.TransformerEncoderLayer, src) -> tuple | None:
    """The arguments nn.TransformerEncoderLayer.forward(src) passes to `torch._transformer_encoder_layer_fwd`
    when it takes its fused fast path (no masks), else None. PyTorch's own checks, memoised on what they
    read, except the hooks and parameter types, which are checked on every call. Grad mode must be off
    (with grad on the fast path depends on every parameter's requires_grad: left to PyTorch's forward)."""
    if type(src) is not torch.Tensor or torch.is_grad_enabled():
        return None
    attrs = layer.__dict__
    modules = attrs["_modules"]
    attn, norm1, norm2 = modules["self_attn"], modules["norm1"], modules["norm2"]
    autocast, fastpath = torch.is_autocast_enabled(), torch.backends.mha.get_fastpath_enabled()
    key = (id(layer), src.shape, src.dtype, src.device, src.is_nested, attrs["training"], autocast, fastpath)
    ok = _ENCODER_MEMO.get(key)
    if ok is None:
        if len(_ENCODER_MEMO) >= 1024:
            _ENCODER_MEMO.clear()
        a = attn.__dict__
        ok = _ENCODER_MEMO[key] = bool(
            fastpath and not autocast and src.dim() == 3 and not src.is_nested and not attrs["training"]
            and a["batch_first"] and attn._parameters.get("in_proj_bias") is not None and a["_qkv_same_embed_dim"]
            and attrs.get("activation_relu_or_gelu") and norm1.eps == norm2.eps and a["num_heads"] % 2 == 0
            and src.device.type in ("cpu", "cuda"))
    if not ok:
        return None
    if _any_forward_hooks(layer):
        return None
    ap, op = attn._parameters, attn._modules["out_proj"]._parameters
    l1, l2 = modules["linear1"]._parameters, modules["linear2"]._parameters
    n1, n2 = norm1._parameters, norm2._parameters
    # .get: a replaced norm or linear may lack a parameter; None then sends the call to PyTorch's forward
    tensors = (ap.get("in_proj_weight"), ap.get("in_proj_bias"), op.get("weight"), op.get("bias"), n1.get("weight"),
               n1.get("bias"), n2.get("weight"), n2.get("bias"), l1.get("weight"), l1.get("bias"), l2.get("weight"),
               l2.get("bias"))
    for t in tensors:
        # is_cuda / is_cpu: a fifth of device.type's cost, twelve times per call
        if type(t) not in _PLAIN_PARAMETER_TYPES or not (t.is_cuda or t.is_cpu):
            return None  # None (bias=False), a subclass, an unsupported device: PyTorch's forward decides
    a = attn.__dict__
    return (src, a["embed_dim"], a["num_heads"], *tensors[:4], attrs["activation_relu_or_gelu"] == 2,
            attrs["norm_first"], norm1.eps, *tensors[4:], None, None)


def _encoder_layer_forward_wrapper(original):
    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        where = _routing_here()
        # exact classes only: a customised layer or attention module may call SDPA itself, and lifting
        # the router would leave that call unrouted
        if (where is None or type(self) is not nn.TransformerEncoderLayer
                or type(self.self_attn) is not nn.MultiheadAttention or len(args) > 4):
            return original(self, *args, **kwargs)
        routed = fused = None
        attrs = self.__dict__
        if not attrs["training"] and attrs.get("activation_relu_or_gelu", 0):
            masks = (_arg(args, kwargs, 1, "src_mask"), _arg(args, kwargs, 2, "src_key_padding_mask"))
            # the checks' own tensor queries need not go through the router (each would cost a
            # __torch_function__ round trip: ~25 µs per call on the CPU host, and enough on the H200 host
            # to make TransformerEncoderLayer(512, 16) eval at 128 x 128 tokens 0.85x with routing on)
            with _NO_MODES():
                src = _arg(args, kwargs, 0, "src")
                routed = _fast_path_decision(attrs["_modules"]["self_attn"], src, masks)
                if routed is not None and masks[0] is None and masks[1] is None and len(args) + len(kwargs) == 1:
                    fused = _encoder_layer_fused_args(self, src)
            if routed is not None:  # way 1 (if PyTorch still takes its Python path, self_attn must not count again)
                routed.count()
                if fused is not None:  # layer(src): PyTorch's fused op directly
                    return _lifted(where, torch._transformer_encoder_layer_fwd, *fused)
                _LIFTED.counted = True
                try:
                    return _lifted(where, original, self, *args, **kwargs)
                finally:
                    _LIFTED.counted = False
        with _NO_MODES():
            no_fast_path = _encoder_layer_has_no_fast_path(self, _arg(args, kwargs, 0, "src"))
        if no_fast_path:
            # no fast path to lose: the layer's own ops need no routing, and its self_attn call
            # comes back to the MHA wrapper
            return _lifted(where, original, self, *args, **kwargs)
        # lifting the router would let PyTorch's fused layer run its own attention choice
        return original(self, *args, **kwargs) if where == "top" else _unlifted(original, self, *args, **kwargs)
    return forward


def install() -> None:
    """Wrap the two classes' forward once (idempotent)."""
    for cls, wrap in ((nn.MultiheadAttention, _mha_forward_wrapper),
                      (nn.TransformerEncoderLayer, _encoder_layer_forward_wrapper)):
        if cls not in _ORIGINAL:
            _ORIGINAL[cls] = cls.forward
            cls.forward = wrap(cls.forward)


__all__ = ["install"]
