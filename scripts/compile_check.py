"""Compile the Triton kernels for sm90 on a machine without a GPU and report resources.

For each tile configuration: registers, spills (ptxas -v), shared memory, and how many wgmma /
TMA instructions the PTX holds. Prunes configurations before any GPU time is spent.

    python scripts/compile_check.py                 # the configs in _configs.py
    python scripts/compile_check.py --candidates    # the tuning candidates too
    python scripts/compile_check.py --features      # also each optional feature (mask, dropout, ..., varlen)
    python scripts/compile_check.py --features varlen varlen_window_dropout   # only the packed-sequence kernels

Each line ends with a hash of the PTX with the kernel name removed, so that two revisions can be
compared for identical code (e.g. the no-feature path after adding constexpr-gated features).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
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


def _ptxas() -> str:
    """The ptxas Triton itself runs for sm90: Triton 3.9 writes PTX 9.x, which only its newer bundled ptxas (named
    ptxas-blackwell) reads; older Triton releases use the plain one."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return get_ptxas(90).path
    except (ImportError, TypeError, AttributeError):  # before get_ptxas(arch) -> NvidiaTool
        return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


PTXAS = _ptxas()
TARGET = GPUTarget("cuda", 90, 32)


def _source(fn, example: dict, dtype: str) -> ASTSource:
    """Signature as the JIT would specialise a typical launch: ints equal to 1 become constants,
    multiples of 16 and pointers get the divisibility hint."""
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        # Arguments left out take their default (feature flags) or None (unused feature tensors/scalars).
        default = fn.params[i].default
        value = example.get(name, None if default is inspect.Parameter.empty else default)
        if fn.params[i].is_constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, tuple) and value[0] == "desc":  # a host TMA descriptor: ("desc", rows, columns)
            signature[name] = f"tensordesc<{dtype}[1, 1, {value[1]}, {value[2]}]>"
        elif value in ("ptr", "ptr32", "ptr8", "ptri32"):
            signature[name] = {"ptr32": "*fp32", "ptr8": "*u8", "ptri32": "*i32"}.get(value, f"*{dtype}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif fn.params[i].do_not_specialize:
            signature[name] = "i32"
        elif isinstance(value, int) and value >= 2**31:
            signature[name] = "i64"
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
    code = ptx.split("\t.section\t.debug")[0]  # DWARF sections and .loc/.file hold source positions
    body = "\n".join(line for line in code.splitlines()
                     if not line.startswith(("//", "$L__tmp")) and not line.lstrip().startswith((".loc", ".file")))
    digest = hashlib.sha1(re.sub(r"_attn_fwd|_bwd_dkdv|_bwd_dq", "K", body).encode()).hexdigest()[:10]
    return (f"regs={regs.group(1) if regs else '?':>3} spills={spill.group(1) if spill else '?':>4} "
            f"smem={kernel.metadata.shared:>6} wgmma={wgmma:>3} cp.async={cp_async:>3} tma={tma} ptx={digest}")


# Example arguments of each optional feature (names as in the kernels' signatures).
FEATURES: dict[str, dict] = {
    "bool_mask": dict(Mask="ptr8", stride_mb=0, stride_mh=0, stride_mm=4096, stride_mn=1, MASK_KIND=1),
    "additive_mask": dict(Mask="ptr", stride_mb=0, stride_mh=0, stride_mm=4096, stride_mn=1, MASK_KIND=2),
    "key_padding_mask": dict(Mask="ptr8", stride_mb=4096, stride_mh=0, stride_mm=0, stride_mn=1, MASK_KIND=3),
    "bool_mask_bounds": dict(Mask="ptr8", stride_mb=0, stride_mh=0, stride_mm=4096, stride_mn=1, MASK_KIND=1,
                             Bounds="ptri32", stride_bb=0, stride_bh=0, stride_br=4, MASK_BOUNDS=True),
    "dropout": dict(seed=2**40, rng_offset=0, drop_threshold=6554, dropout_scale=1.1, DROPOUT=2),
    "dropout_words": dict(seed=2**40, rng_offset=0, drop_threshold=42949673, dropout_scale=1.01, DROPOUT=1),
    "window": dict(left_offset=-256, WINDOW_LEFT=True),
    "softcap": dict(softcap_in=0.01, SOFTCAP=True),
    "alibi": dict(Alibi="ptr32", stride_ab=0, stride_ah=1, alibi_offset=0, HAS_ALIBI=True),
    # Packed sequences (flash_attn_varlen_func): batch strides 0, cu_seqlens, LSE row stride.
    "varlen": dict(CuSeqQ="ptri32", CuSeqK="ptri32", TOTAL_Q=65536, TOTAL_K=65536, VARLEN=True, stride_qb=0,
                   stride_kb=0, stride_vb=0, stride_ob=0, stride_dob=0, stride_dkb=0, stride_dvb=0, stride_dqb=0),
    "varlen_window_dropout": dict(CuSeqQ="ptri32", CuSeqK="ptri32", TOTAL_Q=65536, TOTAL_K=65536, VARLEN=True,
                                  stride_qb=0, stride_kb=0, stride_vb=0, stride_ob=0, stride_dob=0, stride_dkb=0,
                                  stride_dvb=0,
                                  stride_dqb=0, left_offset=-256, WINDOW_LEFT=True, seed=2**40, rng_offset=0,
                                  drop_threshold=6554, dropout_scale=1.1, DROPOUT=2),
    # host-bound backward calls (flash_bwd.EXACT_DS_MAX_SCORES): dS unrounded into the dQ / dK products (the
    # backward kernels only: --kernels dkdv dq)
    "exact_ds": dict(EXACT_DS=True),
}


def check_fwd(cfg: _configs.TileConfig, d: int, causal: bool, dtype: str = "bf16", extra: dict | None = None) -> str:
    example = dict(Q="ptr", K="ptr", V="ptr", O="ptr", LSE="ptr32", **_strides("m", "q"),
                   stride_kb=2048 * 4096, stride_kh=128, stride_kn=2048, stride_kd=1,
                   stride_vb=2048 * 4096, stride_vh=128, stride_vn=2048, stride_vd=1,
                   **_strides("m", "o"), NUM_HEADS_Q=16, GROUP=1, SEQ_Q=4096, SEQ_K=4096, NUM_M_BLOCKS=32,
                   causal_offset=0, qk_scale=0.1, HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_M=cfg.block_m,
                   BLOCK_N=cfg.block_n, BLOCK_D=d, BLOCK_DV=d, CAUSAL=causal, SCALE_NEG=False,
                   LAZY_RESCALE=cfg.lazy_rescale, USE_TMA=cfg.tma and not (extra or {}).get("VARLEN"))
    if example["USE_TMA"]:
        example.update(KD=("desc", cfg.block_n, d), VD=("desc", cfg.block_n, d))
    example.update(extra or {})
    return _compile(_attn_fwd, example, cfg, dtype)


def _compile(fn, example: dict, cfg: _configs.TileConfig, dtype: str) -> str:
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _report(triton.compile(_source(fn, example, dtype), target=TARGET, options=opts), opts)


def _bwd_example(d, causal, cfg, extra=None):
    ex = dict(Q="ptr", K="ptr", V="ptr", DO="ptr", LSE="ptr32", DELTA="ptr32", DK="ptr", DV="ptr", DQ="ptr",
              NUM_HEADS_Q=16, NUM_HEADS_K=16, GROUP=1, SEQ_Q=4096, SEQ_K=4096, NUM_N_BLOCKS=32, NUM_M_BLOCKS=32,
              causal_offset=0, qk_scale=0.1, sm_scale=0.08, HEAD_DIM=d, HEAD_DIM_V=d, BLOCK_D=d, BLOCK_DV=d,
              CAUSAL=causal, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    for n in ("q", "do", "dq"):
        ex.update(_strides("m", n))
    for n in ("k", "v", "dk", "dv"):
        ex.update(_strides("n", n))
    ex.update(extra or {})
    return ex


def check_dkdv(cfg: _configs.TileConfig, d: int, causal: bool, dtype: str = "bf16", extra: dict | None = None) -> str:
    atomic = dict(DQ_ACC="ptr32", ATOMIC_DQ=True) if cfg.atomic_dq else {}
    tma = dict(USE_TMA=2 if cfg.atomic_dq else True, QD=("desc", cfg.block_m, d), DOD=("desc", cfg.block_m, d)) \
        if cfg.tma and not (extra or {}).get("VARLEN") else {}
    return _compile(_bwd_dkdv, _bwd_example(d, causal, cfg, {**atomic, **tma, **(extra or {})}), cfg, dtype)


def check_dq(cfg: _configs.TileConfig, d: int, causal: bool, dtype: str = "bf16", extra: dict | None = None) -> str:
    tma = dict(USE_TMA=True, KD=("desc", cfg.block_n, d), VD=("desc", cfg.block_n, d)) \
        if cfg.tma and not (extra or {}).get("VARLEN") else {}
    return _compile(_bwd_dq, _bwd_example(d, causal, cfg, {**tma, **(extra or {})}), cfg, dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", action="store_true", help="also check the tuning candidates")
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 128, 256])
    parser.add_argument("--kernels", nargs="*", default=["fwd", "dkdv", "dq"])
    parser.add_argument("--features", nargs="*", default=None,
                        help=f"also compile these feature variants (no name: all of {', '.join(FEATURES)})")
    args = parser.parse_args()
    variants = {"": {}}
    if args.features is not None:
        variants.update({f: FEATURES[f] for f in (args.features or FEATURES)})
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
                    run_cfg = cfg
                    for feature, extra in variants.items():
                        if feature and feature not in ("varlen", "exact_ds") and cfg in table:
                            # feature calls use the feature tables where they exist (plain varlen and exact_ds: the
                            # plain ones)
                            run_cfg = {"fwd": _configs._GPU_FWD_FEATURES.get(d),
                                       "dkdv": getattr(_configs._GPU_BWD_FEATURES.get(d), "dkdv", None),
                                       "dq": getattr(_configs._GPU_BWD_FEATURES.get(d), "dq", None)}[name] or cfg
                        else:
                            run_cfg = cfg
                        try:
                            res = check(run_cfg, d, causal, extra=extra)
                        except Exception as e:  # a config that fails to compile is reported and pruned
                            res = f"FAILED {type(e).__name__}: {str(e)[:200]}"
                        mark = "*" if run_cfg in table else " "
                        tag = f" +{feature}" if feature else ""
                        print(f"{name:4} d={d:3} causal={causal:d} {mark}{run_cfg}{tag}: {res}", flush=True)


if __name__ == "__main__":
    main()
