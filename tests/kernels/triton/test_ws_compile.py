"""The warp-specialized kernels (forward, dK / dV) compiled for sm90 on any machine (no GPU needed): Triton still
specializes their loops (the producer and two consumer warpgroups: 12 warps, setmaxnreg) and fits them in shared
memory. A Triton that stops doing so would leave them slow 4-warp kernels without any numerics test failing.
Compiled in a fresh interpreter without TRITON_INTERPRET (under it @triton.jit functions cannot be compiled)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from fa_backend.kernels.triton import _ws, flash_bwd_ws, flash_fwd_ws

pytestmark = pytest.mark.skipif(not _ws.HAS_WS, reason="this Triton has no warp_specialize")

_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fa_backend.kernels.triton import flash_bwd_ws, flash_fwd_ws

kind, d, mask_cols, causal = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
mod = flash_bwd_ws if kind.startswith("bwd") else flash_fwd_ws
block_m, block_n, num_warps, num_stages = mod.WS_TILES[d]
fn = dict(fwd=flash_fwd_ws._attn_fwd_ws, short=flash_fwd_ws._attn_fwd_ws,
          persistent=flash_fwd_ws._attn_fwd_ws_persistent, bwd=flash_bwd_ws._bwd_dkdv_ws,
          bwd_gqa=flash_bwd_ws._bwd_dkdv_ws)[kind]
constexprs = dict(HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n)
constexprs["BLOCK_D"] = triton.next_power_of_2(d)
if kind in ("fwd", "short"):
    constexprs["WARP_SPEC"] = True
    constexprs["HEADS_FASTEST"] = kind == "short"
if kind in ("bwd", "bwd_gqa"):
    constexprs["WARP_SPEC"] = True
    constexprs["GROUP"] = 4 if kind == "bwd_gqa" else 1
    constexprs["CAUSAL"] = causal
    if not causal:
        constexprs["KEYS"] = None
if not kind.startswith("bwd"):
    constexprs["MASK_COLS"] = mask_cols
    constexprs["CAUSAL"] = causal
    if not causal:
        constexprs["ROWS"] = None
types = {n: "*bf16" for n in ("Q", "K", "V", "O", "DO", "DK", "DV")}
types.update(LSE="*fp32", DELTA="*fp32", qk_scale="fp32", sm_scale="fp32", ROWS="*i32", KEYS="*i32")
signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
k = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=num_warps, num_stages=num_stages))
ptx = k.asm["ptx"]
# the column coordinate of every 2-D TMA store (O, dK, dV), as named in the TTGIR
store_cols = re.findall(r"async_tma_copy_local_to_global %\S+\[%[\w.]+, (%[\w.]+)\]", k.asm["ttgir"])
print(json.dumps(dict(num_warps=k.metadata.num_warps, asked=num_warps, shared=k.metadata.shared,
                      setmaxnreg="setmaxnreg" in ptx, wgmma="wgmma.mma_async" in ptx,
                      tma="cp.async.bulk.tensor" in ptx, store_cols=store_cols)))
"""


# the forward's opt-in causal variant (flash_fwd_ws.CAUSAL_ENABLED) and its persistent kernel (PERSISTENT), causal
# or not (CAUSAL_PERSISTENT; "short": the per-tile launch of the tiles it leaves), and the dK / dV kernel, causal
# (flash_bwd_ws.CAUSAL_ENABLED) or not, MHA or GQA (GQA_ENABLED), too: their loops must still be specialized
@pytest.mark.parametrize("kind,d,mask_cols,causal", [("fwd", d, m, 0) for d in sorted(flash_fwd_ws.WS_TILES)
                                                     for m in (0, 1)]
                         + [("fwd", d, 1, 1) for d in sorted(flash_fwd_ws.WS_TILES)]
                         + [("persistent", d, m, 0) for d in sorted(flash_fwd_ws.WS_TILES) for m in (0, 1)]
                         + [("persistent", d, 1, 1) for d in sorted(flash_fwd_ws.WS_TILES)]
                         + [("short", d, 1, 1) for d in sorted(flash_fwd_ws.WS_TILES)]
                         + [(kind, d, 0, c) for kind in ("bwd", "bwd_gqa") for d in sorted(flash_bwd_ws.WS_TILES)
                            for c in (0, 1)])
def test_ws_kernel_specializes_for_sm90(kind, d, mask_cols, causal):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE, kind, str(d), str(mask_cols), str(causal)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["num_warps"] == 3 * info["asked"], info  # producer (default partition) + two consumer warpgroups
    assert info["setmaxnreg"] and info["wgmma"] and info["tma"], info
    assert info["shared"] <= 232448, info  # sm90's per-block limit
    # each consumer stores its rows of the whole tile from column 0: the pass offsets only the row coordinate (the
    # causal variant's second consumer once stored at column 64, the pass having offset a shared constant 0)
    assert len(info["store_cols"]) >= 2, info
    assert all(re.fullmatch(r"%c0_i32(_\d+)?", col) for col in info["store_cols"]), info
