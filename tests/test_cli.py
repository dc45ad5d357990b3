"""The command line: demo (routing report) and doctor run end to end on this machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "fa_backend", *args], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, **(env or {})), timeout=900)


def test_doctor_reports_backends_and_routing():
    from fa_backend.doctor import report

    text = report()
    assert "torch " + torch.__version__ in text
    for name in ("cute", "triton", "torch", "math"):
        assert f"\n  {name:7} " in text
    assert "SDPA routing: enabled process-wide: no" in text
    assert "kernel check, triton: " in text and "FAILED" not in text and "WRONG" not in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback report")
def test_demo_on_cpu_falls_back_with_reasons():
    res = _run("demo", env={"TRITON_INTERPRET": "0"})
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    assert "triton  no: [device] device=cpu" in out and "torch   RUNS" in out
    assert "eager:    runs {'torch': 2}" in out
    assert "max |routed - unrouted| compiled: logits 0.000e+00" in out


def test_usage():
    res = _run()
    assert res.returncode == 2 and "demo" in res.stdout and "doctor" in res.stdout and "bench" in res.stdout
