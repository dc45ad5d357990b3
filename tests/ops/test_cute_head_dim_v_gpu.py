"""Unequal head dims through the CuTe op on the H200: q and k at 192, v (and out) at 128 (MLA; flash_fwd_ws's and
flash_bwd_wide's HEAD_DIM_V_PAIRS). The CuTe forward and backward (with dropout: the Triton backward), outputs and
gradients against float64 with the 2x rule; with a key mask and with dropout; opcheck; SDPA routing. Needs the CuTe
DSL and a Hopper GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fa_backend
from fa_backend.kernels.cute import DSL_AVAILABLE, DSL_MISSING
from tests.reference import check_features

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.cute,
              pytest.mark.skipif(not DSL_AVAILABLE, reason=f"needs the CuTe DSL: {DSL_MISSING}"),
              pytest.mark.skipif(not HOPPER, reason="needs a Hopper (sm90) GPU")]

D, DV = 192, 128


def _qkv(b, hq, hkv, sq, sk, dtype=torch.bfloat16, grad=False):
    return [torch.randn(b, h, s, dim, device="cuda", dtype=dtype).requires_grad_(grad)
            for h, s, dim in ((hq, sq, D), (hkv, sk, D), (hkv, sk, DV))]


@pytest.fixture
def cute_backward_calls(monkeypatch):
    """Calls of the CuTe backward kernels."""
    from fa_backend.kernels.cute import flash_bwd as module

    calls = []
    real, launch = module.flash_bwd, module.BackwardLaunch.__call__
    monkeypatch.setattr(module, "flash_bwd", lambda *a, **kw: calls.append(a[1].shape) or real(*a, **kw))
    # a prepared launch (ops.cute_flash._BACKWARD_LAUNCHES)
    monkeypatch.setattr(module.BackwardLaunch, "__call__",
                        lambda self, *a, **kw: calls.append(a[1].shape) or launch(self, *a, **kw))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("causal,bottom_right", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("b,hq,hkv,sq,sk", [(2, 4, 4, 256, 256), (1, 8, 2, 100, 333), (2, 2, 1, 333, 100),
                                            (1, 4, 4, 1000, 1100)])
def test_forward_and_gradients_within_bar(dtype, causal, bottom_right, b, hq, hkv, sq, sk, cute_backward_calls):
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(b, hq, hkv, sq, sk, dtype)
    fa_backend.reset_stats()
    out = check_features(lambda q, k, v: cute_flash_attention(q, k, v, None, causal, bottom_right)[0], q, k, v,
                         is_causal=causal, bottom_right=bottom_right)
    assert out.shape == (b, hq, sq, DV)
    assert fa_backend.stats()["runs"] == {"cute": 1}
    assert len(cute_backward_calls) == 1  # flash_bwd_wide's


def test_key_mask_forward_and_gradients_within_bar(cute_backward_calls):
    """Key padding with one empty sequence: out 0 and zero gradients there; the CuTe backward's key-mask variant."""
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(3, 8, 2, 333, 400)
    lengths = torch.tensor([400, 123, 0], device="cuda")
    mask = (torch.arange(400, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    out = check_features(lambda q, k, v: cute_flash_attention(q, k, v, None, False, False, mask)[0], q, k, v,
                         attn_mask=mask)
    assert out[2].abs().max().item() == 0.0
    assert len(cute_backward_calls) == 1


def test_deterministic_mode_runs_the_ordered_cute_backward(cute_backward_calls, deterministic_algorithms):
    """Under torch.use_deterministic_algorithms: flash_bwd_wide's deterministic variant, the same bits on every run."""
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(2, 8, 2, 1024, 1024, grad=True)
    dout = torch.randn(2, 8, 1024, DV, device="cuda", dtype=torch.bfloat16)
    runs = [torch.autograd.grad(cute_flash_attention(q, k, v, None, True)[0], (q, k, v), dout) for _ in range(3)]
    assert len(cute_backward_calls) == 3
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_and_gradients_within_bar(causal):
    """The CuTe forward's dropout variant at 192 / 128, then the Triton backward with the same mask; against the
    float64 reference that applies the Triton kernels' keep mask for the RNG state."""
    from fa_backend.kernels.triton import dropout_keep_mask
    from fa_backend.ops import cute_flash_attention, new_rng_state

    p, (b, hq, hkv, sq, sk) = 0.2, (2, 8, 2, 512, 640)
    q, k, v = _qkv(b, hq, hkv, sq, sk)
    rng = new_rng_state()
    keep = dropout_keep_mask(b, hq, sq, sk, p, tuple(rng.tolist()), "cuda")
    fa_backend.reset_stats()
    check_features(lambda q, k, v: cute_flash_attention(q, k, v, None, causal, True, dropout_p=p, rng_state=rng)[0],
                   q, k, v, is_causal=causal, bottom_right=True, dropout_keep=keep, dropout_p=p)
    assert fa_backend.stats()["runs"] == {"cute": 1}


def test_opcheck():
    from fa_backend.ops import cute_flash_bwd, cute_flash_fwd

    q, k, v = _qkv(1, 4, 2, 200, 300, grad=True)
    torch.library.opcheck(cute_flash_fwd, (q, k, v, None, True, True))
    mask = torch.rand(1, 1, 1, 300, device="cuda") > 0.3
    torch.library.opcheck(cute_flash_fwd, (q, k, v, None, False, False, mask))
    q, k, v = (t.detach() for t in (q, k, v))  # the backward op has no autograd formula of its own
    out, lse, _ = cute_flash_fwd(q, k, v, None, True, True)
    torch.library.opcheck(cute_flash_bwd, (torch.randn_like(out), q, k, v, out, lse, None, None, True, True))


@pytest.mark.parametrize("grad", [True, False])
def test_routed_call_runs_cute(clean, grad):
    """SDPA with MLA head dims and no causal mask goes to the CuTe kernels when routing is on (PyTorch's flash backend
    refuses unequal head dims), with or without gradients, under eager and torch.compile."""
    from fa_backend.ops import cute_flash_attention

    q, k, v = _qkv(2, 16, 16, 1024, 1024, grad=grad)
    direct = cute_flash_attention(q, k, v)[0]
    fa_backend.reset_stats()
    with fa_backend.enabled():
        routed = F.scaled_dot_product_attention(q, k, v)
        compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), fullgraph=True)(q, k, v)
        if grad:
            (routed.sum() + compiled.sum()).backward()
    assert fa_backend.stats()["runs"].get("cute", 0) >= 1 and set(fa_backend.stats()["runs"]) == {"cute"}
    assert torch.equal(routed, direct) and torch.equal(compiled, direct)
    assert not grad or not q.grad.isnan().any()


def test_routed_causal_training_call_goes_to_cudnn(clean):
    """A causal MLA call with gradients: cuDNN's training step is measured faster (preference rule), so PyTorch runs
    it."""
    q, k, v = _qkv(2, 16, 16, 2048, 2048, grad=True)
    fa_backend.reset_stats()
    with fa_backend.enabled():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert fa_backend.stats()["runs"] == {"torch": 1}
    out.sum().backward()
    assert not q.grad.isnan().any()
