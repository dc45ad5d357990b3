"""References for kernel tests: PyTorch's math SDPA, in float64 (the truth) and in the input dtype.

The accuracy rule (FlashAttention's): a fused result's max error against the float64 result
must be at most 2x the error of PyTorch's own math implementation run in the same low precision,
plus a small epsilon.
"""

from __future__ import annotations

import contextlib

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def causal_mask(sq: int, sk: int, bottom_right: bool, device) -> torch.Tensor:
    """Boolean (sq, sk) mask, True = attend."""
    offset = sk - sq if bottom_right else 0
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(offset)


def attention_math(q, k, v, *, is_causal=False, bottom_right=False, scale=None, dtype=None):
    """PyTorch's math SDPA (GQA, both causal alignments), computed in `dtype` (default: q's)."""
    if dtype is not None:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    mask = causal_mask(q.shape[2], k.shape[2], bottom_right, q.device) if is_causal else None
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@contextlib.contextmanager
def _reduced_precision_math():
    """Let PyTorch's math SDPA compute fp16/bf16 in that precision.

    By default (torch >= 2.5) the math backend upcasts fp16/bf16 inputs to fp32 and rounds only
    the result, on CPU and CUDA alike: that is an fp32 implementation, not a same-precision one.
    """
    prev = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(prev)


def attention_same_dtype(q, k, v, **kw):
    """PyTorch's math SDPA computed in the inputs' own precision (the 2x rule's baseline).

    Autograd's backward of the returned tensor runs outside this function; the math backend's
    backward is made of ordinary ops whose precision follows their (low-precision) inputs.
    """
    with _reduced_precision_math():
        return attention_math(q, k, v, **kw)


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item() if a.numel() else 0.0


def rounding_floor(ref: torch.Tensor, dtype: torch.dtype) -> float:
    """Half an ulp, in `dtype`, of the largest |ref|: the error of merely storing that value in dtype."""
    if not ref.numel() or not dtype.is_floating_point:
        return 0.0
    top = ref.double().abs().max().item()
    if top == 0.0 or not math.isfinite(top):
        return 0.0
    return 0.5 * torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top))


def assert_within_bar(name: str, ours: torch.Tensor, same_dtype: torch.Tensor, ref: torch.Tensor, atol: float = 1e-5):
    """ours must be finite and its error at most 2 x (PyTorch same-dtype error) + atol.

    The baseline is floored at the rounding of the largest reference value to the output dtype: on
    tiny outputs (tens of elements) PyTorch's result can by chance round every element more closely
    than half an ulp, and no result stored in that dtype can be held to better than that (seen: dv
    of a 4-key row, ours 8.1e-4 from the truth at |dv| = 2.05, half an fp16 ulp being 9.8e-4, with
    PyTorch's rounding landing 3.4e-4 away).
    """
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(ours).all(), f"{name}: non-finite values (unwritten or overflowed elements)"
    err, base = max_err(ours, ref), max(max_err(same_dtype, ref), rounding_floor(ref, ours.dtype))
    assert err <= 2 * base + atol, f"{name}: max error {err:.3e} > 2 x PyTorch same-dtype error {base:.3e} + {atol:g}"


def assert_grads_within_bar(out, leaves, pt, pt_leaves, ref, ref_leaves, atol: float = 1e-5) -> None:
    """dq, dk, dv of `out` against the reference's (truth) and PyTorch same-dtype's (baseline) for one
    random upstream gradient; a leaf a reference does not use (empty sequences) has zero gradient."""
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_grads = _grads_or_zeros(ref, ref_leaves, dout.to(ref.dtype))
    pt_grads = _grads_or_zeros(pt, pt_leaves, dout)
    for name, g, gp, gr in zip(("dq", "dk", "dv"), grads, pt_grads, ref_grads):
        assert g.dtype == leaves[0].dtype
        assert_within_bar(name, g, gp, gr, atol)


def check_attention(attn_fn, q, k, v, *, is_causal=False, bottom_right=False, scale=None, grad=True, atol=1e-5):
    """Run attn_fn(q, k, v) forward (and backward) and check output and gradients against the bar.

    The reference is float64, or float32 (IEEE, no TF32) when the score matrix is large.
    """
    leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    out = attn_fn(*leaves)
    big = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] > 2**27
    ref_dtype = torch.float32 if big else torch.float64
    ref_leaves = [t.detach().to(ref_dtype).requires_grad_(grad) for t in (q, k, v)]
    ref = attention_math(*ref_leaves, is_causal=is_causal, bottom_right=bottom_right, scale=scale)
    pt_leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    pt = attention_same_dtype(*pt_leaves, is_causal=is_causal, bottom_right=bottom_right, scale=scale)
    assert out.dtype == q.dtype
    assert_within_bar("out", out, pt, ref, atol)
    if not grad:
        return out
    assert_grads_within_bar(out, leaves, pt, pt_leaves, ref, ref_leaves, atol)
    return out


def attention_ref(q, k, v, *, attn_mask=None, is_causal=False, bottom_right=False, scale=None,
                  window=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_keep=None, dropout_p=0.0, dtype=None):
    """Explicit attention with every kernel feature, in plain PyTorch ops (`dtype`, default q's).

    logits = softcap(scale * q k^T) + alibi + additive mask, with softcap(x) = c * tanh(x / c)
    (FlashAttention-2), ALiBi bias -slope * |i + sk - sq - j| (FlashAttention-2), a bool mask /
    causal band / sliding window (FA2: i + sk - sq - left <= j <= i + sk - sq + right) removing
    keys; rows with no key left output 0 with zero gradients (PyTorch's math backend); dropout
    multiplies the probabilities by dropout_keep / (1 - p) (the kernel's own mask).
    """
    if dtype is not None:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scale = d ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).view(-1 if alibi_slopes.dim() == 2 else 1, hq)[:, :, None, None]
        s = s - slopes * (i + sk - sq - j).abs().to(s.dtype)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if is_causal:
        keep &= j <= i + (sk - sq if bottom_right else 0)
    left, right = window
    if left >= 0:
        keep &= j >= i + sk - sq - left
    if right >= 0:
        keep &= j <= i + sk - sq + right
    keep = keep.expand(s.shape)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = keep & attn_mask
        else:
            s = s + attn_mask.to(s.dtype)
    s = s.masked_fill(~keep, float("-inf"))
    dead = (s == float("-inf")).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    if dropout_keep is not None and dropout_p > 0:
        p = p * dropout_keep.to(p.dtype) / (1.0 - dropout_p)
    return p @ v


def check_features(attn_fn, q, k, v, *, grad=True, atol=1e-5, **features):
    """check_attention for calls with features: attn_fn(q, k, v) against attention_ref in float64
    (the truth) and in the inputs' dtype (the 2x baseline). A float mask in `features` is a leaf
    of neither (no mask gradient)."""
    leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    out = attn_fn(*leaves)
    ref_leaves = [t.detach().double().requires_grad_(grad) for t in (q, k, v)]
    ref = attention_ref(*ref_leaves, **features)
    pt_leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    pt = attention_ref(*pt_leaves, **features)
    assert out.dtype == q.dtype
    assert_within_bar("out", out, pt, ref, atol)
    if not grad:
        return out
    assert_grads_within_bar(out, leaves, pt, pt_leaves, ref, ref_leaves, atol)
    return out


def varlen_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, dropout_keep=None, dtype=None,
                         **features):
    """attention_ref per sequence of a packed (FlashAttention-2 varlen) batch, concatenated.

    q (total_q, hq, d), k / v (total_k, hkv, d); sequence i is rows cu_seqlens_q[i]:cu_seqlens_q[i + 1]
    over keys cu_seqlens_k[i]:cu_seqlens_k[i + 1], each computed by the dense reference (bottom-right
    alignment, as FA2's varlen). alibi_slopes (b, hq) is sliced per sequence; dropout_keep is the
    list of per-sequence (hq, sq_i, sk_i) keep-masks. Returns out (total_q, hq, dv) and the fp32
    LSE (hq, total_q) of the scores (-inf for rows without keys).
    """
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if dtype is not None:
        q, k, v = (t.to(dtype) for t in (q, k, v))
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qi, ki, vi = (t[a:b].transpose(0, 1).unsqueeze(0) for t, a, b in
                      ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1])))
        slopes = alibi_slopes[i] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        keep = None if dropout_keep is None else dropout_keep[i].unsqueeze(0)
        out = attention_ref(qi, ki, vi, alibi_slopes=slopes, dropout_keep=keep, bottom_right=True, **{
            name: val for name, val in features.items() if name != "bottom_right"})
        outs.append(out[0].transpose(0, 1))
        lses.append(_lse_ref(qi, ki, alibi_slopes=slopes, **features)[0])
    return torch.cat(outs), torch.cat(lses, 1)


def _lse_ref(q, k, *, is_causal=False, scale=None, window=(-1, -1), softcap=0.0, alibi_slopes=None, **_):
    """Natural-log sum-exp of the scores of attention_ref (bottom-right), float64, detached."""
    q, k = q.detach().double(), k.detach().double()
    hq, sq, d = q.shape[1], q.shape[2], q.shape[3]
    sk = k.shape[2]
    k = k.repeat_interleave(hq // k.shape[1], 1)
    s = (q @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    if alibi_slopes is not None:
        s = s - alibi_slopes.double().view(1, hq, 1, 1) * (i + sk - sq - j).abs().double()
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if is_causal:
        keep &= j <= i + sk - sq
    if window[0] >= 0:
        keep &= j >= i + sk - sq - window[0]
    if window[1] >= 0:
        keep &= j <= i + sk - sq + window[1]
    return torch.logsumexp(s.masked_fill(~keep, float("-inf")), -1)


def check_varlen(attn_fn, q, k, v, cu_seqlens_q, cu_seqlens_k, *, grad=True, atol=1e-5, **features):
    """check_features for packed batches: attn_fn(q, k, v) -> (out, lse) against varlen_attention_ref in
    float64 (the truth; float32 without TF32 when the score matrices are large, as check_attention) and
    in the inputs' dtype (the 2x baseline), output, LSE and gradients."""
    leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    out, lse = attn_fn(*leaves)
    lq, lk = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
    big = q.shape[1] * sum(a * b for a, b in zip(lq, lk)) > 2**27  # as check_attention: fp32 (IEEE) when large
    ref_dtype = torch.float32 if big else torch.float64
    ref_leaves = [t.detach().to(ref_dtype).requires_grad_(grad) for t in (q, k, v)]
    ref, lse_ref = varlen_attention_ref(*ref_leaves, cu_seqlens_q, cu_seqlens_k, **features)
    pt_leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
    pt, _ = varlen_attention_ref(*pt_leaves, cu_seqlens_q, cu_seqlens_k, **features)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_within_bar("out", out, pt, ref, atol)
    assert lse.shape == lse_ref.shape, (tuple(lse.shape), tuple(lse_ref.shape))
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite) and (lse[~finite] == float("-inf")).all(), "lse: -inf rows differ"
    assert max_err(lse[finite], lse_ref[finite]) < 1e-3, f"lse: max error {max_err(lse[finite], lse_ref[finite]):.3e}"
    if not grad:
        return out, lse
    assert_grads_within_bar(out, leaves, pt, pt_leaves, ref, ref_leaves, atol)
    return out, lse


def _grads_or_zeros(out, leaves, dout):
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
