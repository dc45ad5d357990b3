"""Packed-sequence kernels with cu_seqlens that do not describe the packed rows.

cu_seqlens live on the device, so the host cannot check them without a sync. A sequence whose boundaries are
unusable (a start below 0 or below the previous start, an end past the packed rows, a length above max_seqlen)
must read nothing and write NaN over its rows (output, LSE, dQ; dK / dV over its keys), inside the tensors
only; the other sequences stay exact. Every input and output is a view with guard rows on both sides: a read past
the tensors returns finite values where NaN is required, a write lands in a guard that the test checks.
"""

from __future__ import annotations

import pytest
import torch

from fa_backend.kernels.triton import _launch
from fa_backend.kernels.triton.flash_bwd import flash_bwd_varlen
from fa_backend.kernels.triton.flash_fwd import flash_fwd_varlen
from tests.conftest import DEVICE
from tests.reference import assert_within_bar, attention_ref

DT = torch.float16
HQ, HKV, D, G = 4, 2, 32, 4  # G guard rows on each side of every packed tensor
TOTAL_Q, TOTAL_K = 16, 18  # valid packing: query lengths 5, 7, 4 and key lengths 6, 9, 3

# case: (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, query rows that must be NaN, key rows that must be
# NaN, sequences checked against the reference)
CASES = {
    "q_past_end": ([0, 5, 12, 19], [0, 6, 15, 18], 8, 10, range(12, 16), range(15, 18), (0, 1)),
    "q_negative_start": ([-2, 5, 12, 16], [0, 6, 15, 18], 8, 10, range(0, 5), range(0, 6), (1, 2)),
    # a length above max_seqlen_q: the grid covers its first 8 rows (5..12), row 13 is nobody's
    "q_too_long": ([0, 5, 14, 16], [0, 6, 15, 18], 8, 10, range(5, 13), range(6, 15), (0, 2)),
    # sequence 1 of negative length; sequence 2 starts before sequence 1 (and overlaps sequence 0: rows 5..8 are
    # written by both, so only the rows past sequence 0 are checked)
    "q_decreasing": ([0, 9, 5, 16], [0, 6, 15, 18], 12, 10, range(9, 16), range(6, 18), ()),
    "k_past_end": ([0, 5, 12, 16], [0, 6, 15, 20], 8, 10, range(12, 16), range(15, 18), (0, 1)),
    # a key length above max_seqlen_k: the dK / dV grid covers its first 10 keys (6..15), key 16 is nobody's
    "k_too_long": ([0, 5, 12, 16], [0, 6, 17, 18], 8, 10, range(5, 12), range(6, 16), (0, 2)),
}


def _guarded(total, *rest, fill=None):
    """(buffer, view of rows G .. G + total): a packed tensor with G guard rows before and after it."""
    buf = torch.randn(total + 2 * G, *rest, dtype=DT, device=DEVICE) if fill is None else \
        torch.full((total + 2 * G, *rest), fill, dtype=DT, device=DEVICE)
    return buf, buf[G:G + total]


def _seq_ref(q, k, v, dout, qs, qe, ks, ke, dtype):
    """Output and (dq, dk, dv) of one sequence by the dense reference (causal, bottom right), in dtype."""
    leaves = [t.detach().to(dtype).transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q[qs:qe], k[ks:ke],
                                                                                             v[ks:ke])]
    out = attention_ref(*leaves, is_causal=True, bottom_right=True)
    grads = torch.autograd.grad(out, leaves, dout[qs:qe].to(dtype).transpose(0, 1).unsqueeze(0))
    return [t.squeeze(0).transpose(0, 1) for t in (out, *grads)]


@pytest.mark.parametrize("case", list(CASES))
def test_invalid_sequence_is_nan_and_stays_inside(case, monkeypatch):
    cq, ck, max_q, max_k, nan_q, nan_k, valid = CASES[case]
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in (cq, ck))
    (qb, q), (kb, k), (vb, v), (dob, dout) = (_guarded(n, h, D) for n, h in
                                              ((TOTAL_Q, HQ), (TOTAL_K, HKV), (TOTAL_K, HKV), (TOTAL_Q, HQ)))
    inputs0 = [t.clone() for t in (qb, kb, vb, dob)]
    outs = {n: _guarded(total, h, D, fill=7.0) for n, total, h in
            (("out", TOTAL_Q, HQ), ("dq", TOTAL_Q, HQ), ("dk", TOTAL_K, HKV), ("dv", TOTAL_K, HKV))}
    lse_buf = torch.full((HQ * TOTAL_Q + 2 * G,), 7.0, dtype=torch.float32, device=DEVICE)
    lse = lse_buf[G:G + HQ * TOTAL_Q].view(HQ, TOTAL_Q)
    # outputs prefilled with a finite value: NaN must come from the kernels, not from an unwritten element
    monkeypatch.setattr(_launch, "POISON_OUTPUTS", True)
    monkeypatch.setattr(_launch, "poison", lambda *ts: [t.fill_(3.0) for t in ts])
    scale = D ** -0.5
    out = outs["out"][1]
    flash_fwd_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, True, out, lse)
    dq, dk, dv = (outs[n][1] for n in ("dq", "dk", "dv"))
    flash_bwd_varlen(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, True, dq=dq, dk=dk, dv=dv)

    rows_q, rows_k = list(nan_q), list(nan_k)
    for name, t, rows in (("out", out, rows_q), ("lse", lse.t(), rows_q), ("dq", dq, rows_q), ("dk", dk, rows_k),
                          ("dv", dv, rows_k)):
        assert torch.isnan(t[rows]).all(), f"{name}: the invalid sequence's rows must be NaN"
    for i in valid:
        qs, qe, ks, ke = cq[i], cq[i + 1], ck[i], ck[i + 1]
        ref = _seq_ref(q, k, v, dout, qs, qe, ks, ke, torch.float64)
        same = _seq_ref(q, k, v, dout, qs, qe, ks, ke, DT)
        for name, ours, r, p in zip(("out", "dq", "dk", "dv"), (out[qs:qe], dq[qs:qe], dk[ks:ke], dv[ks:ke]),
                                    ref, same):
            assert_within_bar(f"sequence {i} {name}", ours, p, r)
    for name, (buf, _) in outs.items():
        assert (buf[:G] == 7.0).all() and (buf[-G:] == 7.0).all(), f"{name}: a write outside the tensor"
    assert (lse_buf[:G] == 7.0).all() and (lse_buf[-G:] == 7.0).all(), "lse: a write outside the tensor"
    for before, after in zip(inputs0, (qb, kb, vb, dob)):
        assert torch.equal(before, after), "an input was written"
