"""Fast launches of kernels with host TMA descriptors (fa_backend.kernels.triton._desc_launch) on CPU.

The C launcher and the descriptor encoder are fakes (no GPU): the arguments our path hands the launcher must be
exactly those Triton's own wrapper (driver.wrap_handle_tensordesc) hands it, and an encoding must be reused only
for the same address, shape, strides, tile and padding. The GPU tests compare whole launches bitwise with the JIT
path (tests/kernels/triton/test_fast_launch_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton

from fa_backend.kernels.triton import _desc_launch, _tma

nvidia_driver = pytest.importorskip("triton.backends.nvidia.driver")
if not triton.__version__.startswith("3.6."):
    pytest.skip("the descriptor fast path is laid out for Triton 3.6's launcher", allow_module_level=True)

META = {"swizzle": 128, "elem_size": 2, "elem_type": 10, "block_size": [1, 1, 64, 64], "fp4_padded": False}
META_B = dict(META, block_size=[1, 1, 64, 32])
# a kernel's signature as Triton's launcher sees it: X, n, a descriptor, a constexpr, another descriptor, m
SIGNATURE = {0: "*bf16", 1: "i32", 2: "tensordesc<bf16[1,1,64,64]>", 3: "constexpr", 4: "tensordesc<bf16[1,1,64,32]>",
             5: "i32"}


@pytest.fixture
def fake_encoder(monkeypatch):
    """Triton's active driver with an encoder that records its calls and returns their arguments."""
    calls = []

    def fill(*args):
        calls.append(args)
        return ("map", len(calls), args)

    monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace(utils=SimpleNamespace(
        fill_tma_descriptor=fill)))
    monkeypatch.setattr(_desc_launch, "_ENCODED", {})
    return calls


def _compiled(log):
    """A compiled kernel whose runner wraps a recording C launcher the way Triton 3.6's CudaLauncher does."""
    inner = nvidia_driver.wrap_handle_tensordesc(lambda *args: log.append(args), SIGNATURE, [META, META_B])
    runner = SimpleNamespace(launch=inner, num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                             profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False,
                             launch_pdl=False)
    return SimpleNamespace(run=runner, function="fn", packed_metadata="meta")


def _values(t, n=5, m=7):
    return [t, n, _tma.head_tiles(t, 64, 64), 64, _tma.head_tiles(t[:, :, :, :64], 64, 32), m]


def _same(a, b) -> bool:
    """Equal launcher arguments: tensors by identity, an encoding by the encoder's arguments (its first two
    entries number the calls)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, tuple) and a and a[0] == "map":
        return isinstance(b, tuple) and b and b[0] == "map" and _same(a[2], b[2])
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _reference(compiled, values):
    """What Triton's own wrapper passes to the C launcher for the same call."""
    log = []
    _compiled(log).run.launch(4, 1, 1, 9, "fn", False, False, None, None, "meta", None, None, None, *values)
    return log[0]


def test_arguments_are_those_of_tritons_wrapper(fake_encoder):
    log = []
    compiled = _compiled(log)
    launch = _desc_launch.plan(compiled)
    assert launch is not None
    t = torch.empty(2, 3, 100, 128, dtype=torch.bfloat16)
    values = _values(t)
    launch(compiled, 4, 1, 1, 9, values)
    ours, theirs = log[0], _reference(compiled, values)
    assert len(ours) == 13 + 1 + 1 + 9 + 1 + 9 + 1  # base, X, n, descriptor (map, shape, strides), constexpr, ...
    assert _same(ours, theirs)
    assert values[2].base is t  # the caller's list is not spliced in place


def test_encoding_reused_only_for_the_same_geometry(fake_encoder):
    log = []
    compiled = _compiled(log)
    launch = _desc_launch.plan(compiled)
    t = torch.empty(2, 3, 100, 128, dtype=torch.bfloat16)
    launch(compiled, 1, 1, 1, 0, _values(t))
    assert len(fake_encoder) == 2
    launch(compiled, 1, 1, 1, 0, _values(t, n=6, m=8))  # same tensors, other integers: encodings reused
    assert len(fake_encoder) == 2 and log[1][13 + 1] == 6 and log[1][-1] == 8
    assert log[1][13 + 2] is log[0][13 + 2]  # the same encoding object
    other = torch.empty(2, 3, 100, 128, dtype=torch.bfloat16)
    launch(compiled, 1, 1, 1, 0, _values(other))  # another address
    assert len(fake_encoder) == 4
    launch(compiled, 1, 1, 1, 0, _values(t[:, :, :96]))  # same address, another shape
    launch(compiled, 1, 1, 1, 0, _values(t.transpose(1, 2).contiguous().transpose(1, 2)))  # strides
    assert len(fake_encoder) == 8
    assert {c[0] for c in fake_encoder} == {t.data_ptr(), other.data_ptr(), fake_encoder[-1][0]}


def test_kernels_without_descriptors_keep_their_launcher():
    compiled = SimpleNamespace(run=SimpleNamespace(launch=lambda *a: None))
    assert _desc_launch.plan(compiled) is None
    inner = nvidia_driver.wrap_handle_tensordesc(lambda *a: None, {0: "*bf16", 1: "i32"}, None)
    assert _desc_launch.plan(SimpleNamespace(run=SimpleNamespace(launch=inner))) is None


def test_head_tiles_matches_tensor_descriptor():
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.empty(1, 3, 100, 128, dtype=torch.float16)
    for _ in range(2):  # the first sight of a tile shape, then the path without the constructor
        assert _tma.head_tiles(t, 64, 32) == TensorDescriptor(t, [1, 3, 100, 128], list(t.stride()), [1, 1, 64, 32])
    b = t[:, :1].expand(1, 3, 100, 128)  # a broadcast head: its stride 0 stands for any aligned stride
    with pytest.raises(ValueError, match="TMA cannot read"):
        _tma.head_tiles(b, 64, 32)
    with pytest.raises(ValueError, match="TMA cannot read"):
        _tma.head_tiles(torch.empty(2, 3, 100, 100, dtype=torch.float16)[..., 1:97], 64, 32)
    with pytest.raises(ValueError):
        _tma.head_tiles(t, 48, 32)  # not a power of two
