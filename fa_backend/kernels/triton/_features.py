"""Host side of the optional kernel features: attn_mask, dropout, sliding window, softcap, ALiBi.

`kernel_features(...)` turns the user-level arguments into the extra positional arguments and
constexpr flags shared by the forward and both backward kernels. An unused feature passes None
(a constexpr) for its arguments, so a launch without features specialises exactly as before.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._common import MASK_BITS_ROW
from ._mask_bounds import as_4d, row_bits, worth_it

_LOG2E = 1.0 / math.log(2.0)


@dataclasses.dataclass(frozen=True)
class KernelFeatures:
    causal: bool  # the kernels' CAUSAL: any right bound (causal and/or a finite right window)
    causal_offset: int  # key j visible to query i only if j <= i + causal_offset (when causal)
    qk_scale: float  # multiplier of q.k into the log2 domain (softcap * log2(e) with softcap)
    args: tuple  # the kernels' feature arguments, in order (see _attn_fwd: Mask ... dropout_scale)
    constexprs: dict  # MASK_KIND, HAS_ALIBI, SOFTCAP, WINDOW_LEFT, DROPOUT (only the ones set)


def expand_mask(attn_mask: torch.Tensor, b: int, hq: int, sq: int, sk: int) -> torch.Tensor:
    """The mask as a (b, hq, sq, sk) view: broadcast dims get stride 0, nothing is copied.

    Bool masks are reinterpreted as uint8 (same bytes) for the kernels.
    """
    m = as_4d(attn_mask).expand(b, hq, sq, sk)
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
    return m


def dropout_threshold(dropout_p: float) -> int:
    """The kernels' integer form of dropout_p for 32-bit draws: a score is dropped iff its uniform 32-bit Philox
    word is below floor(dropout_p * 2**32), so the drop probability is dropout_p to within 2**-32 (dropout_p < 1)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return min(int(dropout_p * 2**32), 2**32 - 1)


DROP_WORDS, DROP_HALVES = 1, 2  # the kernels' DROPOUT constexpr (_common.DROP_WORDS / DROP_HALVES)
_HALVES_REL_ERROR = 2.0**-13


def dropout_draw(dropout_p: float) -> tuple[int, int]:
    """(DROPOUT, drop_threshold) of the kernels for dropout_p.

    16-bit draws (DROP_HALVES: eight keys per Philox draw, half the RNG work of 32-bit ones) drop with
    probability round(dropout_p * 2**16) / 2**16. They are used only where that changes neither dropout_p nor
    1 - dropout_p by more than 2**-13 of itself (every p in [1/16, 15/16], and p = k / 2**16 exactly);
    other p (e.g. 0.01) use 32-bit draws, exact to within 2**-32.
    """
    threshold32 = dropout_threshold(dropout_p)
    threshold16 = round(dropout_p * 2**16)
    error = abs(threshold16 / 2**16 - dropout_p)
    if 0 < threshold16 < 2**16 and error <= _HALVES_REL_ERROR * min(dropout_p, 1.0 - dropout_p):
        return DROP_HALVES, threshold16
    return DROP_WORDS, threshold32


_NO_FEATURE_ARGS = (None,) * 15  # Mask + 4 strides, Alibi + 3, softcap_in, left_offset, dropout's 4


def plain_call(attn_mask, dropout_p: float, window: tuple[int, int], softcap: float, alibi_slopes) -> bool:
    """No optional feature: no mask, dropout, window, softcap or ALiBi (causal either way)."""
    return (attn_mask is None and alibi_slopes is None and dropout_p <= 0 and softcap <= 0 and window[0] < 0
            and window[1] < 0)


def kernel_features(
    q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool, bottom_right: bool,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, rng: tuple[int, int] | None = None,
    window: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
    shift: int | None = None,
) -> KernelFeatures:
    """Kernel arguments for one call. Window semantics are FlashAttention-2's: query i sees key j
    iff i + sk - sq - left <= j <= i + sk - sq + right, a negative side meaning unbounded; with
    causal, the causal bound (of the requested alignment) applies as well.

    shift overrides sk - sq; varlen launches pass 0 (offsets relative to each sequence's own
    seqlen_k - seqlen_q, which the kernels add)."""
    sq, sk = q.shape[2], k.shape[2]
    left, right = window
    if plain_call(attn_mask, dropout_p, window, softcap, alibi_slopes):
        # the plain call (most calls): no feature arguments to build
        return KernelFeatures(causal, ((sk - sq if shift is None else shift) if bottom_right else 0) if causal else 0,
                              scale * _LOG2E, _NO_FEATURE_ARGS, {})
    b, hq = q.shape[0], q.shape[1]
    if shift is None:
        shift = sk - sq  # FlashAttention's bottom-right alignment of windows and ALiBi
    causal_offset = (shift if bottom_right else 0) if causal else 0
    if right >= 0:
        causal_offset = min(causal_offset, shift + right) if causal else shift + right
        causal = True
    window_left = left >= 0
    constexprs: dict = {}
    if attn_mask is not None:
        mask = expand_mask(attn_mask, b, hq, sq, sk)
        # 1 bool, 2 additive; 3 / 4 the same read one row per tile (no query stride: _common.MASK_BOOL_ROW);
        # 5 a bool row mask packed 32 keys per word, on calls large enough for the packing to pay
        kind = (1 if attn_mask.dtype == torch.bool else 2) + (2 if mask.stride(2) == 0 else 0)
        if kind == 3 and worth_it(attn_mask, b, hq, sq, sk, q.shape[-1]):
            words, stride_wb, stride_wh = row_bits(attn_mask, b, hq, sk)
            mask_args, kind = (words, stride_wb, stride_wh, 0, 1), 5
        else:
            mask_args = (mask, *mask.stride())
        constexprs["MASK_KIND"] = kind
    else:
        mask_args = (None,) * 5
    if alibi_slopes is not None:
        slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes.view(1, -1)
        alibi_args = (slopes, slopes.stride(0) if slopes.shape[0] > 1 else 0, slopes.stride(1), shift)
        constexprs["HAS_ALIBI"] = True
    else:
        alibi_args = (None,) * 4
    if softcap > 0:
        qk_scale, softcap_in = softcap * _LOG2E, scale / softcap
        constexprs["SOFTCAP"] = True
    else:
        qk_scale, softcap_in = scale * _LOG2E, None
    left_offset = None
    if window_left:
        left_offset = shift - left
        constexprs["WINDOW_LEFT"] = True
    if dropout_p > 0:
        if rng is None:
            raise ValueError("dropout_p > 0 needs the RNG state (seed, offset)")
        draw, threshold = dropout_draw(dropout_p)
        drop_args = (int(rng[0]), int(rng[1]), threshold, 1.0 / (1.0 - dropout_p))
        constexprs["DROPOUT"] = draw
    else:
        drop_args = (None,) * 4
    if qk_scale == 0.0 and constexprs.get("MASK_KIND") in (1, 3, 5):
        # The forward masks a bool mask's scores before scaling them, where -inf * 0 is NaN. 2**-126 (the
        # smallest normal fp32) scales every finite fp16 / bf16 score (|q.k| < 2**100) below 2**-26, whose exp2
        # rounds to 1.0 in fp32, exactly as exp2(0): the same probabilities as scale 0.
        qk_scale = 2.0**-126
    args = (*mask_args, *alibi_args, softcap_in, left_offset, *drop_args)
    return KernelFeatures(causal, causal_offset, qk_scale, args, constexprs)


def tile_class(feat: KernelFeatures, attn_mask: torch.Tensor | None, b: int, hq: int, sq: int, sk: int,
               d: int) -> bool | str:
    """Which tile tables a call's launches use (_configs.fwd_config / bwd_config): False for a plain call;
    "dropout" (with or without other features); for an attn_mask alone read through block bounds,
    "mask_rows" (packed 32 keys per word: a key mask) or "mask_bounds" (any other mask); True otherwise."""
    if not feat.constexprs:
        return False
    if "DROPOUT" in feat.constexprs:
        return "dropout"
    if set(feat.constexprs) == {"MASK_KIND"} and worth_it(attn_mask, b, hq, sq, sk, d):
        return "mask_rows" if feat.constexprs["MASK_KIND"] == MASK_BITS_ROW.value else "mask_bounds"
    return True
