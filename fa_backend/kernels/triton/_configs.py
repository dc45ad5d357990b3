"""Tile configurations for the Triton kernels, per padded head dim.

The GPU tables were chosen by timing candidates on an H200 (scripts/tune_triton.py) after
pruning the ones that spill registers (scripts/compile_check.py); the interpreter uses small
tiles so CPU tests exercise multi-block loops on small shapes. `override` pins a configuration
for tests and the tuner.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from . import _launch
from ._launch import pad_head_dim


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int = 4
    num_stages: int = 2
    lazy_rescale: bool = False  # forward only: see _common.RESCALE_LOG2 (candidates only until timed)
    atomic_dq: bool = False  # dK/dV only: dQ added there with atomics (flash_bwd.py; candidates only until timed)
    tma: bool = False  # TMA reads on sm90 where strides allow: forward and dQ K and V, dK/dV Q and dO
    key_major: bool = False  # dK/dV only: programs ordered key block first (causal: longest first; candidates only)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    dkdv: TileConfig  # KV-block-stationary kernel: block_n keys held, walks block_m query rows
    dq: TileConfig  # query-block-stationary kernel: block_m rows held, walks block_n keys


_INTERPRETER_FWD = TileConfig(16, 16, 4, 1)
_INTERPRETER_BWD = BwdConfig(TileConfig(16, 16, 4, 1), TileConfig(16, 16, 4, 1))

# Keyed on max(padded d, padded dv). Chosen on an H200 (bf16, batch*seqlen = 16384,
# heads*d = 2048, seqlen 4096) by scripts/tune_triton.py; widths 16 and 32 reuse the d=64 tiles.
_GPU_FWD: dict[int, TileConfig] = {
    16: TileConfig(128, 64, 8, 3),
    32: TileConfig(128, 64, 8, 3),
    64: TileConfig(128, 64, 8, 3),
    128: TileConfig(128, 128, 8, 3),
    256: TileConfig(128, 64, 8, 2),
}
_GPU_FWD_CAUSAL: dict[int, TileConfig] = {**_GPU_FWD, 128: TileConfig(128, 64, 8, 3)}
# Causal calls with short keys (seqlen_k <= SHORT_SEQLEN): smaller query tiles give more
# programs and a thinner masked diagonal (tuned at seqlen 512 and 1024: +2-20%).
SHORT_SEQLEN = 1024
_GPU_FWD_CAUSAL_SHORT: dict[int, TileConfig] = {
    **_GPU_FWD_CAUSAL, **{w: TileConfig(64, 32, 4, 3) for w in (16, 32, 64, 128)}}
# Causal calls with long keys (seqlen_k >= LONG_SEQLEN) at width 128: 128 x 128 tiles with K and V by TMA (the
# pointer-load 128 x 128 tile needs 254 registers, the TMA one 190). H200, s=8192: 450.8 against 428.9 TFLOP/s;
# at s=2048 they lose (341.7 against 361.6): scripts/tune_triton.py --kernels fwd, docs/perf-log.md.
LONG_SEQLEN = 8192
_GPU_FWD_CAUSAL_LONG: dict[int, TileConfig] = {**_GPU_FWD_CAUSAL, 128: TileConfig(128, 128, 8, 3, tma=True)}

# TMA tiles read their streamed operand (dK/dV: Q and dO; dQ: K and V) by TMA where strides allow, else by pointer
# loads (a dK/dV tile then runs one stage, as fast as two without TMA). Timed on the H200
# (scripts/tune_triton.py, s=4096; docs/perf-log.md): dK/dV at d=128 +4 %; dQ +2-3 % (d=64), +3 % (d=128).
_GPU_BWD: dict[int, BwdConfig] = {
    16: BwdConfig(TileConfig(32, 64, 4, 2), TileConfig(64, 64, 4, 3)),
    32: BwdConfig(TileConfig(32, 64, 4, 2), TileConfig(64, 64, 4, 3)),
    64: BwdConfig(TileConfig(32, 64, 4, 2), TileConfig(64, 64, 4, 3, tma=True)),
    # d=128 dK/dV: 64 x 64 x 4 warps with Q / dO by TMA (99 KB of shared memory: two CTAs per SM) against 64 x 128 x
    # 8 warps: 349.1 -> 369.5 TFLOP/s, causal (pointer loads before) 291.8 -> 315.4 (scripts/tune_triton.py, s=4096)
    128: BwdConfig(TileConfig(64, 64, 4, 2, tma=True), TileConfig(64, 64, 4, 2, tma=True)),
    # width 256: the TMA tiles (_TMA_256_*), timed at s=4096 against the pointer-load tiles 32 x 32 x 4 / 64 x 32 x 4
    # x 1 (which spill): dK/dV 146.5 -> 173.4 (causal 137.3 -> 156.9), dQ 146.9 -> 151.4 (137.3 -> 138.4) TFLOP/s
    256: BwdConfig(TileConfig(32, 64, 8, 2, tma=True), TileConfig(64, 32, 4, 2, tma=True)),
}
# dK/dV tiles for a launch whose Q / dO strides TMA cannot read, where the TMA tile with pointer loads would spill
# more than the previous table's tile (sm90 compile check, width 256: 32 x 64 x 8 x 1 spills 172 / 1148 bytes,
# 32 x 32 x 4 x 1 16 / 72); other widths run the TMA tile with pointer loads and one stage: the same tile shape, so
# that a launch with a broadcast dout (eager autograd's gradient of a sum) and one with a contiguous dout (the same
# graph compiled) sum in the same order (tests/kernels/triton/test_flash_attention_gpu.py compares them bitwise)
BWD_DKDV_WITHOUT_TMA: dict[int, TileConfig] = {256: TileConfig(32, 32, 4, 1)}
# Packed-sequence (varlen) launches read Q / dO by pointers; without features they keep the dK/dV tiles the width-128
# tables had before the 4-warp TMA tile, with which docs/benchmarks.md's varlen figures were measured
BWD_DKDV_VARLEN: dict[tuple[int, bool], TileConfig] = {(128, False): TileConfig(64, 128, 8, 1),
                                                       (128, True): TileConfig(64, 128, 8, 2)}
_GPU_BWD_CAUSAL: dict[int, BwdConfig] = {
    **_GPU_BWD,
    **{w: BwdConfig(TileConfig(32, 128, 4, 1), TileConfig(64, 64, 4, 3)) for w in (16, 32)},
    # d=64 dK/dV: the 32 x 128 x 4 warps tile with Q / dO by TMA and two stages (forty-first session; without TMA
    # strides it runs the previous tile, the same shape with pointer loads and one stage): H100, scripts/tune_triton.py
    # --kernels dkdv --dims 64, 242.3 -> 244.9 (s = 2048), 292.8 -> 296.9 (8192) TFLOP/s. sm90: 253 registers, no spills
    64: BwdConfig(TileConfig(32, 128, 4, 2, tma=True), TileConfig(64, 64, 4, 3, tma=True)),
    128: BwdConfig(TileConfig(64, 64, 4, 2, tma=True), TileConfig(64, 64, 4, 2, tma=True)),
}
# GQA (more query heads than key/value heads) at width 128, causal: the dK/dV programs in key-block-major order
# (the first key blocks, GROUP times longer than MHA's, start first). H200, hq = 4 hkv, scripts/tune_triton.py
# --group 4 --match key_major=True (dK/dV + dQ TFLOP/s): 64 x 64 x 4 warps by TMA in key-major order 286.7 / 353.1
# (s = 2k / 8k) against 257.1 / 314.1 in the table's order and 268.0 / 328.7 for the previous 64 x 128 x 8 key-major
# tile. Non-causal GQA runs the MHA table (64 x 64 in the table's order: 379.6 / 406.3; key-major 375.9 / 388.8;
# the previous key-major 64 x 128 336.8 / 367.4).
_GPU_BWD_GQA: dict[int, BwdConfig] = {128: _GPU_BWD[128]}
_GPU_BWD_GQA_CAUSAL: dict[int, BwdConfig] = {128: BwdConfig(TileConfig(64, 64, 4, 2, tma=True, key_major=True),
                                                            _GPU_BWD_CAUSAL[128].dq)}

# Calls with optional features (mask, dropout, window, softcap, ALiBi) need more registers per score
# tile; at width 128 the tiles below compile without spills on sm90 for every feature
# (scripts/compile_check.py --features; dropout's dK/dV keeps a 12-16 byte spill). Other widths use the plain
# tables.
_GPU_FWD_FEATURES: dict[int, TileConfig] = {128: TileConfig(128, 64, 8, 3)}
_GPU_BWD_FEATURES: dict[int, BwdConfig] = {128: BwdConfig(TileConfig(32, 128, 8, 1), TileConfig(64, 32, 4, 2))}
# Three feature classes timed on the H200 (scripts/tune_features.py, bf16, d=128, seqlen 8192, TFLOP/s of the
# whole backward with the other kernel's tile fixed; docs/perf-log.md): an attn_mask alone read through block
# bounds (kernels/triton/_mask_bounds.py; most tiles then run the unmasked loop), the same with a key mask packed
# 32 keys per word (_common.MASK_BITS_ROW), and dropout. TMA tiles (K / V, or Q / dO, by tensor descriptors) need
# far fewer registers with a feature (sm90 compile check: packed-mask dQ 64 x 64 255 + 24 bytes of spills -> 187
# registers, none; dropout dQ 255 + 108 -> 224, none). dK/dV 64 x 64 x 4 warps by TMA against the previous tables'
# tiles: explicit causal mask 537 -> 600, key padding 370 -> 420, random keys 287 -> 324, dropout 198 -> 214 (not
# taken, below); dQ by TMA: 537 -> 596, 370 -> 391, 287 -> 313, 198 -> 206 (64 x 32 x 3 stages; 64 x 64: 205).
_GPU_BWD_MASK_BOUNDS: dict[int, BwdConfig] = {128: BwdConfig(TileConfig(64, 64, 4, 2, tma=True),
                                                            TileConfig(64, 64, 4, 2, tma=True))}
_GPU_BWD_MASK_ROWS: dict[int, BwdConfig] = {128: BwdConfig(TileConfig(64, 64, 4, 2, tma=True),
                                                          TileConfig(64, 64, 4, 2, tma=True))}
# Dropout keeps its dK/dV tile: the 64 x 64 TMA one spills 244 bytes when causal and 176-1040 with other features
# (sm90 compile check; 32 x 128 x 8 x 1: 0-112).
_GPU_BWD_DROPOUT: dict[int, BwdConfig] = {128: BwdConfig(TileConfig(32, 128, 8, 1), TileConfig(64, 32, 4, 3, tma=True))}
# Forward of a packed key mask: 128 x 128 x 3 stages with K / V by TMA (225 registers; the pointer-load 128 x 64
# needs 254): key padding 587 -> 630, random keys 399 -> 463 TFLOP/s. 2-D masks keep 128 x 64 (the TMA 128 x 128
# x 3 tile needs 246 KB of shared memory with their bounds; x 2 stages: 827 against 842), dropout too (the TMA
# tiles lose: 272-289 against 303).
_GPU_FWD_MASK_ROWS: dict[int, TileConfig] = {128: TileConfig(128, 128, 8, 3, tma=True)}
_FWD_FEATURE_TABLES = {"mask_rows": _GPU_FWD_MASK_ROWS}
_BWD_FEATURE_TABLES = {"features": _GPU_BWD_FEATURES, "mask_bounds": _GPU_BWD_MASK_BOUNDS,
                       "mask_rows": _GPU_BWD_MASK_ROWS, "dropout": _GPU_BWD_DROPOUT}

_override: dict[str, object] = {"fwd": None, "bwd": None}


@contextlib.contextmanager
def override(fwd: TileConfig | None = None, bwd: BwdConfig | None = None) -> Iterator[None]:
    """Pin the tile configuration used by every launch inside the block."""
    saved = dict(_override)
    _override.update(fwd=fwd, bwd=bwd)
    try:
        yield
    finally:
        _override.update(saved)


def fwd_table(causal: bool, seqlen_k: int | None = None) -> dict[int, TileConfig]:
    if causal and seqlen_k is not None and seqlen_k <= SHORT_SEQLEN:
        return _GPU_FWD_CAUSAL_SHORT
    if causal and seqlen_k is not None and seqlen_k >= LONG_SEQLEN:
        return _GPU_FWD_CAUSAL_LONG
    return _GPU_FWD_CAUSAL if causal else _GPU_FWD


def bwd_table(causal: bool) -> dict[int, BwdConfig]:
    return _GPU_BWD_CAUSAL if causal else _GPU_BWD


def fwd_candidates(width: int) -> list[TileConfig]:
    """Forward tiles worth timing for a padded head dim (no register spills on sm90 at bf16), the
    lazy-rescale variant of the table's tiles, and TMA variants of the 8-warp and 64-row tiles up to width 128."""
    lazy = [dataclasses.replace(t[width], lazy_rescale=True) for t in (_GPU_FWD, _GPU_FWD_CAUSAL) if width in t]
    plain = _plain_fwd_candidates(width)
    # K and V by TMA (no per-thread addresses in the pipelined loads) on the 8-warp tiles, and on the 64-row 4-warp
    # ones short causal calls run (sm90 compile, d=128 causal: 64 x 32 x 4 x 3 119 registers against 162 with
    # pointer loads; 64 x 64 x 4 x 3 139, 116 KB; no spills)
    tma = [dataclasses.replace(c, tma=True) for c in plain
           if width <= 128 and (c.num_warps == 8 or (c.num_warps == 4 and c.block_m == 64))]
    return list(dict.fromkeys(plain + lazy + tma))


def _plain_fwd_candidates(width: int) -> list[TileConfig]:
    if width <= 64:
        return [TileConfig(128, 64, 4, s) for s in (2, 3, 4)] + [
            TileConfig(128, 128, 8, s) for s in (2, 3)] + [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 4),
                                                          TileConfig(64, 64, 4, 3), TileConfig(64, 64, 4, 4),
                                                          TileConfig(64, 32, 4, 3)]
    if width <= 128:
        return [TileConfig(128, 128, 8, 3), TileConfig(128, 64, 8, 2), TileConfig(128, 64, 8, 3),
                TileConfig(128, 64, 8, 4), TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 3),
                TileConfig(64, 128, 8, 2), TileConfig(128, 32, 4, 4), TileConfig(64, 32, 4, 3),
                TileConfig(64, 64, 4, 4), TileConfig(128, 128, 8, 2)]
    return [TileConfig(64, 64, 4, 2), TileConfig(64, 32, 4, 2), TileConfig(64, 64, 8, 2),
            TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 2)]


def dkdv_candidates(width: int) -> list[TileConfig]:
    """dK/dV tiles worth timing, and atomic-dQ variants of those with 32 query rows per step (8 warps from
    width 128 on): the ones that leave registers for the dQ tile (sm90 compile check: larger ones spill)."""
    plain = _plain_dkdv_candidates(width)
    table = [t[width].dkdv for t in (_GPU_BWD, _GPU_BWD_CAUSAL) if width in t]
    atomic = [dataclasses.replace(c, atomic_dq=True) for c in table + plain
              if c.block_m <= 32 and (width <= 64 or c.num_warps == 8)]
    # TMA loads free the registers of the Q / dO tile addresses: deeper pipelines of the large tiles (sm90 compile
    # check, d=128 64 x 128 x 8 warps: 2 stages spill 4 bytes instead of 36, causal 24 instead of 124)
    tma = [dataclasses.replace(c, tma=True) for c in table + plain if c.num_warps == 8 and c.block_n == 128]
    # and 4-warp TMA tiles (two CTAs per SM at d=128: 99 KB of shared memory each); the best dK/dV tile of the
    # feature backwards on the H200 (scripts/tune_features.py: key padding +14 %, explicit causal mask +12 %)
    tma += [TileConfig(64, 64, 4, 2, tma=True), TileConfig(64, 64, 4, 3, tma=True), TileConfig(32, 64, 4, 2, tma=True)]
    # the d=64 causal tile before the forty-first session (32 x 128 x 4 x 1, pointer loads) by TMA with a second
    # stage, the table's since: sm90 compile, causal, 253 registers, no spills, 49 KB (64 x 128 x 4 x 2 spills 1032)
    tma += [TileConfig(32, 128, 4, 2, tma=True)] if width <= 64 else []
    # dQ by TMA bulk reduce-add (no per-element atomics) on tiles that leave registers for the dQ tile
    tma_atomic = [dataclasses.replace(c, tma=True, atomic_dq=True) for c in table + plain + _TMA_ATOMIC_EXTRA
                  if width <= 128 and c.block_m * (c.block_n if width <= 64 else 128) <= 64 * 128
                  and (width <= 64 or c.num_warps == 8)]
    wide = _TMA_256_DKDV if width == 256 else []
    # the tables' tiles with the programs in key-block-major order (causal GQA: dK/dV programs GROUP times longer,
    # the first key blocks the longest; H200: GQA 32:8 causal backward 0.90-0.93x of MHA's)
    gqa = [t[width].dkdv for t in (_GPU_BWD_GQA, _GPU_BWD_GQA_CAUSAL) if width in t]
    key_major = [dataclasses.replace(c, key_major=True) for c in table] + gqa
    return list(dict.fromkeys(plain + atomic + tma + tma_atomic + wide + key_major))


_TMA_ATOMIC_EXTRA = [TileConfig(64, 128, 8, 1), TileConfig(32, 128, 8, 3), TileConfig(64, 64, 8, 3)]
# Width 256 (d = 129-256): the table's pointer-load tiles spill (sm90 compile check: dQ 64 x 32 x 4 warps, 504-524
# bytes; dK/dV 32 x 32 x 4 warps, 16-72 bytes, and no wgmma at 32 rows per 4 warps). With Q / dO (dK/dV) or K / V
# (dQ) by TMA, these compile with 8 warps, two stages and wgmma: dK/dV 32 x 64: 238 registers, no spills (causal: 52
# bytes); dQ 64 x 64: 225-229 registers, none; dQ 64 x 32 x 4 warps: 0-8 bytes. In the table since 2026-11-30 (timed).
_TMA_256_DKDV = [TileConfig(32, 64, 8, 2, tma=True)]
_TMA_256_DQ = [TileConfig(64, 64, 8, 2, tma=True), TileConfig(64, 32, 4, 2, tma=True)]


def _plain_dkdv_candidates(width: int) -> list[TileConfig]:
    if width <= 64:
        return [TileConfig(64, 128, 8, s) for s in (1, 2, 3)] + [
            TileConfig(64, 64, 4, s) for s in (1, 2)] + [TileConfig(32, 128, 4, 1), TileConfig(32, 64, 4, 2)]
    if width <= 128:
        return [TileConfig(64, 128, 8, s) for s in (1, 2)] + [
            TileConfig(32, 128, 8, 2), TileConfig(64, 64, 8, 2), TileConfig(32, 64, 4, 2),
            TileConfig(64, 64, 4, 1), TileConfig(32, 64, 8, 2)]
    return [TileConfig(32, 64, 4, 1), TileConfig(32, 64, 8, 1), TileConfig(64, 64, 8, 1), TileConfig(32, 32, 4, 1),
            TileConfig(16, 32, 4, 1)]


def dq_candidates(width: int) -> list[TileConfig]:
    """dQ tiles worth timing, and TMA variants (K and V by TMA) of those up to width 128 with 2-3 stages, and
    of two 2-stage tiles at width 256."""
    plain = _plain_dq_candidates(width)
    tma = [dataclasses.replace(c, tma=True) for c in plain if width <= 128 and c.num_stages >= 2]
    # wider key steps and a third stage, which TMA's register savings allow at width 128 (sm90 compile check: 174-255
    # registers, at most 8 bytes of spills)
    wide = [TileConfig(64, 64, 4, 3, tma=True), TileConfig(64, 128, 4, 2, tma=True),
            TileConfig(64, 128, 8, 2, tma=True), TileConfig(128, 128, 8, 2, tma=True)] if width == 128 else []
    return list(dict.fromkeys(plain + tma + wide + (_TMA_256_DQ if width == 256 else [])))


def _plain_dq_candidates(width: int) -> list[TileConfig]:
    if width <= 64:
        return [TileConfig(64, 64, 4, s) for s in (1, 2, 3)] + [
            TileConfig(128, 64, 8, s) for s in (1, 2)] + [TileConfig(128, 32, 4, 2), TileConfig(128, 128, 8, 2)]
    if width <= 128:
        return [TileConfig(128, 64, 8, s) for s in (1, 2)] + [
            TileConfig(64, 64, 4, s) for s in (1, 2)] + [TileConfig(64, 64, 8, 2), TileConfig(128, 32, 8, 2),
                                                          TileConfig(64, 32, 4, 2)]
    return [TileConfig(64, 32, 4, 1), TileConfig(64, 64, 8, 1), TileConfig(64, 32, 8, 1), TileConfig(32, 64, 4, 1),
            TileConfig(32, 32, 4, 1), TileConfig(16, 64, 4, 1)]


def _width(d: int, dv: int) -> int:
    return max(pad_head_dim(d), pad_head_dim(dv))


def fwd_config(q: torch.Tensor, d: int, dv: int, causal: bool, seqlen_k: int,
               features: bool | str = False) -> TileConfig:
    """Forward tile; features: False for a plain call, else a class of _features.tile_class (True: any)."""
    if _override["fwd"] is not None:
        return _override["fwd"]  # type: ignore[return-value]
    if q.device.type != "cuda" or _launch._INTERPRET:
        return _INTERPRETER_FWD
    width = _width(d, dv)
    if features:
        table = _FWD_FEATURE_TABLES.get(features, _GPU_FWD_FEATURES)
        if width in table:
            return table[width]
    return fwd_table(causal, seqlen_k)[width]


# flash_fwd's EXACT_PV launches (the fp32 recomputation of O for small backward calls: fp32 P @ V, no tensor cores):
# a tile whose fp32 operands fit at every head dim. The plain tables' tiles spilled up to 18 KB and asked for up to
# 320 KB of shared memory at d = 128-256 (sm90 compile check); this one: 206 / 228 registers at d = 128 / 256, no
# spills, 22 / 43 KB. Host-bound calls: the tile's speed is not seen. Pinned tiles do not apply.
FWD_EXACT_PV = TileConfig(16, 32, 8, 1)


def fwd_exact_pv_config(q: torch.Tensor) -> TileConfig:
    """The forward tile of an EXACT_PV launch (the interpreter's tile on the CPU)."""
    return _INTERPRETER_FWD if q.device.type != "cuda" or _launch._INTERPRET else FWD_EXACT_PV


def fwd_without_tma(cfg: TileConfig, causal: bool, d: int, dv: int, features: bool | str = False) -> TileConfig:
    """The forward tile of a launch that cannot read K / V by TMA although `cfg` asks for it: the pointer-load
    tile of its table (plain, or the feature calls' _GPU_FWD_FEATURES); for a pinned tile, the same tile with
    pointer loads."""
    if _override["fwd"] is not None:
        return dataclasses.replace(cfg, tma=False)
    width = _width(d, dv)
    if features and width in _GPU_FWD_FEATURES:
        return _GPU_FWD_FEATURES[width]
    return fwd_table(causal)[width]


def bwd_config_varlen(q: torch.Tensor, d: int, dv: int, causal: bool, features: bool = False) -> BwdConfig:
    """Backward tiles of a packed-sequence launch: bwd_config's, with BWD_DKDV_VARLEN's dK/dV tile for a plain
    call on the GPU (not under a pinned tile)."""
    cfg = bwd_config(q, d, dv, causal, features)
    if _override["bwd"] is None and not features and q.device.type == "cuda" and not _launch._INTERPRET:
        dkdv = BWD_DKDV_VARLEN.get((_width(d, dv), causal))
        if dkdv is not None:
            cfg = dataclasses.replace(cfg, dkdv=dkdv)
    return cfg


def bwd_config(q: torch.Tensor, d: int, dv: int, causal: bool, features: bool | str = False,
               group: int = 1) -> BwdConfig:
    """Backward tiles; features: False for a plain call, else True / "features", "mask_bounds" (an attn_mask
    alone, read through block bounds), "mask_rows" (the same, a packed key mask) or "dropout" (with or without
    other features); group: query heads per key/value head (GQA tiles for a plain call when > 1)."""
    if _override["bwd"] is not None:
        return _override["bwd"]  # type: ignore[return-value]
    if q.device.type != "cuda" or _launch._INTERPRET:
        return _INTERPRETER_BWD
    width = _width(d, dv)
    if features:
        table = _BWD_FEATURE_TABLES["features" if features is True else features]
        if width in table:
            return table[width]
    elif group > 1:
        gqa = _GPU_BWD_GQA_CAUSAL if causal else _GPU_BWD_GQA
        if width in gqa:
            return gqa[width]
    return bwd_table(causal)[width]
