"""The warp-specialized non-causal forward (flash_fwd_ws): under the interpreter here (which runs the same math
without the specialization), on sm90 in the GPU suite: outputs within the 2x rule, the LSE, which calls take it,
and the fallback when the pass fails."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_backend.kernels.triton import _configs, _launch, flash_fwd_split, flash_fwd_ws
from fa_backend.kernels.triton.flash_fwd import flash_fwd
from tests.conftest import DEVICE
from tests.reference import assert_within_bar, attention_math, attention_same_dtype, causal_mask

pytestmark = pytest.mark.usefixtures("poisoned")

ON_SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture
def launched(monkeypatch):
    """The names of the kernels launched, every switch at its default."""
    names = []
    real = _launch.launch
    monkeypatch.setattr(_launch, "launch", lambda kernel, grid, args, kw: names.append(kernel.fn.__name__)
                        or real(kernel, grid, args, kw))
    return names


@pytest.fixture
def ws_launches(launched, monkeypatch):
    """The WS kernel enabled (also under the interpreter); yields the list of kernels launched."""
    monkeypatch.setattr(flash_fwd_ws, "INTERPRET", True)
    monkeypatch.setattr(flash_fwd_ws, "ENABLED", True)
    monkeypatch.setattr(flash_fwd_ws, "MIN_SEQ_K", {})  # the small shapes of the fallback tests too
    monkeypatch.setattr(flash_fwd_ws, "PERSISTENT", False)  # a program per tile (ws_persistent_launches: the other)
    monkeypatch.setattr(flash_fwd_split, "ENABLED", False)  # d=96's 64 + 32 split, which goes first from 1k keys
    if DEVICE == "cpu":  # the kernel is generic in the head dim: d=64 keeps the interpreter tests cheap
        monkeypatch.setattr(flash_fwd_ws, "WS_TILES", {d: (16, 16, 4, 1) for d in (48, 64, 96, 128)})
        monkeypatch.setattr(flash_fwd_ws, "PERSISTENT_ONLY", frozenset())
    return launched


def _qkv(b, hq, hkv, sq, sk, d, dtype, bshd):
    def make(h, s):
        if bshd:
            return torch.randn(b, s, h, d, dtype=dtype, device=DEVICE).transpose(1, 2)
        return torch.randn(b, h, s, d, dtype=dtype, device=DEVICE)
    return make(hq, sq), make(hkv, sk), make(hkv, sk)


def _lse(q, k, causal=False, bottom_right=False):
    """float64 natural-log sum-exp of the scaled scores (of the visible keys)."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(~causal_mask(q.shape[2], k.shape[2], bottom_right, q.device), float("-inf"))
    return torch.logsumexp(scores, -1)


def _check(q, k, v, names, causal=False, bottom_right=True):
    out, lse = flash_fwd(q, k, v, q.shape[-1] ** -0.5, causal, bottom_right)
    # the persistent kernel takes the non-causal calls with more key blocks than K / V stages when switched on; the
    # others stay one program per tile
    block_n, stages = (16, 1) if DEVICE == "cpu" else flash_fwd_ws.WS_TILES[q.shape[-1]][1::2]
    persistent = flash_fwd_ws.PERSISTENT and not causal and -(-k.shape[2] // block_n) > stages
    kernel = "_attn_fwd_ws_persistent" if persistent else "_attn_fwd_ws"
    if causal and flash_fwd_ws.PERSISTENT and flash_fwd_ws.CAUSAL_PERSISTENT:
        kernel = _causal_launches(q.shape[2], k.shape[2], q.shape[-1], bottom_right)[-1]
    assert names and names[-1] == kernel, names
    big = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > 2**27
    ref_dtype = torch.float32 if big else torch.float64
    kw = dict(is_causal=causal, bottom_right=bottom_right)
    ref = attention_math(*(t.to(ref_dtype) for t in (q, k, v)), **kw)
    assert_within_bar("out", out, attention_same_dtype(q, k, v, **kw), ref)
    lse_ref = _lse(q, k, causal, bottom_right)
    assert torch.isfinite(lse).all(), "unwritten LSE rows"
    # fp32 sum-exp of dtype-rounded scores against float64: within a few units of the scores' rounding
    assert (lse.double() - lse_ref).abs().max().item() < 2e-2


CPU_CASES = [
    # d, hq, hkv, sq, sk, bshd
    (64, 4, 2, 44, 70, True),  # keys not a multiple of the tile (MASK_COLS), GQA, (b, s, h, d) layout
    (64, 2, 2, 48, 64, False),  # no mask at all
    (64, 2, 1, 72, 40, True),  # more queries than keys
    (128, 2, 2, 32, 40, False),
    (96, 2, 1, 40, 56, True),  # head dim padded to the tile's 128 columns (zero-filled loads, clipped stores)
    (48, 2, 2, 36, 40, False),
]


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bshd", CPU_CASES)
def test_ws_forward_interpreted(ws_launches, d, hq, hkv, sq, sk, bshd):
    _check(*_qkv(2, hq, hkv, sq, sk, d, torch.float16, bshd), ws_launches)


@pytest.fixture(params=[3, 5] if DEVICE == "cpu" else [0], ids=lambda n: f"{n}programs" if n else "sms")
def ws_persistent_launches(ws_launches, monkeypatch, request):
    """ws_launches with the persistent kernel on; under the interpreter 3 or 5 programs (the CPU cases have 12-24
    tiles: each program walks several, and with 5 some walk one more than others), on the GPU one per SM."""
    monkeypatch.setattr(flash_fwd_ws, "PERSISTENT", True)
    if request.param:
        monkeypatch.setattr(flash_fwd_ws, "INTERPRET_PROGRAMS", request.param)
    return ws_launches


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bshd", CPU_CASES[:3] + CPU_CASES[4:5])
def test_ws_persistent_forward_interpreted(ws_persistent_launches, d, hq, hkv, sq, sk, bshd):
    _check(*_qkv(2, hq, hkv, sq, sk, d, torch.float16, bshd), ws_persistent_launches)


def test_ws_persistent_needs_more_key_blocks_than_stages(ws_persistent_launches):
    # the persistent kernel's per-tile Q descriptor is rewritten before the producer waits for the previous Q load:
    # calls with at most as many key blocks as K / V stages take the per-tile kernel
    block_n, stages = (16, 1) if DEVICE == "cpu" else flash_fwd_ws.WS_TILES[128][1::2]
    d = 64 if DEVICE == "cpu" else 128
    for blocks, kernel in ((stages, "_attn_fwd_ws"), (stages + 1, "_attn_fwd_ws_persistent")):
        q, k, v = _qkv(1, 2, 2, 32, blocks * block_n, d, torch.float16, False)
        out, _ = flash_fwd(q, k, v, d ** -0.5, False, True)
        assert ws_persistent_launches[-1] == kernel, (blocks, ws_persistent_launches)
        assert_within_bar("out", out, attention_same_dtype(q, k, v), attention_math(q.double(), k.double(), v.double()))


def test_ws_persistent_zero_batch_stride(ws_persistent_launches):
    # b = 1 with a 0 batch stride (tma_ok passes it: one batch): the 4-D descriptors get a stride TMA accepts
    d, s = (64, 40) if DEVICE == "cpu" else (128, 1024)
    q, k, v = (torch.randn(2, s, d, dtype=torch.float16, device=DEVICE).as_strided((1, 2, s, d), (0, s * d, d, 1))
               for _ in range(3))
    _check(q, k, v, ws_persistent_launches)


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
def test_ws_persistent_more_programs_than_tiles(ws_persistent_launches, monkeypatch):
    monkeypatch.setattr(flash_fwd_ws, "INTERPRET_PROGRAMS", 64)  # one tile each (2 x 2 x 1 tiles: the grid is 4)
    _check(*_qkv(2, 2, 1, 12, 40, 64, torch.float16, False), ws_persistent_launches)


@pytest.fixture
def ws_causal_launches(ws_launches, monkeypatch):
    """ws_launches with the opt-in causal variant on."""
    monkeypatch.setattr(flash_fwd_ws, "CAUSAL_ENABLED", True)
    return ws_launches


CPU_CAUSAL_CASES = [
    # d, hq, hkv, sq, sk, bottom_right, bshd
    (64, 4, 2, 44, 70, False, True),  # top-left, more keys than queries, a partial last key tile, GQA
    (64, 2, 2, 48, 64, True, False),  # bottom-right: the diagonal 16 keys to the right
    (64, 2, 1, 72, 40, False, True),  # top-left, more queries than keys: rows past 40 see every key
    (96, 2, 1, 40, 56, True, True),  # padded head dim, bottom-right, partial tiles
    (64, 2, 2, 36, 36, True, False),  # square: both alignments agree
]


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bottom_right,bshd", CPU_CAUSAL_CASES)
def test_ws_causal_forward_interpreted(ws_causal_launches, d, hq, hkv, sq, sk, bottom_right, bshd):
    _check(*_qkv(2, hq, hkv, sq, sk, d, torch.float16, bshd), ws_causal_launches, True, bottom_right)


# fresh examples every run: the WS kernel's bounds (both causal alignments and none, GQA, partial tiles, layouts)
@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 2), hkv=st.integers(1, 2), group=st.integers(1, 3), sq4=st.integers(1, 16),
       sk=st.integers(1, 70), d=st.sampled_from([48, 64, 96]), mode=st.sampled_from(["none", "tl", "br"]),
       bshd=st.booleans(), persistent=st.booleans())
def test_ws_random_shapes_interpreted(ws_causal_launches, monkeypatch, b, hkv, group, sq4, sk, d, mode, bshd,
                                      persistent):
    monkeypatch.setattr(flash_fwd_ws, "PERSISTENT", persistent)
    monkeypatch.setattr(flash_fwd_ws, "CAUSAL_PERSISTENT", persistent)
    sq = 4 * sq4  # the LSE rows' TMA alignment (ws_eligible)
    if mode == "br":
        sk = max(sk, sq)  # bottom-right rows all see a key only when sk >= sq (else the general kernel runs)
    _check(*_qkv(b, hkv * group, hkv, sq, sk, d, torch.float16, bshd), ws_causal_launches, mode != "none",
           mode == "br")


@pytest.fixture
def ws_causal_persistent_launches(ws_persistent_launches, monkeypatch):
    """ws_persistent_launches with causal calls on the persistent kernel (CAUSAL_ENABLED, CAUSAL_PERSISTENT)."""
    monkeypatch.setattr(flash_fwd_ws, "CAUSAL_ENABLED", True)
    monkeypatch.setattr(flash_fwd_ws, "CAUSAL_PERSISTENT", True)
    return ws_persistent_launches


def _causal_launches(sq, sk, d, bottom_right):
    """The kernels a causal call takes with CAUSAL_PERSISTENT: the persistent kernel for the tiles that see more
    key blocks than stages, the per-tile kernel for the rest (each only if it has tiles)."""
    block_m, block_n, _, stages = flash_fwd_ws.WS_TILES[d]  # (ws_launches: the interpreter's tile on the CPU)
    offset = sk - sq if bottom_right else 0
    ends = [min(sk, (i + 1) * block_m + offset) for i in range(-(-sq // block_m))]
    long_tiles = sum(-(-end // block_n) > stages for end in ends)
    return ["_attn_fwd_ws_persistent"] * bool(long_tiles) + ["_attn_fwd_ws"] * (long_tiles < len(ends))


CPU_CAUSAL_PERSISTENT_CASES = CPU_CAUSAL_CASES + [
    (64, 2, 2, 64, 20, False, False),  # every tile sees at most two key blocks: the per-tile kernel alone
    (64, 3, 1, 36, 100, True, True),  # bottom-right, 64 keys to the left: every tile on the persistent kernel
]


@pytest.mark.skipif(DEVICE != "cpu", reason="interpreter sizes")
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bottom_right,bshd", CPU_CAUSAL_PERSISTENT_CASES)
def test_ws_causal_persistent_interpreted(ws_causal_persistent_launches, d, hq, hkv, sq, sk, bottom_right, bshd):
    q, k, v = _qkv(2, hq, hkv, sq, sk, d, torch.float16, bshd)
    out, lse = flash_fwd(q, k, v, d ** -0.5, True, bottom_right)
    assert ws_causal_persistent_launches == _causal_launches(sq, sk, d, bottom_right)
    kw = dict(is_causal=True, bottom_right=bottom_right)
    ref = attention_math(q.double(), k.double(), v.double(), **kw)
    assert_within_bar("out", out, attention_same_dtype(q, k, v, **kw), ref)
    assert (lse.double() - _lse(q, k, True, bottom_right)).abs().max().item() < 2e-2


def test_ws_causal_persistent_compile_failure_falls_back(ws_causal_persistent_launches, monkeypatch):
    # the causal persistent kernel does not build: that call and later ones run a program per tile; the non-causal
    # persistent kernel is still tried (here it fails too, and its call runs a program per tile as well)
    d = 64 if DEVICE == "cpu" else 128
    block_n, stages = (16, 1) if DEVICE == "cpu" else flash_fwd_ws.WS_TILES[d][1::2]
    q, k, v = _qkv(1, 2, 2, 4 * block_n, (stages + 2) * block_n, d, torch.float16, False)
    _persistent_fails_to_compile(monkeypatch, ws_causal_persistent_launches)
    for causal in (True, True, False):
        out, _ = flash_fwd(q, k, v, d ** -0.5, causal, False)
        kw = dict(is_causal=causal)
        assert_within_bar("out", out, attention_same_dtype(q, k, v, **kw),
                          attention_math(q.double(), k.double(), v.double(), **kw))
    assert ws_causal_persistent_launches == ["_attn_fwd_ws_persistent", "_attn_fwd_ws", "_attn_fwd_ws",
                                             "_attn_fwd_ws_persistent", "_attn_fwd_ws"]
    assert flash_fwd_ws._FAILED == {(d, torch.float16, "persistent_causal"), (d, torch.float16, "persistent")}


def test_ws_causal_persistent_only_head_dims(ws_causal_launches, monkeypatch):
    # a head dim in PERSISTENT_ONLY takes causal calls with CAUSAL_PERSISTENT only, and the general kernel if that
    # kernel does not build
    d = 64 if DEVICE == "cpu" else 128
    monkeypatch.setattr(flash_fwd_ws, "PERSISTENT_ONLY", frozenset({d}))
    monkeypatch.setattr(flash_fwd_ws, "PERSISTENT", True)
    block_n, stages = (16, 1) if DEVICE == "cpu" else flash_fwd_ws.WS_TILES[d][1::2]
    q, k, v = _qkv(1, 2, 2, 4 * block_n, 4 * block_n, d, torch.float16, False)
    out = torch.empty_like(q)
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, True, True)
    monkeypatch.setattr(flash_fwd_ws, "CAUSAL_PERSISTENT", True)
    assert flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, True, True) == (DEVICE == "cpu" or ON_SM90)
    _persistent_fails_to_compile(monkeypatch, ws_causal_launches)
    for _ in range(2):
        out, _ = flash_fwd(q, k, v, d ** -0.5, True, True)
        assert_within_bar("out", out, attention_same_dtype(q, k, v, is_causal=True),
                          attention_math(q.double(), k.double(), v.double(), is_causal=True))
    assert ws_causal_launches == ["_attn_fwd_ws_persistent", "_attn_fwd", "_attn_fwd"]
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, True, True)


def test_ws_causal_only_where_every_row_sees_a_key(ws_causal_launches, monkeypatch):
    q, k, v = _qkv(1, 2, 2, 48, 32, 64 if DEVICE == "cpu" else 128, torch.float16, False)
    out = torch.empty_like(q)
    on = DEVICE == "cpu" or ON_SM90
    assert flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, True, True, bottom_right=False) == on
    # bottom-right with more queries than keys: the first 16 rows see none (PyTorch's zeros; the general kernel's)
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, True, True, bottom_right=True)
    out, _ = flash_fwd(q, k, v, q.shape[-1] ** -0.5, True, True)
    assert ws_causal_launches[-1] == "_attn_fwd"
    monkeypatch.setattr(flash_fwd_ws, "CAUSAL_ENABLED", False)
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, True, True, bottom_right=False)


GPU_CASES = [(d, hq, hkv, sq, sk, bshd) for d in (128, 96)
             for hq, hkv, sq, sk, bshd in ((16, 16, 2048, 8192, True), (8, 2, 1000, 9001, False),
                                           (4, 4, 3000, 8192, True), (2, 2, 8192, 16384, False))]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (Triton's warp specialization on Hopper)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bshd", GPU_CASES)
def test_ws_forward_real_size(ws_launches, dtype, d, hq, hkv, sq, sk, bshd):
    _check(*_qkv(2, hq, hkv, sq, sk, d, dtype, bshd), ws_launches)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (Triton's warp specialization on Hopper)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bshd", GPU_CASES + [(64, *case[1:]) for case in GPU_CASES[:4]]
                         + [(128, 16, 16, 512, 512, True), (128, 4, 1, 1020, 1000, False)])
def test_ws_persistent_forward_real_size(ws_persistent_launches, dtype, d, hq, hkv, sq, sk, bshd):
    # more tiles than SMs (GPU_CASES: 512 tiles in the first, so a program walks several) and fewer (the two
    # added: 128 and 64 tiles, a program each); d=64, which takes only this kernel
    _check(*_qkv(2, hq, hkv, sq, sk, d, dtype, bshd), ws_persistent_launches)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (Triton's warp specialization on Hopper)")
def test_ws_defaults_route_by_head_dim_and_keys(launched):
    # as shipped: d=128 from 512 keys on the persistent kernel, d=64 from 4k keys there and below it the general one
    for d, sk, kernel in ((128, 384, "_attn_fwd"), (128, 512, "_attn_fwd_ws_persistent"), (64, 2048, "_attn_fwd"),
                          (64, 4096, "_attn_fwd_ws_persistent")):
        q, k, v = _qkv(2, 4, 4, 256, sk, d, torch.bfloat16, False)
        out, _ = flash_fwd(q, k, v, d ** -0.5, False, True)
        assert launched[-1] == kernel, (d, sk, launched)
        assert_within_bar("out", out, attention_same_dtype(q, k, v), attention_math(q.double(), k.double(), v.double()))


GPU_CAUSAL_CASES = [(d, hq, hkv, sq, sk, br, bshd) for d in (128, 96)
                    for hq, hkv, sq, sk, br, bshd in (
                        (16, 16, 2048, 2048, False, True), (8, 2, 1000, 9001, True, False),
                        (4, 4, 3000, 2999, False, True), (2, 2, 8192, 16384, True, False),
                        (2, 1, 4096, 4096, True, True))]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (Triton's warp specialization on Hopper)")
# (strict: a pass fails the suite, so a fix shows)
@pytest.mark.xfail(strict=True, reason="the opt-in causal variant left output elements unwritten on sm90 (every "
                                       "case on H100s in the forty-fifth and forty-sixth sessions); its O store's "
                                       "column was fixed in the fifty-fifth session, not yet run on a GPU: this mark "
                                       "goes when it passes there; CAUSAL_ENABLED stays off")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bottom_right,bshd", GPU_CAUSAL_CASES)
def test_ws_causal_forward_real_size(ws_causal_launches, dtype, d, hq, hkv, sq, sk, bottom_right, bshd):
    # the opt-in causal variant (CAUSAL_ENABLED): what its first GPU run has to pass before it goes on by default
    _check(*_qkv(2, hq, hkv, sq, sk, d, dtype, bshd), ws_causal_launches, True, bottom_right)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90 (Triton's warp specialization on Hopper)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d,hq,hkv,sq,sk,bottom_right,bshd", GPU_CAUSAL_CASES + [(128, 4, 4, 200, 300, False, False)])
def test_ws_causal_persistent_forward_real_size(ws_causal_persistent_launches, dtype, d, hq, hkv, sq, sk,
                                                bottom_right, bshd):
    # CAUSAL_PERSISTENT: the long tiles on the persistent kernel, the short ones a program each (the added case:
    # every tile short, the per-tile launch alone)
    _check(*_qkv(2, hq, hkv, sq, sk, d, dtype, bshd), ws_causal_persistent_launches, True, bottom_right)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_SM90, reason="sm90")
def test_ws_forward_large_logits_finite(ws_launches):
    q, k, v = _qkv(1, 4, 4, 1024, 1024, 128, torch.bfloat16, True)
    out, lse = flash_fwd(q * 30, k * 30, v, 128 ** -0.5, False, False)
    assert ws_launches[-1] == "_attn_fwd_ws"
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def _plain_qkv(d=64 if DEVICE == "cpu" else 128):
    return _qkv(1, 2, 2, 40, 40, d, torch.float16, False)


@pytest.mark.parametrize("kw", [dict(attn_mask="bool"), dict(dropout_p=0.1), dict(softcap=5.0),
                                dict(window=(8, -1)), dict(alibi_slopes=True), dict(scale=-0.1), dict(d=80),
                                dict(causal=True), dict(sq=38)],
                         ids=lambda kw: next(iter(kw)))
def test_ws_not_taken_for_features(ws_launches, kw):
    q, k, v = _plain_qkv(kw.pop("d", 64 if DEVICE == "cpu" else 128))
    causal = kw.pop("causal", False)
    q = q[:, :, :kw.pop("sq", 40)]  # a query length that is not a multiple of 4: the LSE rows' TMA alignment
    scale = kw.pop("scale", q.shape[-1] ** -0.5)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(40, 40, device=DEVICE) > 0.2
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = torch.rand(2, device=DEVICE)
    if "dropout_p" in kw:
        kw["rng"] = (1, 0)
    flash_fwd(q, k, v, scale, causal, True, **kw)
    assert "_attn_fwd_ws" not in ws_launches and ws_launches[-1] == "_attn_fwd"


def test_ws_switches(ws_launches, monkeypatch):
    q, k, v = _plain_qkv()
    out = torch.empty_like(q)
    assert flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True) == (DEVICE == "cpu" or ON_SM90)
    monkeypatch.setattr(flash_fwd_ws, "ENABLED", False)
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True)
    monkeypatch.setattr(flash_fwd_ws, "ENABLED", True)
    monkeypatch.setattr(flash_fwd_ws, "INTERPRET", False)
    if DEVICE == "cpu":  # the CPU suite keeps testing _attn_fwd on plain calls unless a test asks
        assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True)
    monkeypatch.setattr(flash_fwd_ws, "INTERPRET", True)
    with _configs.override(fwd=_configs.TileConfig(16, 16, 4, 1)):  # a pinned tile is one for _attn_fwd
        assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True)
    monkeypatch.setattr(flash_fwd_ws, "MIN_SEQ_K", {q.shape[-1]: 41})  # 40 keys
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True) or DEVICE == "cpu"


def test_ws_compile_failure_falls_back(ws_launches, monkeypatch):
    # A Triton whose pass cannot specialize the loop: the call runs _attn_fwd, and later calls skip the try.
    q, k, v = _plain_qkv()
    real = _launch.launch

    def failing(kernel, grid, args, kw):
        if kernel.fn.__name__ == "_attn_fwd_ws":
            raise RuntimeError("PassManager::run failed")
        return real(kernel, grid, args, kw)

    monkeypatch.setattr(_launch, "launch", failing)
    monkeypatch.setattr(flash_fwd_ws, "_FAILED", set())
    out, _ = flash_fwd(q, k, v, q.shape[-1] ** -0.5, False, True)
    ref = attention_math(q.double(), k.double(), v.double())
    assert_within_bar("out", out, attention_same_dtype(q, k, v), ref)
    assert (q.shape[-1], torch.float16, False) in flash_fwd_ws._FAILED
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True)


def _persistent_fails_to_compile(monkeypatch, names):
    """Launches of the persistent kernel raise the pass's error (recorded in names); the others run."""
    real = _launch.launch  # (the fixture's launch: records the name)

    def failing(kernel, grid, args, kw):
        if kernel.fn.__name__ == "_attn_fwd_ws_persistent":
            names.append(kernel.fn.__name__)
            raise RuntimeError("PassManager::run failed")
        return real(kernel, grid, args, kw)

    monkeypatch.setattr(_launch, "launch", failing)
    monkeypatch.setattr(flash_fwd_ws, "_FAILED", set())


def test_ws_persistent_compile_failure_falls_back(ws_persistent_launches, monkeypatch):
    # A Triton whose pass cannot build the persistent kernel: the call runs the per-tile WS kernel, later calls too
    d = 64 if DEVICE == "cpu" else 128
    block_n, stages = (16, 1) if DEVICE == "cpu" else flash_fwd_ws.WS_TILES[d][1::2]
    q, k, v = _qkv(1, 2, 2, 40, (stages + 1) * block_n, d, torch.float16, False)  # enough key blocks for it
    _persistent_fails_to_compile(monkeypatch, ws_persistent_launches)
    for _ in range(2):
        out, _ = flash_fwd(q, k, v, q.shape[-1] ** -0.5, False, True)
        assert_within_bar("out", out, attention_same_dtype(q, k, v), attention_math(q.double(), k.double(), v.double()))
    assert ws_persistent_launches == ["_attn_fwd_ws_persistent", "_attn_fwd_ws", "_attn_fwd_ws"]
    assert flash_fwd_ws._FAILED == {(q.shape[-1], torch.float16, "persistent")}


def test_ws_persistent_only_head_dims(ws_persistent_launches, monkeypatch):
    # a head dim in PERSISTENT_ONLY takes the general kernel wherever the persistent one does not run: switched off,
    # too few key blocks, or its compile failed (the per-tile WS kernel is never tried for it)
    d = 64 if DEVICE == "cpu" else 128
    monkeypatch.setattr(flash_fwd_ws, "PERSISTENT_ONLY", frozenset({d}))
    block_n, stages = (16, 1) if DEVICE == "cpu" else flash_fwd_ws.WS_TILES[d][1::2]
    few = _qkv(1, 2, 2, 32, stages * block_n, d, torch.float16, False)
    q, k, v = _qkv(1, 2, 2, 32, (stages + 1) * block_n, d, torch.float16, False)
    out = torch.empty_like(q)
    on = DEVICE == "cpu" or ON_SM90
    assert flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True) == on
    assert not flash_fwd_ws.ws_eligible(*few, out, 0.1, False, True)
    monkeypatch.setattr(flash_fwd_ws, "PERSISTENT", False)
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True)
    monkeypatch.setattr(flash_fwd_ws, "PERSISTENT", True)
    _persistent_fails_to_compile(monkeypatch, ws_persistent_launches)
    for _ in range(2):
        out, _ = flash_fwd(q, k, v, d ** -0.5, False, True)
        assert_within_bar("out", out, attention_same_dtype(q, k, v), attention_math(q.double(), k.double(), v.double()))
    assert ws_persistent_launches == ["_attn_fwd_ws_persistent", "_attn_fwd", "_attn_fwd"]
    assert not flash_fwd_ws.ws_eligible(q, k, v, out, 0.1, False, True)


def test_ws_unaligned_lse_buffer_falls_back(ws_launches):
    q, k, v = _plain_qkv()
    out = torch.empty_like(q)
    lse = torch.empty(2 * 40 + 1, dtype=torch.float32, device=DEVICE)[1:].view(1, 2, 40)  # 4-byte offset
    flash_fwd(q, k, v, q.shape[-1] ** -0.5, False, True, out, lse)
    assert ws_launches[-1] == "_attn_fwd"
    assert_within_bar("out", out, attention_same_dtype(q, k, v), attention_math(q.double(), k.double(), v.double()))


def test_ws_not_taken_for_fp32_out(ws_launches):
    # flash_bwd recomputes O in fp32 for small calls: that buffer is the general kernel's
    q, k, v = _plain_qkv()
    out = torch.empty(q.shape, dtype=torch.float32, device=DEVICE)
    flash_fwd(q, k, v, q.shape[-1] ** -0.5, False, True, out)
    assert ws_launches[-1] == "_attn_fwd"
    assert_within_bar("out", out, attention_same_dtype(q, k, v), attention_math(q.double(), k.double(), v.double()))


def test_ws_other_errors_propagate(ws_launches, monkeypatch):
    q, k, v = _plain_qkv()

    def failing(kernel, grid, args, kw):
        raise ValueError("not a compile failure")

    monkeypatch.setattr(_launch, "launch", failing)
    with pytest.raises(ValueError, match="not a compile failure"):
        flash_fwd(q, k, v, q.shape[-1] ** -0.5, False, True)
