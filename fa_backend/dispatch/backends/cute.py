"""The `cute` backend: fa_backend's CuTe DSL kernels for Hopper (issue 7) and their declared limits.

It runs the warp-specialised sm90 forward and the CuTe backward (op fa_backend::cute_flash_fwd and its autograd
formula, ops/cute_flash.py; under deterministic algorithms its ordered-dQ variant at d=64 / 128, the Triton
backward kernels at d=96 and with a key mask). Head dims 64, 96, 128, 192, 256, and 192 for Q / K with 128 for V
(MLA). Masks: bool key masks only (no query dim, e.g. key padding (b, 1, 1, sk)), read packed 32 keys per word.
Dropout: in the forward kernel, with 16-bit draws only (the Triton kernels' mask; backward: the CuTe one at d=128,
the Triton kernels elsewhere). Where nvidia-cutlass-dsl is missing every call gets a not_installed reason with the
install hint.
"""

from __future__ import annotations

import torch

from ...kernels.cute._availability import DSL_MISSING
from ..call import CAUSAL_ALIGNMENTS, DECODE_MAX_SEQLEN_Q, AttentionCall
from ..reasons import Reason, ReasonCode
from .base import Backend, input_reasons, mask_call_reasons
from .triton import TRITON_MISSING

# Read as a module constant (torch.compile); False turns the backend off (every call: not_installed).
KERNELS_ENABLED = True
_OPS: list = []


def bind_ops() -> None:
    """Fill _OPS with the CuTe op, which imports this module: at the package's import (fa_backend/__init__), not on
    the first run, where a torch.compile trace would fill it and Dynamo would guard on the emptied list."""
    from ...ops.cute_flash import cute_flash_attention

    _OPS[:] = [cute_flash_attention]


def _not_enabled() -> str | None:
    """Why the backend cannot run anything at all (DSL missing, or kernels turned off), or None."""
    if DSL_MISSING:
        return DSL_MISSING  # with the install hint
    if not KERNELS_ENABLED:
        return "fa_backend's CuTe kernels are turned off (dispatch.backends.cute.KERNELS_ENABLED = False)"
    return None


def _compile_failure(call: AttentionCall) -> str | None:
    """Why the variant this call needs failed to compile earlier in this process, or None."""
    if (DSL_MISSING or call.dtype not in CuteBackend.SUPPORTED_DTYPES
            or call.head_dim not in CuteBackend.SUPPORTED_HEAD_DIMS):
        return None
    from ...kernels.cute import _compile_cache

    if not _compile_cache.CACHE.failed_any():
        return None
    from ...kernels.cute.flash_fwd_ws import fastest_variant_key

    bottom_right = call.is_causal and call.causal_alignment == "bottom_right"
    key = fastest_variant_key(call.dtype, call.head_dim, call.is_causal, bottom_right, call.mask_kind != "none",
                              call.dropout_p > 0, call.head_dim_v)
    return _compile_cache.CACHE.failure(key)


def _dropout_reasons(dropout_p: float) -> list[Reason]:
    """Why the CuTe forward cannot drop with this probability: outside [0, 1), or a p the kernels draw with 32-bit
    words (kernels/triton/_features.dropout_draw), which only the Triton kernels make."""
    if not 0.0 <= dropout_p < 1.0:
        return [Reason(ReasonCode.DROPOUT, f"dropout_p={dropout_p} (supported: 0 <= dropout_p < 1)")]
    from ...kernels.triton._features import DROP_HALVES, dropout_draw

    if dropout_draw(dropout_p)[0] != DROP_HALVES:
        return [Reason(ReasonCode.DROPOUT, f"dropout_p={dropout_p} needs 32-bit random draws (supported: dropout_p "
                                           "whose rounding to a multiple of 2**-16 changes neither it nor 1 - "
                                           "dropout_p by more than 2**-13 of itself, e.g. every p in [1/16, 15/16])")]
    return []


def _names(values) -> str:
    return ", ".join(str(v) for v in sorted(values, key=str))


class CuteBackend(Backend):
    """Limits of fa_backend/kernels/cute (sm90 forward), as data; `why_not` returns every failing rule."""

    NAME = "cute"
    DEVICE_TYPE = "cuda"
    CAPABILITY_MAJOR = 9  # Hopper only: the kernels are built for sm_90a (wgmma, TMA)
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    SUPPORTED_HEAD_DIMS = frozenset({64, 96, 128, 192, 256})  # kernels/cute/flash_fwd_ws.py HEAD_DIMS
    # (head_dim, head_dim_v) pairs with head_dim_v != head_dim (kernels/cute/flash_fwd_ws.py HEAD_DIM_V_PAIRS; MLA's)
    SUPPORTED_HEAD_DIM_V_PAIRS = frozenset({(192, 128)})
    SUPPORTED_MASKS = frozenset({"none", "bool"})  # bool: key masks only (AttentionCall.mask_key_only); causal is a flag
    CAUSAL_ALIGNMENTS = frozenset(CAUSAL_ALIGNMENTS)
    SUPPORTS_DROPOUT = True  # the forward kernel's 16-bit draws only (_dropout_reasons)
    SUPPORTS_GQA = True
    SUPPORTS_BACKWARD = True  # the CuTe backward (deterministic mode: its ordered variant or Triton's, ops/cute_flash.py)

    @classmethod
    def why_not(cls, call: AttentionCall) -> list[Reason]:
        reasons: list[Reason] = []
        missing = _not_enabled()
        if missing:
            reasons.append(Reason(ReasonCode.NOT_INSTALLED, missing))
        reasons += input_reasons(call)
        if call.device_type != cls.DEVICE_TYPE:
            reasons.append(Reason(ReasonCode.DEVICE, f"device={call.device_type} (supported: {cls.DEVICE_TYPE})"))
        elif call.capability is None or call.capability[0] != cls.CAPABILITY_MAJOR:
            reasons.append(Reason(ReasonCode.CAPABILITY, f"compute capability {call.capability} (supported: "
                                                         f"{cls.CAPABILITY_MAJOR}.x, Hopper)"))
        if not call.same_dtype:
            reasons.append(Reason(ReasonCode.DTYPE, "query, key and value have different dtypes"))
        elif call.dtype not in cls.SUPPORTED_DTYPES:
            reasons.append(Reason(ReasonCode.DTYPE, f"dtype={call.dtype} (supported: {_names(cls.SUPPORTED_DTYPES)})"))
        if call.ranks == (4, 4, 4):
            if call.head_dim not in cls.SUPPORTED_HEAD_DIMS:
                reasons.append(Reason(ReasonCode.HEAD_DIM, f"head_dim={call.head_dim} (supported: "
                                                           f"{', '.join(map(str, sorted(cls.SUPPORTED_HEAD_DIMS)))})"))
            if (call.head_dim_v != call.head_dim
                    and (call.head_dim, call.head_dim_v) not in cls.SUPPORTED_HEAD_DIM_V_PAIRS):
                pairs = ", ".join(f"{d} / {dv}" for d, dv in sorted(cls.SUPPORTED_HEAD_DIM_V_PAIRS))
                reasons.append(Reason(ReasonCode.HEAD_DIM, f"head_dim_v={call.head_dim_v} != head_dim={call.head_dim} "
                                                           f"(supported: equal head dims, or head_dim / head_dim_v "
                                                           f"{pairs})"))
            if call.heads_kv == 0 or call.heads_q % call.heads_kv:
                reasons.append(Reason(ReasonCode.GQA, f"heads_q={call.heads_q} is not a multiple of heads_kv={call.heads_kv}"))
            elif call.heads_q != call.heads_kv and not (cls.SUPPORTS_GQA and call.enable_gqa):
                reasons.append(Reason(ReasonCode.GQA, f"heads_q={call.heads_q} != heads_kv={call.heads_kv} needs enable_gqa=True"))
        if call.mask_kind not in cls.SUPPORTED_MASKS:
            reasons.append(Reason(ReasonCode.MASK, f"attn_mask ({call.mask_kind}) is not supported "
                                                   f"(supported: a bool key mask; is_causal=True)"))
        elif call.mask_kind != "none":
            if not call.mask_key_only:
                reasons.append(Reason(ReasonCode.MASK, f"attn_mask shape={list(call.mask_shape or ())} varies along the "
                                                       "query dim (supported: bool key masks, size 1 or stride 0 on "
                                                       "the query dim, e.g. key padding (b, 1, 1, seqlen_k))"))
            reasons += mask_call_reasons(call)
        if call.is_causal and call.causal_alignment not in cls.CAUSAL_ALIGNMENTS:
            reasons.append(Reason(ReasonCode.MASK, f"causal alignment {call.causal_alignment!r} (supported: "
                                                   f"{_names(cls.CAUSAL_ALIGNMENTS)})"))
        if call.dropout_p != 0.0:
            reasons += _dropout_reasons(call.dropout_p)
        if call.requires_grad and TRITON_MISSING:
            reasons.append(Reason(ReasonCode.GRAD, f"inputs require grad and the backward runs the Triton kernels: "
                                                   f"{TRITON_MISSING}"))
        if call.ranks == (4, 4, 4) and call.shapes_consistent:
            if not call.tma_aligned:
                reasons.append(Reason(ReasonCode.LAYOUT, "query, key or value cannot be read by TMA (supported: "
                                                         "stride 1 on head_dim, other strides and storage offsets "
                                                         "positive multiples of 16 bytes)"))
            if 0 < call.seqlen_q <= DECODE_MAX_SEQLEN_Q:
                reasons.append(Reason(ReasonCode.SEQ_LEN, f"seqlen_q={call.seqlen_q} (supported: > "
                                                          f"{DECODE_MAX_SEQLEN_Q}; the CuTe forward tiles 128 query "
                                                          "rows, decode calls go to the split-KV decode kernel)"))
            if 0 in (call.batch, call.heads_q, call.seqlen_q, call.heads_kv, call.seqlen_k):
                # a grid or a TMA box over an empty dimension cannot be launched or encoded
                reasons.append(Reason(ReasonCode.SEQ_LEN, f"empty inputs (batch={call.batch}, heads_q={call.heads_q}, "
                                                          f"seqlen_q={call.seqlen_q}, heads_kv={call.heads_kv}, "
                                                          f"seqlen_k={call.seqlen_k}; supported: none of them 0)"))
        if not reasons:
            failure = _compile_failure(call)
            if failure:
                reasons.append(Reason(ReasonCode.COMPILE_FAILED, f"the CuTe forward for this variant failed to "
                                                                 f"compile: {failure}"))
        return reasons

    @classmethod
    def run(cls, call, sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        if not _OPS:
            bind_ops()
        bottom_right = bool(is_causal) and call.causal_alignment == "bottom_right"
        return _OPS[0](q, k, v, scale, bool(is_causal), bottom_right, attn_mask, float(dropout_p))[0]
