"""The DSL availability probe: what it reports for a missing, old, broken or good install."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from fa_backend.kernels import cute
from fa_backend.kernels.cute import _availability


def _fake_version(version):
    def version_of(name):
        assert name == "nvidia-cutlass-dsl"
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version
    return version_of


def test_missing(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _fake_version(None))
    assert _availability.probe() == (None, "nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')")


@pytest.mark.parametrize("version", ["4.2.0", "3.9.9", "dev"])
def test_too_old(monkeypatch, version):
    monkeypatch.setattr(importlib.metadata, "version", _fake_version(version))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    found, missing = _availability.probe()
    assert found == version
    assert missing == f"nvidia-cutlass-dsl {version} is older than 4.8 (pip install -e '.[cute]')"


@pytest.mark.parametrize("version", ["4.8.1", "4.8.0rc1", "4.10.0", "5.0"])
def test_new_enough(monkeypatch, version):
    monkeypatch.setattr(importlib.metadata, "version", _fake_version(version))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert _availability.probe() == (version, None)


def test_distribution_without_module(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _fake_version("4.8.1"))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert _availability.probe()[1] == "nvidia-cutlass-dsl 4.8.1 is installed but its `cutlass` module is not importable"


def test_constants_are_the_probe_at_import():
    assert (cute.DSL_VERSION, cute.DSL_MISSING) == _availability.probe()
    assert cute.DSL_AVAILABLE == (cute.DSL_MISSING is None)


def test_package_import_does_not_import_the_dsl():
    import subprocess
    import sys

    code = "import sys, fa_backend.kernels.cute; print('cutlass' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
