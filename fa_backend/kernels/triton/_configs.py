"""Tile configurations for the Triton kernels, per padded head dim.

The GPU table was chosen by timing candidates on an H200 (scripts/tune_triton.py); the
interpreter uses small tiles so CPU tests exercise multi-block loops on small shapes.
`override` lets tests and the tuner pin a configuration.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from ._launch import interpreting, pad_head_dim


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """dK/dV kernel (KV block stationary, walks query blocks) and dQ kernel (query block stationary)."""

    kv_block_m: int
    kv_block_n: int
    kv_num_warps: int
    kv_num_stages: int
    q_block_m: int
    q_block_n: int
    q_num_warps: int
    q_num_stages: int


_INTERPRETER_FWD = FwdConfig(16, 16, 4, 1)
_INTERPRETER_BWD = BwdConfig(16, 16, 4, 1, 16, 16, 4, 1)

# Keyed on max(padded d, padded dv). Larger head dims take smaller tiles so the fp32
# accumulators stay in registers.
_GPU_FWD: dict[int, FwdConfig] = {
    16: FwdConfig(128, 64, 4, 3),
    32: FwdConfig(128, 64, 4, 3),
    64: FwdConfig(128, 64, 4, 3),
    128: FwdConfig(128, 128, 8, 3),
    256: FwdConfig(128, 64, 8, 2),
}
_GPU_FWD_CAUSAL: dict[int, FwdConfig] = dict(_GPU_FWD)

_GPU_BWD: dict[int, BwdConfig] = {
    16: BwdConfig(64, 128, 4, 3, 128, 64, 4, 3),
    32: BwdConfig(64, 128, 4, 3, 128, 64, 4, 3),
    64: BwdConfig(64, 128, 4, 3, 128, 64, 4, 3),
    128: BwdConfig(64, 128, 8, 2, 128, 64, 8, 2),
    256: BwdConfig(32, 64, 4, 1, 64, 32, 4, 1),
}

_override: dict[str, object] = {"fwd": None, "bwd": None}


@contextlib.contextmanager
def override(fwd: FwdConfig | None = None, bwd: BwdConfig | None = None) -> Iterator[None]:
    """Pin the tile configuration used by every launch inside the block."""
    saved = dict(_override)
    _override.update(fwd=fwd, bwd=bwd)
    try:
        yield
    finally:
        _override.update(saved)


def _width(d: int, dv: int) -> int:
    return max(pad_head_dim(d), pad_head_dim(dv))


def fwd_config(q: torch.Tensor, d: int, dv: int, causal: bool) -> FwdConfig:
    if _override["fwd"] is not None:
        return _override["fwd"]  # type: ignore[return-value]
    if interpreting() or q.device.type != "cuda":
        return _INTERPRETER_FWD
    table = _GPU_FWD_CAUSAL if causal else _GPU_FWD
    return table[_width(d, dv)]


def bwd_config(q: torch.Tensor, d: int, dv: int, causal: bool) -> BwdConfig:
    if _override["bwd"] is not None:
        return _override["bwd"]  # type: ignore[return-value]
    if interpreting() or q.device.type != "cuda":
        return _INTERPRETER_BWD
    return _GPU_BWD[_width(d, dv)]
