"""Block ranges of an attn_mask, so the kernels skip what it hides and do not read it where it hides nothing.

A mask often has structure at the scale of a tile: an explicit causal mask hides every block above the
diagonal, a key-padding mask hides whole key blocks past each sequence's length, a document mask hides
every block outside the diagonal documents. For each tile row of the kernel's grid, `block_bounds`
classifies the blocks along the loop (keys for the forward and dQ kernels, queries for the dK/dV one):

- hidden: every element masked (bool False, additive -inf): the block changes nothing and is skipped;
- open: every element attended with nothing added (bool True, additive 0): the mask is not read;
- partial: anything else; the kernel reads the mask there.

The kernels get, per tile row, four loop positions (lo, open_lo, open_hi, hi): blocks outside [lo, hi)
are hidden, blocks in [open_lo, open_hi) are open. Blocks in between are handled as partial, so the
result is exact for any mask; the saving depends on the mask having one run of open blocks per tile
row (true of causal, padding, sliding-window and document masks).

The classification reads the mask once per launch (about sq * sk bytes for a bool mask), which is why
launchers use it only on calls large enough for the skipped work to pay (see `worth_it`).

The same calls get a bool key mask (no query dim) packed 32 keys per int32 word (`row_bits`), which the kernels
read a few words per tile instead of one byte per key (_common.MASK_BITS_ROW). Both are cached per mask tensor.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

# Loop end for "to the end of the sequence": larger than any sequence, small enough for int32 arithmetic.
TO_END = 2**30

# Calls below this many forward FLOPs (4 * b * hq * sq * sk * d) read the mask in every block instead:
# building the bounds costs about fifteen small launches (~100 µs of host time), more than it saves there
# (2**33 FLOPs: ~20 µs of attention on an H200). A mask whose bounds cannot be cached (an inference tensor, or
# during CUDA-graph capture, see block_bounds) pays that on every call, so it needs a larger call (~170 µs).
MIN_FLOPS = 2**33
MIN_FLOPS_UNCACHED = 2**36


def as_4d(attn_mask: torch.Tensor) -> torch.Tensor:
    """The mask viewed with leading size-1 dims up to 4 dims (b, h, sq, sk as broadcast)."""
    if attn_mask.dim() >= 4:
        return attn_mask
    return attn_mask.view((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))


def _distinct(m: torch.Tensor, dims: range) -> torch.Tensor:
    """m narrowed to one slice along each broadcast (stride 0) dim of dims."""
    for dim in dims:
        if m.shape[dim] > 1 and m.stride(dim) == 0:
            m = m.narrow(dim, 0, 1)
    return m


def cacheable(attn_mask: torch.Tensor) -> bool:
    """Whether block_bounds may reuse this mask's bounds from an earlier call."""
    return CACHE_ENABLED and not attn_mask.is_inference() and not (
        attn_mask.is_cuda and torch.cuda.is_current_stream_capturing())


def worth_it(attn_mask: torch.Tensor, b: int, hq: int, sq: int, sk: int, d: int) -> bool:
    """Whether a masked launch of this size builds block bounds (module-level thresholds, 0 in tests)."""
    flops = 4 * b * hq * sq * sk * d
    return flops >= MIN_FLOPS and (cacheable(attn_mask) or flops >= MIN_FLOPS_UNCACHED)


def block_classes(attn_mask: torch.Tensor, sq: int, sk: int, block_q: int, block_k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(visible, open) bool tensors of shape (mb, mh, nq, nk) for the mask's (block_q x block_k) blocks.

    visible: some element of the block is not hidden; open: no element is masked or biased. mb / mh are
    the mask's own batch / head sizes (1 when broadcast); nq is 1 when the mask's query dim is broadcast.
    Key positions past sk count as hidden; query rows past sq count as attended with a zero bias (so a
    last, partial query block is never classified hidden: conservative, still exact).
    """
    m = _distinct(as_4d(attn_mask), range(3))  # a broadcast batch, head or query dim holds one distinct slice
    mb, mh, mq, mk = m.shape
    if mk == 1:
        m = m.expand(mb, mh, mq, sk)
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
        key_pad, row_pad = 0, 1
    else:
        key_pad, row_pad = float("-inf"), 0.0
    nk = -(-sk // block_k)
    if nk * block_k != sk:
        m = F.pad(m, (0, nk * block_k - sk), value=key_pad)
    if mq == 1:
        nq, rows = 1, 1
    else:
        nq = -(-sq // block_q)
        rows = block_q
        if nq * block_q != sq:
            m = F.pad(m, (0, 0, 0, nq * block_q - sq), value=row_pad)
    blocks = m.reshape(mb, mh, nq, rows, nk, block_k)
    hi = blocks.amax(dim=(3, 5))
    lo = blocks.amin(dim=(3, 5))
    if m.dtype == torch.uint8:
        return hi != 0, lo != 0
    return hi != float("-inf"), (lo == 0) & (hi == 0)


def bounds_from_classes(visible: torch.Tensor, open_: torch.Tensor, block: int) -> torch.Tensor:
    """int32 (..., 4) loop positions (lo, open_lo, open_hi, hi) along the last dim of the classes, in
    elements (multiples of block; TO_END for the end of the dim). open_hi is the end of the first run of
    open blocks; with no visible block lo = TO_END and hi = 0 (no range)."""
    n = visible.shape[-1]
    idx = torch.arange(n, device=visible.device, dtype=torch.int32)
    end = torch.full((), n, device=visible.device, dtype=torch.int32)
    lo = torch.where(visible, idx, end).amin(-1)
    hi = torch.where(visible, idx + 1, 0).amax(-1)
    open_lo = torch.where(open_, idx, end).amin(-1)
    open_hi = torch.where(open_ | (idx < open_lo.unsqueeze(-1)), end, idx).amin(-1)
    out = torch.stack((lo, open_lo, open_hi, hi), dim=-1)
    return torch.where(out >= n, TO_END // block, out) * block


# Bounds (and packed bits) of recent masks: a model passes one mask object to every layer, and the backward
# needs them again. Keyed on the mask's identity (checked through a weak reference, so a new tensor at a reused
# address never matches) and its version counter (an in-place write makes a new entry). Writes that bypass
# the version counter (through `.data`, or a foreign kernel writing through data_ptr) are not seen: the
# contract autograd's saved tensors rely on too. CACHE_ENABLED = False recomputes them on every launch
# (a few small launches each).
CACHE_ENABLED = True
_CACHE: dict[tuple, tuple[weakref.ref, tuple]] = {}
_CACHE_SIZE = 64


def _cached(attn_mask: torch.Tensor, key: tuple, compute):
    """compute(), reused for the same mask tensor (and key) while it is not written in place; recomputed during
    CUDA-graph capture (the graph must compute it from the mask's contents at replay time) and for inference
    tensors (which have no version counter)."""
    if not cacheable(attn_mask):
        return compute()
    key = (id(attn_mask), attn_mask._version) + key
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is attn_mask:
        return hit[1]
    result = compute()
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = (weakref.ref(attn_mask), result)
    return result


def block_bounds(attn_mask: torch.Tensor, sq: int, sk: int, block_q: int, block_k: int, by_keys: bool = False
                 ) -> tuple[torch.Tensor, int, int, int]:
    """Loop bounds of one kernel launch and their (batch, head, tile-row) strides (0 where broadcast).

    by_keys=False: one row per query block (forward, dQ), positions in keys. by_keys=True: one row per
    key block (dK/dV), positions in queries. The tensor is (mb, mh, rows, 4) int32 on the mask's device.
    Cached per mask tensor (_cached).
    """
    return _cached(attn_mask, ("bounds", sq, sk, block_q, block_k, by_keys),
                   lambda: _block_bounds(attn_mask, sq, sk, block_q, block_k, by_keys))


def row_bits(attn_mask: torch.Tensor, b: int, hq: int, sk: int) -> tuple[torch.Tensor, int, int]:
    """A bool mask without a query dim (key padding: (b, 1, 1, sk), or one expanded from it) packed for the
    kernels' MASK_BITS_ROW: int32 words (mb, mh, ceil(sk / 32)), key j at bit j % 32 of word j // 32 (1 =
    attend; keys past sk read 0: the words hide them, the kernels apply no other bound to them), and the
    word tensor's (batch, head) strides as a (b, hq) broadcast (0 where the mask is broadcast). Cached per
    mask tensor (_cached)."""
    words = _cached(attn_mask, ("row_bits", sk), lambda: _row_bits(attn_mask, sk))
    mb, mh, _ = words.shape
    return words, (words.stride(0) if mb > 1 else 0), (words.stride(1) if mh > 1 else 0)


def _row_bits(attn_mask: torch.Tensor, sk: int) -> torch.Tensor:
    m = _distinct(as_4d(attn_mask), range(3))[:, :, 0, :]
    mb, mh, mk = m.shape
    m = m.expand(mb, mh, sk).to(torch.int64)
    nw = -(-sk // 32)
    if nw * 32 != sk:
        m = F.pad(m, (0, nw * 32 - sk), value=0)
    words = (m.view(mb, mh, nw, 32) << torch.arange(32, device=m.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def _block_bounds(attn_mask: torch.Tensor, sq: int, sk: int, block_q: int, block_k: int, by_keys: bool
                  ) -> tuple[torch.Tensor, int, int, int]:
    visible, open_ = block_classes(attn_mask, sq, sk, block_q, block_k)
    if by_keys:
        bounds = bounds_from_classes(visible.transpose(-1, -2), open_.transpose(-1, -2), block_q)
    else:
        bounds = bounds_from_classes(visible, open_, block_k)
    mb, mh, rows, _ = bounds.shape
    return (bounds, bounds.stride(0) if mb > 1 else 0, bounds.stride(1) if mh > 1 else 0,
            bounds.stride(2) if rows > 1 else 0)


def launch_args(attn_mask: torch.Tensor | None, b: int, hq: int, sq: int, sk: int, d: int, block_q: int,
                block_k: int, by_keys: bool = False) -> dict:
    """Keyword arguments that let a launch skip the mask's hidden blocks (Bounds, its strides, MASK_BOUNDS);
    empty when there is no mask or the call is too small for it to pay (worth_it)."""
    if attn_mask is None or not worth_it(attn_mask, b, hq, sq, sk, d):
        return {}
    bounds, sb, sh, sr = block_bounds(attn_mask, sq, sk, block_q, block_k, by_keys)
    return dict(Bounds=bounds, stride_bb=sb, stride_bh=sh, stride_br=sr, MASK_BOUNDS=True)
