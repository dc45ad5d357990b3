"""torch.library op for the CuTe DSL forward on Hopper: fa_backend::cute_flash_fwd.

The forward is the warp-specialised kernel (kernels/cute/flash_fwd_ws.py) in its fastest variant per head
dim and causal mode measured on the H200 (flash_fwd_ws.FASTEST: at d=128 two consumers with intra-warpgroup overlap;
three consumers in round-robin ping-pong at d=64). The forward returns out contiguous (b, hq, sq, dv) and
the natural-log fp32 lse (b, hq, sq), the layout the Triton forward writes too. V's head dim dv equals q's and k's d,
or (d, dv) = (192, 128) (MLA; flash_fwd_ws.HEAD_DIM_V_PAIRS), whose backward is flash_bwd_wide's (dropout: Triton's).

The autograd formula runs the CuTe backward (kernels/cute/flash_bwd.py; the warp-specialised kernel at d=128 and
64, flash_bwd_wide's at d=192 and 256): on the H200 1.21-1.56x the Triton backward through this op at 2k-8k tokens,
d=64 and 128, causal or not, 2.4-3.2x at d=192 / 256 (docs/benchmarks.md). The Triton backward kernels
(fa_backend::triton_flash_bwd, which take the CuTe forward's outputs as they are) run instead for scale 0, after a
compile failure, with a key mask at d=96 (KEY_MASK_BACKWARD), with CUTE_BACKWARD = False, and under
torch.use_deterministic_algorithms where the CuTe backward has no deterministic variant (d=96, key masks). Under
deterministic algorithms the warp-specialised kernels add each dQ block's parts in key-block order (turn flags), so
their gradients are the same bits on every run.

A bool key mask (attn_mask without a query dim, e.g. key padding) runs in both kernels, packed by key_words.

Dropout (dropout_p > 0 with an rng_state, as fa_backend::triton_flash_fwd takes them) runs in the forward kernel
(kernels/cute/_dropout.py), which draws the Triton kernels' mask bit for bit; the backward regenerates that mask: at
d=128 (DROPOUT_BACKWARD) the warp-specialised CuTe backward, whose producer warpgroup draws the bits, elsewhere and
under deterministic algorithms or with a key mask the Triton backward with the same rng_state. A d=128 forward
that will be differentiated (cute_flash_attention decides: save_keep_bits) also saves its keep decisions, one bit
per score, as its third output, and the CuTe backward loads them instead of drawing them again (the draws had set its
pace): kernels/keep_bits.py, within its KEEP_BITS_BUDGET (beyond it those of every second or fourth row of
tiles, and the backward draws the rest: _keep_layout). Only dropout_p whose
16-bit rounding the kernels accept (kernels/triton/_features.dropout_draw: every p in [1/16, 15/16], among others)
runs here; the cute backend declines the rest with reason `dropout`.

cute_flash_attention, the entry point the dispatcher calls, runs the op under torch.compile and for tensor
subclasses; for plain tensors in eager mode it calls the same forward and backward functions through an
autograd.Function twin (_EagerCuteFlash), without the torch.library dispatch and custom-op autograd layers (their
host time: the op's forward 269 / 386 us per call without / with gradients on the H200's host, cuDNN's SDPA 98 /
128; CPU machine, kernels stubbed: op 79 / 171 us, twin 39 / 69).

The op never fails on what it accepts: inputs TMA cannot read (strides, offsets) are copied to contiguous
tensors first, and a variant that fails to compile runs the Triton forward instead (logged once by the
compile cache; the dispatcher then reports `compile_failed` for that variant).
"""

from __future__ import annotations

import torch

from ..dispatch import counters
from ..dispatch.backends.cute import CuteBackend
from ..dispatch.call import AttentionCall, is_tma_aligned, validate
from ..dispatch.reasons import BackendUnsupportedError, ReasonCode
from ._library import NAMESPACE
from .triton_flash import _plain


def check_cute_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, is_causal: bool,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      rng_state: torch.Tensor | None = None) -> None:
    """ValueError for malformed input; BackendUnsupportedError listing every reason the cute backend
    has against these inputs otherwise, except two the op handles itself: a layout TMA cannot read (it
    copies) and a variant that failed to compile (it runs the Triton forward)."""
    validate(q, k, v)
    if dropout_p > 0:
        _check_rng_state(rng_state)
    call = AttentionCall.from_tensors(q, k, v, attn_mask, dropout_p, is_causal=is_causal, scale=scale,
                                      enable_gqa=True)
    handled = (ReasonCode.LAYOUT, ReasonCode.COMPILE_FAILED) if call.shapes_consistent else (ReasonCode.COMPILE_FAILED,)
    reasons = [r for r in CuteBackend.why_not(call) if r.code not in handled]
    if reasons:
        raise BackendUnsupportedError(call.describe(), {CuteBackend.NAME: reasons})


def _check_rng_state(rng_state: torch.Tensor | None) -> None:
    if (rng_state is None or rng_state.numel() != 2 or rng_state.dtype != torch.int64
            or rng_state.device.type != "cpu"):
        raise ValueError("dropout_p > 0 needs rng_state, an int64 CPU tensor (seed, offset); "
                         "see fa_backend.ops.new_rng_state()")


def _dropout_args(q: torch.Tensor, dropout_p: float, rng_state: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """The forward kernel's dropout arguments: (seed, offset) on q's device, the 16-bit keep threshold and
    1 / (1 - dropout_p) (the Triton forward's scale)."""
    from ..kernels.triton._features import DROP_HALVES, dropout_draw

    draw, threshold = dropout_draw(dropout_p)
    if draw != DROP_HALVES:  # check_cute_inputs refuses these first (the backend's `dropout` reason)
        raise ValueError(f"dropout_p={dropout_p} needs 32-bit draws, which the CuTe forward does not make")
    return rng_state.to(q.device, non_blocking=True), threshold, 1.0 / (1.0 - dropout_p)


def _readable(t: torch.Tensor) -> torch.Tensor:
    """t itself when TMA can read it, else a contiguous copy (16-byte aligned from the allocator)."""
    return t if is_tma_aligned(t) and t.data_ptr() % 16 == 0 else t.contiguous()


def _triton_forward(q, k, v, scale, is_causal, bottom_right, attn_mask=None, dropout_p=0.0, rng_state=None):
    """The Triton forward under the op's contract (contiguous out, fp32 lse), counted as a triton run."""
    from ..kernels.triton import flash_fwd

    counters.record_run("triton")
    rng = tuple(rng_state.tolist()) if dropout_p > 0 else None
    out, lse = flash_fwd(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale, is_causal, bottom_right,
                         attn_mask=attn_mask, dropout_p=dropout_p, rng=rng)
    return out.contiguous(), lse.contiguous()


def key_words(attn_mask: torch.Tensor, b: int, hq: int, sk: int) -> torch.Tensor:
    """A bool key mask (no query dim: size 1 or stride 0) packed as the CuTe kernels read it: int32 (b, hq,
    ceil(sk / 32) + 1), key j at bit j % 32 of word j // 32 (1 = attend; the Triton kernels' packing,
    _mask_bounds.row_bits), then one word more: the row's key bound (1 + its last attended key, 0 if none), past
    which the kernels visit no key block. Broadcast dims have stride 0; cached per mask tensor."""
    from ..kernels.triton._mask_bounds import _cached

    words = _cached(attn_mask, ("cute_key_words", sk), lambda: _words_and_bound(attn_mask, b, hq, sk))
    return words.expand(b, hq, words.shape[-1])


def _words_and_bound(attn_mask: torch.Tensor, b: int, hq: int, sk: int) -> torch.Tensor:
    from ..kernels.triton._mask_bounds import row_bits

    words, _, _ = row_bits(attn_mask, b, hq, sk)  # (mb, mh, nw)
    nw = words.shape[-1]
    index = torch.arange(nw, device=words.device)
    last = torch.where(words != 0, index, -1).amax(-1)  # the last word holding an attended key, -1 if none
    top = words.gather(-1, last.clamp(min=0)[..., None])[..., 0].to(torch.int64) & 0xFFFFFFFF
    # 1 + the highest set bit of that word (exact: float64 holds every 32-bit value)
    high = torch.floor(torch.log2(top.clamp(min=1).to(torch.float64))).to(torch.int64) + 1
    bound = torch.where(last >= 0, 32 * last + high, 0).to(torch.int32)
    return torch.cat([words, bound[..., None]], -1).contiguous()


def save_keep_bits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
                   attn_mask: torch.Tensor | None, dropout_p: float, is_causal: bool = False,
                   bottom_right: bool = False) -> bool:
    """Whether a dropout forward that will be differentiated saves its keep bits for the CuTe backward: d = dv = 128
    (DROPOUT_BACKWARD, whose 64-row steps read them), no mask, a nonzero scale, not under deterministic algorithms
    (whose backward is Triton's), within kernels/keep_bits.KEEP_BITS_BUDGET (a causal call's in the causal layout)."""
    from ..kernels.keep_bits import causal_offset, keep_bits_fit

    if (dropout_p <= 0 or attn_mask is not None or scale == 0.0 or q.dim() != 4 or k.dim() != 4
            or q.shape[-1] not in DROPOUT_BACKWARD or v.shape[-1] != q.shape[-1]
            or torch.are_deterministic_algorithms_enabled()):
        return False
    return keep_bits_fit(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[-1], v.shape[-1],
                         q.element_size(), causal_offset(q.shape[2], k.shape[2], is_causal, bottom_right))


def _keep_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                 bottom_right: bool = False) -> tuple[int, int | None]:
    """(period, causal offset) of the keep bits a keep_bits forward saves: every period-th row of tiles
    (kernels/keep_bits.keep_period: every row within the budget, else every second or fourth), in the causal layout
    for a causal call (keep_bits.causal_offset)."""
    from ..kernels.keep_bits import causal_offset, keep_period

    diagonal = causal_offset(q.shape[2], k.shape[2], is_causal, bottom_right)
    return keep_period(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[-1], v.shape[-1],
                       q.element_size(), diagonal), diagonal


def _keep_bits_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: bool, is_causal: bool = False,
                   bottom_right: bool = False) -> torch.Tensor:
    """The third output of cute_flash_fwd: the buffer of the saved keep bits (_keep_layout's; the backward reads the
    period from its size), or an empty one."""
    from ..kernels.keep_bits import keep_bits_bytes

    size = keep_bits_bytes(q.shape[0], q.shape[1], q.shape[2], k.shape[2],
                           *_keep_layout(q, k, v, is_causal, bottom_right)) if keep else 0
    return torch.empty(size, dtype=torch.uint8, device=q.device)


@torch.library.custom_op(f"{NAMESPACE}::cute_flash_fwd", mutates_args=())
def cute_flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                   is_causal: bool = False, bottom_right: bool = False, attn_mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, rng_state: torch.Tensor | None = None,
                   keep_bits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention forward on Hopper; returns out (b, hq, sq, dv) contiguous in q's dtype, the fp32 natural-log lse
    (b, hq, sq) (before dropout) and the saved keep bits (uint8; empty unless keep_bits). GQA when hq is a multiple
    of hkv; causal top-left or bottom-right; attn_mask: a bool key mask (True = attend) broadcastable to (b, hq, sq,
    sk) without a query dim (size 1 or stride 0), e.g. key padding (b, 1, 1, sk); a row that sees no key gets out 0
    and lse -inf. dropout_p > 0 needs rng_state (int64 CPU (seed, offset), ops.new_rng_state): the mask
    fa_backend::triton_flash_fwd draws for it. keep_bits (where save_keep_bits holds): also save that mask for the
    CuTe backward (kernels/keep_bits.py)."""
    return _cute_forward(q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state, keep_bits)


# The plain forward's prepared launches (flash_fwd.ForwardLaunch) per call signature (_launch_key): a signature seen
# before skips check_cute_inputs, the kernel's own checks, the compile-cache lookup and the marshalling (on the
# H200's host the forward's Python path was 211 us per call without gradients, scripts/host_profile_cute.py). A launch
# keeps the variant flash_fwd_ws.FASTEST named when it was prepared (clear _LAUNCHES after changing FASTEST).
_LAUNCHES: dict[tuple, object] = {}
MAX_LAUNCHES = 256  # signatures kept; shapes that keep changing start over rather than grow
_MODULES: list = []  # dispatch.backends.cute and kernels.cute._fast_call, whose switches the launch keys read


def _modules() -> list:
    """_MODULES, imported once, not per call (the DSL's modules load with the first CuTe call); _fast_call is None
    where the DSL is missing."""
    if not _MODULES:
        from ..dispatch.backends import cute as cute_backend

        if cute_backend.DSL_MISSING:  # no DSL: no prepared launch; check_cute_inputs gives the reason
            _MODULES.extend((cute_backend, None))
        else:
            from ..kernels.cute import _fast_call

            _MODULES.extend((cute_backend, _fast_call))
    return _MODULES


def _launch_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, is_causal: bool,
                bottom_right: bool) -> tuple | None:
    """What check_cute_inputs and the prepared launch depend on for a call without mask or dropout (shapes,
    strides, dtypes, devices, scale, causal mode, the switches read at each call),
    or None where the call cannot take a prepared launch (data not 16-byte aligned: the op copies it first; a
    scale that is not positive)."""
    cute_backend, _fast_call = _modules()
    if (_fast_call is None or (scale is not None and not scale > 0)
            or not (_fast_call.ENABLED and cute_backend.KERNELS_ENABLED)):
        return None
    size = q.element_size()
    for t in (q, k, v):
        if t.data_ptr() & 15 or (t.storage_offset() * size) & 15:
            return None
    # gradients change check_cute_inputs' answer only where the Triton kernels are missing (the `grad` reason)
    grad = bool(cute_backend.TRITON_MISSING) and torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad)
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
            k.device, v.device, scale, is_causal, bottom_right, grad)


def _checked(q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state) -> None:
    """check_cute_inputs, unless the call's signature already has a prepared launch (which it passed)."""
    if (attn_mask is not None or dropout_p > 0
            or _launch_key(q, k, v, scale, is_causal, bottom_right and is_causal) not in _LAUNCHES):
        check_cute_inputs(q, k, v, scale, is_causal, attn_mask, dropout_p, rng_state)


_EMPTY_BITS: dict[torch.device, torch.Tensor] = {}


def _no_bits(q: torch.Tensor, k: torch.Tensor, fresh: bool) -> torch.Tensor:
    """The empty keep-bits output: a new one for the op (its outputs must not alias), else one per device."""
    if fresh:
        return _keep_bits_out(q, k, k, False)
    bits = _EMPTY_BITS.get(q.device)
    if bits is None:
        bits = _EMPTY_BITS[q.device] = torch.empty(0, dtype=torch.uint8, device=q.device)
    return bits


def _cute_forward(q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state, keep_bits, check=True,
                  fresh_bits=True):
    """cute_flash_fwd's implementation (the op's and its eager twin's): (out, lse, bits). check=False: the caller
    ran check_cute_inputs (the twin, in grad mode: inside its autograd.Function the call would not require grad).
    fresh_bits=False (the eager callers): an empty bits output may be shared."""
    if attn_mask is None and dropout_p == 0 and not keep_bits:
        key = _launch_key(q, k, v, scale, is_causal, bottom_right and is_causal)
        launch = _LAUNCHES.get(key) if key is not None else None
        if launch is None and key is not None:
            launch = _prepared(key, q, k, v, scale, is_causal, bottom_right and is_causal, check)
            check = False  # done by _prepared
        if launch is not None:
            counters.record_run("cute")
            return (*launch(q, k, v), _no_bits(q, k, fresh_bits))
    if check:
        check_cute_inputs(q, k, v, scale, is_causal, attn_mask, dropout_p, rng_state)
    if keep_bits and not save_keep_bits(q, k, v, scale, attn_mask, dropout_p, is_causal, bottom_right):
        raise ValueError("keep_bits=True needs dropout at head dim 128 without a mask, a nonzero scale, no "
                         "deterministic algorithms and bits within keep_bits.KEEP_BITS_BUDGET (see save_keep_bits)")
    from ..kernels.cute._compile_cache import CompileFailedError
    from ..kernels.cute.flash_fwd_ws import flash_fwd_fastest

    bits = _keep_bits_out(q, k, v, keep_bits, is_causal, bottom_right)
    bottom_right = bottom_right and is_causal
    fallback = (q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state)
    if scale == 0.0:  # -inf * 0 on masked keys: the kernels need a nonzero scale
        return (*_triton_forward(*fallback), bits)
    q, k, v = (_readable(t) for t in (q, k, v))
    if scale is not None and scale < 0:  # the kernels take the row max before scaling: (-q) k^T (-scale), exact
        q, scale = -q, -scale
    words = None if attn_mask is None else key_words(attn_mask, q.shape[0], q.shape[1], k.shape[2])
    dropout = _dropout_args(q, dropout_p, rng_state) if dropout_p > 0 else None
    if keep_bits:
        dropout = (*dropout, bits)
    try:
        out, lse = flash_fwd_fastest(q, k, v, scale, is_causal, bottom_right, key_words=words, dropout=dropout)
    except CompileFailedError:  # logged once by the compile cache; the Triton forward keeps the contract
        out, lse = _triton_forward(*fallback)
        if keep_bits:  # the same mask's bits, drawn by a Triton kernel of their own
            from ..kernels.triton.keep_bits import fill_keep_bits

            fill_keep_bits(bits, q.shape[0], q.shape[1], q.shape[2], k.shape[2], dropout_p,
                           tuple(rng_state.tolist()), *_keep_layout(q, k, v, is_causal, bottom_right))
        return out, lse, bits
    counters.record_run("cute")
    return out, lse, bits


def _prepared(key: tuple, q, k, v, scale, is_causal, bottom_right, check: bool):
    """The prepared launch of a plain call's signature (check_cute_inputs first where `check`: ValueError,
    BackendUnsupportedError), kept in _LAUNCHES; None where the forward cannot prepare one (the pointer convention is
    off, or the variant failed to compile: the caller's general path then runs the Triton forward)."""
    from ..kernels.cute._compile_cache import CompileFailedError
    from ..kernels.cute.flash_fwd_ws import prepare_fastest

    if check:
        check_cute_inputs(q, k, v, scale, is_causal)
    if not all(is_tma_aligned(t) for t in (q, k, v)):  # the general path copies these first
        return None
    try:
        launch = prepare_fastest(q, k, v, scale, is_causal, bottom_right)
    except CompileFailedError:
        return None
    if launch is not None:
        if len(_LAUNCHES) >= MAX_LAUNCHES:
            _LAUNCHES.clear()
        _LAUNCHES[key] = launch
    return launch


@cute_flash_fwd.register_fake
def _(q, k, v, scale=None, is_causal=False, bottom_right=False, attn_mask=None, dropout_p=0.0, rng_state=None,
      keep_bits=False):
    validate(q, k, v)
    return (q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32),
            _keep_bits_out(q, k, v, keep_bits, is_causal, bottom_right))


def _save(ctx, inputs, out, lse, bits) -> None:
    """What the backward reads, saved by the op's setup_context and its eager twin's forward."""
    q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state, _ = inputs
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, rng_state, bits)
    ctx.scale, ctx.is_causal, ctx.bottom_right = scale, is_causal, bottom_right and is_causal
    ctx.dropout_p = dropout_p
    # no zero gradients for outputs the caller did not use: the keep bits (uint8, one bit per score: autograd
    # filled 67 MB of zeros per 2k training call, 21 us on the H200) and, usually, lse
    ctx.set_materialize_grads(False)


def _setup_context(ctx, inputs, output):
    out, lse, bits = output
    ctx.mark_non_differentiable(bits)
    _save(ctx, inputs, out, lse, bits)


# Read at each backward: True runs the CuTe backward where it applies (see the module docstring).
CUTE_BACKWARD = True
# the CuTe backward's variant per head dim (flash_bwd keywords): at d=128 the warp-specialised kernel (two MMA
# warpgroups with 128 keys per CTA and a producer warpgroup; 6-7 % faster than two warpgroups without the producer
# at 2k-8k tokens on the H200, eleventh session); at d=64 the same kernel with 128 query rows per step (FA4's d=64
# tile: +5-9 % over one warpgroup at 2k-8k, causal 2k equal, twelfth session); one warpgroup elsewhere
# d=192 / 256: flash_bwd_wide's kernel (both MMA warpgroups on one 64-key tile, split by columns; 2.4-3.2x the Triton
# backward it replaced, fifteenth session)
BACKWARD_VARIANTS = {128: dict(wgs=2, warp_specialized=True), 64: dict(wgs=2, warp_specialized=True, tile_m=128),
                     192: dict(wgs=2, warp_specialized=True), 256: dict(wgs=2, warp_specialized=True)}


# head dims whose CuTe backward drops (flash_bwd_ws's dropout variant, sixteenth session): d=128. At d=64 (128 query
# rows per step) the variant spills 16-20 bytes in the MMA warpgroups (sm_90a compile check); d=96, 192 and 256 have
# other backward kernels. The rest runs the Triton backward with the same mask.
DROPOUT_BACKWARD = frozenset({128})

# head dims whose backward variant runs a key mask: the warp-specialised kernel's 64-row steps (d=128) and its 128-row
# d=64 variant (with the per-row key bound it spills 12 bytes, 92 when causal, on the sm90 compile check; on the H200
# its masked backward is within 8-9 % of its unmasked one, thirteenth session), and flash_bwd_wide at d=192 / 256
# (fifteenth session). d=96's backward variant is one warpgroup without the mask: a masked d=96 backward runs the
# Triton kernels with the same mask.
KEY_MASK_BACKWARD = frozenset({128, 64, 192, 256})


def _cute_backward(q, k, v, out, lse, dout, dlse, scale, is_causal, bottom_right, attn_mask=None, dropout_p=0.0,
                   rng_state=None, keep_bits=None):
    """(dq, dk, dv) from the CuTe backward, or None where it does not apply (scale 0, unequal head dims other than
    flash_bwd_wide's HEAD_DIM_V_PAIRS, a variant that failed to compile, a key mask at a head dim whose backward
    variant has none (96), deterministic mode at d=96 or with a key mask, dropout at a head dim outside
    DROPOUT_BACKWARD or with a key mask or deterministic: the caller runs the Triton backward). keep_bits: the
    forward's saved keep bits (empty where it saved none). Under torch.use_deterministic_algorithms the
    warp-specialised kernels add dQ in a fixed order (d=64 / 128 / 192 / 256)."""
    from ..kernels.cute._compile_cache import CompileFailedError
    from ..kernels.cute.flash_bwd import HEAD_DIMS, WIDE_HEAD_DIMS, flash_bwd
    from ..kernels.cute.flash_bwd_wide import HEAD_DIM_V_PAIRS

    if attn_mask is None and dropout_p == 0:
        key = _backward_key(dout, q, k, v, out, lse, dlse, scale, is_causal, bottom_right)
        if key is not None:
            launch = _BACKWARD_LAUNCHES.get(key, _UNPREPARED)
            if launch is _UNPREPARED:
                launch = _prepared_backward(key, dout, q, k, v, out, lse, scale, is_causal, bottom_right)
            if launch is not None:
                return launch(dout, q, k, v, out, lse, dlse)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dims = (q.shape[-1], v.shape[-1])
    if scale == 0.0 or q.shape[-1] not in HEAD_DIMS + WIDE_HEAD_DIMS or (dims[1] != dims[0]
                                                                         and dims not in HEAD_DIM_V_PAIRS):
        return None
    variant = BACKWARD_VARIANTS.get(q.shape[-1], {})  # one warpgroup where absent
    deterministic = torch.are_deterministic_algorithms_enabled()
    if dropout_p > 0:
        if q.shape[-1] not in DROPOUT_BACKWARD or deterministic or attn_mask is not None:
            return None
        dropout = _dropout_args(q, dropout_p, rng_state)
        if keep_bits is not None and keep_bits.numel() > 0:
            dropout = (*dropout, keep_bits)  # loaded instead of drawn again
        variant = dict(variant, dropout=dropout)
    if deterministic:
        if not variant.get("warp_specialized") or attn_mask is not None:
            return None  # the deterministic variant is the warp-specialised kernel's, without a key mask
        variant = dict(variant, deterministic=True)
    words = None
    if attn_mask is not None:
        if q.shape[-1] not in KEY_MASK_BACKWARD:
            return None
        words = key_words(attn_mask, q.shape[0], q.shape[1], k.shape[2])
    q, k, v = (_readable(t) for t in (q, k, v))
    negate = scale < 0  # as the forward: (-q) k^T (-scale), so dq of -q is -dq
    try:
        dq, dk, dv = flash_bwd(dout, -q if negate else q, k, v, out, lse, -scale if negate else scale, is_causal,
                               bottom_right, dlse=dlse, key_words=words, **variant)
    except CompileFailedError:  # logged once by the compile cache
        return None
    return (-dq if negate else dq), dk, dv


# The backward's prepared launches (flash_bwd.BackwardLaunch) per call signature (_backward_key), as _LAUNCHES for the
# forward: a signature seen before skips flash_bwd's checks, the compile-cache lookup and the marshalling (on the
# H200's host the backward's Python path was 406-614 us per call, 480 function calls, scripts/host_profile_cute.py
# --backward). None for a signature that cannot take one (it runs the general path). A launch keeps the variant
# BACKWARD_VARIANTS named when it was prepared (the variant is part of the key).
_BACKWARD_LAUNCHES: dict[tuple, object] = {}
_UNPREPARED = object()
_PREPARED_VARIANT_KEYS = frozenset({"wgs", "warp_specialized", "tile_m", "tma_store"})  # prepare_backward's keywords


def _backward_key(dout, q, k, v, out, lse, dlse, scale, is_causal, bottom_right) -> tuple | None:
    """What flash_bwd's checks and the prepared launch depend on for a backward without mask or dropout (shapes,
    strides, dtypes and devices of its tensors, scale, causal mode, the head dim's variant, the switches read at
    each call), or None where the call cannot take a prepared launch (data of q, k, v or dout not 16-byte
    aligned, a scale that is not positive, deterministic algorithms, the pointer convention off)."""
    _, _fast_call = _modules()
    if (_fast_call is None or (scale is not None and not scale > 0) or not _fast_call.ENABLED
            or torch.are_deterministic_algorithms_enabled()):
        return None
    for t in (q, k, v, dout):
        if t.data_ptr() & 15:
            return None
    if lse.data_ptr() & 3:
        return None
    variant = BACKWARD_VARIANTS.get(q.shape[-1])
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), dout.shape, dout.stride(), out.shape,
            out.stride(), lse.shape, lse.stride(), q.dtype, k.dtype, v.dtype, dout.dtype, out.dtype, lse.dtype,
            q.device, k.device, v.device, dout.device, out.device, lse.device, dlse is None, scale, is_causal,
            bottom_right, tuple(variant.items()) if variant else ())


def _prepared_backward(key: tuple, dout, q, k, v, out, lse, scale, is_causal, bottom_right):
    """The prepared backward launch of a call's signature, kept in _BACKWARD_LAUNCHES (flash_bwd's checks:
    ValueError); None, also kept, where the signature takes the general path (a head dim, head-dim pair or variant
    that prepare_backward does not take, q / k / v that TMA cannot read in place, a dout or lse that flash_bwd
    copies first, a variant that failed to compile)."""
    from ..kernels.cute._compile_cache import CompileFailedError
    from ..kernels.cute.flash_bwd import HEAD_DIMS, WIDE_HEAD_DIMS, prepare_backward
    from ..kernels.cute.flash_bwd_wide import HEAD_DIM_V_PAIRS

    d, dv = q.shape[-1], v.shape[-1]
    variant = BACKWARD_VARIANTS.get(d, {})
    launch = None
    if (d in HEAD_DIMS + WIDE_HEAD_DIMS and (dv == d or (d, dv) in HEAD_DIM_V_PAIRS)
            and set(variant) <= _PREPARED_VARIANT_KEYS and all(is_tma_aligned(t) for t in (q, k, v))):
        try:
            launch = prepare_backward(dout, q, k, v, out, lse, scale, is_causal, bottom_right, **variant)
        except CompileFailedError:  # logged once by the compile cache; the general path falls back to Triton
            launch = None
    if len(_BACKWARD_LAUNCHES) >= MAX_LAUNCHES:
        _BACKWARD_LAUNCHES.clear()
    _BACKWARD_LAUNCHES[key] = launch
    return launch


@torch.library.custom_op(f"{NAMESPACE}::cute_flash_bwd", mutates_args=())
def cute_flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dlse: torch.Tensor | None, scale: float | None = None, is_causal: bool = False,
                   bottom_right: bool = False, attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   rng_state: torch.Tensor | None = None,
                   keep_bits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) of cute_flash_fwd by the CuTe backward, contiguous whatever the inputs' strides
    (what the fake implementation promises); dlse is the gradient of its lse output, if any. The Triton backward
    where the CuTe one does not apply (see the module docstring). dropout_p, rng_state and keep_bits: the
    forward's (its saved keep bits, read where not empty)."""
    return _cute_gradients(dout, q, k, v, out, lse, dlse, scale, is_causal, bottom_right, attn_mask, dropout_p,
                           rng_state, keep_bits)


def _cute_gradients(dout, q, k, v, out, lse, dlse, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state,
                    keep_bits):
    """cute_flash_bwd's implementation (the op's and its eager twin's): (dq, dk, dv)."""
    if dropout_p > 0:
        _check_rng_state(rng_state)
    grads = _cute_backward(q, k, v, out, lse, dout, dlse, scale, is_causal, bottom_right, attn_mask, dropout_p,
                           rng_state, keep_bits)
    if grads is None:
        from ..kernels.triton import flash_bwd

        dq, dk, dv = _contiguous_like(q, k, v)
        rng = tuple(rng_state.tolist()) if dropout_p > 0 else None
        grads = flash_bwd(dout, q, k, v, out, lse, q.shape[-1] ** -0.5 if scale is None else scale, is_causal,
                          bottom_right, dlse, attn_mask=attn_mask, dropout_p=dropout_p, rng=rng, dq=dq, dk=dk, dv=dv)
    return grads


def _contiguous_like(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


@cute_flash_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, scale=None, is_causal=False, bottom_right=False, attn_mask=None, dropout_p=0.0,
      rng_state=None, keep_bits=None):
    return _contiguous_like(q, k, v)


def _gradients(ctx, dout, dlse, cute_bwd) -> tuple:
    """The autograd formula of the op (cute_bwd: the cute_flash_bwd op) and of its eager twin (_cute_gradients)."""
    from .triton_flash import triton_flash_bwd

    q, k, v, out, lse, attn_mask, rng_state, bits = ctx.saved_tensors
    if dout is None:  # only lse was differentiated (dlse is None where only out was: the kernels take None)
        dout = torch.zeros_like(out)
    if CUTE_BACKWARD:
        grads = cute_bwd(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.is_causal, ctx.bottom_right, attn_mask,
                         ctx.dropout_p, rng_state, bits)
    else:
        grads = triton_flash_bwd(dout, q, k, v, out, lse, dlse, ctx.scale, ctx.is_causal, ctx.bottom_right,
                                 attn_mask, ctx.dropout_p, rng_state)
    return (*grads, None, None, None, None, None, None, None)


def _backward(ctx, dout, dlse, dbits):
    return _gradients(ctx, dout, dlse, cute_flash_bwd)


cute_flash_fwd.register_autograd(_backward, setup_context=_setup_context)


def cute_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                         is_causal: bool = False, bottom_right: bool = False, attn_mask: torch.Tensor | None = None,
                         dropout_p: float = 0.0,
                         rng_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the CuTe forward, differentiable in q, k and v (the CuTe backward, see the module docstring);
    attn_mask: a bool key mask (cute_flash_fwd). With dropout_p > 0 and no rng_state, a fresh one is drawn
    (ops.new_rng_state: torch's CPU generator, so torch.manual_seed reproduces it); where the call will be
    differentiated, its keep bits are saved for the backward (save_keep_bits)."""
    if dropout_p > 0 and rng_state is None:
        from .triton_flash import new_rng_state

        rng_state = new_rng_state()
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    keep = dropout_p > 0 and grad and save_keep_bits(q, k, v, scale, attn_mask, dropout_p, is_causal, bottom_right)
    args = (q, k, v, scale, bool(is_causal), bool(bottom_right), attn_mask, float(dropout_p),
            rng_state if dropout_p > 0 else None, keep)
    if torch.compiler.is_compiling() or not _plain(q, k, v, attn_mask):
        out, lse, _ = cute_flash_fwd(*args)
    elif not grad:
        out, lse, _ = _cute_forward(*args, fresh_bits=False)  # nothing to differentiate: no autograd.Function layer
    else:
        _checked(q, k, v, scale, is_causal, bottom_right, attn_mask, dropout_p, rng_state)
        out, lse = _EagerCuteFlash.apply(*args)
    return out, lse


class _EagerCuteFlash(torch.autograd.Function):
    """cute_flash_fwd's eager twin for plain tensors: the same checks, kernels, counters and gradients (bitwise),
    without the torch.library dispatch and custom-op autograd layers (on the H200's host the op's forward took
    269 us per call without gradients and 386 us with them, cuDNN's SDPA 98 / 128: scripts/profile_op_kernels.py).
    The keep bits stay in the context, not an output: no gradient of theirs is ever materialised."""

    @staticmethod
    def forward(ctx, *inputs):  # cute_flash_fwd's arguments, checked by the caller in grad mode
        out, lse, bits = _cute_forward(*inputs, check=False, fresh_bits=False)
        _save(ctx, inputs, out, lse, bits)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return _gradients(ctx, dout, dlse, _cute_gradients)


__all__ = ["check_cute_inputs", "cute_flash_attention", "cute_flash_bwd", "cute_flash_fwd"]
