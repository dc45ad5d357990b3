"""flash_attn_with_kvcache with lengths or indices that do not fit the caches.

Tensor lengths and indices stay on the device, so the host cannot check them: the kernels must neither write nor
read outside the tensors, and the affected batch entry's output and LSE must be NaN while the other entries stay
exact. The caches are views into larger buffers, so a write past a cache lands in a guard region that the test
checks, and a read past it returns finite values where NaN is required. An int cache_seqlens is checked on the
host.
"""

from __future__ import annotations

import pytest
import torch

import fa_backend
from fa_backend.kernels.triton import _launch
from tests.conftest import DEVICE
from tests.kernels.triton.kvcache_reference import kvcache_ref
from tests.kernels.triton.test_kvcache import _randn
from tests.reference import assert_within_bar

B, SQ, HQ, HKV, D, S_CACHE, S_NEW, PAGE = 3, 2, 4, 2, 32, 32, 2, 8
BAD = 1  # the batch entry given invalid input

# what each case breaks, and whether the append kernel must skip that entry (those the decode kernel alone sees,
# cache_leftpad and the block table's first page, leave the append valid); page_high_rows: a left pad of 0 makes
# the decode kernel look pages up per row instead of per tile
CASES = {"overflow": True, "negative": True, "leftpad": False, "leftpad_past_end": False, "batch_idx_low": True,
         "batch_idx_high": True,
         "page_low": False, "page_high": False, "page_high_rows": False}


def _setup(case):
    """(buffers, kw for the call, the cache views, reference kwargs per valid entry)."""
    seqlens = [5, 10, 20]
    kw = {}
    if case.startswith("page"):
        num_pages = B * S_CACHE // PAGE + 2
        kbuf, vbuf = _randn(num_pages + 2, PAGE, HKV, D), _randn(num_pages + 2, PAGE, HKV, D)
        kc, vc = kbuf[1:-1], vbuf[1:-1]  # guard pages before and after
        table = torch.randperm(num_pages, device=DEVICE)[: B * S_CACHE // PAGE].reshape(B, -1).to(torch.int32)
        table[BAD, 0] = -1 if case == "page_low" else num_pages
        kw["block_table"] = table
        if case == "page_high_rows":
            kw["cache_leftpad"] = torch.zeros(B, dtype=torch.int32, device=DEVICE)
    elif case.startswith("batch_idx"):
        kbuf, vbuf = _randn(B + 4, S_CACHE, HKV, D), _randn(B + 4, S_CACHE, HKV, D)
        kc, vc = kbuf[1:-1], vbuf[1:-1]  # B + 2 entries with a guard entry on each side
        idx = torch.tensor([0, 3, 2], dtype=torch.int32, device=DEVICE)
        idx[BAD] = -1 if case == "batch_idx_low" else B + 2
        kw["cache_batch_idx"] = idx
    else:
        kbuf, vbuf = _randn(B, S_CACHE + 16, HKV, D), _randn(B, S_CACHE + 16, HKV, D)
        kc, vc = kbuf[:, :S_CACHE], vbuf[:, :S_CACHE]  # 16 guard rows after each entry's cache
        if case == "overflow":
            seqlens[BAD] = S_CACHE - S_NEW + 1
        elif case == "negative":
            seqlens[BAD] = -3
        else:  # a left pad below 0, or past the entry's rows (10 + 2 new ones)
            kw["cache_leftpad"] = torch.tensor([0, -1 if case == "leftpad" else 13, 0], dtype=torch.int32,
                                               device=DEVICE)
    kw["cache_seqlens"] = torch.tensor(seqlens, dtype=torch.int32, device=DEVICE)
    return kbuf, vbuf, kc, vc, kw


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_invalid_entry_outputs_nan_and_touches_nothing_outside(case, num_splits, monkeypatch):
    kbuf, vbuf, kc, vc, kw = _setup(case)
    q, k, v = _randn(B, SQ, HQ, D), _randn(B, S_NEW, HKV, D), _randn(B, S_NEW, HKV, D)
    kbuf0, vbuf0, kc0, vc0 = kbuf.clone(), vbuf.clone(), kc.clone(), vc.clone()
    # outputs prefilled with a finite value: NaN must come from the kernel, not from an unwritten element
    monkeypatch.setattr(_launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(_launch, "poison", lambda *ts: [t.fill_(3.0) for t in ts])
    out, lse = fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, causal=True, num_splits=num_splits,
                                                  return_softmax_lse=True, **kw)

    assert torch.isnan(out[BAD]).all() and torch.isnan(lse[BAD]).all()
    for i in (0, 2):
        sub = {n: t[i:i + 1] for n, t in kw.items()}
        kc_i, vc_i = (kc0, vc0) if ("block_table" in kw or "cache_batch_idx" in kw) else (kc0[i:i + 1], vc0[i:i + 1])
        ref, ref_lse, _, _ = kvcache_ref(q[i:i + 1], kc_i, vc_i, k[i:i + 1], v[i:i + 1], causal=True,
                                         dtype=torch.float64, **sub)
        pt, pt_lse, _, _ = kvcache_ref(q[i:i + 1], kc_i, vc_i, k[i:i + 1], v[i:i + 1], causal=True, **sub)
        assert_within_bar(f"out[{i}]", out[i:i + 1], pt, ref)
        assert_within_bar(f"lse[{i}]", lse[i:i + 1], pt_lse, ref_lse)

    # The caches: the valid entries' new rows written, the invalid entry's only where the append sees valid input,
    # and nothing else anywhere in the buffers (guards included).
    exp_k, exp_v = kbuf0.clone(), vbuf0.clone()
    view_k = exp_k[1:-1] if ("block_table" in kw or "cache_batch_idx" in kw) else exp_k[:, :S_CACHE]
    view_v = exp_v[1:-1] if ("block_table" in kw or "cache_batch_idx" in kw) else exp_v[:, :S_CACHE]
    for i in range(B):
        if i == BAD and CASES[case]:
            continue
        for r in range(S_NEW):
            row = int(kw["cache_seqlens"][i]) + r
            if "block_table" in kw:
                p0, p1 = int(kw["block_table"][i, row // PAGE]), row % PAGE
            else:
                p0, p1 = (int(kw["cache_batch_idx"][i]) if "cache_batch_idx" in kw else i), row
            view_k[p0, p1], view_v[p0, p1] = k[i, r], v[i, r]
    assert torch.equal(kbuf, exp_k), "k cache buffer: a write outside the valid appended rows"
    assert torch.equal(vbuf, exp_v), "v cache buffer: a write outside the valid appended rows"


def test_int_cache_seqlens_without_room_raise():
    kc, vc = _randn(B, S_CACHE, HKV, D), _randn(B, S_CACHE, HKV, D)
    q, k, v = _randn(B, SQ, HQ, D), _randn(B, S_NEW, HKV, D), _randn(B, S_NEW, HKV, D)
    with pytest.raises(ValueError, match=r"cache_seqlens 31 must be in \[0, 30\]"):
        fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=S_CACHE - S_NEW + 1)
    with pytest.raises(ValueError, match=r"cache_seqlens -1 must be in \[0, 32\]"):
        fa_backend.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=-1)
    # the boundary itself is accepted: the new rows end exactly at the cache's last row
    fa_backend.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=S_CACHE - S_NEW)
