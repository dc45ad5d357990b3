"""The kernels' TMA loads (TileConfig.tma): K and V in the forward, Q and dO in the dK/dV kernel, K and V in the
dQ kernel, under the interpreter here and on sm90 in the GPU suite: results within the 2x rule, and the fallback
to pointer loads where TMA's alignment rules do not hold."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _configs, _launch
from fa_backend.kernels.triton.flash_bwd import _tma_ok
from fa_backend.kernels.triton._configs import BwdConfig, TileConfig
from tests.conftest import DEVICE
from tests.reference import check_attention, check_features

pytestmark = pytest.mark.usefixtures("poisoned")

TMA_BWD = (BwdConfig(TileConfig(16, 32, 4, 1, tma=True), TileConfig(16, 16, 4, 1, tma=True)) if DEVICE == "cpu"
           else BwdConfig(TileConfig(64, 128, 8, 2, tma=True), TileConfig(64, 64, 4, 2, tma=True)))


def _qkv(b, hq, hkv, sq, sk, d, dtype=torch.float16):
    return (torch.randn(b, hq, sq, d, dtype=dtype, device=DEVICE),
            torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE),
            torch.randn(b, hkv, sk, d, dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("d,causal", [(16, True), (40, False)] if DEVICE == "cpu"
                         else [(d, c) for d in (16, 40, 64, 128) for c in (False, True)])
def test_tma_dkdv_gradients(d, causal):
    # sq not a multiple of the tile (rows past the end come zero-filled from the copy), d = 40 padded to 64
    # columns (zero-filled too), GQA (the Q / dO descriptors of every query head of a group).
    q, k, v = _qkv(2, 4, 2, 45 if DEVICE == "cpu" else 1000, 70 if DEVICE == "cpu" else 1100, d)
    assert _tma_ok(q, q)
    with _configs.override(bwd=TMA_BWD):
        check_attention(
            lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal, causal_alignment="bottom_right"),
            q, k, v, is_causal=causal, bottom_right=True)


@pytest.mark.parametrize("tile", [TileConfig(16, 16, 4, 1, tma=True)] if DEVICE == "cpu"
                         else [TileConfig(128, 128, 8, 3, tma=True), TileConfig(128, 64, 8, 3, tma=True)], ids=str)
@pytest.mark.parametrize("d,causal,window", [(16, True, (-1, -1)), (40, False, (7, -1))] if DEVICE == "cpu"
                         else [(d, c, (-1, -1)) for d in (64, 128) for c in (False, True)] + [(128, True, (300, 0))])
def test_tma_forward(monkeypatch, tile, d, causal, window):
    # keys not a multiple of the tile (rows past the end come zero-filled from the copy), d = 40 padded to 64
    # columns, GQA (one K / V descriptor per KV head), a window's masked left edge
    kwargs = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch",
                        lambda kernel, grid, args, kw: kwargs.append(kw) or real(kernel, grid, args, kw))
    q, k, v = _qkv(2, 4, 2, 45 if DEVICE == "cpu" else 1000, 70 if DEVICE == "cpu" else 1100, d)
    with _configs.override(fwd=tile):
        check_features(
            lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal, causal_alignment="bottom_right",
                                                 window_size=window),
            q, k, v, is_causal=causal, bottom_right=True, window=window, grad=False)
    assert kwargs[0].get("USE_TMA") is True


def test_tma_needs_aligned_strides():
    q, k, v = _qkv(1, 2, 2, 33, 33, 24)
    assert _tma_ok(q, q)
    odd = torch.randn(1, 2, 33, 28, dtype=torch.float16, device=DEVICE)[..., :24]  # rows 56 bytes apart
    assert not _tma_ok(odd, odd) and not _tma_ok(q, odd)
    shifted = torch.randn(2 * 33 * 24 + 4, dtype=torch.float16, device=DEVICE)[4:].view(1, 2, 33, 24)  # 8-byte base
    assert not _tma_ok(shifted, shifted)
    broadcast = torch.randn(1, 1, 1, 24, dtype=torch.float16, device=DEVICE).expand(1, 2, 33, 24)
    assert not _tma_ok(q, broadcast)  # an expanded gradient (stride-0 rows)
    # such views take the pointer loads, with the same results
    with _configs.override(bwd=TMA_BWD):
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v), odd, k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_tma_ok_is_tmas_rule_on_random_views(dtype):
    """tma_ok against TMA's rule written out (unit last stride, 16-byte base and strides, no broadcast dim of size
    > 1) over random strided views of one buffer: strides mostly whole 16-byte units (0 included), some not, bases
    aligned or not, so that both answers come up often."""
    gen = torch.Generator().manual_seed(0)
    size = torch.empty(0, dtype=dtype).element_size()
    unit = 16 // size
    buf = torch.zeros(1 << 16, dtype=dtype, device=DEVICE)

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=gen))

    answers = []
    for _ in range(400):
        shape = [1 + draw(4) for _ in range(4)]
        strides = [unit * draw(6) if draw(5) else draw(40) for _ in range(3)] + [1 if draw(8) else 2]
        t = buf[unit * draw(4) if draw(4) else draw(32):].as_strided(shape, strides)
        rule = (t.stride(3) == 1 and t.data_ptr() % 16 == 0
                and all((st * size) % 16 == 0 and not (st == 0 and n > 1)
                        for st, n in zip(t.stride()[:3], t.shape[:3])))
        assert _tma_ok(t) == rule, (shape, strides, t.data_ptr() % 16)
        answers.append(rule)
    assert 40 < sum(answers) < 360, sum(answers)


def test_head_tiles_of_strided_views():
    """Host descriptors (_tma.head_tiles) over the (b, h, s, d) view the kernels are given: its own strides (a (b, s,
    h, d) tensor transposed), and a 16-byte stride for a size-1 dim of stride 0 (TMA wants non-zero strides; the
    coordinate there is always 0)."""
    from fa_backend.kernels.triton._tma import head_tiles

    bshd = torch.randn(2, 33, 4, 24, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    desc = head_tiles(bshd, 16, 32)
    assert desc.shape == [2, 4, 33, 24] and desc.strides == list(bshd.stride()) and desc.block_shape == [1, 1, 16, 32]
    one = torch.randn(4, 33, 24, dtype=torch.float16, device=DEVICE).as_strided((1, 4, 33, 24), (0, 33 * 24, 24, 1))
    assert one.stride(0) == 0 and _tma_ok(one, one)
    assert head_tiles(one, 16, 32).strides == [8, 33 * 24, 24, 1]


@pytest.mark.parametrize("causal", [False, True])
def test_tma_with_a_stride_zero_batch(causal):
    """q, k, v with a size-1 batch dim of stride 0: forward and backward through the TMA tiles,
    within the 2x rule."""
    q, k, v = (torch.randn(h, 45, 40, dtype=torch.float16, device=DEVICE).as_strided((1, h, 45, 40), (0, 1800, 40, 1))
               for h in (4, 2, 2))
    assert q.stride(0) == 0 and all(_tma_ok(t, t) for t in (q, k, v))
    fwd = TileConfig(16, 16, 4, 1, tma=True) if DEVICE == "cpu" else TileConfig(128, 64, 8, 3, tma=True)
    with _configs.override(fwd=fwd, bwd=TMA_BWD):
        check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=causal), q, k, v, is_causal=causal)


def test_tma_tile_falls_back_to_one_stage():
    from fa_backend.kernels.triton.flash_bwd import _without_tma

    cfg = BwdConfig(TileConfig(64, 128, 8, 2, tma=True), TileConfig(64, 64, 4, 2))
    assert _without_tma(cfg, True) == cfg
    assert _without_tma(cfg, False) == BwdConfig(TileConfig(64, 128, 8, 1), TileConfig(64, 64, 4, 2))
    both = BwdConfig(TileConfig(64, 128, 8, 2, tma=True), TileConfig(64, 64, 4, 3, tma=True))
    assert _without_tma(both, True, False) == BwdConfig(TileConfig(64, 128, 8, 2, tma=True), TileConfig(64, 64, 4, 3))


def test_width_256_falls_back_to_its_pointer_tile():
    from fa_backend.kernels.triton.flash_bwd import _without_tma

    table = _configs.bwd_table(False)[256]
    assert table.dkdv.tma and table.dq.tma
    # the 32 x 64 x 8 TMA tile with pointer loads spills more than the old 32 x 32 x 4 tile: that one runs instead
    assert _without_tma(table, False, False, 256) == BwdConfig(TileConfig(32, 32, 4, 1), TileConfig(64, 32, 4, 2))
    assert _without_tma(table, True, True, 256) == table


def test_gqa_calls_take_the_key_major_tiles(monkeypatch):
    monkeypatch.setattr(_configs._launch, "_INTERPRET", False)
    cuda_q = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    for causal in (False, True):
        gqa = _configs.bwd_config(cuda_q, 128, 128, causal, group=4)
        mha = _configs.bwd_config(cuda_q, 128, 128, causal, group=1)
        # key-major order for causal GQA (its first key blocks are the longest); non-causal GQA: the MHA tiles
        assert gqa.dkdv.key_major == causal and gqa.dkdv.tma and not mha.dkdv.key_major
        assert gqa.dq == mha.dq == _configs.bwd_table(causal)[128].dq
        assert _configs.bwd_config(cuda_q, 64, 64, causal, group=4) == _configs.bwd_table(causal)[64]  # no GQA tile
        # calls with features keep their own tables
        assert not _configs.bwd_config(cuda_q, 128, 128, causal, features=True, group=4).dkdv.key_major


def test_long_causal_table_tile_and_its_pointer_fallback():
    long = _configs.fwd_table(True, _configs.LONG_SEQLEN)[128]
    assert long.tma and not _configs.fwd_table(True, _configs.LONG_SEQLEN - 1)[128].tma
    assert _configs.fwd_without_tma(long, True, 128, 128) == _configs._GPU_FWD_CAUSAL[128]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the table's tiles run on the GPU")
@pytest.mark.parametrize("aligned", [True, False])
def test_long_causal_forward_on_the_table_tile(monkeypatch, aligned):
    # seqlen_k >= LONG_SEQLEN, causal, d=128: the TMA tile; K / V rows 264 bytes apart: its pointer-load fallback
    kwargs = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch",
                        lambda kernel, grid, args, kw: kwargs.append(kw) or real(kernel, grid, args, kw))
    s = _configs.LONG_SEQLEN + 100
    q = torch.randn(1, 2, s, 128, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(1, 2, s, 128 if aligned else 132, dtype=torch.bfloat16, device=DEVICE)[..., :128]
            for _ in range(2))
    check_attention(lambda q, k, v: fa_backend.attention(q, k, v, is_causal=True), q, k, v, is_causal=True,
                    grad=False)
    assert (kwargs[0].get("USE_TMA") is True) == aligned
    assert (kwargs[0]["BLOCK_N"], kwargs[0]["num_stages"]) == ((128, 3) if aligned else (64, 3))


def test_feature_tables_by_tile_class(monkeypatch):
    # Key masks (packed) read K / V by TMA in the forward; every mask class and dropout read K / V by TMA in the dQ
    # kernel; the pointer-load fallback of a feature forward is the feature table's tile, not the plain one.
    monkeypatch.setattr(_configs._launch, "_INTERPRET", False)
    cuda_q = types.SimpleNamespace(device=types.SimpleNamespace(type="cuda"))
    rows = _configs.fwd_config(cuda_q, 128, 128, False, 4096, features="mask_rows")
    assert rows.tma and (rows.block_m, rows.block_n) == (128, 128)
    for cls in (True, "mask_bounds", "dropout"):
        assert _configs.fwd_config(cuda_q, 128, 128, False, 4096, features=cls) == _configs._GPU_FWD_FEATURES[128]
    assert _configs.fwd_without_tma(rows, False, 128, 128, "mask_rows") == _configs._GPU_FWD_FEATURES[128]
    # packed sequences keep the pointer-load dK/dV tiles their benchmark was measured with
    for causal in (False, True):
        assert _configs.bwd_config_varlen(cuda_q, 128, 128, causal) == dataclasses.replace(
            _configs.bwd_config(cuda_q, 128, 128, causal), dkdv=TileConfig(64, 128, 8, 2 if causal else 1))
        assert _configs.bwd_config_varlen(cuda_q, 128, 128, causal, True) == _configs._GPU_BWD_FEATURES[128]
    # backward: the same dK/dV tile shape with pointer loads (a launch with a broadcast dout sums as one without)
    from fa_backend.kernels.triton.flash_bwd import _without_tma
    for cls in ("mask_rows", "mask_bounds", False):
        for causal in (False, True):
            cfg = _configs.bwd_config(cuda_q, 128, 128, causal, features=cls, group=4)
            pointer = _without_tma(cfg, False, False, 128).dkdv
            assert cfg.dkdv.tma and not pointer.tma
            assert (pointer.block_m, pointer.block_n, pointer.num_warps) == (cfg.dkdv.block_m, cfg.dkdv.block_n,
                                                                              cfg.dkdv.num_warps)
    for cls in ("mask_rows", "mask_bounds", "dropout"):
        assert _configs.bwd_config(cuda_q, 128, 128, False, features=cls).dq.tma
    assert _configs.fwd_config(cuda_q, 64, 64, False, 4096, features="mask_rows") == _configs._GPU_FWD[64]


@pytest.mark.parametrize("case", ["key_mask", "two_d", "dropout"])
def test_tma_tiles_with_masks_and_dropout(monkeypatch, case):
    # The feature tables' kind of tiles (K / V by TMA in the forward and dQ, Q / dO in dK/dV) with a packed key mask
    # read through block bounds, a 2-D mask through block bounds, and dropout; small tiles under the interpreter.
    from fa_backend.kernels.triton import _mask_bounds
    monkeypatch.setattr(_mask_bounds, "MIN_FLOPS", 0)
    kwargs = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch",
                        lambda kernel, grid, args, kw: kwargs.append(kw) or real(kernel, grid, args, kw))
    b, h, sq, sk, d = (2, 2, 40, 70, 32) if DEVICE == "cpu" else (2, 4, 1000, 1100, 128)
    q, k, v = _qkv(b, h, h, sq, sk, d)
    fwd_tile = TileConfig(16, 16, 4, 1, tma=True) if DEVICE == "cpu" else TileConfig(128, 64, 8, 3, tma=True)
    with _configs.override(fwd=fwd_tile, bwd=TMA_BWD):
        if case == "dropout":
            from fa_backend.kernels.triton import dropout_keep_mask
            from fa_backend.ops import new_rng_state, triton_flash_attention
            rng = new_rng_state()
            keep = dropout_keep_mask(b, h, sq, sk, 0.2, tuple(rng.tolist()), DEVICE)
            check_features(lambda q, k, v: triton_flash_attention(q, k, v, None, False, False, dropout_p=0.2,
                                                                  rng_state=rng)[0],
                           q, k, v, dropout_keep=keep, dropout_p=0.2)
        else:
            gen = torch.Generator().manual_seed(7)
            if case == "key_mask":  # right padding, one sequence padded past a whole tile, 10 % random holes
                mask = (torch.arange(sk) < torch.tensor([sk - 37, sk]).view(b, 1, 1, 1)) & (
                    torch.rand(b, 1, 1, sk, generator=gen) >= 0.1)
            else:
                mask = torch.rand(sq, sk, generator=gen) < 0.7
            mask = mask.to(DEVICE)
            check_features(lambda q, k, v: fa_backend.attention(q, k, v, attn_mask=mask), q, k, v, attn_mask=mask)
    # (not the fp32 recomputation of O of a small call's backward: its own tile, _configs.FWD_EXACT_PV)
    tiled = [kw for kw in kwargs if "CAUSAL" in kw and not kw.get("EXACT_PV")]
    assert tiled and all(kw.get("USE_TMA") for kw in tiled)
    if case != "dropout":
        assert all(kw.get("MASK_BOUNDS") for kw in tiled)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the feature tables' tiles run on the GPU")
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("case", ["key_padding", "two_d", "dropout"])
def test_feature_tables_on_the_gpu(monkeypatch, case, aligned):
    # The timed feature tiles (TMA forward for key masks, TMA dQ, 64 x 64 TMA dK/dV for masks) at d=128, and
    # their pointer-load fallbacks for K / V rows 264 bytes apart, against the float64 reference.
    from fa_backend.kernels.triton import _mask_bounds
    monkeypatch.setattr(_mask_bounds, "MIN_FLOPS", 0)
    kwargs = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch",
                        lambda kernel, grid, args, kw: kwargs.append(kw) or real(kernel, grid, args, kw))
    b, h, s = 2, 4, 1100
    q = torch.randn(b, h, s, 128, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.randn(b, h, s, 128 if aligned else 132, dtype=torch.bfloat16, device=DEVICE)[..., :128]
            for _ in range(2))
    if case == "dropout":
        from fa_backend.kernels.triton import dropout_keep_mask
        from fa_backend.ops import new_rng_state, triton_flash_attention
        rng = new_rng_state()
        keep = dropout_keep_mask(b, h, s, s, 0.1, tuple(rng.tolist()), "cuda")
        check_features(lambda q, k, v: triton_flash_attention(q, k, v, None, False, False, dropout_p=0.1,
                                                              rng_state=rng)[0],
                       q, k, v, dropout_keep=keep, dropout_p=0.1)
    else:
        if case == "key_padding":
            lengths = torch.tensor([s - 300, s - 7], device=DEVICE).view(b, 1, 1, 1)
            mask = torch.arange(s, device=DEVICE) < lengths
        else:
            mask = torch.rand(s, s, device=DEVICE) < 0.8
        check_features(lambda q, k, v: fa_backend.attention(q, k, v, attn_mask=mask), q, k, v, attn_mask=mask)
    # launches: forward, then delta, dK/dV and dQ (the kernels with a CAUSAL flag: forward, dK/dV, dQ)
    tiled = [kw for kw in kwargs if "CAUSAL" in kw]
    assert (tiled[0].get("USE_TMA") is True) == (aligned and case == "key_padding")
    assert bool(tiled[-1].get("USE_TMA")) == aligned  # dQ: K / V by TMA in every feature table
