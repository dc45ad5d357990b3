"""Compile the decode kernels for sm90 on a machine without a GPU; report registers, spills, smem.

    python scripts/compile_check_decode.py [--dims 64 128 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from compile_check import TARGET, _report
from compile_check import _source as _base_source

from fa_backend.kernels.triton import decode
from fa_backend.kernels.triton.kv_append import _rotary_copy


def _source(fn, example: dict, dtype: str):
    """compile_check._source plus explicit pointer types ("*i32") for the int32 index tensors."""
    typed = {n: v for n, v in example.items() if isinstance(v, str) and v.startswith("*")}
    src = _base_source(fn, {n: ("ptr32" if n in typed else v) for n, v in example.items()}, dtype)
    for n, ty in typed.items():
        src.signature[n] = ty
    return src


def _strides(prefix: str, hq: int, d: int) -> dict:
    # (b, s, h, d) contiguous with s = 4096
    return {f"stride_{prefix}b": 4096 * hq * d, f"stride_{prefix}{'m' if prefix in 'qo' else 'n'}": hq * d,
            f"stride_{prefix}h": d, f"stride_{prefix}d": 1}


def check_decode(d: int, group: int, paged: bool, splits: int, features: bool) -> str:
    block_n, warps, stages = decode.decode_config(d)  # the GPU table (TRITON_INTERPRET unset here)
    hkv = 8
    ex = dict(Q="ptr", K="ptr", V="ptr", O="ptr", LSE="ptr32", O_PART="ptr32", LSE_PART="ptr32",
              CACHE_SEQLENS="*i32", BATCH_IDX="*i32", LEFTPAD="*i32", BLOCK_TABLE="*i32", ALIBI="ptr32",
              **_strides("q", hkv * group, d), **_strides("k", hkv, d), **_strides("v", hkv, d),
              **_strides("o", hkv * group, d), stride_bt=512, stride_alibi_b=0,
              BATCH=8, NUM_HEADS_Q=hkv * group, NUM_HEADS_K=hkv, SEQ_Q=1, SEQ_NEW=1, NUM_M_BLOCKS=1,
              qk_scale=0.1, softcap=30.0, WINDOW_LEFT=0, WINDOW_RIGHT=0,
              GROUP=group, HEAD_DIM=d, BLOCK_M=decode.block_m_for(group, 1), BLOCK_N=block_n, BLOCK_D=d,
              NUM_SPLITS=splits, HAS_BATCH_IDX=False, HAS_LEFTPAD=features, PAGE_SIZE=64 if paged else 0,
              HAS_ALIBI=features, SOFTCAP=features, HAS_LEFT=features, HAS_RIGHT=features)
    src = _source(decode._decode_split, ex, "bf16")
    opts = {"num_warps": warps, "num_stages": stages}
    return _report(triton.compile(src, target=TARGET, options=opts), opts)


def check_append(d: int) -> str:
    ex = {"X": "ptr", "Y": "ptr", "SEQ_OFF": "*i32", "BATCH_IDX": "*i32", "BLOCK_TABLE": "*i32", "COS": "ptr",
          "SIN": "ptr", "stride_xb": 8 * d, "stride_xs": 8 * d, "stride_xh": d, "stride_xd": 1,
          "stride_yb": 4096 * 8 * d, "stride_ys": 8 * d, "stride_yh": d, "stride_yd": 1, "stride_bt": 512,
          "stride_cos": d // 2, "stride_sin": d // 2, "NUM_HEADS": 8, "SEQ": 1, "NUM_S_BLOCKS": 1, "HEAD_DIM": d,
          "BLOCK_D": d, "BLOCK_S": 16, "ROTARY_DIM": d, "INTERLEAVED": True, "POS_STEP": 1, "DST_AT_SEQLEN": True,
          "HAS_BATCH_IDX": False, "PAGE_SIZE": 0}
    opts = {"num_warps": 4, "num_stages": 1}
    return _report(triton.compile(_source(_rotary_copy, ex, "bf16"), target=TARGET, options=opts), opts)


def check_merge(d: int, splits: int) -> str:
    ex = {"O_PART": "ptr32", "LSE_PART": "ptr32", "O": "ptr", "LSE": "ptr32", "stride_ob": 32 * d,
          "stride_om": 32 * d, "stride_oh": d, "stride_od": 1, "N_ROWS": 256, "NUM_HEADS_Q": 32, "SEQ_Q": 1,
          "NUM_SPLITS": splits, "SPLITS_P2": triton.next_power_of_2(splits), "HEAD_DIM": d, "BLOCK_D": d,
          "BLOCK_R": 16}
    opts = {"num_warps": 4, "num_stages": 1}
    return _report(triton.compile(_source(decode._merge_splits, ex, "bf16"), target=TARGET, options=opts), opts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", type=int, nargs="*", default=[64, 128, 256])
    args = parser.parse_args()
    for d in args.dims:
        print(f"append d={d:3}: {check_append(d)}", flush=True)
        print(f"merge  d={d:3} splits=33: {check_merge(d, 33)}", flush=True)
        for group in (1, 4):
            for paged in (False, True):
                for splits, features in ((1, False), (16, False), (16, True)):
                    try:
                        res = check_decode(d, group, paged, splits, features)
                    except Exception as e:  # noqa: BLE001  (reported, not fatal)
                        res = f"FAILED {type(e).__name__}: {str(e)[:300]}"
                    print(f"decode d={d:3} group={group} paged={paged:d} splits={splits:2} features={features:d}: "
                          f"{res}", flush=True)


if __name__ == "__main__":
    main()
