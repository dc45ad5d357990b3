"""The CuTe forward's prepared launches per call signature (ops/cute_flash._LAUNCHES), on the CPU: the input check,
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
