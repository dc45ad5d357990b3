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
from fa_backend.kernels.triton.kv_append import _append_kv


def _source(fn, example: dict, dtype: str):
    """compile_check._source plus explicit pointer types ("*i32") for the int32 index tensors."""
    typed = {n: v for n, v in example.items() if isinstance(v, str) and v.startswith("*")}
    src = _base_source(fn, {n: ("ptr32" if n in typed else v) for n, v in example.items()}, dtype)
    for n, ty in typed.items():
        src.signature[n] = ty
    return src


def check_decode(d: int, group: int, paged: bool, splits: int, features: bool, mask: int = 0) -> str:
    """mask: 0 none; 1 a bool key-padding mask (b, 1, 1, sk), 2 an additive (b, 1, sq, sk) mask, both as
    routed SDPA decode calls send them (one int cache length, no cache_seqlens tensor)."""
    block_n, warps, stages = decode.decode_config(d, splits)  # the GPU table (TRITON_INTERPRET unset here)
    page_tiles = False
    if paged:
        block_n, page_tiles = decode.page_block_n(block_n, 64)
    hkv, hq = 8, 8 * group
    idx = "*i32"
    ex = {"Q": "ptr", "K": "ptr", "V": "ptr", "O": "ptr", "LSE": "ptr32" if features else None,
          "WS": "ptr32" if splits > 1 else None, "CACHE_SEQLENS": idx, "BATCH_IDX": None,
          "LEFTPAD": idx if features else None, "BLOCK_TABLE": idx if paged else None,
          "ALIBI": "ptr32" if features else None, "COS": "ptr" if features else None,
          "SIN": "ptr" if features else None,
          "stride_qb": hq * d, "stride_qm": hq * d, "stride_qh": d, "stride_kb": 4096 * hkv * d,
          "stride_kn": hkv * d, "stride_kh": d, "stride_vb": 4096 * hkv * d, "stride_vn": hkv * d, "stride_vh": d,
          "stride_bt": 512, "SEQ_Q": 1, "SEQ_NEW": 1, "SEQ_BASE": 0, "qk_scale": 0.1, "softcap": 30.0,
          "WINDOW_LEFT": 0, "WINDOW_RIGHT": 0, "CAPACITY": 4096, "NUM_CACHE": 512, "GROUP": group, "NUM_HEADS_K": hkv, "HEAD_DIM": d,
          "BLOCK_M": decode.block_m_for(group, 1), "BLOCK_N": block_n, "BLOCK_D": d, "NUM_SPLITS": splits,
          "PAGE_SIZE": 64 if paged else 0, "PAGE_TILES": page_tiles and not features, "SOFTCAP": features,
          "HAS_LEFT": features, "HAS_RIGHT": features, "ALIBI_PER_BATCH": False,
          "ROTARY_DIM": d if features else 0, "ROTARY_INTERLEAVED": True, "ROTARY_POS_STEP": 0,
          "COUNTERS": idx if splits > 1 and decode.FUSED_MERGE else None,
          "SPLITS_P2": triton.next_power_of_2(splits),
          "SPLIT_CHUNK": decode.split_chunk(decode.block_m_for(group, 1), d, splits)}
    if mask:
        ex.update({"CACHE_SEQLENS": None, "MASK": "ptr8" if mask == 1 else "ptr", "stride_mb": 4096,
                   "stride_mh": 0, "stride_mm": 0 if mask == 1 else 4096, "stride_mn": 1, "MASK_KIND": mask})
    src = _source(decode._decode_split, ex, "bf16")
    opts = {"num_warps": warps, "num_stages": stages}
    return _report(triton.compile(src, target=TARGET, options=opts), opts)


def check_append(d: int) -> str:
    ex = {"K": "ptr", "V": "ptr", "K_CACHE": "ptr", "V_CACHE": "ptr", "SEQ_OFF": "*i32", "BATCH_IDX": None,
          "BLOCK_TABLE": None, "COS": "ptr", "SIN": "ptr", "stride_kb": 8 * d, "stride_ks": 8 * d, "stride_kh": d,
          "stride_vb": 8 * d, "stride_vs": 8 * d, "stride_vh": d, "stride_kcb": 4096 * 8 * d, "stride_kcs": 8 * d,
          "stride_kch": d, "stride_vcb": 4096 * 8 * d, "stride_vcs": 8 * d, "stride_vch": d, "stride_bt": 512,
          "SEQ": 1, "SEQ_BASE": 0, "CAPACITY": 4096, "NUM_CACHE": 64, "NUM_HEADS": 8, "HEAD_DIM": d, "BLOCK_D": d, "BLOCK_S": 16, "ROTARY_DIM": d,
          "INTERLEAVED": True, "PAGE_SIZE": 0}
    opts = {"num_warps": 4, "num_stages": 1}
    return _report(triton.compile(_source(_append_kv, ex, "bf16"), target=TARGET, options=opts), opts)


def check_merge(d: int, splits: int) -> str:
    ex = {"WS": "ptr32", "O": "ptr", "LSE": "ptr32", "N_ROWS": 256, "SEQ_Q": 1, "NUM_HEADS_Q": 32,
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
            for splits, mask in ((1, 1), (16, 1), (16, 2)):
                print(f"decode d={d:3} group={group} paged=0 splits={splits:2} mask={'bool' if mask == 1 else 'add '}: "
                      f"{check_decode(d, group, False, splits, False, mask)}", flush=True)


if __name__ == "__main__":
    main()
