"""The opt-in fast launch path (fa_backend.kernels.triton._launch.launch, FA_BACKEND_FAST_LAUNCH=1) on CPU.

Its cache key must separate every pair of arguments that Triton's JIT would compile differently: checked
against Triton's own specialisation function. The launcher is a fake here (no GPU); the GPU tests compare
the real path bitwise with the JIT path (tests/kernels/triton/test_kvcache_gpu.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fa_backend.kernels.triton import _launch


def _triton_spec(value, specialize=True):
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = type(make_backend(GPUTarget("cuda", 90, 32)))
    return native_specialize_impl(backend, value, False, specialize, True)


def _descriptors() -> list:
    """Host TMA descriptors (_tma.head_tiles) that differ in dtype, block shape, padding or only in shape / strides."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.empty(2, 3, 64, 96, dtype=torch.float16)
    return [TensorDescriptor(t, [2, 3, 64, 96], list(t.stride()), [1, 1, 64, 32]),
            TensorDescriptor(t, [2, 3, 40, 96], list(t.stride()), [1, 1, 64, 32]),
            TensorDescriptor(t, [2, 3, 64, 96], list(t.stride()), [1, 1, 32, 32]),
            TensorDescriptor(t, [2, 3, 64, 96], list(t.stride()), [1, 1, 64, 32], "nan"),
            TensorDescriptor(t.bfloat16(), [2, 3, 64, 96], list(t.stride()), [1, 1, 64, 32]),
            TensorDescriptor(t.float(), [2 * 3 * 64, 96], [96, 1], [1, 64])]


def test_spec_key_never_looser_than_triton():
    base = torch.empty(64, dtype=torch.float16)
    values = (list(range(-40, 40)) + [2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1, 2**40,
                                      2**63, 2**64 - 16, 0.5, 1.0, None, True, False]
              + [base, base[1:], base[8:], base.float(), base.to(torch.int32)[4:], torch.empty(0)]
              + _descriptors())
    by_key: dict = {}
    for v in values:
        (k,) = _launch.spec_key([v])
        for specialize in (True, False):
            spec = _triton_spec(v, specialize)
            assert by_key.setdefault((k, specialize), spec) == spec, (v, k, spec, by_key[(k, specialize)])


class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, gx, gy, gz, stream, function, packed, launch_metadata, enter, exit_, *args):
        self.log.append(("fast", (gx, gy, gz), stream, args))


def _param(name, is_constexpr, default=None, has_default=False):
    return SimpleNamespace(name=name, is_constexpr=is_constexpr, default=default, has_default=has_default)


class _FakeKernel:
    """params like a JITFunction (runtime X, n, then constexpr BLOCK; with `extra`, a runtime Y=None and a
    constexpr FLAG=False with defaults, as the varlen / feature arguments); kernel[grid](...) 'compiles'."""

    def __init__(self, extra: bool = False):
        self.params = [_param("X", False), _param("n", False), _param("BLOCK", True)]
        if extra:
            self.params += [_param("Y", False, None, True), _param("FLAG", True, False, True)]
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _FakeCompiled(self.log)
        return run


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(_launch, "FAST_LAUNCH", True)
    monkeypatch.setattr(_launch, "_INTERPRET", False)
    monkeypatch.setattr(_launch, "_current_device_and_stream", lambda: (0, 7))
    monkeypatch.setattr(_launch, "_FAST", {})


def test_fast_launch_reuses_then_respecialises(fast):
    kern = _FakeKernel()
    x = torch.empty(64)
    _launch.launch(kern, (3,), (x, 5), {"BLOCK": 16, "num_warps": 4})
    _launch.launch(kern, (4,), (x, 21), {"BLOCK": 16, "num_warps": 4})  # same classes: the cached kernel
    assert [e[0] for e in kern.log] == ["jit", "fast"]
    assert kern.log[1] == ("fast", (4, 1, 1), 7, (x, 21, 16))
    for args, kw in (((x, 32), {"BLOCK": 16, "num_warps": 4}),  # n divisible by 16
                     ((x, 1), {"BLOCK": 16, "num_warps": 4}),  # n == 1
                     ((x[1:], 5), {"BLOCK": 16, "num_warps": 4}),  # misaligned pointer
                     ((x.half(), 5), {"BLOCK": 16, "num_warps": 4}),  # dtype
                     ((x, 5), {"BLOCK": 32, "num_warps": 4}),  # constexpr
                     ((x, 5), {"BLOCK": 16, "num_warps": 8})):  # option
        kern.log.clear()
        _launch.launch(kern, (1,), args, kw)
        assert [e[0] for e in kern.log] == ["jit"], (args, kw)


def test_fast_launch_binds_keywords_and_defaults_in_signature_order(fast):
    kern = _FakeKernel(extra=True)
    x, y = torch.empty(64), torch.empty(32)
    _launch.launch(kern, (2,), (x, 5), {"BLOCK": 16, "num_warps": 4})
    _launch.launch(kern, (2,), (x, 5), {"BLOCK": 16, "num_warps": 4})
    assert kern.log[-1] == ("fast", (2, 1, 1), 7, (x, 5, 16, None, False))  # defaults filled in
    # a runtime argument given by keyword is specialised like a positional one; a constexpr by value
    for kw in ({"BLOCK": 16, "Y": y, "num_warps": 4}, {"BLOCK": 16, "FLAG": True, "num_warps": 4},
               {"BLOCK": 16, "Y": y[1:], "num_warps": 4}):
        kern.log.clear()
        _launch.launch(kern, (2,), (x, 5), kw)
        _launch.launch(kern, (2,), (x, 7), kw)
        assert [e[0] for e in kern.log] == ["jit", "fast"], kw
        assert kern.log[1][3] == (x, 7, 16, kw.get("Y"), kw.get("FLAG", False))


def test_fast_launch_refuses_positional_constexpr(fast):
    kern = _FakeKernel()
    x = torch.empty(64)
    for _ in range(2):
        _launch.launch(kern, (1,), (x, 5, 16), {})
    assert [e[0] for e in kern.log] == ["jit", "jit"]


def test_fast_launch_keeps_jit_path_with_launch_hooks(fast, monkeypatch):
    from triton import knobs

    kern = _FakeKernel()
    x = torch.empty(64)
    _launch.launch(kern, (1,), (x, 5), {"BLOCK": 16})
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    _launch.launch(kern, (1,), (x, 5), {"BLOCK": 16})
    assert [e[0] for e in kern.log] == ["jit", "jit"]


def test_fast_launch_off_is_the_jit_call(monkeypatch):
    monkeypatch.setattr(_launch, "FAST_LAUNCH", False)
    kern = _FakeKernel()
    x = torch.empty(64)
    for _ in range(2):
        _launch.launch(kern, (1,), (x, 5), {"BLOCK": 16})
    assert [e[0] for e in kern.log] == ["jit", "jit"]


def test_fast_launch_leaves_other_argument_types_to_the_jit(fast):
    np = pytest.importorskip("numpy")
    kern = _FakeKernel()
    x = torch.empty(64)
    assert _launch.spec_key([x, np.int64(5)]) is None
    for _ in range(2):
        _launch.launch(kern, (1,), (x, np.int64(5)), {"BLOCK": 16})
    assert [e[0] for e in kern.log] == ["jit", "jit"] and not _launch._FAST


@pytest.mark.parametrize("version,options", [("3.6.0", {}), ("3.8.0", {}), ("3.9.0", {"enable_fp_fusion": True}),
                                             ("3.10.0+git1234", {"enable_fp_fusion": True}), ("unknown", {})])
def test_compile_options_ask_for_fma_contraction_from_triton_3_9(version, options):
    """Triton 3.9 warns that FMA contraction turns off by default in 3.10: from 3.9 every launch asks for it."""
    assert _launch._compile_options(version) == options


def test_launch_passes_the_compile_options(monkeypatch):
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(kwargs)

    monkeypatch.setattr(_launch, "COMPILE_OPTIONS", {"enable_fp_fusion": True})
    monkeypatch.setattr(_launch, "FAST_LAUNCH", False)
    kwargs = {"BLOCK": 16}
    _launch.launch(Kernel(), (1,), (), kwargs)
    assert seen == [{"BLOCK": 16, "enable_fp_fusion": True}] and kwargs == {"BLOCK": 16}
