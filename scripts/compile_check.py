"""Compile the Triton kernels for sm90 on a machine without a GPU and report resources.

For each tile configuration: registers, spills (ptxas -v), shared memory, and how many wgmma /
TMA instructions the PTX holds. Prunes configurations before any GPU time is spent.

    python scripts/compile_check.py                 # the configs in _configs.py
    python scripts/compile_check.py --candidates    # the tuning candidates too
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fa_backend.kernels.triton import _configs  # noqa: E402
from fa_backend.kernels.triton.flash_bwd import _bwd_dkdv, _bwd_dq  # noqa: E402
from fa_backend.kernels.triton.flash_fwd import _attn_fwd  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
TARGET = GPUTarget("cuda", 90, 32)


def _source(fn, example: dict, dtype: str) -> ASTSource:
    """Signature as the JIT would specialise a typical launch: ints equal to 1 become constants,
    multiples of 16 and pointers get the divisibility hint."""
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        value = example[name]
        if fn.params[i].is_constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif value == "ptr" or value == "ptr32":
            signature[name] = "*fp32" if value == "ptr32" else f"*{dtype}"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif fn.params[i].do_not_specialize:
            signature[name] = "i32"
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, signature, constexprs, attrs)


def _strides(prefix: str, names: str) -> dict:
    # (b, s, h, d) memory viewed as (b, h, s, d): strides (s*h*d, d, h*d, 1) with h*d = 2048.
    out = {}
    for n in names.split():
        out.update({f"stride_{n}b": 2048 * 4096, f"stride_{n}h": 128, f"stride_{n}{prefix}": 2048, f"stride_{n}d": 1})
    return out


def _report(kernel, options: dict) -> str:
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        arch = "sm_90a"
        res = subprocess.run([PTXAS, f"-arch={arch}", "-v", path, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    info = res.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    wgmma = ptx.count("wgmma.mma_async")
    cp_async = ptx.count("cp.async.")
    tma = ptx.count("cp.async.bulk.tensor")
    return (f"regs={regs.group(1) if regs else '?':>3} spills={spill.group(1) if spill else '?':>4} "
            f"smem={kernel.metadata.shared:>6} wgmma={wgmma:>3} cp.async={cp_async:>3} tma={tma}")


def check_fwd(cfg: _configs.TileConfig, d: int, causal: bool, dtype: str = "bf16") -> str:
    example = dict(Q="ptr", K="ptr", V="ptr", O="ptr", LSE="ptr32", **_strides("m", "q"),
                   stride_kb=2048 * 4096, stride_kh=128, stride_kn=2048, stride_kd=1,
                   stride_vb=2048 * 4096, stride_vh=128, stride_vn=2048, stride_vd=1,
                   **_strides("m", "o"), NUM_HEADS_Q=16, GROUP=1, SEQ_Q=4096, SEQ_K=4096, NUM_M_BLOCKS=32,
                   causal_offset=0, qk_scale=0.1, HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_M=cfg.block_m,
                   BLOCK_N=cfg.block_n, BLOCK_D=d, BLOCK_DV=d, CAUSAL=causal, SCALE_NEG=False)
    return _compile(_attn_fwd, example, cfg, dtype)


def _compile(fn, example: dict, cfg: _configs.TileConfig, dtype: str) -> str:
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _report(triton.compile(_source(fn, example, dtype), target=TARGET, options=opts), opts)


def _bwd_example(d, causal, cfg):
    ex = dict(Q="ptr", K="ptr", V="ptr", DO="ptr", LSE="ptr32", DELTA="ptr32", DK="ptr", DV="ptr", DQ="ptr",
              NUM_HEADS_Q=16, NUM_HEADS_K=16, GROUP=1, SEQ_Q=4096, SEQ_K=4096, NUM_N_BLOCKS=32, NUM_M_BLOCKS=32,
              causal_offset=0, qk_scale=0.1, sm_scale=0.08, HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_D=d, BLOCK_DV=d,
              CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    for n in ("q", "do", "dq"):
        ex.update(_strides("m", n))
    for n in ("k", "v", "dk", "dv"):
        ex.update(_strides("n", n))
    return ex


def check_dkdv(cfg: _configs.TileConfig, d: int, causal: bool, dtype: str = "bf16") -> str:
    return _compile(_bwd_dkdv, _bwd_example(d, causal, cfg), cfg, dtype)


def check_dq(cfg: _configs.TileConfig, d: int, causal: bool, dtype: str = "bf16") -> str:
    return _compile(_bwd_dq, _bwd_example(d, causal, cfg), cfg, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", action="store_true", help="also check the tuning candidates")
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 128, 256])
    parser.add_argument("--kernels", nargs="*", default=["fwd", "dkdv", "dq"])
    args = parser.parse_args()
    for d in args.dims:
        for causal in (False, True):
            plan = {
                "fwd": (check_fwd, [_configs.fwd_table(causal)[d]], _configs.fwd_candidates(d)),
                "dkdv": (check_dkdv, [_configs.bwd_table(causal)[d].dkdv], _configs.dkdv_candidates(d)),
                "dq": (check_dq, [_configs.bwd_table(causal)[d].dq], _configs.dq_candidates(d)),
            }
            for name in args.kernels:
                check, table, candidates = plan[name]
                for cfg in dict.fromkeys(table + (candidates if args.candidates else [])):
                    try:
                        res = check(cfg, d, causal)
                    except Exception as e:  # a config that fails to compile is reported and pruned
                        res = f"FAILED {type(e).__name__}: {str(e)[:200]}"
                    mark = "*" if cfg in table else " "
                    print(f"{name:4} d={d:3} causal={causal:d} {mark}{cfg}: {res}", flush=True)


if __name__ == "__main__":
    main()
