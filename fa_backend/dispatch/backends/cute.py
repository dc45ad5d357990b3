"""The `cute` backend: fa_backend's CuTe DSL kernels for Hopper (issue 7) and their declared limits.

No CuTe kernel has passed on an H200 yet, so KERNELS_ENABLED is False and every call gets a
not_installed reason (besides any limit it breaks): the backend routes nothing, and `run` raises.
"""

from __future__ import annotations

import torch

from ...kernels.cute._availability import DSL_MISSING, DSL_VERSION
from ..call import CAUSAL_ALIGNMENTS, AttentionCall
from ..reasons import Reason, ReasonCode
from .base import Backend, input_reasons

# Flipped to True once a kernel has passed its GPU tests; read as a module constant (torch.compile).
KERNELS_ENABLED = False


def _not_enabled() -> str | None:
    """Why the backend cannot run anything at all (DSL missing, or kernels not enabled), or None."""
    if DSL_MISSING:
        return f"{DSL_MISSING}; fa_backend's CuTe kernels are not enabled yet either"
    if not KERNELS_ENABLED:
        return (f"nvidia-cutlass-dsl {DSL_VERSION} is installed, but fa_backend's CuTe kernels are not enabled "
                "yet (none has passed on a Hopper GPU)")
    return None


def _names(values) -> str:
    return ", ".join(str(v) for v in sorted(values, key=str))


class CuteBackend(Backend):
    """Limits of fa_backend/kernels/cute (sm90 forward), as data; `why_not` returns every failing rule."""

    NAME = "cute"
    DEVICE_TYPE = "cuda"
    CAPABILITY_MAJOR = 9  # Hopper only: the kernels are built for sm_90a (wgmma, TMA)
    SUPPORTED_DTYPES = frozenset({torch.float16, torch.bfloat16})
    SUPPORTED_HEAD_DIMS = frozenset({64, 96, 128})
    SUPPORTS_HEAD_DIM_V_NE_HEAD_DIM = False
    SUPPORTED_MASKS = frozenset({"none"})  # causal is a flag, not a mask
    CAUSAL_ALIGNMENTS = frozenset(CAUSAL_ALIGNMENTS)
    SUPPORTS_DROPOUT = False
    SUPPORTS_GQA = True
    SUPPORTS_BACKWARD = False  # forward kernel first; calls that need gradients stay elsewhere

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
            if call.head_dim_v != call.head_dim and not cls.SUPPORTS_HEAD_DIM_V_NE_HEAD_DIM:
                reasons.append(Reason(ReasonCode.HEAD_DIM, f"head_dim_v={call.head_dim_v} != head_dim={call.head_dim} "
                                                           "(supported: equal head dims)"))
            if call.heads_kv == 0 or call.heads_q % call.heads_kv:
                reasons.append(Reason(ReasonCode.GQA, f"heads_q={call.heads_q} is not a multiple of heads_kv={call.heads_kv}"))
            elif call.heads_q != call.heads_kv and not (cls.SUPPORTS_GQA and call.enable_gqa):
                reasons.append(Reason(ReasonCode.GQA, f"heads_q={call.heads_q} != heads_kv={call.heads_kv} needs enable_gqa=True"))
        if call.mask_kind not in cls.SUPPORTED_MASKS:
            reasons.append(Reason(ReasonCode.MASK, f"attn_mask ({call.mask_kind}) is not supported "
                                                   f"(supported: no attn_mask; is_causal=True)"))
        if call.is_causal and call.causal_alignment not in cls.CAUSAL_ALIGNMENTS:
            reasons.append(Reason(ReasonCode.MASK, f"causal alignment {call.causal_alignment!r} (supported: "
                                                   f"{_names(cls.CAUSAL_ALIGNMENTS)})"))
        if call.dropout_p != 0.0 and not cls.SUPPORTS_DROPOUT:
            reasons.append(Reason(ReasonCode.DROPOUT, f"dropout_p={call.dropout_p} (supported: 0.0)"))
        if call.requires_grad and not cls.SUPPORTS_BACKWARD:
            reasons.append(Reason(ReasonCode.GRAD, "inputs require grad (supported: forward only, no backward kernel yet)"))
        return reasons

    @classmethod
    def run(cls, call, sdpa, *args):
        raise RuntimeError("the cute backend runs no call yet: fa_backend's CuTe kernels are not enabled "
                           f"(why_not: {'; '.join(str(r) for r in cls.why_not(call)) or 'no reason'})")
