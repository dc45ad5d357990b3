"""The CuTe op's autograd wiring on meta tensors (CPU: its fake implementations run, no GPU or DSL needed)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fa_backend.ops import cute_flash


class _Ops(TorchDispatchMode):
    """Records each aten / custom op call with its outputs' dtypes and shapes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.calls.append((str(func), [(o.dtype, tuple(o.shape)) for o in outs if isinstance(o, torch.Tensor)]))
        return out


def _forward(keep_bits: bool):
    q, k, v = (torch.randn(1, 2, 256, 128, device="meta", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    rng = torch.tensor([2**33, 0], dtype=torch.int64)
    return (q, k, v), cute_flash.cute_flash_fwd(q, k, v, None, True, False, None, 0.1, rng, keep_bits)


@pytest.mark.parametrize("keep_bits", [False, True])
def test_the_backward_materialises_no_gradient_for_unused_outputs(keep_bits):
    """Differentiating out alone: the backward gets no zero-filled gradient for the keep bits (uint8, one bit per
    score: 67 MB of zeros per 2k training call before) nor for lse, and runs one cute_flash_bwd."""
    inputs, (out, lse, bits) = _forward(keep_bits)
    assert out.requires_grad and lse.requires_grad and not bits.requires_grad
    assert bits.numel() == (cute_flash._keep_bits_out(*inputs[:3], True, True).numel() if keep_bits else 0)
    dout = torch.randn_like(out)
    ops = _Ops()
    with ops:
        grads = torch.autograd.grad(out, inputs, dout)
    fills = [c for c in ops.calls if c[0].split(".")[1] in ("zeros", "zeros_like", "new_zeros", "fill_", "zero_")]
    assert not fills, fills
    assert [c[0] for c in ops.calls].count("fa_backend.cute_flash_bwd.default") == 1
    assert [g.shape for g in grads] == [t.shape for t in inputs]


def test_differentiating_lse_alone_still_runs_the_backward():
    """lse alone: out's gradient is zeros (the backward needs dO), lse's is the caller's."""
    inputs, (out, lse, bits) = _forward(True)
    ops = _Ops()
    with ops:
        grads = torch.autograd.grad(lse, inputs, torch.randn_like(lse))
    assert ("aten.zeros_like.default", [(out.dtype, tuple(out.shape))]) in ops.calls
    assert [c[0] for c in ops.calls].count("fa_backend.cute_flash_bwd.default") == 1
    assert [g.shape for g in grads] == [t.shape for t in inputs]


def test_the_eager_twin_checks_its_inputs_in_grad_mode(monkeypatch):
    """cute_flash_attention's eager twin (plain tensors, eager mode) checks a call that requires grad before its
    autograd.Function runs, where grad mode is still on (inside, the call would not require grad: reasons such as
    `grad` would be lost), and checks once."""
    seen = []

    class Stop(Exception):
        pass

    def check(q, k, v, *args):
        seen.append(torch.is_grad_enabled() and q.requires_grad)
        raise Stop

    monkeypatch.setattr(cute_flash, "check_cute_inputs", check)
    q, k, v = (torch.randn(1, 2, 256, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with pytest.raises(Stop):
        cute_flash.cute_flash_attention(q, k, v, None, True)
    assert seen == [True]
