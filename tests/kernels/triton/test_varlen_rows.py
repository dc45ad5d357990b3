"""Packed rows outside every sequence (before cu_seqlens[0], from cu_seqlens[-1] on): a varlen call must define them.

Static-shape padding (torch.compile, CUDA graphs, sequence-parallel round-up) leaves rows that no sequence covers.
Their output is 0 with LSE -inf (a query that sees no key) and their gradients are 0 (they change no output); left
unwritten, they would carry the allocator's garbage into the model (outputs are poisoned with NaN before each
launch here, as the allocator may hand back NaN). Runs in Triton's interpreter on CPU (fp16) or on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from fa_backend import flash_attn_varlen_func, flash_attn_varlen_qkvpacked_func
from fa_backend.kernels.triton.varlen_rows import fill_rows_outside
from fa_backend.ops import triton_varlen_attention
from tests.conftest import DEVICE
from tests.reference import check_varlen

pytestmark = pytest.mark.usefixtures("poisoned")

LENS_Q, LENS_K = [5, 0, 9], [7, 3, 6]
PAD_Q, PAD_K = (3, 4), (2, 5)  # rows before the first sequence, rows after the last


def _cu(lens, before):
    return torch.tensor([before + sum(lens[:i]) for i in range(len(lens) + 1)], dtype=torch.int32, device=DEVICE)


def _pad(t, pad):
    """t with pad[0] random rows before it and pad[1] after (differentiable in t)."""
    rand = lambda n: torch.randn(n, *t.shape[1:], dtype=t.dtype, device=t.device)  # noqa: E731
    return torch.cat([rand(pad[0]), t, rand(pad[1])])


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sequences_exact_beside_padding_rows(is_causal, hq, hkv):
    d = 16
    q = torch.randn(sum(LENS_Q), hq, d, dtype=torch.float16, device=DEVICE)
    k = torch.randn(sum(LENS_K), hkv, d, dtype=torch.float16, device=DEVICE)
    v = torch.randn(sum(LENS_K), hkv, d, dtype=torch.float16, device=DEVICE)
    cq, ck = _cu(LENS_Q, PAD_Q[0]), _cu(LENS_K, PAD_K[0])
    rows_q = slice(PAD_Q[0], PAD_Q[0] + sum(LENS_Q))

    def fn(q, k, v):
        out, lse = triton_varlen_attention(_pad(q, PAD_Q), _pad(k, PAD_K), _pad(v, PAD_K), cq, ck, max(LENS_Q),
                                           max(LENS_K), None, is_causal)
        return out[rows_q], lse[:, rows_q]

    check_varlen(fn, q, k, v, _cu(LENS_Q, 0), _cu(LENS_K, 0), is_causal=is_causal)


@pytest.mark.parametrize("is_causal", [False, True])
def test_padding_rows_output_zero_and_gradient_zero(is_causal):
    hq, hkv, d = 4, 2, 16
    total_q, total_k = sum(PAD_Q) + sum(LENS_Q), sum(PAD_K) + sum(LENS_K)
    q = torch.randn(total_q, hq, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    k = torch.randn(total_k, hkv, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    v = torch.randn(total_k, hkv, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    out, lse = triton_varlen_attention(q, k, v, _cu(LENS_Q, PAD_Q[0]), _cu(LENS_K, PAD_K[0]), max(LENS_Q),
                                       max(LENS_K), None, is_causal)
    out.backward(torch.randn_like(out))  # a gradient on the padding rows' output too: it must not reach q, k, v
    pad_q = list(range(PAD_Q[0])) + list(range(total_q - PAD_Q[1], total_q))
    pad_k = list(range(PAD_K[0])) + list(range(total_k - PAD_K[1], total_k))
    assert (out[pad_q] == 0).all(), "out: rows outside the sequences must be 0"
    assert (lse[:, pad_q] == float("-inf")).all(), "lse: rows outside the sequences must be -inf"
    for name, grad, rows in (("dq", q.grad, pad_q), ("dk", k.grad, pad_k), ("dv", v.grad, pad_k)):
        assert (grad[rows] == 0).all(), f"{name}: rows outside the sequences must have gradient 0"
        assert not grad.isnan().any(), f"{name}: NaN"
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("packed", [False, True])
def test_flash_attn_varlen_func_static_padding(packed):
    # the usual shape of the problem: one buffer padded to a fixed row count, the sequences at its start; packed:
    # the qkv-packed function, whose backward writes dQ, dK and dV into views of one (total, 3, h, d) gradient
    hq, d, lens = 2, 32, [6, 11]
    total = 24  # 7 padding rows
    x = torch.randn(total, 3, hq, d, dtype=torch.float16, device=DEVICE, requires_grad=True)
    cu = _cu(lens, 0)
    if packed:
        out = flash_attn_varlen_qkvpacked_func(x, cu, max(lens), causal=True)
    else:
        out = flash_attn_varlen_func(x[:, 0], x[:, 1], x[:, 2], cu, cu, max(lens), max(lens), causal=True)
    out.float().square().sum().backward()
    assert (out[sum(lens):] == 0).all()
    assert (x.grad[sum(lens):] == 0).all() and not x.grad.isnan().any()


FILLS = [((20, 3, 5), [2, 7, 15]), ((200, 4, 40), [0, 100, 130]), ((70, 2), [0, 70]), ((130, 33, 7), [-3, 5, 129])]


def _case(shape, cu, value):
    """(buffer, strided view of it with guard rows and columns, the buffer as expected after the fill, fill args)"""
    total, rest = shape[0], shape[1:]
    buf = torch.randn(total + 4, *rest[:-1], rest[-1] + 2, device=DEVICE)
    view = buf[2:2 + total, ..., 1:1 + rest[-1]]
    expected = buf.clone()
    exp_view = expected[2:2 + total, ..., 1:1 + rest[-1]]
    exp_view[:max(cu[0], 0)] = value
    exp_view[cu[-1]:] = value
    return buf, expected, (view, torch.tensor(cu, dtype=torch.int32, device=DEVICE), value)


@pytest.mark.parametrize("group", [[0], [1], [2], [3], [1, 2, 3], [0, 3]])
def test_fill_rows_outside_touches_only_those_rows(group):
    # strided views inside larger buffers (guard rows and columns), up to three of different row counts in one
    # launch: rows outside [cu[0], cu[-1]) take the value, every other element keeps its own
    cases = [_case(*FILLS[i], value) for i, value in zip(group, (float("-inf"), 0.0, 2.5))]
    fill_rows_outside(*(c[2] for c in cases))
    for i, (buf, expected, _) in zip(group, cases):
        assert torch.equal(buf, expected), FILLS[i]
