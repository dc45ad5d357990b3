"""The `triton` backend: our Triton FlashAttention kernels and their declared limits."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import ClassVar

import torch

from ..call import DECODE_MAX_SEQLEN_Q, AttentionCall
from ..reasons import Reason, ReasonCode
from .base import Backend, input_reasons, mask_call_reasons

# Probed once at import: traced code (torch.compile) must only read a constant.
TRITON_MISSING: str | None = (None if importlib.util.find_spec("triton") is not None
                              else "the `triton` package is not installed (pip install triton)")


# Triton reads TRITON_INTERPRET when kernels are defined; CPU tensors are only runnable then.
INTERPRETER = os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_interpreter() -> None:
    """Run the Triton kernels in Triton's CPU interpreter from now on (demos, doctor on CPU).

    Only possible before the kernels are first imported: Triton decides at definition time.
    """
    global INTERPRETER
    if INTERPRETER:
        return
    if "fa_backend.kernels.triton.flash_fwd" in sys.modules:
        raise RuntimeError("the Triton kernels are already loaded for the GPU; set TRITON_INTERPRET=1 before "
                           "the first attention call to use the interpreter")
    os.environ["TRITON_INTERPRET"] = "1"
    INTERPRETER = True


_OPS: list = []


def _load_ops() -> list:
    """[triton_flash_attention, sdpa_decode]: the ops import this module, so they are bound after both are imported
    (bind_ops, at the package's import) and not on the first run, where a torch.compile trace would fill _OPS: Dynamo
    guards on the emptied list and compiles the process's first routed graph a second time."""
    from ...ops import triton_flash_attention
    from ...ops.triton_decode import sdpa_decode

    _OPS[:] = [triton_flash_attention, sdpa_decode]
    return _OPS


bind_ops = _load_ops


class TritonBackend(Backend):
    """Limits of fa_backend/kernels/triton, as data; `why_not` returns every failing rule."""

    NAME = "triton"
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    HEAD_DIM_MULTIPLE = 8
    MAX_HEAD_DIM = 256
    MIN_CAPABILITY = (8, 0)
    SUPPORTED_MASKS = frozenset({"none", "bool", "additive"})
    # Additive masks: the query dtype or float32 (read and added in fp32 by the kernels).
    ADDITIVE_MASK_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32})
    SUPPORTS_DROPOUT = True
    SUPPORTS_GQA = True
    SUPPORTS_HEAD_DIM_V_NE_HEAD_DIM = True
    SUPPORTS_BACKWARD = True
    IS_DETERMINISTIC = True
    # Two kernels: the dense FlashAttention kernel ("triton", forward and backward) and, for decode calls
    # (AttentionCall.kind: seqlen_q <= 16) that need no gradient and no dropout, the split-KV decode
    # kernel ("triton_decode", kernels/triton/decode.py; the op fa_backend::triton_sdpa_decode). The
    # names are the keys of stats()["runs"] and of the measured-speed rules (dispatch/preference.py).
    DECODE_KERNEL = "triton_decode"
    KERNEL_LABELS: ClassVar[dict[str, str]] = {"triton": "dense", "triton_decode": "split-KV decode"}

    @classmethod
    def why_not(cls, call: AttentionCall) -> list[Reason]:
        reasons: list[Reason] = []
        if TRITON_MISSING:
            reasons.append(Reason(ReasonCode.NOT_INSTALLED, TRITON_MISSING))
        reasons += input_reasons(call)
        if call.device_type == "cuda":
            cap = call.capability
            if cap is not None and cap < cls.MIN_CAPABILITY:
                reasons.append(Reason(ReasonCode.CAPABILITY,
                                      f"requires compute capability >= {cls.MIN_CAPABILITY}, the GPU has {cap}"))
        elif not (call.device_type == "cpu" and INTERPRETER):
            reasons.append(Reason(ReasonCode.DEVICE,
                                  f"device={call.device_type} (supported: cuda; cpu only under TRITON_INTERPRET=1)"))
        if not call.same_dtype:
            reasons.append(Reason(ReasonCode.DTYPE, "query, key and value have different dtypes"))
        elif call.dtype not in cls.SUPPORTED_DTYPES:
            reasons.append(Reason(ReasonCode.DTYPE,
                                  f"dtype={call.dtype} (supported: torch.float16, torch.bfloat16; inputs are never downcast)"))
        if call.ranks == (4, 4, 4):
            for name, dim in (("head_dim", call.head_dim), ("head_dim_v", call.head_dim_v)):
                if dim % cls.HEAD_DIM_MULTIPLE or not 0 < dim <= cls.MAX_HEAD_DIM:
                    reasons.append(Reason(ReasonCode.HEAD_DIM,
                                          f"{name}={dim} (supported: multiples of {cls.HEAD_DIM_MULTIPLE} up to {cls.MAX_HEAD_DIM})"))
            if call.heads_kv == 0 or call.heads_q % call.heads_kv:
                reasons.append(Reason(ReasonCode.GQA, f"heads_q={call.heads_q} is not a multiple of heads_kv={call.heads_kv}"))
            elif call.heads_q != call.heads_kv and not call.enable_gqa:
                reasons.append(Reason(ReasonCode.GQA, f"heads_q={call.heads_q} != heads_kv={call.heads_kv} needs enable_gqa=True"))
        if call.mask_kind not in cls.SUPPORTED_MASKS:
            reasons.append(Reason(ReasonCode.MASK, f"attn_mask ({call.mask_kind}) is not supported "
                                                   f"(supported: {', '.join(sorted(cls.SUPPORTED_MASKS))})"))
        elif call.mask_kind == "additive" and call.mask_dtype not in (cls.ADDITIVE_MASK_DTYPES & {call.dtype, torch.float32}):
            reasons.append(Reason(ReasonCode.MASK, f"attn_mask dtype={call.mask_dtype} (supported: torch.bool, "
                                                   f"the query dtype {call.dtype} or torch.float32)"))
        if call.mask_kind != "none":
            reasons += mask_call_reasons(call)
        if call.dropout_p > 0 and not cls.SUPPORTS_DROPOUT:
            reasons.append(Reason(ReasonCode.DROPOUT, f"dropout_p={call.dropout_p} (supported: 0.0)"))
        elif not 0.0 <= call.dropout_p < 1.0:
            reasons.append(Reason(ReasonCode.DROPOUT, f"dropout_p={call.dropout_p} (supported: 0 <= dropout_p < 1)"))
        return reasons

    @classmethod
    def decode_why_not(cls, call: AttentionCall) -> list[Reason]:
        """Every reason an eligible call does not run on the split-KV decode kernel; empty when it does."""
        reasons: list[Reason] = []
        if call.kind != "decode":
            reasons.append(Reason(ReasonCode.SEQ_LEN, f"seqlen_q={call.seqlen_q} > {DECODE_MAX_SEQLEN_Q} (the split-KV "
                                                      "decode kernel takes short queries)"))
        if call.requires_grad:
            reasons.append(Reason(ReasonCode.GRAD, "inputs require grad (the split-KV decode kernel has no backward)"))
        if call.dropout_p > 0:
            reasons.append(Reason(ReasonCode.DROPOUT, f"dropout_p={call.dropout_p} (the split-KV decode kernel: 0.0)"))
        if call.head_dim_v != call.head_dim:
            reasons.append(Reason(ReasonCode.HEAD_DIM, f"head_dim_v={call.head_dim_v} != head_dim={call.head_dim} "
                                                       "(the split-KV decode kernel: equal head dims)"))
        if not call.kv_last_dim_contiguous:
            reasons.append(Reason(ReasonCode.LAYOUT, "key or value has a strided head_dim (the split-KV decode kernel "
                                                     "reads contiguous rows; the dense kernel takes any strides)"))
        return reasons

    @classmethod
    def kernel_for(cls, call: AttentionCall) -> tuple[str, tuple[Reason, ...]]:
        reasons = tuple(cls.decode_why_not(call))
        return (cls.NAME, reasons) if reasons else (cls.DECODE_KERNEL, ())

    @classmethod
    def eager_runner(cls, call: AttentionCall, kernel: str | None):
        if kernel != cls.DECODE_KERNEL or call.subclass:
            return super().eager_runner(call, kernel)
        from ...ops.triton_decode import eager_sdpa_decode

        # the decision already holds what sdpa_decode would check on every call: plain tensors, eager
        bottom_right = call.causal_alignment == "bottom_right"
        return lambda sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa: eager_sdpa_decode(
            q, k, v, attn_mask, bool(is_causal), bottom_right and bool(is_causal), scale)

    @classmethod
    def run(cls, call, sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        bottom_right = bool(is_causal) and call.causal_alignment == "bottom_right"
        if call.kind == "decode" and not cls.decode_why_not(call):
            sdpa_decode = (_OPS if _OPS else _load_ops())[1]
            return sdpa_decode(q, k, v, attn_mask, bool(is_causal), bottom_right, scale)
        triton_flash_attention = (_OPS if _OPS else _load_ops())[0]
        return triton_flash_attention(q, k, v, scale, bool(is_causal), bottom_right,
                                      attn_mask=attn_mask, dropout_p=float(dropout_p))[0]
