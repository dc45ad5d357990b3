"""The CuTe prepared launches per call signature (ops/cute_flash._LAUNCHES, _BACKWARD_LAUNCHES), on the CPU: the input check,
the kernel and its preparation stubbed, so what is tested is which calls take a prepared launch and which check or
prepare again."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")  # flash_fwd_ws (whose prepare_fastest is stubbed) imports the DSL

from fa_backend.dispatch import counters  # noqa: E402
from fa_backend.kernels.cute import flash_fwd_ws  # noqa: E402
from fa_backend.ops import cute_flash  # noqa: E402


class _Stubs:
    def __init__(self):
        self.checks = 0
        self.prepared = []  # (shape, stride) of q per preparation
        self.launched = 0
        self.general = 0  # calls of the kernel's general path (flash_fwd_fastest)

    def check(self, q, k, v, *args, **kwargs):
        self.checks += 1

    def prepare(self, q, k, v, scale, causal, bottom_right):
        self.prepared.append((tuple(q.shape), q.stride(), causal, bottom_right))
        stubs = self

        def launch(q, k, v):
            stubs.launched += 1
            return (torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype),
                    torch.zeros(q.shape[:3], dtype=torch.float32))

        return launch

    def general_path(self, q, k, v, scale, causal, bottom_right=False, key_words=None, dropout=None):
        self.general += 1
        return torch.ones(*q.shape[:3], v.shape[-1], dtype=q.dtype), torch.ones(q.shape[:3], dtype=torch.float32)


@pytest.fixture
def stubs(monkeypatch):
    s = _Stubs()
    monkeypatch.setattr(cute_flash, "check_cute_inputs", s.check)
    monkeypatch.setattr(cute_flash, "_LAUNCHES", {})
    monkeypatch.setattr(flash_fwd_ws, "prepare_fastest", s.prepare)
    monkeypatch.setattr(flash_fwd_ws, "flash_fwd_fastest", s.general_path)
    return s


def _qkv(requires_grad=False, s=64, d=128):
    return [torch.randn(2, 4, s, d, dtype=torch.bfloat16, requires_grad=requires_grad) for _ in range(3)]


def test_a_signature_is_checked_and_prepared_once(stubs):
    runs = counters.stats()["runs"].get("cute", 0)
    for _ in range(3):
        q, k, v = _qkv()  # fresh tensors, same shapes and strides
        out, lse = cute_flash.cute_flash_attention(q, k, v, None, True)
    assert (stubs.checks, len(stubs.prepared), stubs.launched, stubs.general) == (1, 1, 3, 0)
    assert out.shape == (2, 4, 64, 128) and lse.dtype == torch.float32
    assert counters.stats()["runs"]["cute"] == runs + 3  # each prepared launch still counts as a cute run


def test_what_the_signature_holds(stubs):
    q, k, v = _qkv()
    cute_flash.cute_flash_attention(q, k, v, None, True)
    cute_flash.cute_flash_attention(q, k, v, None, False)  # causal mode
    cute_flash.cute_flash_attention(q, k, v, 0.5, False)  # scale
    cute_flash.cute_flash_attention(q, k, v, None, True, True)  # bottom-right alignment
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
    cute_flash.cute_flash_attention(qt, k, v, None, True)
    cute_flash.cute_flash_attention(*_qkv(s=128), None, True)  # seqlen
    assert stubs.checks == len(stubs.prepared) == 6
    assert [p[2:] for p in stubs.prepared[:4]] == [(True, False), (False, False), (False, False), (True, True)]
    cute_flash.cute_flash_attention(qt, k, v, None, True)
    assert stubs.checks == len(stubs.prepared) == 6 and stubs.launched == 7


def test_misaligned_data_masks_and_dropout_take_the_general_path(stubs):
    q, k, v = _qkv()
    base = torch.randn(q.numel() + 1, dtype=q.dtype)
    q_odd = base[1:].view(q.shape)  # 2-byte storage offset: the op copies it for TMA
    for _ in range(2):
        cute_flash.cute_flash_attention(q_odd, k, v, None, True)
    mask = torch.ones(2, 1, 1, 64, dtype=torch.bool)
    cute_flash.cute_flash_attention(q, k, v, None, True, attn_mask=mask)
    cute_flash.cute_flash_attention(q, k, v, None, True, dropout_p=0.25)
    cute_flash.cute_flash_attention(q, k, v, -1.0, True)  # a negative scale: the op negates q first
    assert stubs.prepared == [] and stubs.launched == 0
    assert stubs.checks == stubs.general == 5


def test_a_failing_check_is_not_remembered(stubs, monkeypatch):
    class Refused(Exception):
        pass

    def refuse(*args, **kwargs):
        stubs.checks += 1
        raise Refused

    monkeypatch.setattr(cute_flash, "check_cute_inputs", refuse)
    q, k, v = _qkv()
    for _ in range(2):
        with pytest.raises(Refused):
            cute_flash.cute_flash_attention(q, k, v, None, True)
    assert stubs.checks == 2 and stubs.prepared == []


def test_kernels_turned_off_are_asked_again(stubs, monkeypatch):
    from fa_backend.dispatch.backends import cute as cute_backend

    q, k, v = _qkv()
    cute_flash.cute_flash_attention(q, k, v, None, True)
    monkeypatch.setattr(cute_backend, "KERNELS_ENABLED", False)
    cute_flash.cute_flash_attention(q, k, v, None, True)  # the real check would refuse it (not_installed)
    assert stubs.checks == 2 and len(stubs.prepared) == 1 and stubs.general == 1


def test_the_eager_twin_checks_once_in_grad_mode_then_never(stubs):
    """With gradients: the twin's check (in grad mode, before its autograd.Function) runs for the first call only;
    the forward inside prepares without checking again; the next calls take the launch and still differentiate."""
    for _ in range(3):
        q, k, v = _qkv(requires_grad=True)
        out, _ = cute_flash.cute_flash_attention(q, k, v, None, True)
        assert out.requires_grad
    assert (stubs.checks, len(stubs.prepared), stubs.launched) == (1, 1, 3)


def test_the_op_returns_fresh_outputs_and_eager_calls_may_share_the_empty_bits(stubs):
    q, k, v = _qkv()
    op_bits = [cute_flash.cute_flash_fwd(q, k, v, None, True)[2] for _ in range(2)]
    assert op_bits[0].numel() == 0 and op_bits[0] is not op_bits[1]  # custom-op outputs must not alias
    eager_bits = [cute_flash._cute_forward(q, k, v, None, True, False, None, 0.0, None, False, fresh_bits=False)[2]
                  for _ in range(2)]
    assert eager_bits[0] is eager_bits[1] and eager_bits[0].numel() == 0
    assert stubs.checks == 1 and len(stubs.prepared) == 1


@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (4, 1, 9), (1, 1, 1, 128), (3, 0, 2)])
def test_prepared_launches_marshal_contiguous_strides(shape):
    """flash_fwd.prepare_forward marshals out's and lse's strides without allocating them: those of a contiguous
    tensor of the shape (size-1 and empty dims included)."""
    from fa_backend.kernels.cute.flash_fwd import _Contiguous

    assert _Contiguous(shape).stride() == torch.empty(shape).stride()


# The backward's prepared launches (ops/cute_flash._BACKWARD_LAUNCHES, kernels/cute/flash_bwd.BackwardLaunch).

class _BackwardStubs:
    def __init__(self):
        self.prepared = []  # (q's shape, dout's strides, scale, causal, bottom_right, variant) per preparation
        self.launched = 0
        self.general = 0  # calls of the general path (flash_bwd)
        self.decline = False  # prepare_backward's answer None: the signature takes the general path

    def prepare(self, dout, q, k, v, out, lse, scale, causal, bottom_right, **variant):
        self.prepared.append((tuple(q.shape), dout.stride(), scale, causal, bottom_right, variant))
        if self.decline:
            return None
        stubs = self

        def launch(dout, q, k, v, out, lse, dlse=None):
            stubs.launched += 1
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

        return launch

    def general_path(self, dout, q, k, v, out, lse, scale=None, causal=False, bottom_right=False, **kwargs):
        self.general += 1
        return torch.ones_like(q), torch.ones_like(k), torch.ones_like(v)


@pytest.fixture
def bwd(monkeypatch):
    from fa_backend.kernels.cute import flash_bwd

    s = _BackwardStubs()
    monkeypatch.setattr(cute_flash, "_BACKWARD_LAUNCHES", {})
    monkeypatch.setattr(flash_bwd, "prepare_backward", s.prepare)
    monkeypatch.setattr(flash_bwd, "flash_bwd", s.general_path)
    return s


def _backward_inputs(s=64, d=128, dout_layout="bhsd"):
    q, k, v = _qkv(s=s, d=d)
    out = torch.randn_like(q)
    lse = torch.randn(q.shape[:3])
    dout = torch.randn_like(q) if dout_layout == "bhsd" else torch.randn(2, s, 4, d, dtype=q.dtype).transpose(1, 2)
    return q, k, v, out, lse, dout


def _backward(q, k, v, out, lse, dout, dlse=None, scale=None, causal=True, bottom_right=False, **kwargs):
    return cute_flash._cute_backward(q, k, v, out, lse, dout, dlse, scale, causal, bottom_right, **kwargs)


def test_a_backward_signature_is_prepared_once(bwd):
    for _ in range(3):
        dq, dk, dv = _backward(*_backward_inputs())  # fresh tensors, same shapes and strides
    assert (len(bwd.prepared), bwd.launched, bwd.general) == (1, 3, 0)
    assert float(dq.abs().sum()) == 0  # the launch's gradients, not the general path's
    assert bwd.prepared[0][3:] == (True, False, cute_flash.BACKWARD_VARIANTS[128])


def test_what_the_backward_signature_holds(bwd, monkeypatch):
    inputs = _backward_inputs()
    _backward(*inputs)
    _backward(*inputs, causal=False)
    _backward(*inputs, scale=0.5)
    _backward(*inputs, bottom_right=True)
    _backward(*inputs[:5], inputs[5].transpose(1, 2).contiguous().transpose(1, 2))  # dout's strides
    _backward(*inputs, dlse=torch.randn(inputs[4].shape))  # an LSE gradient
    _backward(*_backward_inputs(s=128))  # seqlen
    _backward(*_backward_inputs(d=64))  # head dim: its own variant
    _backward(*inputs, scale=0.5)  # seen before
    assert len(bwd.prepared) == 8 and bwd.launched == 9 and bwd.general == 0
    monkeypatch.setitem(cute_flash.BACKWARD_VARIANTS, 128, dict(wgs=2, warp_specialized=True, tile_m=80))
    _backward(*inputs)  # the head dim's variant changed
    assert len(bwd.prepared) == 9 and bwd.launched == 10
    assert bwd.prepared[7][5] == cute_flash.BACKWARD_VARIANTS[64] and bwd.prepared[8][5]["tile_m"] == 80


def test_masks_dropout_misaligned_dout_and_deterministic_mode_take_the_general_path(bwd, monkeypatch):
    q, k, v, out, lse, dout = _backward_inputs()
    base = torch.randn(dout.numel() + 1, dtype=dout.dtype)
    _backward(q, k, v, out, lse, base[1:].view(dout.shape))  # dout 2 bytes off: flash_bwd copies it
    _backward(q, k, v, out, lse, dout, attn_mask=torch.ones(2, 1, 1, 64, dtype=torch.bool))
    _backward(q, k, v, out, lse, dout, scale=-0.5)  # the op negates q first
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    _backward(q, k, v, out, lse, dout)  # the ordered variant
    assert bwd.prepared == [] and bwd.launched == 0 and bwd.general == 4


def test_a_declined_backward_signature_is_remembered(bwd):
    bwd.decline = True
    for _ in range(2):
        _backward(*_backward_inputs())
    assert len(bwd.prepared) == 1 and bwd.general == 2
    q, k, v, out, lse, dout = _backward_inputs(s=128)
    q = torch.randn(2, 4, 128, 132, dtype=q.dtype)[..., :128]  # rows 264 bytes apart: TMA cannot read them
    for _ in range(2):
        _backward(q, k, v, out, lse, dout)
    assert len(bwd.prepared) == 1 and bwd.general == 4  # declined by the op itself, without asking prepare


def test_a_failing_backward_check_is_not_remembered(bwd, monkeypatch):
    from fa_backend.kernels.cute import flash_bwd

    def refuse(*args, **kwargs):
        bwd.prepared.append(None)
        raise ValueError("refused")

    monkeypatch.setattr(flash_bwd, "prepare_backward", refuse)
    for _ in range(2):
        with pytest.raises(ValueError, match="refused"):
            _backward(*_backward_inputs())
    assert len(bwd.prepared) == 2 and cute_flash._BACKWARD_LAUNCHES == {}


def test_a_training_call_takes_both_prepared_launches(stubs, bwd):
    """The eager twin with gradients: the forward's and the backward's prepared launches, once prepared each."""
    for _ in range(3):
        q, k, v = _qkv(requires_grad=True)
        out, _ = cute_flash.cute_flash_attention(q, k, v, None, True)
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        assert all(float(g.abs().sum()) == 0 for g in grads)
    assert (len(stubs.prepared), stubs.launched, len(bwd.prepared), bwd.launched) == (1, 3, 1, 3)


@pytest.mark.parametrize("d,dv,variant", [(128, 128, dict(wgs=2, warp_specialized=True)),
                                          (64, 64, dict(wgs=2, warp_specialized=True, tile_m=128)),
                                          (96, 96, {}), (192, 128, dict(wgs=2, warp_specialized=True))])
def test_prepared_backward_marshals_what_flash_bwd_passes(monkeypatch, d, dv, variant):
    """flash_bwd.prepare_backward (its compile stubbed) marshals the integers flash_bwd's general path passes for the
    tensors it allocates (delta, dK, dV, dQ's chunks), with strided q and dO and GQA."""
    from fa_backend.kernels.cute import _fast_call, flash_bwd

    compiled = []
    monkeypatch.setattr(flash_bwd, "compile_flash_bwd", lambda *a, **kw: compiled.append((a, kw)) or object())
    b, hq, hkv, sq, sk = 2, 8, 2, 100, 333
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, hkv, sk, d, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, sk, dv, dtype=torch.bfloat16)
    out, dout = torch.randn(b, hq, sq, dv, dtype=q.dtype), torch.randn(b, sq, hq, dv, dtype=q.dtype).transpose(1, 2)
    lse = torch.randn(b, hq, sq)
    launch = flash_bwd.prepare_backward(dout, q, k, v, out, lse, 0.3, True, True, **variant)
    tile_m = variant.get("tile_m", flash_bwd.TILE_M)
    delta = torch.empty(b, hq, sq)
    dk, dv_ = torch.empty_like(k), torch.empty_like(v)
    dqacc = torch.zeros(b, hq, -(-sq // tile_m), tile_m * d)  # flash_bwd's chunks
    assert launch._ints == _fast_call.backward_scalars(q, k, v, dout, lse, delta, dk, dv_, dqacc)
    assert launch._floats == (0.3 * flash_bwd._LOG2E, 0.3) and launch._acc_shape == tuple(dqacc.shape)
    (args, kwargs), = compiled
    assert args[:4] == (torch.bfloat16, d, True, True) and kwargs["pointer_args"]
    assert kwargs["head_dim_v"] == (None if dv == d else dv)
    assert {k: kwargs[k] for k in variant} == variant


def test_prepare_backward_declines_what_flash_bwd_copies(monkeypatch):
    from fa_backend.kernels.cute import flash_bwd

    monkeypatch.setattr(flash_bwd, "compile_flash_bwd", lambda *a, **kw: object())
    q, k, v = _qkv()
    out, lse = torch.randn_like(q), torch.randn(q.shape[:3])
    base = torch.randn(q.numel() + 1, dtype=q.dtype)
    assert flash_bwd.prepare_backward(base[1:].view(q.shape), q, k, v, out, lse) is None  # dO 2 bytes off
    assert flash_bwd.prepare_backward(torch.randn_like(q), q, k, v, out, lse.transpose(1, 2).contiguous()
                                      .transpose(1, 2)) is None  # a strided LSE
    assert flash_bwd.prepare_backward(torch.randn_like(q), q, k, v, out, lse) is not None
    with pytest.raises(ValueError, match="dout"):
        flash_bwd.prepare_backward(torch.randn_like(q).float(), q, k, v, out, lse)
