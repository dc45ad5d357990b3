"""SASS of the CuTe kernels' main loops, compiled for sm_90a on a machine without a GPU: ours, or FlashAttention-4's.

For each loop of a cubin that holds wgmma (HGMMA) instructions, innermost first: its length in instructions and its
opcode histogram (IMAD, LDS, SHFL, MUFU, ...), plus ptxas's spill and C75xx (wgmma serialised) notes. This is how the
twenty-eighth session compared the d=64 backward's step with FA4's (1508 against 1160 instructions, then 1172):

    python scripts/sass_loops.py bwd --d 64 --tile-m 128 [--causal] [--key-mask]   # flash_bwd_ws (wgs=2, WS)
    python scripts/sass_loops.py fwd --d 64 [--causal]                               # flash_fwd_ws, FASTEST variant
    python scripts/sass_loops.py cubin PATH.cubin                                    # any cubin

FA4's kernels compile the same way under torch's FakeTensorMode, from its package (flash-attn-4, quack-kernels and
apache-tvm-ffi installed, e.g. with pip install --no-deps --target DIR and DIR on PYTHONPATH):

    FLASH_ATTENTION_ARCH=sm_90 CUTE_DSL_ARCH=sm_90a FLASH_ATTENTION_NUM_SMS=132 CUTE_DSL_KEEP_PTX=1 \\
      CUTE_DSL_KEEP_CUBIN=1 CUTE_DSL_DUMP_DIR=/tmp/fa4 python scripts/sass_loops.py fa4-bwd --d 64
    ptxas -arch=sm_90a -v /tmp/fa4/*bwd_sm90*.ptx -o /tmp/fa4/bwd.cubin
    python scripts/sass_loops.py cubin /tmp/fa4/bwd.cubin

Needs ptxas (the CUDA toolkit's on PATH, else Triton's) and cuobjdump (Triton's wheel ships one).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _tool(name: str) -> str:
    """The CUDA toolkit's tool on PATH (the DSL's PTX may be newer than Triton's bundled ptxas reads), else
    Triton's."""
    return shutil.which(name) or os.path.join(BIN, name)


def ptxas(ptx: str, cubin: str) -> list[str]:
    """ptxas -v on a PTX file: its spill / register / C75xx lines."""
    run = subprocess.run([_tool("ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"ptxas failed: {run.stderr.strip()[:400]}")
    return [line.strip() for line in (run.stdout + run.stderr).splitlines()
            if "spill" in line or "C75" in line or "Used" in line]


def loops(cubin: str) -> list[tuple[int, int, int, collections.Counter]]:
    """(instructions, first address, last address, opcode counts) of every backward branch's body with an HGMMA."""
    sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True).stdout.splitlines()
    code = []
    for line in sass:
        m = re.search(r"/\*([0-9a-f]+)\*/\s+(\S.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
    found = {}
    for addr, ins in code:
        m = re.search(r"BRA 0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            lo = int(m.group(1), 16)
            body = [i for a, i in code if lo <= a <= addr]
            if any("HGMMA" in i for i in body):
                ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in body)
                found[(lo, addr)] = (len(body), lo, addr, ops)
    return sorted(found.values())


def report(cubin: str, notes: list[str]) -> None:
    for line in notes:
        print(line)
    for n, lo, hi, ops in loops(cubin):
        print(f"{n:5d} instructions [{lo:#x}, {hi:#x}]  " + " ".join(f"{k}:{v}" for k, v in ops.most_common(16)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("bwd", "fwd", "cubin", "fa4-bwd", "fa4-fwd"))
    parser.add_argument("path", nargs="?", help="the cubin (what=cubin)")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--tile-m", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--key-mask", action="store_true")
    args = parser.parse_args()
    if args.what == "cubin":
        report(args.path, [])
        return
    import torch

    if args.what.startswith("fa4"):
        from torch._subclasses.fake_tensor import FakeTensorMode
        from flash_attn.cute import interface

        b, s, h, d = 2, 2048, 2048 // args.d, args.d
        with FakeTensorMode():
            q = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="cuda")
            k, v, o, do = (torch.empty_like(q) for _ in range(4))
            if args.what == "fa4-bwd":
                lse = torch.empty(b, h, s, dtype=torch.float32, device="cuda")
                interface._flash_attn_bwd(q, k, v, o, do, lse, causal=args.causal)
            else:
                interface._flash_attn_fwd(q, k, v, causal=args.causal, return_lse=True)
        print("compiled; PTX and cubins in $CUTE_DSL_DUMP_DIR")
        return
    os.environ.setdefault("FA_BACKEND_CUTE_CACHE_DIR", tempfile.mkdtemp())
    dump = tempfile.mkdtemp()
    if args.what == "bwd":
        from fa_backend.kernels.cute import flash_bwd

        extra = dict(key_mask=True, pointer_args=True) if args.key_mask else {}
        flash_bwd.compile_flash_bwd(torch.bfloat16, args.d, args.causal, False, "sm_90a", dump, wgs=2,
                                    warp_specialized=True, tile_m=args.tile_m, **extra)
    else:
        from fa_backend.kernels.cute import flash_fwd_ws

        flash_fwd_ws.compile_flash_fwd_ws(torch.bfloat16, args.d, args.causal, False, "sm_90a", dump,
                                          key_mask=args.key_mask, **flash_fwd_ws.FASTEST[args.d, args.causal])
    ptx = sorted(glob.glob(os.path.join(dump, "*.ptx")))[0]
    cubin = os.path.join(dump, "kernel.cubin")
    report(cubin, ptxas(ptx, cubin))


if __name__ == "__main__":
    main()
