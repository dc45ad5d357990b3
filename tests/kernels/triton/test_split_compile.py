"""The split-column kernels (head dims 129-192; dq_from_ds at 256) compiled for sm90 on any machine (no GPU
needed), at their default tiles: they fit sm90's shared memory and use wgmma and TMA. The tiles were timed on a GPU;
a Triton that needs more shared memory for them would otherwise fail only at launch there. Compiled in a fresh
interpreter without TRITON_INTERPRET (under it @triton.jit functions cannot be compiled)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fa_backend.kernels.triton import dq_from_ds, flash_bwd_split, flash_fwd_split

d192 = dict(HEAD_DIM=192, HEAD_DIM_V=192, D_A=128, D_B=64, CAUSAL=True)
kernels = ((flash_fwd_split._attn_fwd_split, flash_fwd_split.TILES[192], d192),
           (flash_bwd_split._bwd_dkdv_split, flash_bwd_split.TILES[192][0], d192),
           (flash_bwd_split._bwd_dq_split, flash_bwd_split.TILES[192][1], d192),
           (dq_from_ds._dq_from_ds, dq_from_ds.TILE, dict(HEAD_DIM=256, D_A=128, D_B=128, CAUSAL=True)))
types = {n: "*bf16" for n in ("DQ", "DK", "DV")}
types.update(LSE="*fp32", DELTA="*fp32", qk_scale="fp32", sm_scale="fp32")
# host TMA descriptors (_tma.head_tiles): (rows, columns) of their blocks, by argument name
desc_blocks = dict(QA=("BLOCK_M", "D_A"), QB=("BLOCK_M", "D_B"), OA=("BLOCK_M", "D_A"), OB=("BLOCK_M", "D_B"),
                   KA=("BLOCK_N", "D_A"), KB=("BLOCK_N", "D_B"), VA=("BLOCK_N", "D_A"), VB=("BLOCK_N", "D_B"),
                   DOA=("BLOCK_M", "D_A"), DOB=("BLOCK_M", "D_B"), DS=("BLOCK_N", "BLOCK_M"))
for fn, (block_m, block_n, num_warps, num_stages), dims in kernels:
    constexprs = dict(dims, BLOCK_M=block_m, BLOCK_N=block_n)
    for name, (rows, cols) in desc_blocks.items():
        types[name] = f"tensordesc<bf16[1, 1, {constexprs[rows]}, {constexprs[cols]}]>"
    for name in ("EXACT_DS", "BLOCK_MAJOR", "ONE_LOOP", "STORE_DS"):  # constexpr flags at their defaults (off)
        if name in fn.arg_names:
            constexprs[name] = False
    if "STORE_DS" in fn.arg_names:  # (the dK / dV launch without dS^T stores)
        constexprs["DS"] = None
    constexprs = {n: v for n, v in constexprs.items() if n in fn.arg_names}
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = k.asm["ptx"]
    print(json.dumps(dict(kernel=fn.__name__, shared=k.metadata.shared, wgmma="wgmma.mma_async" in ptx,
                          tma="cp.async.bulk.tensor" in ptx)))
"""


def test_split_kernels_fit_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    infos = [json.loads(line) for line in res.stdout.strip().splitlines() if line.startswith("{")]
    assert [i["kernel"] for i in infos] == ["_attn_fwd_split", "_bwd_dkdv_split", "_bwd_dq_split", "_dq_from_ds"], infos
    for info in infos:
        assert info["wgmma"] and info["tma"], info
        assert info["shared"] <= 232448, info  # sm90's per-block limit
