"""The provider on a GPU (target: torch 2.11 on an H200): PyTorch's own SDPA paths run our kernels.

Evidence that our kernels ran: fa_backend.stats()["runs"]["triton"] (counted by the provider's forward)
and provider.stats() ("forward"/"backward" for our kernels, "fallback_*" for PyTorch's).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa_backend
from fa_backend.integrations import provider
from tests.reference import (
    assert_within_bar,
    attention_math,
    attention_same_dtype,
    check_attention,
    max_err,
)

pytestmark = pytest.mark.gpu

FWD = torch.ops.aten._scaled_dot_product_flash_attention.default


def _runs() -> int:
    return fa_backend.stats()["runs"].get("triton", 0)


def _qkv(b=2, h=8, s=1024, d=64, sk=None, layout="bshd", dtype=torch.bfloat16):
    sk = s if sk is None else sk
    shapes = ((b, h, s, d), (b, h, sk, d), (b, h, sk, d))
    if layout == "bshd":  # what models produce: (b, s, h, d) memory viewed as (b, h, s, d)
        return [torch.randn(x[0], x[2], x[1], x[3], device="cuda", dtype=dtype).transpose(1, 2) for x in shapes]
    return [torch.randn(x, device="cuda", dtype=dtype) for x in shapes]


@pytest.fixture
def active():
    """The provider activated with cuDNN preferred off; everything restored afterwards."""
    provider.deactivate()
    torch._dynamo.reset()  # compiled code keeps the SDPA backend chosen when it was traced
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    provider.reset_stats()
    handle = provider.activate(prefer_over_cudnn=True)
    yield handle
    handle.remove()
    torch._dynamo.reset()
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
    assert not provider.is_active()


def test_activation_makes_flash_pytorchs_choice(active):
    assert torch.nn.attention.current_flash_attention_impl() == provider.NAME
    assert torch.backends.cuda.cudnn_sdp_enabled() is False
    q, k, v = _qkv(s=256)
    assert torch._fused_sdp_choice(q, k, v, is_causal=True) == int(SDPBackend.FLASH_ATTENTION)


@pytest.mark.parametrize("causal,d,layout", [(True, 64, "bshd"), (False, 128, "bhsd")])
def test_eager_sdpa_forward_and_backward_run_our_kernels(active, causal, d, layout):
    q, k, v = _qkv(d=d, layout=layout)
    runs = _runs()
    check_attention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v,
                    is_causal=causal)
    assert _runs() == runs + 1
    assert provider.stats() == {"forward": 1, "backward": 1}


@pytest.mark.parametrize("causal,d,layout", [(True, 64, "bhsd"), (False, 128, "bshd")])
def test_compiled_sdpa_forward_and_backward_run_our_kernels(active, causal, d, layout):
    q, k, v = _qkv(d=d, layout=layout)
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
    runs = _runs()
    check_attention(compiled, q, k, v, is_causal=causal)
    stats = provider.stats()
    assert stats.get("forward", 0) >= 1 and stats.get("backward", 0) >= 1, stats
    assert not any(key.startswith("fallback") for key in stats), stats
    assert _runs() == runs + stats["forward"]


def test_head_dim_padded_by_pytorch_runs_ours(active):
    """SDPA pads head_dim 36 to 40 (with the scale of 36) before the flash op: still ours, still right."""
    q, k, v = _qkv(b=1, h=4, s=256, d=36)
    check_attention(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), q, k, v)
    assert provider.stats() == {"forward": 1, "backward": 1}


def test_dropout_falls_back_to_pytorchs_flash_and_is_not_counted(active):
    q, k, v = (t.requires_grad_() for t in _qkv(d=64))
    dout = torch.randn_like(q)
    runs = _runs()
    torch.manual_seed(7)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert _runs() == runs
    stats = provider.stats()
    assert stats.get("forward", 0) == 0 and stats.get("backward", 0) == 0
    assert stats["fallback_forward:dropout"] == 1 and stats["fallback_backward:dropout"] == 1

    active.remove()  # PyTorch's own FlashAttention-2, same RNG state: the very same dropout pattern
    torch.manual_seed(7)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out_pt = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
        grads_pt = torch.autograd.grad(out_pt, (q, k, v), dout)
    assert torch.equal(out, out_pt)
    for g, g_pt in zip(grads, grads_pt):  # FA2's backward accumulates dq with atomics
        torch.testing.assert_close(g, g_pt, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_direct_op_matches_flash_attention_2s_contract(active, layout):
    """seqlen_q != seqlen_k causal: bottom-right, like PyTorch's FA2 behind this op; same output metadata."""
    q, k, v = _qkv(s=512, sk=1024, layout=layout)
    ours = FWD(q, k, v, 0.0, True)
    assert provider.stats() == {"forward": 1}
    active.remove()
    theirs = FWD(q, k, v, 0.0, True)
    assert provider.stats() == {"forward": 1}
    ref = attention_math(q.double(), k.double(), v.double(), is_causal=True, bottom_right=True)
    same = attention_same_dtype(q, k, v, is_causal=True, bottom_right=True)
    assert_within_bar("ours", ours[0], same, ref)
    assert_within_bar("PyTorch FA2 (bottom-right semantics)", theirs[0], same, ref)
    for i in (0, 1, 6, 7, 8):
        a, b = ours[i], theirs[i]
        assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), i
    assert ours[0].stride() == theirs[0].stride() == torch.empty_like(q).stride()
    assert ours[1].stride() == theirs[1].stride()
    assert ours[2:6] == theirs[2:6]
    assert (ours[1] - theirs[1]).abs().max().item() < 2e-2


def test_multihead_attention_fast_path_reaches_our_kernel(active):
    mha = nn.MultiheadAttention(512, 8, batch_first=True, device="cuda", dtype=torch.bfloat16).eval()
    x = torch.randn(2, 1024, 512, device="cuda", dtype=torch.bfloat16)
    runs = _runs()
    with torch.no_grad():
        y, weights = mha(x, x, x, need_weights=False)
    assert weights is None
    assert _runs() == runs + 1 and provider.stats() == {"forward": 1}

    active.remove()
    with torch.no_grad():
        y_pt = mha(x, x, x, need_weights=False)[0]  # PyTorch's own fused kernel
        mha32 = copy.deepcopy(mha).float()
        with sdpa_kernel(SDPBackend.MATH):
            ref = mha32(x.float(), x.float(), x.float(), need_weights=False)[0]
    assert provider.stats() == {"forward": 1}
    assert max_err(y, ref) <= 2 * max_err(y_pt, ref) + 1e-3


def test_nothing_is_routed_after_remove(active):
    q, k, v = _qkv()
    F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert provider.stats() == {"forward": 1}
    active.remove()
    assert torch.nn.attention.current_flash_attention_impl() is None and not provider.is_active()
    runs = _runs()
    F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # PyTorch picks FLASH, and it is PyTorch's kernel again
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert _runs() == runs and provider.stats() == {"forward": 1}
    assert torch.isfinite(out).all()
