"""The warp-specialized forward compiled for sm90 on any machine (no GPU needed): Triton still specializes its
loop (the producer and two consumer warpgroups: 12 warps, setmaxnreg) and fits it in shared memory. A Triton that
stops doing so would leave the kernel a slow 4-warp one without any numerics test failing. Compiled in a fresh
interpreter without TRITON_INTERPRET (under it @triton.jit functions cannot be compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fa_backend.kernels.triton import flash_fwd_ws

pytestmark = pytest.mark.skipif(not flash_fwd_ws._HAS_WS, reason="this Triton has no warp_specialize")

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fa_backend.kernels.triton import flash_fwd_ws

d, mask_cols = int(sys.argv[1]), sys.argv[2] == "1"
block_m, block_n, num_warps, num_stages = flash_fwd_ws.WS_TILES[d]
fn = flash_fwd_ws._attn_fwd_ws
constexprs = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, MASK_COLS=mask_cols, WARP_SPEC=True)
types = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "LSE": "*fp32", "qk_scale": "fp32"}
signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
k = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=num_warps, num_stages=num_stages))
ptx = k.asm["ptx"]
print(json.dumps(dict(num_warps=k.metadata.num_warps, asked=num_warps, shared=k.metadata.shared,
                      setmaxnreg="setmaxnreg" in ptx, wgmma="wgmma.mma_async" in ptx,
                      tma="cp.async.bulk.tensor" in ptx)))
"""


@pytest.mark.parametrize("mask_cols", [False, True])
@pytest.mark.parametrize("d", sorted(flash_fwd_ws.WS_TILES))
def test_ws_forward_specializes_for_sm90(d, mask_cols):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE, str(d), str(int(mask_cols))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["num_warps"] == 3 * info["asked"], info  # producer (default partition) + two consumer warpgroups
    assert info["setmaxnreg"] and info["wgmma"] and info["tma"], info
    assert info["shared"] <= 232448, info  # sm90's per-block limit
