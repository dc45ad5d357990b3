"""Routing `nn.MultiheadAttention` / `nn.TransformerEncoderLayer` attention through the dispatcher.

With any TorchFunctionMode active PyTorch skips these modules' fused C++ fast path and calls
`F.multi_head_attention_forward`, whose inner SDPA call the mode cannot see (a mode is popped while
its own handler runs). The router hands that call here.

`mha_forward` computes the common form itself (need_weights=False, no bias_k/bias_v, no
add_zero_attn, no static_k/static_v, batched input) the way PyTorch's fast path does: one packed
in-projection GEMM, Q/K/V as strided views of its output (our kernels take strides, so no copies),
the attention through the dispatcher, and the out-projection straight from the kernel's
(b, s, h, d)-ordered output. That keeps enabling fa_backend from costing the copies PyTorch's Python
path makes, and it works under torch.compile because it is plain tensor code.

Any other form runs PyTorch's own `F.multi_head_attention_forward`; in eager mode its inner SDPA
call is routed by pointing torch.nn.functional's module global at the router for the duration of
the call, under torch.compile it runs unrouted and that is logged.
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

_MHA = F.multi_head_attention_forward
_SDPA = F.scaled_dot_product_attention
_SIGNATURE = inspect.signature(_MHA)
_DEFAULTS = {name: p.default for name, p in _SIGNATURE.parameters.items() if p.default is not inspect.Parameter.empty}

RouteFn = Callable[[Callable, tuple, dict], torch.Tensor]


_NAMES = tuple(_SIGNATURE.parameters)


def _bind(args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (signature.bind costs tens of microseconds per call)."""
    if (len(args) > len(_NAMES) or any(name not in _SIGNATURE.parameters for name in kwargs)
            or any(name in kwargs for name in _NAMES[:len(args)])):
        _SIGNATURE.bind(*args, **kwargs)  # raises PyTorch's TypeError
    bound = {**_DEFAULTS, **dict(zip(_NAMES, args)), **kwargs}
    if len(bound) < len(_NAMES):
        _SIGNATURE.bind(*args, **kwargs)  # a required argument is missing: raises the TypeError
    return bound


def direct_form_problem(a: dict) -> str | None:
    """Why `mha_forward` cannot compute this call itself (None when it can)."""
    if a["need_weights"]:
        return "need_weights=True"
    if a["bias_k"] is not None or a["bias_v"] is not None or a["add_zero_attn"]:
        return "bias_k/bias_v/add_zero_attn"
    if a["static_k"] is not None or a["static_v"] is not None:
        return "static_k/static_v"
    query, key, value = a["query"], a["key"], a["value"]
    if not all(isinstance(t, torch.Tensor) for t in (query, key, value)):
        return "non-tensor input"  # PyTorch's own function reports it
    if query.is_nested or key.is_nested or value.is_nested:
        return "nested tensor input"
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        return "unbatched input"
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    if embed_dim != a["embed_dim_to_check"] or embed_dim % a["num_heads"] or key.shape[:2] != value.shape[:2]:
        return "shape mismatch"  # PyTorch's own function raises its error
    if not a["use_separate_proj_weight"] and (a["in_proj_weight"] is None or key.shape[-1] != embed_dim
                                              or value.shape[-1] != embed_dim):
        return "shape mismatch"
    if a["use_separate_proj_weight"] and any(a[w] is None for w in ("q_proj_weight", "k_proj_weight",
                                                                       "v_proj_weight")):
        return "shape mismatch"
    if key.shape[1] != bsz:
        return "shape mismatch"
    mask, kpm = a["attn_mask"], a["key_padding_mask"]
    if a["is_causal"] and mask is None:
        return "is_causal without attn_mask"  # PyTorch raises
    if mask is not None and tuple(mask.shape) not in ((tgt_len, src_len), (bsz * a["num_heads"], tgt_len, src_len)):
        return "attn_mask shape"
    if kpm is not None and tuple(kpm.shape) != (bsz, src_len):
        return "key_padding_mask shape"
    return None


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int, heads: int) -> torch.Tensor:
    """Linear projection of x (s, b, E) as a (b, s, parts, heads, d) view, with no layout copy.

    Modules built with batch_first hand over a transposed view of a contiguous (b, s, E) tensor:
    projecting that view's transpose keeps the GEMM copy-free.
    """
    batch_first = x.transpose(0, 1)
    if batch_first.is_contiguous():
        return F.linear(batch_first, weight, bias).unflatten(-1, (parts, heads, -1))
    return F.linear(x, weight, bias).unflatten(-1, (parts, heads, -1)).transpose(0, 1)


def _merged_mask(a: dict, dtype: torch.dtype, bsz: int, heads: int, tgt_len: int, src_len: int):
    """The SDPA mask and is_causal flag PyTorch's function would pass (broadcast, not expanded)."""
    mask, kpm, is_causal = a["attn_mask"], a["key_padding_mask"], a["is_causal"]
    kpm = F._canonical_mask(mask=kpm, mask_name="key_padding_mask", other_type=F._none_or_dtype(mask),
                            other_name="attn_mask", target_type=dtype)
    if is_causal and kpm is None:
        return None, True
    mask = F._canonical_mask(mask=mask, mask_name="attn_mask", other_type=None, other_name="",
                             target_type=dtype, check_other=False)
    if mask is not None:
        mask = mask.view(1, 1, tgt_len, src_len) if mask.dim() == 2 else mask.view(bsz, heads, tgt_len, src_len)
    if kpm is not None:
        kpm = kpm.view(bsz, 1, 1, src_len)
        mask = kpm if mask is None else mask + kpm
    return mask, False


def mha_forward(a: dict, route: RouteFn) -> tuple[torch.Tensor, None]:
    """`F.multi_head_attention_forward` for a call `direct_form_problem` accepts, attention routed."""
    query, key, value, heads = a["query"], a["key"], a["value"], a["num_heads"]
    tgt_len, bsz, embed_dim = query.shape
    src_len = key.shape[0]
    w, b = a["in_proj_weight"], a["in_proj_bias"]
    if a["use_separate_proj_weight"]:
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        q = _project(query, a["q_proj_weight"], bq, 1, heads)[:, :, 0]
        k = _project(key, a["k_proj_weight"], bk, 1, heads)[:, :, 0]
        v = _project(value, a["v_proj_weight"], bv, 1, heads)[:, :, 0]
    elif query is key and key is value:
        qkv = _project(query, w, b, 3, heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        wq, wk, wv = w.chunk(3)
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        q = _project(query, wq, bq, 1, heads)[:, :, 0]
        if key is value:
            kv = _project(key, w[embed_dim:], None if b is None else b[embed_dim:], 2, heads)
            k, v = kv[:, :, 0], kv[:, :, 1]
        else:
            k = _project(key, wk, bk, 1, heads)[:, :, 0]
            v = _project(value, wv, bv, 1, heads)[:, :, 0]
    mask, is_causal = _merged_mask(a, query.dtype, bsz, heads, tgt_len, src_len)
    dropout_p = a["dropout_p"] if a["training"] else 0.0
    # (b, s, h, d) views -> SDPA layout (b, h, s, d)
    out = route(_SDPA, (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
                {"attn_mask": mask, "dropout_p": dropout_p, "is_causal": is_causal})
    out = out.transpose(1, 2).reshape(bsz, tgt_len, embed_dim)  # a view for our kernels' output layout
    out = F.linear(out, a["out_proj_weight"], a["out_proj_bias"])
    return out.transpose(0, 1), None


# --- any other form: PyTorch's function with its inner SDPA call routed (eager only) ------------

_LOCK = threading.Lock()
_DEPTH = {"n": 0}
_THREAD = threading.local()


def _inner_sdpa_for(route: RouteFn) -> Callable:
    def inner_sdpa(*args, **kwargs):
        """Stands in for F's module-global `scaled_dot_product_attention` while a routed MHA runs."""
        if getattr(_THREAD, "routing", False):
            return route(_SDPA, args, kwargs)
        return _SDPA(*args, **kwargs)
    return inner_sdpa


def _run_patched(args: tuple, kwargs: dict, route: RouteFn):
    """PyTorch's function, its inner SDPA call routed; other threads fall through to the original."""
    module = sys.modules["torch.nn.functional"]
    with _LOCK:
        if _DEPTH["n"] == 0:
            module.scaled_dot_product_attention = _inner_sdpa_for(route)
        _DEPTH["n"] += 1
    _THREAD.routing = True
    try:
        return _MHA(*args, **kwargs)
    finally:
        _THREAD.routing = False
        with _LOCK:
            _DEPTH["n"] -= 1
            if _DEPTH["n"] == 0:
                module.scaled_dot_product_attention = _SDPA


def route_mha(args: tuple, kwargs: dict, route: RouteFn, note_trace: Callable[[str, str], bool]):
    """Handle one intercepted `F.multi_head_attention_forward` call."""
    a = _bind(args, kwargs)
    problem = direct_form_problem(a)
    if problem is None:
        return mha_forward(a, route)
    if a["need_weights"]:
        return _MHA(*args, **kwargs)  # no SDPA call inside: the weights come from bmm + softmax
    if torch.compiler.is_compiling():
        note_trace("torch", f"multi_head_attention_forward:not routed under torch.compile ({problem})")
        return _MHA(*args, **kwargs)
    return _run_patched(args, kwargs, route)


__all__ = ["direct_form_problem", "mha_forward", "route_mha"]
