"""Numerics of the varlen (packed-sequence) Triton kernels, forward and backward (issue 5).

Runs in Triton's interpreter on CPU (fp16, small shapes) or on CUDA. Each packed batch is checked
against a float64 reference computed sequence by sequence with tests/reference.attention_ref (the
2x rule of tests/reference.py), outputs poisoned (NaN) before each launch so unwritten rows fail.
Lengths include 0 and 1 and differ between queries and keys.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fa_backend.kernels.triton import _configs, dropout_keep_mask_varlen
from fa_backend.ops import new_rng_state, triton_varlen_attention
from tests.conftest import DEVICE
from tests.reference import check_varlen

pytestmark = pytest.mark.usefixtures("poisoned")

# (seqlens_q, seqlens_k): empty sequences on either side, length 1, sq > sk and sq < sk.
LENS = ([5, 0, 17, 1, 33, 3], [9, 4, 17, 0, 20, 1])


def cu_seqlens(lens) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def packed(lens_q, lens_k, hq, hkv, d, dv=None, dtype=torch.float16):
    dv = d if dv is None else dv
    q = torch.randn(sum(lens_q), hq, d, dtype=dtype, device=DEVICE)
    k = torch.randn(sum(lens_k), hkv, d, dtype=dtype, device=DEVICE)
    v = torch.randn(sum(lens_k), hkv, dv, dtype=dtype, device=DEVICE)
    return q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k)


def _check(lens_q, lens_k, hq, hkv, d, dv=None, *, is_causal=False, window=(-1, -1), softcap=0.0, alibi_slopes=None,
           scale=None, max_extra=0):
    q, k, v, cq, ck = packed(lens_q, lens_k, hq, hkv, d, dv)

    def fn(q, k, v):
        return triton_varlen_attention(q, k, v, cq, ck, max(lens_q) + max_extra, max(lens_k) + max_extra, scale,
                                       is_causal, window_left=window[0], window_right=window[1], softcap=softcap,
                                       alibi_slopes=alibi_slopes)
    return check_varlen(fn, q, k, v, cq, ck, is_causal=is_causal, window=window, softcap=softcap,
                        alibi_slopes=alibi_slopes, scale=scale)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_per_sequence_reference(is_causal, hq, hkv):
    _check(*LENS, hq, hkv, 16, is_causal=is_causal)


def test_value_head_dim_scale_and_loose_max_seqlen():
    # max_seqlen larger than every length is allowed (FA2): extra blocks exit at once.
    _check([7, 30, 2], [30, 7, 2], 2, 1, 32, 16, is_causal=True, scale=0.3, max_extra=20)


@pytest.mark.parametrize("window,is_causal", [((6, 2), False), ((8, -1), True), ((-1, 3), False), ((0, 0), False)])
def test_window(window, is_causal):
    _check(*LENS, 2, 1, 16, is_causal=is_causal, window=window)


@pytest.mark.parametrize("per_batch", [False, True])
def test_softcap_and_alibi(per_batch):
    lens_q, lens_k = LENS
    hq = 2
    slopes = torch.rand((len(lens_q), hq) if per_batch else (hq,), device=DEVICE) * 0.5
    _check(lens_q, lens_k, hq, 1, 16, is_causal=per_batch, softcap=3.0, alibi_slopes=slopes)


# fresh combinations every run (the seed changes); 4 per CPU run
@settings(max_examples=4 if DEVICE == "cpu" else 16, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
    hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]), d=st.sampled_from([16, 40, 64]),
    dv=st.sampled_from([None, 16, 32]), is_causal=st.booleans(),
    window=st.tuples(st.sampled_from([-1, 0, 4, 13]), st.sampled_from([-1, 0, 3])),
    softcap=st.sampled_from([0.0, 4.0]), alibi=st.sampled_from([None, "h", "bh"]),
    scale=st.sampled_from([None, 0.25, -0.3]), max_extra=st.sampled_from([0, 9]),
)
def test_random_combinations(lens, hkv, group, d, dv, is_causal, window, softcap, alibi, scale, max_extra):
    """Packed batches of any lengths (0 included, queries and keys apart) with any mix of causal, window, softcap,
    ALiBi, scale, GQA, dv != d and a loose max_seqlen: output, LSE and gradients within the rule."""
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    hq = hkv * group
    slopes = None if alibi is None else torch.rand((hq,) if alibi == "h" else (len(lens), hq), device=DEVICE) * 0.5
    _check(lens_q, lens_k, hq, hkv, d, dv, is_causal=is_causal, window=window, softcap=softcap, alibi_slopes=slopes,
           scale=scale, max_extra=max_extra)


def test_tile_shapes():
    # Causal / window block bounds with BLOCK_M != BLOCK_N, per-sequence offsets of both signs.
    fwd = _configs.TileConfig(32, 16)
    bwd = _configs.BwdConfig(_configs.TileConfig(16, 32), _configs.TileConfig(32, 16))
    with _configs.override(fwd=fwd, bwd=bwd):
        _check([40, 3, 70], [70, 45, 40], 2, 1, 16, is_causal=True, window=(20, -1))


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_dropout_against_kernel_mask(p):
    lens_q, lens_k = LENS
    hq = 2
    q, k, v, cq, ck = packed(lens_q, lens_k, hq, 1, 16)
    rng = new_rng_state()
    mq, mk = max(lens_q), max(lens_k)
    keep = dropout_keep_mask_varlen(cq, ck, mq, mk, hq, p, tuple(rng.tolist()))
    kept = torch.cat([m.flatten() for m in keep]).float().mean().item()
    assert 0.5 * (1 - p) < kept < min(1.0, 1.5 * (1 - p))  # the masks are not trivial

    def fn(q, k, v):
        return triton_varlen_attention(q, k, v, cq, ck, mq, mk, None, True, dropout_p=p, rng_state=rng)
    check_varlen(fn, q, k, v, cq, ck, is_causal=True, dropout_keep=keep, dropout_p=p)


def test_zero_key_sequences_output_zero():
    q, k, v, cq, ck = packed([4, 6, 3], [0, 5, 0], 2, 2, 16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = triton_varlen_attention(*leaves, cq, ck, 6, 5, None, False)
    assert (out[:4] == 0).all() and (out[10:] == 0).all() and (out[4:10] != 0).any()
    assert (lse[:, :4] == float("-inf")).all() and torch.isfinite(lse[:, 4:10]).all()
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn_like(out))
    assert (dq[:4] == 0).all() and (dq[10:] == 0).all() and torch.isfinite(dq).all()
    # Causal with sq > sk: the first sq - sk rows of a sequence see no key either. 4 heads of 64
    # rather than 2 of 16: with ~200 nonzero dq elements the max-error ratio to PyTorch's fp16 has a
    # tail past 2x by chance (40 seeds: median 0.85, max 1.95, and one CI seed at 2.05); at this size
    # 40 seeds gave median 0.98, max 1.83.
    _check([6, 9], [5, 2], 4, 1, 64, is_causal=True)


def test_all_keys_empty():
    q, k, v, cq, ck = packed([3, 2], [0, 0], 2, 2, 16)
    out, lse = triton_varlen_attention(q, k, v, cq, ck, 3, 0)
    assert (out == 0).all() and (lse == float("-inf")).all()


def test_backward_is_deterministic():
    lens_q, lens_k = [33, 1, 20], [20, 45, 33]
    q, k, v, cq, ck = packed(lens_q, lens_k, 2, 1, 16)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, dtype=q.dtype, device=DEVICE)
    runs = []
    for _ in range(2):
        rng = torch.tensor([2**40 + 3, 11], dtype=torch.int64)
        out, _ = triton_varlen_attention(*leaves, cq, ck, 33, 45, None, True, dropout_p=0.1, rng_state=rng,
                                         window_left=10, softcap=5.0)
        runs.append((out, *torch.autograd.grad(out, leaves, dout)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_equal_lengths_match_dense_kernels():
    # Sequences of one length: the varlen launch is the dense one on another layout (bitwise).
    from fa_backend import flash_attn_func

    b, s, h, d = 3, 21, 2, 16
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float16, device=DEVICE) for _ in range(3))
    cu = cu_seqlens([s] * b)
    dense, lse_dense = flash_attn_func(q, k, v, causal=True, return_softmax_lse=True)
    out, lse = triton_varlen_attention(*(t.flatten(0, 1) for t in (q, k, v)), cu, cu, s, s, None, True)
    assert torch.equal(out, dense.flatten(0, 1))
    assert torch.equal(lse, lse_dense.transpose(0, 1).flatten(1))
