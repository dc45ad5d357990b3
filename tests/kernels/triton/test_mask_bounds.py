"""Block-skipping of structured attn_masks (fa_backend/kernels/triton/_mask_bounds.py).

The classification and the loop bounds are checked against a brute-force reading of the mask; the
kernels with bounds are checked with the 2x rule (tests/reference.py) on masks whose blocks are
hidden, open and partial in every arrangement the bounds distinguish, forward and backward, with
causal, window and GQA. Keys in hidden blocks get NaN values: a launch that read them would return NaN.
"""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _mask_bounds
from fa_backend.kernels.triton._features import kernel_features
from tests.conftest import DEVICE
from tests.reference import check_features

pytestmark = pytest.mark.usefixtures("poisoned")


@pytest.fixture(autouse=True)
def always_bounds(monkeypatch):
    monkeypatch.setattr(_mask_bounds, "MIN_FLOPS", 0)
    monkeypatch.setattr(_mask_bounds, "MIN_FLOPS_UNCACHED", 0)


def test_uncacheable_masks_need_larger_calls(monkeypatch):
    monkeypatch.setattr(_mask_bounds, "MIN_FLOPS", 2**33)
    monkeypatch.setattr(_mask_bounds, "MIN_FLOPS_UNCACHED", 2**36)
    mask = torch.ones(8, 8, dtype=torch.bool)
    with torch.inference_mode():
        frozen = torch.ones(8, 8, dtype=torch.bool)
    small, large = (1, 16, 2048, 2048, 128), (8, 16, 2048, 2048, 128)  # 2**35 and 2**38 FLOPs
    assert _mask_bounds.worth_it(mask, *small) and _mask_bounds.worth_it(mask, *large)
    assert not _mask_bounds.worth_it(frozen, *small) and _mask_bounds.worth_it(frozen, *large)
    assert not _mask_bounds.worth_it(mask, 1, 1, 64, 64, 64)


def _brute_classes(mask4, sq, sk, bq, bk):
    """visible / open per block by reading every element (bool or additive)."""
    mb, mh, mq, mk = mask4.shape
    m = mask4.expand(mb, mh, sq if mq > 1 else 1, sk)
    nq = -(-sq // bq) if mq > 1 else 1
    nk = -(-sk // bk)
    vis = torch.zeros(mb, mh, nq, nk, dtype=torch.bool)
    opn = torch.zeros(mb, mh, nq, nk, dtype=torch.bool)
    for i in range(nq):
        rows = slice(i * bq, (i + 1) * bq) if mq > 1 else slice(0, 1)
        for j in range(nk):
            blk = m[:, :, rows, j * bk:(j + 1) * bk]
            full_width = blk.shape[-1] == bk
            if m.dtype == torch.bool:
                vis[:, :, i, j] = blk.any(-1).any(-1)
                opn[:, :, i, j] = blk.all(-1).all(-1) & full_width
            else:
                vis[:, :, i, j] = (blk != float("-inf")).any(-1).any(-1)
                opn[:, :, i, j] = (blk == 0).all(-1).all(-1) & full_width
    return vis, opn


def _structured_masks(sq, sk):
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    lengths = torch.tensor([sk, sk // 3, 0, sk - 5])
    docs = (i * 3 // sq) == (j * 3 // sk)
    return {
        "causal": j <= i + (sk - sq),
        "key_padding": (j < lengths.view(4, 1, 1, 1)).expand(4, 1, 1, sk).clone(),
        "documents": docs,
        "window": (j <= i + 3) & (j >= i - 20),
        "random": torch.rand(2, 3, sq, sk) < 0.5,
        "rows_off": (torch.arange(sq)[:, None] % 5 != 0).expand(sq, sk).clone(),
        "additive": torch.zeros(sq, sk).masked_fill(j > i, float("-inf")).masked_fill((j < 8) & (i > 30), -1.5),
    }


@pytest.mark.parametrize("name", list(_structured_masks(45, 70)))
@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 64)])
def test_classes_and_bounds_match_brute_force(name, bq, bk):
    sq, sk = 45, 70
    mask = _structured_masks(sq, sk)[name]
    mask4 = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
    vis, opn = _mask_bounds.block_classes(mask, sq, sk, bq, bk)
    bvis, bopn = _brute_classes(mask4, sq, sk, bq, bk)
    if mask4.shape[2] > 1 and sq % bq:
        # the last, partial query block is never hidden (conservative); compare full blocks there exactly
        assert (vis[:, :, -1] | ~bvis[:, :, -1]).all()
        vis, bvis = vis[:, :, :-1], bvis[:, :, :-1]
        assert torch.equal(opn, bopn)
    else:
        assert torch.equal(opn, bopn)
    assert torch.equal(vis, bvis)

    for by_keys in (False, True):
        bounds, *_ = _mask_bounds.block_bounds(mask, sq, sk, bq, bk, by_keys)
        v, o = _mask_bounds.block_classes(mask, sq, sk, bq, bk)
        if by_keys:
            v, o, blk = v.transpose(-1, -2), o.transpose(-1, -2), bq
        else:
            blk = bk
        n = v.shape[-1]
        for idx in torch.cartesian_prod(*[torch.arange(s) for s in v.shape[:-1]]).tolist():
            lo, olo, ohi, hi = bounds[tuple(idx)].tolist()
            row_v, row_o = v[tuple(idx)], o[tuple(idx)]
            end = lambda p: n if p >= _mask_bounds.TO_END // blk * blk else p // blk  # noqa: E731
            lo, olo, ohi, hi = lo // blk, olo // blk, end(ohi), end(hi)
            # every visible block is inside [lo, hi); every block of [olo, ohi) is open
            assert not row_v[:lo].any() and not row_v[hi:].any()
            assert row_o[olo:ohi].all() or olo >= ohi


def _qkv(b, hq, hkv, sq, sk, d=16):
    return (torch.randn(b, hq, sq, d, dtype=torch.float16, device=DEVICE),
            torch.randn(b, hkv, sk, d, dtype=torch.float16, device=DEVICE),
            torch.randn(b, hkv, sk, d, dtype=torch.float16, device=DEVICE))


def _check(q, k, v, mask, **kw):
    is_causal = kw.get("is_causal", False)
    window = kw.get("window", (-1, -1))

    def fn(q, k, v):
        return fa_backend.attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                    causal_alignment="bottom_right", window_size=window)
    return check_features(fn, q, k, v, attn_mask=mask, is_causal=is_causal, bottom_right=True, window=window)


@pytest.mark.parametrize("name", ["causal", "key_padding", "documents", "window", "random", "additive"])
def test_forward_backward_with_bounds(name):
    sq, sk = 45, 70
    mask = _structured_masks(sq, sk)[name].to(DEVICE)
    b = 4 if name == "key_padding" else 2
    hq = 3 if name == "random" else 2
    _check(*_qkv(b, hq, 1 if hq == 2 else 3, sq, sk), mask)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(window=(20, 4)), dict(is_causal=True, window=(9, -1))])
def test_bounds_with_causal_and_window(kw):
    sq, sk = 64, 64
    mask = _structured_masks(sq, sk)["documents"].to(DEVICE)
    _check(*_qkv(2, 4, 2, sq, sk), mask, **kw)


@pytest.mark.parametrize("name", ["causal", "documents", "window", "additive"])
@pytest.mark.parametrize("tiles", ["wide_rows", "wide_keys"])
def test_bounds_with_other_tile_shapes(name, tiles):
    # Tiles of different heights and widths in the forward, dQ and dK/dV kernels, so that a tile row can
    # have no open block at all (e.g. the first 32 rows of a causal mask over 16-key blocks).
    from fa_backend.kernels.triton import _configs
    from fa_backend.kernels.triton._configs import BwdConfig, TileConfig

    fwd = TileConfig(32, 16, 4, 1) if tiles == "wide_rows" else TileConfig(16, 32, 4, 1)
    bwd = (BwdConfig(TileConfig(16, 32, 4, 1), TileConfig(32, 16, 4, 1)) if tiles == "wide_rows"
           else BwdConfig(TileConfig(32, 16, 4, 1), TileConfig(16, 32, 4, 1)))
    sq, sk = 64, 64
    mask = _structured_masks(sq, sk)[name].to(DEVICE)
    with _configs.override(fwd=fwd, bwd=bwd):
        _check(*_qkv(1, 2, 1, sq, sk), mask)


def test_hidden_blocks_are_not_read():
    # Key padding: sequence 0 sees 20 keys of 300, sequence 1 all of them. Keys from 128 on (a hidden block
    # for every tile width up to 128) hold NaN; attending to them (even with probability 0) would give NaN.
    sq, sk = 33, 300
    q, k, v = _qkv(2, 2, 2, sq, sk)
    mask = torch.ones(2, 1, 1, sk, dtype=torch.bool, device=DEVICE)
    mask[0, ..., 20:] = False
    v[0, :, 128:] = float("nan")
    k[0, :, 128:] = float("nan")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa_backend.attention(*leaves, attn_mask=mask)
    assert torch.isfinite(out).all()
    grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert all(torch.isfinite(g[0, :, :128]).all() for g in grads[1:])
    assert torch.isfinite(grads[0]).all()
    ref = fa_backend.attention(q[:1], k[:1, :, :20], v[:1, :, :20])
    assert torch.allclose(out[:1].float(), ref.float(), atol=2e-3, rtol=0)


def test_bounds_are_reused_and_follow_in_place_writes(monkeypatch):
    calls = []
    real = _mask_bounds._block_bounds
    monkeypatch.setattr(_mask_bounds, "_block_bounds", lambda *a: calls.append(a[1:]) or real(*a))
    monkeypatch.setattr(_mask_bounds, "_CACHE", {})
    sq = sk = 64
    q, k, v = _qkv(1, 2, 2, sq, sk)
    mask = _structured_masks(sq, sk)["causal"].to(DEVICE)
    first = fa_backend.attention(q, k, v, attn_mask=mask)
    n = len(calls)
    again = fa_backend.attention(q, k, v, attn_mask=mask)
    assert n >= 1 and len(calls) == n and torch.equal(first, again)  # second call: nothing recomputed
    # An in-place write (a new version of the same tensor) is seen: the result follows the new contents.
    mask.copy_(_structured_masks(sq, sk)["documents"].to(DEVICE))
    _check(q, k, v, mask)
    assert len(calls) > n
    # Switched off, every launch computes them, and writes the version counter does not see are seen too.
    monkeypatch.setattr(_mask_bounds, "CACHE_ENABLED", False)
    n = len(calls)
    mask.data.copy_(_structured_masks(sq, sk)["window"].to(DEVICE))  # .data: no version bump
    _check(q, k, v, mask)
    assert len(calls) > n


# ------------------------------------------------------------------ packed key masks (MASK_BITS_ROW)

@pytest.mark.parametrize("shape", [(3, 1, 1, 70), (1, 2, 1, 64), (3, 2, 1, 33), (97,)])
def test_row_bits_match_the_mask(shape):
    mask = torch.rand(shape, device=DEVICE) < 0.6
    m4 = _mask_bounds.as_4d(mask)
    b, hq, sk = 3, 2, shape[-1]
    words, sb, sh = _mask_bounds.row_bits(mask, b, hq, sk)
    assert words.dtype == torch.int32 and words.shape == (m4.shape[0], m4.shape[1], -(-sk // 32))
    assert sb == (words.stride(0) if m4.shape[0] > 1 else 0) and sh == (words.stride(1) if m4.shape[1] > 1 else 0)
    bits = (words.unsqueeze(-1).long() >> torch.arange(32, device=DEVICE)) & 1  # (mb, mh, nw, 32)
    bits = bits.flatten(-2)
    assert torch.equal(bits[..., :sk].bool(), m4[:, :, 0, :])
    assert not bits[..., sk:].any()  # keys past sk are hidden by the words themselves


def _row_masks(b, sk, p_hidden, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(b, 1, 1, sk, generator=gen) >= p_hidden
    keep[0, ..., :3] = False  # a hidden run at the start of a tile
    return keep.to(DEVICE)


@pytest.mark.parametrize("sk,form", [(70, "key_mask"), (129, "expanded")])
def test_packed_key_mask_forward_backward(sk, form):
    # A scattered key mask: every tile is partial, so every tile reads the packed words; sk not a multiple of
    # 32 puts keys past the end in the last word (a multiple of 32: test_packed_key_mask_with_band). "expanded":
    # the (b, hq, sq, sk) stride-0 view Hugging Face builds from a key-padding mask. sq: one full and one partial
    # 16-row tile under the interpreter.
    sq = 21
    mask = _row_masks(2, sk, 0.3)
    if form == "expanded":
        mask = mask.expand(2, 4, sq, sk)
    feat = kernel_features(torch.empty(2, 4, sq, 16), torch.empty(2, 2, sk, 16), 0.25, False, False, mask)
    assert feat.constexprs["MASK_KIND"] == 5
    _check(*_qkv(2, 4, 2, sq, sk), mask)


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(window=(20, 4))])
def test_packed_key_mask_with_band(kw):
    sq, sk = 64, 96
    _check(*_qkv(2, 2, 1, sq, sk), _row_masks(2, sk, 0.25, seed=1), **kw)


@pytest.mark.parametrize("tiles", ["narrow", "wide"])
def test_packed_key_mask_tile_widths(tiles):
    # 16-key tiles read half a word (at bit 0 or 16); 64-key tiles read two words.
    from fa_backend.kernels.triton import _configs
    from fa_backend.kernels.triton._configs import BwdConfig, TileConfig

    fwd = TileConfig(16, 16, 4, 1) if tiles == "narrow" else TileConfig(16, 64, 4, 1)
    bwd = (BwdConfig(TileConfig(16, 16, 4, 1), TileConfig(16, 16, 4, 1)) if tiles == "narrow"
           else BwdConfig(TileConfig(16, 64, 4, 1), TileConfig(16, 64, 4, 1)))
    sq, sk = 40, 150
    with _configs.override(fwd=fwd, bwd=bwd):
        _check(*_qkv(2, 2, 2, sq, sk), _row_masks(2, sk, 0.4, seed=2))


@pytest.mark.parametrize("scale", [0.0, -0.3])
@pytest.mark.parametrize("mask_form", ["key_mask", "full"])
def test_bool_mask_with_zero_or_negative_scale(scale, mask_form):
    # The bool-mask forward masks scores before scaling them: a scale of 0 (uniform over the attended keys)
    # and a negative one must still be exact.
    sq, sk = 33, 80
    q, k, v = _qkv(2, 2, 2, sq, sk)
    mask = _row_masks(2, sk, 0.3, seed=3) if mask_form == "key_mask" else torch.rand(sq, sk, device=DEVICE) < 0.7

    def fn(q, k, v):
        return fa_backend.attention(q, k, v, attn_mask=mask, scale=scale)
    check_features(fn, q, k, v, attn_mask=mask, scale=scale)


def test_backward_tile_class_of_masked_calls(monkeypatch):
    # Timed tables (kernels/triton/_configs.py): packed key masks and 2-D masks have their own tiles.
    monkeypatch.setattr(_mask_bounds, "MIN_FLOPS", 2**33)
    from fa_backend.kernels.triton._features import tile_class

    b, hq, s, d = 8, 16, 2048, 128  # 2**38 forward FLOPs
    q, k = torch.empty(b, hq, s, d), torch.empty(b, hq, s, d)
    key_mask = torch.rand(b, 1, 1, s) < 0.9
    two_d = torch.ones(s, s, dtype=torch.bool).tril()
    for mask, expected in ((key_mask, "mask_rows"), (two_d, "mask_bounds"), (two_d.float(), "mask_bounds")):
        feat = kernel_features(q, k, 0.1, False, False, mask)
        assert tile_class(feat, mask, b, hq, s, s, d) == expected
    small = kernel_features(q[:1, :1, :64], k[:1, :1, :64], 0.1, False, False, key_mask[:1, ..., :64])
    assert small.constexprs["MASK_KIND"] == 3  # below the threshold: the byte mask, no packing
    assert tile_class(small, key_mask[:1, ..., :64], 1, 1, 64, 64, d) is True


def test_packed_key_mask_with_other_features():
    # The packed kind next to softcap and ALiBi (scores through _score_mods, not the bool-only path) and dropout.
    from fa_backend.kernels.triton import dropout_keep_mask
    from fa_backend.ops import new_rng_state, triton_flash_attention

    sq, sk = 24, 40
    mask = _row_masks(2, sk, 0.3, seed=4)
    slopes = torch.rand(2, device=DEVICE) * 0.3
    q, k, v = _qkv(2, 2, 1, sq, sk)

    def fn(q, k, v):
        return fa_backend.attention(q, k, v, attn_mask=mask, is_causal=True, causal_alignment="bottom_right",
                                    softcap=3.0, alibi_slopes=slopes)
    check_features(fn, q, k, v, attn_mask=mask, is_causal=True, bottom_right=True, softcap=3.0, alibi_slopes=slopes)

    rng, p = new_rng_state(), 0.2
    keep = dropout_keep_mask(2, 2, sq, sk, p, tuple(rng.tolist()), DEVICE)

    def dropped(q, k, v):
        return triton_flash_attention(q, k, v, None, False, False, dropout_p=p, rng_state=rng, attn_mask=mask)[0]
    check_features(dropped, q, k, v, attn_mask=mask, dropout_keep=keep, dropout_p=p)
