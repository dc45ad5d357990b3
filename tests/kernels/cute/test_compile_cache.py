"""The compile cache: a variant compiles once, a failing variant is reported once and never retried."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch

from fa_backend.kernels.cute import _compile_cache, _target
from fa_backend.kernels.cute._compile_cache import CompileCache, CompileFailedError, CompileKey

KEY = CompileKey(kernel="flash_fwd", dtype=torch.bfloat16, head_dim=128, head_dim_v=128, causal=True,
                 alignment="bottom_right", gqa_ratio=4, tile=(128, 128), arch="sm_90a")


class Builder:
    def __init__(self, error=None):
        self.calls, self.error = 0, error

    def __call__(self):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return object()


def test_compiles_each_variant_once():
    cache, build = CompileCache(), Builder()
    first = cache.get_or_compile(KEY, build)
    assert cache.get_or_compile(KEY, build) is first
    assert build.calls == 1 and len(cache) == 1


@pytest.mark.parametrize("field,value", [("dtype", torch.float16), ("head_dim", 64), ("head_dim_v", 64),
                                         ("causal", False), ("alignment", "top_left"), ("gqa_ratio", 1),
                                         ("tile", (128, 64)), ("arch", "sm_100a"), ("kernel", "flash_bwd")])
def test_every_key_field_selects_a_variant(field, value):
    cache, build = CompileCache(), Builder()
    a = cache.get_or_compile(KEY, build)
    b = cache.get_or_compile(dataclasses.replace(KEY, **{field: value}), build)
    assert a is not b and build.calls == 2


def test_failure_is_recorded_reported_once_and_not_retried(caplog):
    cache, build = CompileCache(), Builder(ValueError("expects arch to be sm_90a, but got sm_100a\nmore detail"))
    with caplog.at_level(logging.WARNING, logger="fa_backend.cute"):
        with pytest.raises(CompileFailedError) as first:
            cache.get_or_compile(KEY, build)
        with pytest.raises(CompileFailedError) as second:
            cache.get_or_compile(KEY, build)
    assert build.calls == 1
    assert first.value.message == second.value.message == "ValueError: expects arch to be sm_90a, but got sm_100a"
    assert cache.failure(KEY) == first.value.message
    assert isinstance(first.value.__cause__, ValueError) and second.value.__cause__ is None
    warnings = [r for r in caplog.records if r.name == "fa_backend.cute"]
    assert len(warnings) == 1 and "not retried" in warnings[0].getMessage()
    # another variant still compiles
    other = dataclasses.replace(KEY, head_dim=64, head_dim_v=64)
    assert cache.get_or_compile(other, Builder()) is not None and cache.failure(other) is None


def test_clear_forgets_failures():
    cache, build = CompileCache(), Builder(RuntimeError("boom"))
    with pytest.raises(CompileFailedError):
        cache.get_or_compile(KEY, build)
    cache.clear()
    with pytest.raises(CompileFailedError):
        cache.get_or_compile(KEY, build)
    assert build.calls == 2


@pytest.mark.parametrize("capability,arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((8, 0), "sm_80")])
def test_arch_for(monkeypatch, capability, arch):
    monkeypatch.delenv(_target.ARCH_ENV, raising=False)
    assert _target.arch_for(capability) == arch
    monkeypatch.setenv(_target.ARCH_ENV, "sm_90a")
    assert _target.arch_for(capability) == "sm_90a"


def test_compile_options():
    assert _target.compile_options("sm_90a") == "--gpu-arch sm_90a"
    assert _target.compile_options("sm_90a", "/tmp/x") == "--gpu-arch sm_90a --keep-ptx --keep-cubin --dump-dir /tmp/x"


def test_dsl_disk_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delenv(_compile_cache.DSL_CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv(_compile_cache.CACHE_DIR_ENV, str(tmp_path / "ours"))
    assert _compile_cache.enable_dsl_disk_cache() == str(tmp_path / "ours")
    assert os.environ[_compile_cache.DSL_CACHE_DIR_ENV] == str(tmp_path / "ours") and (tmp_path / "ours").is_dir()
    monkeypatch.setenv(_compile_cache.DSL_CACHE_DIR_ENV, str(tmp_path / "users"))  # the user's choice wins
    assert _compile_cache.enable_dsl_disk_cache() == str(tmp_path / "users")
    monkeypatch.delenv(_compile_cache.DSL_CACHE_DIR_ENV)
    monkeypatch.delenv(_compile_cache.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = _compile_cache.enable_dsl_disk_cache()
    assert path.startswith(str(tmp_path / "xdg" / "fa_backend" / "cute-dsl-"))
