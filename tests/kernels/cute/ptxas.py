"""ptxas on the CuTe kernels' PTX (compile-only tests): its resource report, or a skip where it cannot read it."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

needs_ptxas = pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (CUDA toolkit)")


def ptxas_report(ptx: str, workdir: pathlib.Path) -> str:
    """`ptxas -arch=sm_90a -v` on the PTX: its report (registers, spills, C75xx notes); skips the test when this
    ptxas is older than the DSL's PTX."""
    path = workdir / "kernel.ptx"
    path.write_text(ptx)
    run = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(path), "-o", str(workdir / "kernel.cubin")],
                         capture_output=True, text=True)
    if run.returncode and "Unsupported .version" in run.stderr:
        pytest.skip(f"this ptxas is older than the DSL's PTX: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr
    return run.stderr
