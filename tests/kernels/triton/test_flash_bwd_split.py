"""The split-column backward (flash_bwd_split, head dims 129-192 on 128 + 64 columns): gradients within the 2x rule
under the interpreter here and at real sizes on sm90 in the GPU suite; which calls take it."""

from __future__ import annotations

import sys

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _configs, _launch, flash_bwd_split, flash_fwd_split
from tests.conftest import DEVICE
from tests.kernels.triton.conftest import record_launch_kwargs
from tests.kernels.triton.test_flash_fwd_split import qkv as _qkv
from tests.reference import check_attention

pytestmark = pytest.mark.usefixtures("poisoned")

ON_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
_FLASH_BWD = sys.modules["fa_backend.kernels.triton.flash_bwd"]


def _check(q, k, v, causal, bottom_right, names):
    """The 2x rule forward and backward; the split launches ran, and the dQ launch unless DS_GEMM took dQ."""
    check_attention(lambda q, k, v: fa_backend.attention(
        q, k, v, is_causal=causal, causal_alignment="bottom_right" if bottom_right else "top_left"),
        q, k, v, is_causal=causal, bottom_right=bottom_right)
    assert "_bwd_dkdv_split" in names and ("_bwd_dq_split" in names) != _takes_ds(q, v, causal), names
    assert "_bwd_dkdv" not in names and "_bwd_dq" not in names, names


def _takes_ds(q, v, causal):
    """Whether dQ comes from dS^T in this call (its class, no unrounded dS, pieces that fit: DS_GEMM in any number,
    DS_GEMM_CAUSAL_WHOLE in one)."""
    b, hq, sq, d = q.shape
    top = flash_bwd_split.split_widths(d, v.shape[-1], flash_bwd_split.SPLITS)[0]
    if not flash_bwd_split.ds_gemm_class(top, 0 if causal else None) or \
            b * hq * sq * v.shape[2] <= _FLASH_BWD.EXACT_DS_MAX_SCORES:
        return False
    pieces = flash_bwd_split._ds_pieces(b, v.shape[1], hq // v.shape[1], sq, v.shape[2], q.element_size())
    return pieces is not None and (top in flash_bwd_split.DS_GEMM or len(pieces) == 1)


CPU_CASES = [
    # d, dv, hq, hkv, sq, sk, bshd, causal, bottom_right, exact_ds
    (192, 192, 2, 2, 40, 56, False, False, False, False),  # keys not a multiple of the tile
    (192, 192, 4, 2, 48, 48, True, True, False, False),  # GQA (dK / dV summed over the group), causal
    (160, 160, 2, 1, 37, 70, True, True, True, True),  # second column tile zero-filled past d; bottom-right
    (136, 176, 2, 2, 50, 33, False, True, True, False),  # dv != d; more queries than keys
    (192, 144, 2, 2, 33, 47, False, False, False, True),
]


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,dv,hq,hkv,sq,sk,bshd,causal,bottom_right,exact_ds", CPU_CASES)
def test_split_backward_interpreted(split_launches, monkeypatch, d, dv, hq, hkv, sq, sk, bshd, causal, bottom_right,
                                   exact_ds):
    # small calls take dS unrounded (two products each): both forms are run here
    monkeypatch.setattr(_FLASH_BWD, "EXACT_DS_MAX_SCORES", 1 << 20 if exact_ds else 0)
    _check(*_qkv(2, hq, hkv, sq, sk, d, dv, torch.float16, bshd), causal, bottom_right, split_launches)


_SPLIT_KERNELS = ("_attn_fwd_split", "_bwd_dkdv_split", "_bwd_dq_split")


@pytest.fixture
def block_major(monkeypatch):
    """Both split kernels' causal launches in block-major order (the dQ launch too at 129-192, where causal calls
    otherwise take dQ from dS^T); yields the launches' keyword arguments by kernel."""
    monkeypatch.setattr(flash_fwd_split, "CAUSAL_BLOCK_MAJOR", frozenset(flash_fwd_split.SPLITS))
    monkeypatch.setattr(flash_bwd_split, "CAUSAL_BLOCK_MAJOR", frozenset(flash_bwd_split.SPLITS))
    monkeypatch.setattr(flash_bwd_split, "DS_GEMM_CAUSAL_WHOLE", frozenset())
    return record_launch_kwargs(monkeypatch, *_SPLIT_KERNELS)


@pytest.fixture
def one_loop(monkeypatch):
    """The causal dK / dV in one masked loop at every split class; yields the launches' keyword arguments by kernel."""
    monkeypatch.setattr(flash_bwd_split, "CAUSAL_ONE_LOOP", frozenset(flash_bwd_split.SPLITS))
    return record_launch_kwargs(monkeypatch, *_SPLIT_KERNELS)


@pytest.fixture
def two_loops(monkeypatch):
    """The causal dK / dV in a masked and an unmasked loop at every split class."""
    monkeypatch.setattr(flash_bwd_split, "CAUSAL_ONE_LOOP", frozenset())
    return record_launch_kwargs(monkeypatch, *_SPLIT_KERNELS)


def _flagged(kws, name, flag):
    return bool(kws[name]) and all(kw.get(flag, False) for kw in kws[name])


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("causal,bottom_right", [(True, False), (True, True), (False, False)])
def test_split_block_major_interpreted(split_launches, block_major, monkeypatch, causal, bottom_right):
    """Causal launches in block-major order (the longest programs of every head first) cover every block of every
    (batch, head) once: two batches, GQA, lengths that leave partial blocks. Non-causal calls keep head-major."""
    monkeypatch.setattr(_FLASH_BWD, "EXACT_DS_MAX_SCORES", 0)
    _check(*_qkv(2, 4, 2, 40, 56, 192, 192, torch.float16, True), causal, bottom_right, split_launches)
    for name in _SPLIT_KERNELS:
        assert block_major[name] and all(kw.get("BLOCK_MAJOR", False) == causal for kw in block_major[name]), name


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("bottom_right,hq,hkv,sq,sk", [(False, 4, 2, 40, 56), (True, 2, 2, 37, 70),
                                                       (False, 2, 1, 70, 37)])
@pytest.mark.parametrize("loops", ["one_loop", "two_loops"])
def test_split_causal_loops_interpreted(split_launches, request, monkeypatch, loops, bottom_right, hq, hkv, sq, sk):
    """Causal dK / dV in one masked loop and in a masked and an unmasked one: the same gradients within the 2x rule
    (rows before the diagonal, on it, past it; GQA; more queries than keys and fewer)."""
    kws = request.getfixturevalue(loops)
    monkeypatch.setattr(_FLASH_BWD, "EXACT_DS_MAX_SCORES", 0)
    _check(*_qkv(2, hq, hkv, sq, sk, 192, 192, torch.float16, True), True, bottom_right, split_launches)
    assert kws["_bwd_dkdv_split"], kws
    assert all(kw.get("ONE_LOOP", False) == (loops == "one_loop") for kw in kws["_bwd_dkdv_split"]), kws


@pytest.fixture
def ds_gemm(monkeypatch):
    """dQ by the dq_from_ds kernel from the dS^T the dK / dV launch writes (flash_bwd_split.DS_GEMM) at every split
    class; yields the launches' keyword arguments by kernel."""
    monkeypatch.setattr(flash_bwd_split, "DS_GEMM", frozenset(flash_bwd_split.SPLITS))
    monkeypatch.setattr(_FLASH_BWD, "EXACT_DS_MAX_SCORES", 0)  # (small calls with unrounded dS keep the dQ launch)
    return record_launch_kwargs(monkeypatch, *_SPLIT_KERNELS, "_dq_from_ds")


def _check_ds_gemm(q, k, v, causal, bottom_right, names, kws):
    check_attention(lambda q, k, v: fa_backend.attention(
        q, k, v, is_causal=causal, causal_alignment="bottom_right" if bottom_right else "top_left"),
        q, k, v, is_causal=causal, bottom_right=bottom_right)
    assert "_bwd_dkdv_split" in names and "_bwd_dq_split" not in names and "_bwd_dq" not in names, names
    assert _flagged(kws, "_bwd_dkdv_split", "STORE_DS"), kws
    assert len(kws["_dq_from_ds"]) == len(kws["_bwd_dkdv_split"]), kws  # (once per piece of the call)


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bshd,causal,bottom_right", [
    (192, 2, 2, 40, 56, False, False, False),  # partial key and query tiles
    (192, 4, 2, 48, 48, True, True, False),  # GQA: each query head against its K / V head
    (160, 2, 1, 37, 70, True, True, True),  # bottom-right: blocks no program visits stay zero
    (256, 2, 2, 50, 33, False, True, False),  # 128 + 128 columns; more queries than keys
])
def test_split_ds_gemm_interpreted(split_launches, ds_gemm, d, hq, hkv, sq, sk, bshd, causal, bottom_right):
    _check_ds_gemm(*_qkv(2, hq, hkv, sq, sk, d, d, torch.float16, bshd), causal, bottom_right, split_launches,
                   ds_gemm)


def _dq_source(monkeypatch, d, causal=False, b=1):
    """(dQ launched, dS^T stored) for a (b, 2, 64, d) backward, nothing run."""
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, args, kw: None)  # what is launched, not run
    kws = record_launch_kwargs(monkeypatch, "_bwd_dkdv_split", "_bwd_dq_split")
    q = torch.empty(b, 2, 64, d, dtype=torch.float16)
    lse = torch.empty(b, 2, 64)
    for launch in flash_bwd_split.launches(q, q, q, q, lse, lse, q, q, q, 0.1, 0 if causal else None, False):
        launch()
    return bool(kws["_bwd_dq_split"]), all(kw.get("STORE_DS", False) for kw in kws["_bwd_dkdv_split"])


def test_ds_gemm_defaults_and_bounded(monkeypatch):
    """By default dQ comes from dS^T at head dims 193-256, and at 129-192 in causal calls whose dS^T fits in one
    piece; from the dQ launch otherwise, and where one (batch, key head) pair's dS^T passes DS_GEMM_MAX_BYTES."""
    assert flash_bwd_split.DS_GEMM == frozenset({256}) and flash_bwd_split.DS_GEMM_CAUSAL_WHOLE == frozenset({192})
    assert _dq_source(monkeypatch, 192) == (True, False)
    assert _dq_source(monkeypatch, 192, causal=True) == (False, True)
    assert _dq_source(monkeypatch, 160, causal=True, b=2) == (False, True)
    assert _dq_source(monkeypatch, 256) == (False, True) and _dq_source(monkeypatch, 224) == (False, True)
    monkeypatch.setattr(flash_bwd_split, "DS_GEMM_MAX_BYTES", 2 * 64 * 64 * 2)  # one batch element a piece
    assert _dq_source(monkeypatch, 192, causal=True, b=2) == (True, False)
    assert _dq_source(monkeypatch, 256, causal=True, b=2) == (False, True)
    monkeypatch.setattr(flash_bwd_split, "DS_GEMM_MAX_BYTES", 64 * 64 * 2 - 1)  # one byte short of one pair
    assert _dq_source(monkeypatch, 256) == (True, False)
    assert _dq_source(monkeypatch, 192, causal=True) == (True, False)


def test_ds_gemm_under_deterministic_algorithms(monkeypatch, deterministic_algorithms):
    # (the dq_from_ds kernel sums each output tile's keys in order, in one program: no atomics, no cuBLAS)
    assert _dq_source(monkeypatch, 256) == (False, True)


def _pairs(pieces):
    return [(b, h) for bs, hs in pieces for b in range(bs.start, bs.stop) for h in range(hs.start, hs.stop)]


@pytest.mark.parametrize("b,hkv,group,fit,count", [
    (4, 8, 1, 100, 1),  # all at once
    (5, 8, 2, 16, 3),  # two batch elements a piece, as even as 3 pieces allow: 2, 2, 1
    (2, 8, 1, 3, 6),  # 3 key heads at most: 3 pieces of 3, 3, 2 per batch element
    (3, 4, 4, 1, 12),  # one key head (its 4 query heads) a piece
    (2, 4, 1, 0, 0),  # one pair does not fit: the dQ launch
])
def test_ds_pieces_cover_every_pair_once_within_the_budget(monkeypatch, b, hkv, group, fit, count):
    sq, sk, size = 100, 77, 2
    pair = group * sk * 104 * size  # (rows padded to 8: 104)
    monkeypatch.setattr(flash_bwd_split, "DS_GEMM_MAX_BYTES", fit * pair + pair - 1)
    pieces = flash_bwd_split._ds_pieces(b, hkv, group, sq, sk, size)
    if count == 0:
        assert pieces is None
        return
    assert len(pieces) == count
    assert _pairs(pieces) == [(i, h) for i in range(b) for h in range(hkv)]  # each once, in order
    assert max((bs.stop - bs.start) * (hs.stop - hs.start) for bs, hs in pieces) <= fit
    for bs, hs in pieces:  # whole batch elements, or key heads of one
        assert hs == slice(0, hkv) or bs.stop - bs.start == 1


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,b,hq,hkv,sq,sk,causal,bottom_right,fit", [
    (192, 3, 2, 2, 40, 56, False, False, 2),  # one batch element a piece
    (192, 2, 4, 2, 150, 140, True, False, 1),  # GQA, one key head a piece
    (160, 2, 4, 4, 100, 30, True, True, 3),  # rows that see no key; 2 key heads a piece
    (256, 2, 2, 1, 70, 90, True, True, 1),  # 128 + 128 columns; keys beyond the queries
])
def test_ds_gemm_pieces_interpreted(split_launches, ds_gemm, monkeypatch, d, b, hq, hkv, sq, sk, causal,
                                               bottom_right, fit):
    """dQ from dS^T in pieces of the call (one buffer, reused: what a piece reads unmasked it wrote, else the NaN
    the buffer starts with shows)."""
    pair = hq // hkv * sk * (-(-sq // 8) * 8) * 2
    monkeypatch.setattr(flash_bwd_split, "DS_GEMM_MAX_BYTES", fit * pair)
    _check_ds_gemm(*_qkv(b, hq, hkv, sq, sk, d, d, torch.float16, True), causal, bottom_right, split_launches,
                   ds_gemm)
    pieces = flash_bwd_split._ds_pieces(b, hkv, hq // hkv, sq, sk, 2)
    assert len(pieces) > 1 and len(ds_gemm["_bwd_dkdv_split"]) % len(pieces) == 0


@pytest.mark.parametrize("d,causal,taken", [(192, True, True), (160, True, True), (192, False, False),
                                            (256, True, False), (224, True, False)])
def test_causal_defaults(d, causal, taken, monkeypatch):
    """By default the causal dK / dV runs one loop and both causal launches run block-major at head dims 129-192
    (measured faster there), neither at 193-256 (whose dQ comes from dS^T: no dQ launch); calls without a causal
    mask take neither; dQ keeps two loops."""
    monkeypatch.setattr(flash_bwd_split, "DS_GEMM_CAUSAL_WHOLE", frozenset())  # (at 129-192: the dQ launch)
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, args, kw: None)  # what is launched, not run
    kws = record_launch_kwargs(monkeypatch, "_bwd_dkdv_split", "_bwd_dq_split")
    q, k, v, do = (torch.empty(1, 2, 64, d, dtype=torch.float16) for _ in range(4))
    lse = delta = torch.empty(1, 2, 64)
    for launch in flash_bwd_split.launches(q, k, v, do, lse, delta, q, k, v, d ** -0.5, 0 if causal else None,
                                           False):
        launch()
    (dkdv,) = kws["_bwd_dkdv_split"]
    assert dkdv.get("ONE_LOOP", False) == taken and dkdv.get("BLOCK_MAJOR", False) == taken, kws
    if d > 192:
        assert kws["_bwd_dq_split"] == [] and dkdv["STORE_DS"], kws
        return
    (dq,) = kws["_bwd_dq_split"]
    assert "ONE_LOOP" not in dq and dq.get("BLOCK_MAJOR", False) == taken, kws


@pytest.mark.parametrize("d,causal,taken", [(192, True, True), (160, True, True), (192, False, False),
                                            (96, True, False), (80, True, False)])
def test_forward_block_major_default(d, causal, taken, monkeypatch):
    """The split forward's causal launches run block-major by default at head dims 129-192 (measured faster there),
    not at 65-96 (slower) nor without a causal mask."""
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, args, kw: None)  # what is launched, not run
    kws = record_launch_kwargs(monkeypatch, "_attn_fwd_split")
    q = torch.empty(1, 2, 64, d, dtype=torch.float16)
    flash_fwd_split.flash_fwd_split(q, q, q, d ** -0.5, 0 if causal else None, torch.empty_like(q),
                                    torch.empty(1, 2, 64))
    (fwd,) = kws["_attn_fwd_split"]
    assert fwd.get("BLOCK_MAJOR", False) == taken, kws


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (TMA)")
@pytest.mark.parametrize("experiment", ["block_major", "one_loop"])
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bottom_right", [(192, 8, 8, 2048, 2048, False), (256, 8, 2, 1000, 3001, True),
                                                         (160, 4, 4, 3001, 3001, False)])
def test_split_causal_experiments_real_size(split_launches, request, experiment, d, hq, hkv, sq, sk, bottom_right):
    """The causal variants at real sizes (block-major order of both launches; one dK / dV loop): the 2x rule, and
    the launches that took them."""
    kws = request.getfixturevalue(experiment)
    _check(*_qkv(2, hq, hkv, sq, sk, d, d, torch.bfloat16, True), True, bottom_right, split_launches)
    flag = experiment.upper()
    assert _flagged(kws, "_bwd_dkdv_split", flag), kws
    if experiment == "block_major" and kws["_bwd_dq_split"]:  # (d=193-256: dQ from dS^T, no dQ launch)
        assert _flagged(kws, "_bwd_dq_split", flag), kws


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (TMA)")
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bshd,causal,bottom_right", [
    (256, 8, 8, 2048, 2048, True, False, False), (256, 8, 2, 1000, 3001, False, True, True),
    (192, 4, 4, 3001, 3001, True, True, False), (256, 16, 16, 128, 136, False, False, False)])
def test_split_ds_gemm_real_size(split_launches, ds_gemm, d, hq, hkv, sq, sk, bshd, causal, bottom_right):
    """The dS-to-memory experiment (DS_GEMM) at real sizes: the 2x rule, no dQ launch."""
    _check_ds_gemm(*_qkv(2, hq, hkv, sq, sk, d, d, torch.bfloat16, bshd), causal, bottom_right, split_launches,
                   ds_gemm)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (TMA)")
@pytest.mark.parametrize("d,b,hq,hkv,sq,sk,causal,bottom_right,fit", [
    (256, 3, 8, 8, 2048, 2048, False, False, 8),  # one batch element a piece
    (256, 2, 8, 2, 3001, 3001, True, True, 1),  # GQA, one key head a piece
    (224, 1, 4, 4, 4000, 1000, True, True, 3),  # rows that see no key; 2 + 2 key heads
    (256, 2, 4, 4, 1000, 3001, True, False, 4),
])
def test_ds_gemm_pieces_real_size(split_launches, ds_gemm, monkeypatch, d, b, hq, hkv, sq, sk, causal, bottom_right,
                                  fit):
    """dQ from dS^T in pieces of the call at real sizes: the 2x rule, no dQ launch."""
    monkeypatch.setattr(flash_bwd_split, "DS_GEMM_MAX_BYTES", fit * (hq // hkv) * sk * (-(-sq // 8) * 8) * 2)
    _check_ds_gemm(*_qkv(b, hq, hkv, sq, sk, d, d, torch.bfloat16, True), causal, bottom_right, split_launches,
                   ds_gemm)
    assert len(flash_bwd_split._ds_pieces(b, hkv, hq // hkv, sq, sk, 2)) > 1


GPU_CASES = [(d, hq, hkv, sq, sk, bshd, causal)
             for d in (192, 160) for causal in (False, True)
             for hq, hkv, sq, sk, bshd in ((8, 8, 2048, 2048, True), (8, 2, 1000, 3001, False),
                                           (4, 4, 3001, 3001, True), (16, 16, 128, 136, False))]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (TMA)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bshd,causal", GPU_CASES)
def test_split_backward_real_size(split_launches, dtype, d, hq, hkv, sq, sk, bshd, causal):
    _check(*_qkv(2, hq, hkv, sq, sk, d, d, dtype, bshd), causal, True, split_launches)


def _grads(q, k, v, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fa_backend.attention(*leaves, **kw)
    return torch.autograd.grad(out, leaves, torch.randn_like(out))


@pytest.mark.parametrize("kw", [dict(attn_mask=True), dict(softcap=5.0), dict(window_size=(8, -1)), dict(d=128),
                                dict(scale=-0.1), dict(strided=True)], ids=lambda kw: next(iter(kw)))
def test_split_backward_not_taken(split_launches, kw):
    """Features, a negative scale, other head dims and strides TMA cannot read take the general kernels."""
    q, k, v = _qkv(1, 2, 2, 24, 24, kw.pop("d", 192), kw.pop("d", 192), torch.float16, False)
    if kw.pop("strided", False):  # head dim not contiguous
        k = torch.randn(1, 2, q.shape[-1], 24, dtype=q.dtype, device=DEVICE).transpose(-1, -2)
    if kw.pop("attn_mask", False):
        kw["attn_mask"] = torch.rand(24, 24, device=DEVICE) > 0.2
    _grads(q, k, v, **kw)
    assert "_bwd_dkdv_split" not in split_launches and "_bwd_dq_split" not in split_launches, split_launches
    assert "_bwd_dq" in split_launches


def test_split_backward_switches(monkeypatch):
    q, k, v = _qkv(1, 2, 2, 24, 24, 192, 192, torch.float16, False)
    lse = torch.empty(1, 2, 24, device=DEVICE)
    args = (q, k, v, q, q, k, v, lse, 0.1)
    assert flash_bwd_split.split_bwd_eligible(*args, True) == (DEVICE == "cpu" or ON_SM90)
    assert not flash_bwd_split.split_bwd_eligible(*args, False)  # a feature call
    assert not flash_bwd_split.split_bwd_eligible(q, k, v, q, q, k, v, lse.transpose(1, 2).contiguous()
                                                  .transpose(1, 2), 0.1, True)  # a strided LSE
    monkeypatch.setattr(flash_bwd_split, "ENABLED", False)
    assert not flash_bwd_split.split_bwd_eligible(*args, True)
    monkeypatch.setattr(flash_bwd_split, "ENABLED", True)
    with _configs.override(bwd=_configs.BwdConfig(_configs.TileConfig(16, 16, 4, 1),
                                                  _configs.TileConfig(16, 16, 4, 1))):
        assert not flash_bwd_split.split_bwd_eligible(*args, True)


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,causal,widths", [(256, True, (128, 128)), (200, False, (128, 128)), (96, True, (64, 32)),
                                             (72, False, (64, 32))])
def test_split_backward_other_classes_interpreted(split_launches, monkeypatch, d, causal, widths):
    """Head dims 193-256 on 128 + 128 columns (the default) and 65-96 on 64 + 32 (an experiment, off by default)."""
    monkeypatch.setitem(flash_bwd_split.SPLITS, 96 if d <= 96 else 256, widths)
    monkeypatch.setattr(_FLASH_BWD, "EXACT_DS_MAX_SCORES", 0)
    _check(*_qkv(1, 2, 2, 40, 33, d, d, torch.float16, False), causal, False, split_launches)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (TMA)")
@pytest.mark.parametrize("d,widths", [(96, (64, 32)), (256, (128, 128))])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,sq,sk", [(8, 8, 2048, 2048), (8, 2, 1000, 3001)])
def test_split_backward_other_classes_real_size(split_launches, monkeypatch, d, widths, causal, hq, hkv, sq, sk):
    monkeypatch.setitem(flash_bwd_split.SPLITS, 96 if d <= 96 else 256, widths)
    _check(*_qkv(2, hq, hkv, sq, sk, d, d, torch.bfloat16, True), causal, True, split_launches)


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter")
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, True)])
def test_split_default_tiles_interpreted(split_launches, monkeypatch, causal, bottom_right):
    """The forward and backward at the GPU's default tiles (TILES: 128 / 64-row steps), on lengths that leave partial
    tiles and a diagonal inside them, with GQA: the kernels' bounds at those tile sizes (the GPU's code generation is
    left to the GPU tests)."""
    monkeypatch.setattr(flash_fwd_split, "_INTERPRETER_TILE", None)
    monkeypatch.setattr(flash_bwd_split, "_INTERPRETER_TILES", None)
    monkeypatch.setattr(_FLASH_BWD, "EXACT_DS_MAX_SCORES", 0)
    _check(*_qkv(1, 4, 2, 200, 150, 192, 160, torch.float16, True), causal, bottom_right, split_launches)
