"""tests/_interpreter.py, the shortcuts the CPU suite installs in Triton's interpreter, changes no result: a forward
and backward with most kernel features on (causal bottom-right, GQA, a padded head dim, dropout, window, softcap,
ALiBi) give bitwise the tensors of Triton's unmodified interpreter, which runs the same call in a subprocess that
does not install them."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.conftest import DEVICE

_CALL = """
import torch
from fa_backend.kernels.triton import flash_bwd, flash_fwd


def run():
    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 2, 17, 40, generator=g).half() for _ in range(2))
    k, v = (torch.randn(1, 1, 23, 40, generator=g).half() for _ in range(2))
    kw = dict(dropout_p=0.2, rng=(7, 3), window=(9, 2), softcap=3.0, alibi_slopes=torch.rand(2, generator=g))
    out, lse = flash_fwd(q, k, v, 40 ** -0.5, True, True, **kw)
    return [out, lse, *flash_bwd(dout, q, k, v, out, lse, 40 ** -0.5, True, True, **kw)]
"""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.skipif(DEVICE != "cpu", reason="the shortcuts are installed on CPU runs only")
def test_shortcuts_give_the_unmodified_interpreters_results(tmp_path):
    from triton.runtime import interpreter

    if not getattr(interpreter, "_fa_backend_shortcuts", False):
        pytest.skip("shortcuts not installed (a Triton other than 3.6)")
    namespace: dict = {}
    exec(_CALL, namespace)
    patched = namespace["run"]()
    plain_file = tmp_path / "plain.pt"
    check = ("from triton.runtime import interpreter\n"
             "assert not getattr(interpreter, '_fa_backend_shortcuts', False)\n")
    subprocess.run([sys.executable, "-c", _CALL + "\nimport sys\ntorch.save(run(), sys.argv[1])\n" + check,
                    str(plain_file)], check=True, cwd=pathlib.Path(__file__).parents[1],
                   env=dict(os.environ, TRITON_INTERPRET="1"))
    plain = torch.load(plain_file)
    assert all(t.isfinite().all() and t.any() for t in plain)  # a call that computes something
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), patched, plain, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        same = torch.equal(_bits(a), _bits(b))
        assert same, f"{name}: not bitwise the unmodified interpreter's"
