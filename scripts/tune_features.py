"""Time tile configurations of the Triton kernels on the feature calls of `bench --features` (GPU).

For each case (bench_features.case_arguments: causal_mask, key_padding, random_keys, dropout) it times the
forward with the tables' tile ("table") and each forward candidate, then the backward with the case's table
tiles, with each dK/dV candidate (the table's dQ tile) and each dQ candidate (the table's dK/dV tile); the
two backward kernels are separate launches, so their best tiles combine. TFLOP/s count the full (non-causal) matrix,
as bench --features does.

    python scripts/tune_features.py --cases key_padding dropout --seqlens 8192 --json out/tune_features.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fa_backend  # noqa: E402
from fa_backend.bench import _inputs, attention_flops  # noqa: E402
from fa_backend.bench_features import CASES, case_arguments  # noqa: E402
from fa_backend.kernels.triton import _configs  # noqa: E402
from fa_backend.kernels.triton._configs import BwdConfig, TileConfig as T  # noqa: E402

# TMA tiles (K / V for the forward and dQ, Q / dO for dK/dV, by tensor descriptors): far fewer registers with a
# feature (sm90 compile check: forward with a packed key mask 254 -> 148, dropout dQ 64 x 64 255 + 108 bytes of
# spills -> 224, none); select them with --match atomic_dq=False tma=True
FWD = [T(128, 64, 8, 3), T(128, 128, 8, 2), T(128, 64, 8, 2), T(64, 64, 4, 3), T(128, 32, 4, 3),
       T(128, 64, 8, 3, tma=True), T(128, 128, 8, 2, tma=True), T(128, 128, 8, 3, tma=True)]
DKDV = [T(32, 128, 8, 1), T(32, 128, 8, 2), T(64, 64, 4, 1), T(32, 64, 4, 2), T(64, 128, 8, 1),
        T(32, 128, 8, 2, tma=True), T(32, 128, 8, 1, tma=True), T(64, 128, 8, 2, tma=True), T(64, 64, 4, 2, tma=True),
        # dQ added from the dK/dV kernel (the dQ kernel, its second QK^T / dropout draw / mask read, skipped): fp32
        # atomics or TMA bulk reduce-adds; the tiles that compile for sm90 without spills with dropout
        T(32, 128, 8, 1, atomic_dq=True), T(32, 128, 8, 2, atomic_dq=True),
        T(32, 128, 8, 1, atomic_dq=True, tma=True), T(32, 128, 8, 2, atomic_dq=True, tma=True)]
# the backward tile table each case's calls use (_features.tile_class)
TABLE_OF_CASE = {"causal_mask": "mask_bounds", "key_padding": "mask_rows", "random_keys": "mask_rows",
                 "dropout": "dropout"}
DQ = [T(64, 32, 4, 2), T(64, 64, 4, 2), T(128, 64, 8, 2), T(64, 32, 4, 3), T(64, 64, 4, 2, tma=True),
      T(64, 32, 4, 3, tma=True)]


def _time(fn) -> float | None:
    from triton.testing import do_bench
    try:
        fn()
        return do_bench(fn, warmup=10, rep=60, return_mode="median")
    except Exception as e:  # a tile that fails to compile or launch is reported, not fatal
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        return None


def tune_case(case: str, seqlen: int, d: int = 128, tokens: int = 16384, width: int = 2048,
              kernels: tuple[str, ...] = ("fwd", "dkdv", "dq"), match: tuple[str, ...] = ()) -> list[dict]:
    batch, heads = max(1, tokens // seqlen), max(1, width // d)
    kwargs = case_arguments(case, batch, seqlen)
    q, k, v = _inputs(batch, heads, seqlen, d, torch.bfloat16)
    flops = attention_flops(batch, heads, seqlen, seqlen, d, False)
    rows = []

    def fwd():
        return fa_backend.attention(q, k, v, **kwargs)

    # the tiles the tables choose today ("table"), then each candidate; the first candidate always runs
    for cfg in ["table", *FWD] if "fwd" in kernels else []:
        if cfg != "table" and not all(m in str(cfg) for m in match) and cfg != FWD[0]:
            continue
        with _configs.override(fwd=None if cfg == "table" else cfg):
            ms = _time(fwd)
        rows.append(dict(case=case, seqlen=seqlen, kernel="fwd", tile=str(cfg), ms=ms,
                         tflops=None if ms is None else flops / ms * 1e-9))
        print(f"  {case:>11} s={seqlen} fwd  {cfg}: {rows[-1]['tflops'] or 0:6.0f} TFLOP/s", flush=True)
    out = fwd()
    dout = torch.randn_like(out)

    def bwd():
        return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)

    # each candidate runs with the other kernel's tile from the case's table, so a row compares with "table"
    table = _configs._BWD_FEATURE_TABLES[TABLE_OF_CASE[case]][d]
    for kernel, cands in (("table", ["table"]), ("dkdv", DKDV), ("dq", DQ)):
        for cfg in cands if kernel == "table" or kernel in kernels else []:
            if kernel != "table" and not all(m in str(cfg) for m in match) and cfg != cands[0]:
                continue
            pair = (table if kernel == "table" else BwdConfig(cfg, table.dq) if kernel == "dkdv"
                    else BwdConfig(table.dkdv, cfg))
            with _configs.override(bwd=pair):
                out = fwd()
                ms = _time(bwd)
            rows.append(dict(case=case, seqlen=seqlen, kernel=kernel, tile=str(cfg), ms=ms,
                             tflops=None if ms is None else 2.5 * flops / ms * 1e-9))
            print(f"  {case:>11} s={seqlen} bwd  {kernel} {cfg}: {rows[-1]['tflops'] or 0:6.0f} TFLOP/s "
                  f"(with the other kernel's table tile)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--seqlens", type=int, nargs="*", default=[8192])
    parser.add_argument("--json", default=None)
    parser.add_argument("--kernels", nargs="*", default=["fwd", "dkdv", "dq"])
    parser.add_argument("--match", nargs="*", default=[],
                        help="only candidates whose repr contains each of these (and the first)")
    args = parser.parse_args()
    rows = [r for case in args.cases for s in args.seqlens
            for r in tune_case(case, s, kernels=tuple(args.kernels), match=tuple(args.match))]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
