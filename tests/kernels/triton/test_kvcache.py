"""flash_attn_with_kvcache on the Triton kernels: append, rotary, paged caches, splits, masks.

CPU: Triton's interpreter, fp16, small shapes (the interpreter miscomputes bf16 tl.dot). Every case
checks the output, the LSE and the caches after the in-place append against a float64 reference
(tests/kernels/triton/kvcache_reference.py) with the 2x-PyTorch-same-dtype-error rule; outputs are
poisoned (NaN) before each launch so unwritten elements fail.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fa_backend
from fa_backend.kernels.triton import decode
from tests.conftest import DEVICE
from tests.kernels.triton.kvcache_reference import kvcache_ref, rotary_ref
from tests.reference import assert_within_bar, max_err

pytestmark = pytest.mark.usefixtures("poisoned")

DT = torch.float16


def _randn(*shape, dtype=DT):
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


def _seqlens(*vals):
    return torch.tensor(vals, dtype=torch.int32, device=DEVICE)


def _rotary(seqlen_ro, rotary_dim, dtype=DT):
    angle = torch.rand(seqlen_ro, rotary_dim // 2, dtype=torch.float64, device=DEVICE) * 6.3
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def _to_paged(cache, page_size, max_pages=None):
    """Contiguous (b, s, h, d) -> shuffled pages (num_pages, page_size, h, d) + block_table (b, pages/seq)."""
    b, s, h, d = cache.shape
    per_seq = s // page_size if max_pages is None else max_pages
    num_pages = b * per_seq + 3  # a few pages nobody references
    perm = torch.randperm(num_pages, device=cache.device)[: b * per_seq]
    paged = _randn(num_pages, page_size, h, d, dtype=cache.dtype)
    paged[perm] = cache[:, : per_seq * page_size].reshape(b * per_seq, page_size, h, d)
    return paged, perm.reshape(b, per_seq).to(torch.int32)


def _row_addr(i, row, page_size, block_table, cache_batch_idx):
    """(index into dim 0, index into dim 1) of logical cache row `row` of batch entry i."""
    if block_table is not None:
        return int(block_table[i, row // page_size]), row % page_size
    return (i if cache_batch_idx is None else int(cache_batch_idx[i])), row


def check_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, **kw):
    """Run flash_attn_with_kvcache and check out, lse and both caches; returns (out, lse)."""
    kc0, vc0 = k_cache.clone(), v_cache.clone()
    out, lse = fa_backend.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens,
                                                  return_softmax_lse=True, **kw)
    sl = cache_seqlens if torch.is_tensor(cache_seqlens) else _seqlens(*([cache_seqlens] * q.shape[0]))
    ref_kw = {n: kw[n] for n in ("rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad", "block_table",
                                 "causal", "window_size", "softcap", "rotary_interleaved", "alibi_slopes")
              if n in kw}
    ref_kw["scale"] = kw.get("softmax_scale")
    ref, ref_lse, ref_kc, _ref_vc = kvcache_ref(q, kc0, vc0, k, v, cache_seqlens=sl, dtype=torch.float64, **ref_kw)
    pt, pt_lse, pt_kc, _ = kvcache_ref(q, kc0, vc0, k, v, cache_seqlens=sl, **ref_kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_within_bar("out", out, pt, ref)
    assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    empty = torch.isneginf(ref_lse)
    assert torch.isneginf(lse[empty]).all(), "rows that see no key must have LSE -inf"
    assert (out.permute(0, 2, 1, 3)[empty] == 0).all(), "rows that see no key must output 0"
    if (~empty).any():
        assert_within_bar("lse", lse[~empty], pt_lse[~empty], ref_lse[~empty])
    if k is not None:
        # Appended rows: values right; every other element of both caches untouched.
        page = k_cache.shape[1]
        exp_k, exp_v = kc0.clone(), vc0.clone()
        ours_k, ref_k, pt_k = [], [], []
        for i in range(q.shape[0]):
            for r in range(int(sl[i]), int(sl[i]) + k.shape[1]):
                p0, p1 = _row_addr(i, r, page, kw.get("block_table"), kw.get("cache_batch_idx"))
                exp_k[p0, p1] = k_cache[p0, p1]
                exp_v[p0, p1] = v[i, r - int(sl[i])]
                ours_k.append(k_cache[p0, p1])
                ref_k.append(ref_kc[i][r])
                pt_k.append(pt_kc[i][r])
        assert torch.equal(k_cache, exp_k), "k_cache changed outside the appended rows"
        assert torch.equal(v_cache, exp_v), "v_cache: appended rows must be v, the rest unchanged"
        assert_within_bar("k_cache rows", torch.stack(ours_k), torch.stack(pt_k), torch.stack(ref_k))
    else:
        assert torch.equal(k_cache, kc0) and torch.equal(v_cache, vc0)
    return out, lse


def _case(b=2, sq=1, hq=4, hkv=2, d=32, s_cache=48, s_new=1, seqlens=None):
    q = _randn(b, sq, hq, d)
    kc, vc = _randn(b, s_cache, hkv, d), _randn(b, s_cache, hkv, d)
    k = v = None
    if s_new:
        k, v = _randn(b, s_new, hkv, d), _randn(b, s_new, hkv, d)
    if seqlens is None:
        seqlens = torch.randint(0, s_cache - s_new + 1, (b,), dtype=torch.int32, device=DEVICE)
    return q, kc, vc, k, v, seqlens


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (6, 2)])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_decode_gqa_head_dims(hq, hkv, d):
    q, kc, vc, k, v, sl = _case(b=2, hq=hq, hkv=hkv, d=d, s_cache=40)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl)


@pytest.mark.parametrize("d", [40, 72])
def test_head_dim_not_power_of_two(d):
    q, kc, vc, k, v, sl = _case(b=1, hq=4, hkv=2, d=d, s_cache=30)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, causal=True)


def test_append_in_place_without_rotary():
    q, kc, vc, k, v, _ = _case(b=3, s_new=5, s_cache=32)
    k_ptr, v_ptr = kc.data_ptr(), vc.data_ptr()
    check_kvcache(q, kc, vc, k, v, cache_seqlens=_seqlens(0, 13, 27))  # 27 + 5 = 32: the last rows
    assert kc.data_ptr() == k_ptr and vc.data_ptr() == v_ptr


def test_no_new_kv_and_int_seqlens():
    q, kc, vc, _, _, _ = _case(b=2, s_new=0, s_cache=40)
    check_kvcache(q, kc, vc, cache_seqlens=29)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [32, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_rotary(interleaved, rotary_dim, causal):
    # sq = 3 > 1 so the query position rule matters: per row when causal, all at cache_seqlens otherwise.
    q, kc, vc, k, v, sl = _case(b=2, sq=3, hq=4, hkv=2, d=32, s_cache=40, s_new=3)
    cos, sin = _rotary(48, rotary_dim)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, rotary_cos=cos, rotary_sin=sin,
                  rotary_interleaved=interleaved, causal=causal)


def test_rotary_query_positions_follow_fa2_rule():
    # Non-causal, non-local: every query is rotated at position cache_seqlens; local: per row.
    q, kc, vc, k, v, sl = _case(b=1, sq=4, hq=2, hkv=2, d=32, s_cache=32, s_new=4, seqlens=_seqlens(10))
    cos, sin = _rotary(40, 32)
    out_global = fa_backend.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cos, sin, cache_seqlens=sl)
    out_local = fa_backend.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, cos, sin, cache_seqlens=sl,
                                                   window_size=(100, 100))
    # A window wider than the keys masks nothing: only the query positions differ (rows 1.. move).
    assert torch.equal(out_global[:, 0], out_local[:, 0])
    assert max_err(out_global[:, 1:], out_local[:, 1:]) > 1e-2


def _same_tiles(page_size: int, d: int, num_splits: int) -> bool:
    """Paged and contiguous reads use the same key tiles, hence the same summation order, so their
    results are bitwise equal. Pages smaller than the contiguous tile (16/32 rows against 64 on a GPU)
    get smaller tiles: both results are then only checked against the float64 reference."""
    block_n = decode.decode_config(d, num_splits)[0]
    return decode.page_block_n(block_n, page_size)[0] == block_n


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("with_rotary", [False, True])
def test_paged_matches_contiguous(page_size, with_rotary):
    b, s_cache = 3, 64
    q, kc, vc, k, v, sl = _case(b=b, sq=1, hq=4, hkv=2, d=32, s_cache=s_cache, s_new=2)
    rot = dict(zip(("rotary_cos", "rotary_sin"), _rotary(s_cache, 32))) if with_rotary else {}
    kp, bt = _to_paged(kc, page_size)
    vp = _randn(*kp.shape)
    vp[bt.flatten().long()] = vc.reshape(-1, page_size, *vc.shape[2:])
    out_paged, _ = check_kvcache(q, kp, vp, k, v, cache_seqlens=sl, block_table=bt, num_splits=2, **rot)
    out_contig, _ = check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, num_splits=2, **rot)
    if _same_tiles(page_size, 32, 2):
        assert torch.equal(out_paged, out_contig)


def test_cache_batch_idx():
    q, _, _, k, v, sl = _case(b=3, s_cache=40, s_new=2)
    kc, vc = _randn(5, 40, 2, 32), _randn(5, 40, 2, 32)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, cache_batch_idx=_seqlens(4, 0, 2), causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_cache_leftpad(causal):
    q, kc, vc, k, v, _ = _case(b=3, sq=2, s_cache=48, s_new=2)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=_seqlens(30, 12, 40), cache_leftpad=_seqlens(5, 0, 17),
                  causal=causal, alibi_slopes=torch.rand(4, device=DEVICE))


def test_splits_agree():
    # 300 rows of 16-key tiles: the heuristic splits the keys of one (batch, KV head) pair.
    q, kc, vc, k, v, _ = _case(b=1, sq=1, hq=8, hkv=1, d=32, s_cache=304, s_new=1)
    sl = _seqlens(300)
    assert decode.num_splits_heuristic(1, 1, 1, 304, 16, 132) > 1
    outs = []
    for num_splits in (1, 3, 0):
        out, lse = check_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=sl, num_splits=num_splits)
        outs.append((out, lse))
    for out, lse in outs[1:]:
        torch.testing.assert_close(out, outs[0][0], rtol=0, atol=2e-3)
        torch.testing.assert_close(lse, outs[0][1], rtol=0, atol=1e-5)


def test_more_splits_than_tiles_and_short_sequences():
    # Sequences of very different length in one batch: most splits of the short one are empty.
    q, kc, vc, k, v, _ = _case(b=3, sq=1, hq=4, hkv=2, d=32, s_cache=100, s_new=1)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=_seqlens(0, 3, 98), num_splits=7)


@pytest.mark.parametrize("sq,s_new", [(4, 4), (3, 1), (5, 2)])
def test_causal_multi_query_rows(sq, s_new):
    q, kc, vc, k, v, sl = _case(b=2, sq=sq, hq=4, hkv=2, d=32, s_cache=40, s_new=s_new)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, causal=True, num_splits=2)


def test_causal_queries_beyond_keys_output_zero():
    # Empty cache, 2 new keys, 5 queries, causal bottom-right: the first 3 queries see no key.
    q, kc, vc, k, v, _ = _case(b=1, sq=5, hq=2, hkv=1, d=32, s_cache=16, s_new=2)
    out, lse = check_kvcache(q, kc, vc, k, v, cache_seqlens=0, causal=True)
    assert (out[:, :3] == 0).all() and torch.isneginf(lse[:, :, :3]).all()


def test_empty_cache():
    q, kc, vc, k, v, _ = _case(b=2, sq=1, s_cache=16, s_new=1)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=0)
    q, kc, vc, _, _, _ = _case(b=2, sq=1, s_cache=16, s_new=0)
    out, lse = check_kvcache(q, kc, vc, cache_seqlens=0)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("window", [(7, -1), (5, 2), (-1, 3), (0, 0)])
@pytest.mark.parametrize("causal", [False, True])
def test_sliding_window(window, causal):
    q, kc, vc, k, v, sl = _case(b=2, sq=3, hq=4, hkv=2, d=32, s_cache=48, s_new=3)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, window_size=window, causal=causal, num_splits=2)


@pytest.mark.parametrize("softcap", [0.5, 5.0, 30.0])
def test_softcap(softcap):
    q, kc, vc, k, v, sl = _case(b=2, sq=2, hq=4, hkv=2, d=32, s_cache=40, s_new=1)
    check_kvcache(q * 3, kc, vc, k, v, cache_seqlens=sl, softcap=softcap, causal=True)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi(per_batch, causal):
    q, kc, vc, k, v, sl = _case(b=2, sq=2, hq=4, hkv=2, d=32, s_cache=40, s_new=2)
    slopes = torch.rand((2, 4) if per_batch else (4,), device=DEVICE) * 0.5
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, alibi_slopes=slopes, causal=causal, num_splits=3)


def test_all_features_together_paged():
    q, kc, _vc, k, v, _ = _case(b=2, sq=2, hq=6, hkv=2, d=64, s_cache=64, s_new=2)
    kp, bt = _to_paged(kc, 16)
    vp = _randn(*kp.shape)
    cos, sin = _rotary(64, 32)
    check_kvcache(q, kp, vp, k, v, cache_seqlens=_seqlens(40, 21), block_table=bt, rotary_cos=cos, rotary_sin=sin,
                  rotary_interleaved=False, causal=True, window_size=(20, -1), softcap=10.0,
                  alibi_slopes=torch.rand(2, 6, device=DEVICE), cache_leftpad=_seqlens(3, 0), softmax_scale=0.2,
                  num_splits=0)


# fresh combinations every run (the seed changes); 5 per CPU run
@settings(max_examples=5 if DEVICE == "cpu" else 16, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    b=st.integers(1, 3), sq=st.integers(1, 4), hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
    d=st.sampled_from([32, 40, 64]), s_new=st.integers(0, 3),
    storage=st.sampled_from(["contiguous", "paged16", "paged32", "batch_idx"]), leftpad=st.booleans(),
    rotary=st.sampled_from([None, "interleaved", "halves"]), rotary_dim=st.sampled_from([16, 32]),
    causal=st.booleans(), window=st.tuples(st.sampled_from([-1, 0, 9]), st.sampled_from([-1, 0, 2])),
    softcap=st.sampled_from([0.0, 5.0]), alibi=st.sampled_from([None, "h", "bh"]),
    scale=st.sampled_from([None, 0.2]), num_splits=st.sampled_from([0, 1, 3]), data=st.data(),
)
def test_random_combinations(b, sq, hkv, group, d, s_new, storage, leftpad, rotary, rotary_dim, causal, window,
                             softcap, alibi, scale, num_splits, data):
    """A decode step over a contiguous, paged or batch-indexed cache with any mix of appended rows, left padding,
    rotary (both styles), causal, window, softcap, ALiBi, scale, GQA and split count: output, LSE and both caches
    (tests/kernels/triton/kvcache_reference.py)."""
    s_cache, hq = 64, hkv * group
    seqlens = [data.draw(st.integers(0, s_cache - s_new)) for _ in range(b)]
    kw = dict(causal=causal, window_size=window, softcap=softcap, softmax_scale=scale, num_splits=num_splits)
    if leftpad:
        kw["cache_leftpad"] = _seqlens(*[data.draw(st.integers(0, n)) for n in seqlens])
    if rotary and s_new:  # (FlashAttention-2: rotary needs new k and v to append)
        # the shortest table the call accepts: per-row query rotation reaches cache_seqlens + sq - 1
        per_row = causal or window != (-1, -1)
        kw["rotary_cos"], kw["rotary_sin"] = _rotary(s_cache + (max(0, sq - s_new) if per_row else 0), rotary_dim)
        kw["rotary_interleaved"] = rotary == "interleaved"
    if alibi:
        kw["alibi_slopes"] = torch.rand((hq,) if alibi == "h" else (b, hq), device=DEVICE) * 0.5
    q, kc, vc, k, v, sl = _case(b=b, sq=sq, hq=hq, hkv=hkv, d=d, s_cache=s_cache, s_new=s_new,
                                seqlens=_seqlens(*seqlens))
    if storage.startswith("paged"):
        kc, kw["block_table"] = _to_paged(kc, int(storage[5:]))
        vc = _randn(*kc.shape)
    elif storage == "batch_idx":
        kc, vc = _randn(b + 2, s_cache, hkv, d), _randn(b + 2, s_cache, hkv, d)
        kw["cache_batch_idx"] = torch.randperm(b + 2, device=DEVICE)[:b].to(torch.int32)
    check_kvcache(q, kc, vc, k, v, cache_seqlens=sl, **kw)


def test_rotary_reference_self_check():
    # The test's rotary reference: a rotation preserves pair norms and position 0 (cos 1, sin 0) is identity.
    x = torch.randn(3, 2, 8, dtype=torch.float64, device=DEVICE)
    cos, sin = _rotary(4, 8, dtype=torch.float64)
    for inter in (True, False):
        y = rotary_ref(x, cos, sin, torch.tensor([0, 1, 2], device=DEVICE), inter)
        pairs = (lambda t: t.reshape(3, 2, 4, 2)) if inter else (lambda t: torch.stack((t[..., :4], t[..., 4:]), -1))
        torch.testing.assert_close(pairs(y).norm(dim=-1), pairs(x).norm(dim=-1))
        eye = rotary_ref(x, torch.ones(1, 4, dtype=torch.float64, device=DEVICE),
                         torch.zeros(1, 4, dtype=torch.float64, device=DEVICE),
                         torch.zeros(3, dtype=torch.long, device=DEVICE), inter)
        assert torch.equal(eye, x)


def test_heuristic_from_shapes():
    assert decode.num_splits_heuristic(64, 8, 1, 32768, 64, 132) == 1  # 512 programs fill the GPU
    assert decode.num_splits_heuristic(1, 8, 1, 131072, 64, 132) >= 16
    assert decode.num_splits_heuristic(1, 8, 1, 256, 64, 132) == 1  # 4 tiles: not worth a merge
    assert decode.num_splits_heuristic(1, 1, 1, 10**7, 64, 132) <= decode.MAX_SPLITS
    # Batch 1: about one program per SM, at most 16 splits, down to one tile each (tune_decode on the H200,
    # fused merge).
    assert decode.num_splits_heuristic(1, 8, 1, 1024, 64, 132) == 16
    assert decode.num_splits_heuristic(1, 32, 1, 1024, 64, 132) == 8
    assert decode.num_splits_heuristic(1, 8, 1, 4096, 64, 132) == 16
    assert decode.num_splits_heuristic(1, 8, 1, 16384, 64, 132) == 16
    assert decode.num_splits_heuristic(1, 32, 1, 32768, 64, 132) == 8
    assert decode.num_splits_heuristic(8, 8, 1, 4096, 64, 132) == 4


def test_page_block_n():
    assert decode.page_block_n(64, 64) == (64, True)
    assert decode.page_block_n(64, 256) == (64, True)
    assert decode.page_block_n(64, 32) == (32, True)  # smaller tiles that never cross a page
    assert decode.page_block_n(16, 8) == (16, False)  # pages below a tile: one lookup per row
    assert decode.page_block_n(64, 48) == (64, False)


def test_counts_runs():
    q, kc, vc, k, v, sl = _case(b=1, s_cache=20)
    fa_backend.reset_stats()
    fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=sl)
    fa_backend.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=sl)
    assert fa_backend.stats()["runs"].get("triton_decode") == 2
    fa_backend.reset_stats()


def test_malformed_inputs_raise():
    q, kc, vc, k, v, sl = _case(b=2, s_cache=20)
    with pytest.raises(ValueError, match="int32"):
        fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=sl.long())
    with pytest.raises(ValueError, match="multiple"):
        fa_backend.flash_attn_with_kvcache(_randn(2, 1, 3, 32), kc, vc, cache_seqlens=sl)
    with pytest.raises(ValueError, match="rotary"):
        cos, sin = _rotary(20, 32)
        fa_backend.flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=sin, cache_seqlens=sl)
    with pytest.raises(ValueError, match="together"):
        fa_backend.flash_attn_with_kvcache(q, kc, vc, k, None, cache_seqlens=sl)
    # rotary tables shorter than the positions the kernels may read (cache rows; per-row query rotation beyond them)
    with pytest.raises(ValueError, match="seqlen 19 must be at least 20"):
        cos, sin = _rotary(19, 32)
        fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=sl)
    q3 = _randn(2, 3, 4, 32)
    cos, sin = _rotary(20, 32)
    fa_backend.flash_attn_with_kvcache(q3, kc.clone(), vc.clone(), k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=sl)  # one position per query when not causal: 20 rows do
    with pytest.raises(ValueError, match="seqlen 20 must be at least 22: .* plus seqlen_q 3 - seqlen_new 1"):
        fa_backend.flash_attn_with_kvcache(q3, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=sl,
                                           causal=True)
    kp, bt = _to_paged(_randn(2, 32, 2, 32), 8)
    with pytest.raises(ValueError, match="seqlen 20 must be at least 32"):
        fa_backend.flash_attn_with_kvcache(q, kp, _randn(*kp.shape), k, v, rotary_cos=cos, rotary_sin=sin,
                                           cache_seqlens=sl, block_table=bt)
    with pytest.raises(fa_backend.BackendUnsupportedError, match="dtype"):
        fa_backend.flash_attn_with_kvcache(q.float(), kc.float(), vc.float(), cache_seqlens=sl)


def _op_args(q, kc, vc, sl, s_new, bt=None, cos=None, sin=None, alibi=None):
    return (q, kc, vc, sl, s_new, None, None, bt, cos, sin, True, True, alibi, 0.3, -1, 0, 0.0, 2)


def test_opcheck_decode_fwd():
    q, kc, vc, _, _, sl = _case(b=2, sq=2, s_cache=24, s_new=0)
    cos, sin = _rotary(32, 16)
    torch.library.opcheck(torch.ops.fa_backend.triton_decode_fwd.default,
                          _op_args(q, kc, vc, sl, 0, cos=cos, sin=sin, alibi=torch.rand(4, device=DEVICE)))
    kp, bt = _to_paged(kc, 8)
    torch.library.opcheck(torch.ops.fa_backend.triton_decode_fwd.default, _op_args(q, kp, _randn(*kp.shape), sl, 0, bt))


def test_opcheck_kv_append():
    _, kc, vc, k, v, sl = _case(b=2, s_cache=24, s_new=3)
    cos, sin = _rotary(32, 32)
    torch.library.opcheck(torch.ops.fa_backend.triton_kv_append.default,
                          (kc, vc, k, v, sl, None, None, cos, sin, False))
    kp, bt = _to_paged(kc, 8)
    torch.library.opcheck(torch.ops.fa_backend.triton_kv_append.default,
                          (kp, _randn(*kp.shape), k, v, sl, None, bt, None, None, True))


def test_compiled_decode_step_matches_eager():
    # Append + attention under torch.compile(fullgraph): the in-place cache writes must survive.
    q, kc, vc, k, v, sl = _case(b=2, sq=1, s_cache=24, s_new=1)
    cos, sin = _rotary(32, 32)

    def step(q, kc, vc, k, v, sl):
        return fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, cos, sin, cache_seqlens=sl, causal=True)

    kc2, vc2 = kc.clone(), vc.clone()
    eager = step(q, kc, vc, k, v, sl)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc2, vc2, k, v, sl)
    assert torch.equal(eager, compiled)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


class _CountingKernel:
    """Stands in for a jitted kernel: counts `kernel[grid](...)` launches, runs the real one unless run=False."""

    def __init__(self, kernel, name, log, run=True):
        self.kernel, self.name, self.log, self.run = kernel, name, log, run

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append(self.name)
            if self.run:
                return self.kernel[grid](*args, **kwargs)
        return launch


def _count_launches(monkeypatch, run=True):
    from fa_backend.kernels.triton import kv_append

    log = []
    monkeypatch.setattr(decode, "_decode_split", _CountingKernel(decode._decode_split, "decode", log, run))
    monkeypatch.setattr(decode, "_merge_splits", _CountingKernel(decode._merge_splits, "merge", log, run))
    monkeypatch.setattr(kv_append, "_append_kv", _CountingKernel(kv_append._append_kv, "append", log, run))
    return log


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("int_seqlens", [False, True])
def test_launches_per_call(monkeypatch, int_seqlens, fused):
    # Pure decode: one launch (plus the merge when the keys are split and the merge is not fused); an append
    # (keys rotated, values copied) is one more launch; the queries are rotated inside the decode kernel.
    monkeypatch.setattr(decode, "FUSED_MERGE", fused)
    merge = [] if fused else ["merge"]
    log = _count_launches(monkeypatch)
    q, kc, vc, k, v, _ = _case(b=2, sq=1, hq=4, hkv=2, d=32, s_cache=48, s_new=1)
    sl = 30 if int_seqlens else _seqlens(30, 17)
    cos, sin = _rotary(48, 32)
    expected = {
        (False, 1): ["decode"], (False, 3): ["decode", *merge],
        (True, 1): ["append", "decode"], (True, 3): ["append", "decode", *merge],
    }
    for (append, splits), launches in expected.items():
        log.clear()
        kw = {"rotary_cos": cos, "rotary_sin": sin, "causal": True} if append else {}
        check_kvcache(q, kc.clone(), vc.clone(), *((k, v) if append else ()), cache_seqlens=sl, num_splits=splits,
                      **kw)
        assert log == launches, (append, splits)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("paged", [False, True])
def test_no_other_device_work_per_call(monkeypatch, paged, fused):
    # Besides the Triton launches, a call only allocates (out, lse, split workspace): no fill, copy or
    # host-to-device tensor (an int cache_seqlens included), so a CUDA graph captures exactly the launches.
    # The fused merge's arrival counters are zeroed by the first call only (the warm-up call below).
    monkeypatch.setattr(decode, "FUSED_MERGE", fused)
    from torch.utils._python_dispatch import TorchDispatchMode

    from fa_backend.kernels.triton import _launch

    monkeypatch.setattr(_launch, "POISON_OUTPUTS", False)
    log = _count_launches(monkeypatch, run=False)
    q, kc, vc, k, v, _ = _case(b=2, sq=1, hq=4, hkv=2, d=32, s_cache=64, s_new=1)
    bt = None
    if paged:
        kc, bt = _to_paged(kc, 16)
        vc = _randn(*kc.shape)
    cos, sin = _rotary(64, 32)

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    for sl in (_seqlens(30, 17), 30):
        for kv in ((), (k, v)):
            rot = {"rotary_cos": cos, "rotary_sin": sin} if kv else {}
            fa_backend.flash_attn_with_kvcache(q, kc, vc, *kv, cache_seqlens=sl, block_table=bt, num_splits=3, **rot)
            with Ops() as mode:
                log.clear()
                fa_backend.flash_attn_with_kvcache(q, kc, vc, *kv, cache_seqlens=sl, block_table=bt, num_splits=3,
                                                   return_softmax_lse=True, **rot)
            assert set(mode.ops) <= {"empty"}, mode.ops
            assert log == (["append"] if kv else []) + ["decode"] + ([] if fused else ["merge"])


def test_checks_cached_per_metadata_still_reject():
    # A call that passed the checks does not let a different (malformed) call through.
    q, kc, vc, k, v, sl = _case(b=2, s_cache=20)
    fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=sl)
    with pytest.raises(ValueError, match="int32"):
        fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=sl.long())
    with pytest.raises(ValueError, match="contiguous last dimension"):
        wide = _randn(2, 20, 2, 64)
        fa_backend.flash_attn_with_kvcache(q, wide[..., ::2], vc, cache_seqlens=sl)


def test_int_seqlens_append_rotary_and_strided_inputs():
    # int cache_seqlens (scalar kernel argument) with an append and rotary; q, k, v with a non-unit last stride.
    q, kc, vc, k, v, _ = _case(b=2, sq=2, hq=4, hkv=2, d=32, s_cache=40, s_new=2)
    cos, sin = _rotary(48, 32)
    out_int, _ = check_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=21, rotary_cos=cos, rotary_sin=sin,
                               causal=True, num_splits=2)
    out_t, _ = check_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=_seqlens(21, 21), rotary_cos=cos,
                             rotary_sin=sin, causal=True, num_splits=2)
    assert torch.equal(out_int, out_t)
    strided = [torch.stack((t, t), -1)[..., 0] for t in (q, k, v)]
    assert all(t.stride(-1) == 2 for t in strided)
    out_s, _ = check_kvcache(strided[0], kc.clone(), vc.clone(), strided[1], strided[2], cache_seqlens=21,
                             rotary_cos=cos, rotary_sin=sin, causal=True, num_splits=2)
    assert torch.equal(out_s, out_int)


@pytest.mark.parametrize("page_size", [16, 32])
def test_paged_tiles_with_splits_and_leftpad(page_size):
    # Paged K/V with one page lookup per tile (no left pad) and per row (left pad), split mid-sequence.
    q, kc, vc, k, v, _ = _case(b=2, sq=1, hq=4, hkv=2, d=32, s_cache=128, s_new=1)
    kp, bt = _to_paged(kc, page_size)
    vp = _randn(*kp.shape)
    vp[bt.flatten().long()] = vc.reshape(-1, page_size, *vc.shape[2:])
    sl = _seqlens(100, 57)
    for kw in ({}, {"cache_leftpad": _seqlens(7, 0)}):
        out_p, _ = check_kvcache(q, kp.clone(), vp.clone(), k, v, cache_seqlens=sl, block_table=bt, num_splits=3,
                                 **kw)
        out_c, _ = check_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=sl, num_splits=3, **kw)
        if _same_tiles(page_size, 32, 2):
            assert torch.equal(out_p, out_c)


@pytest.mark.parametrize("splits", [2, 5, 16])
def test_fused_merge_equals_merge_launch(monkeypatch, splits):
    # The last-arriving split merges in the decode launch, as the merge launch would (both within the bar),
    # splits without keys (short sequences, an empty cache) included, and every arrival counter is back at
    # zero afterwards so the next launch (or a CUDA-graph replay) starts clean.
    q, kc, vc, k, v, _ = _case(b=3, sq=2, hq=8, hkv=2, d=32, s_cache=96, s_new=2)
    sl = _seqlens(0, 40, 94)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(decode, "FUSED_MERGE", fused)
        results[fused] = check_kvcache(q, kc.clone(), vc.clone(), k, v, cache_seqlens=sl, num_splits=splits,
                                       causal=True)
    for a, b in zip(results[False], results[True]):  # same splits, same fp32 weights: at most rounding apart
        torch.testing.assert_close(a, b)
    assert decode.arrival_counters(q.device, 1).abs().sum().item() == 0


def test_fused_merge_counters_reused_across_shapes(monkeypatch):
    # One counter buffer per stream serves launches of different shapes (it grows when a launch has more
    # (batch, KV head, query block) tiles than it holds); the merged results stay those of the merge launch.
    monkeypatch.setattr(decode, "FUSED_MERGE", True)
    monkeypatch.setattr(decode, "_COUNTERS", {})
    for b, hkv in ((1, 1), (4, 2), (2, 4)):
        q, kc, vc, k, v, _ = _case(b=b, sq=1, hq=4, hkv=hkv, d=32, s_cache=64, s_new=1)
        check_kvcache(q, kc, vc, k, v, cache_seqlens=_seqlens(*([37, 63, 5, 20][:b])), num_splits=3)
    assert decode.arrival_counters(q.device, 1).abs().sum().item() == 0
