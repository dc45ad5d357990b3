"""scripts/tune_triton.py's job list: the table's tile first, candidates after, per head dim and causal mode; a head
dim between the tables' widths on its padded width's tiles."""

from __future__ import annotations

import importlib.util
import pathlib

from fa_backend.kernels.triton import _configs as C

_SPEC = importlib.util.spec_from_file_location(
    "tune_triton", pathlib.Path(__file__).resolve().parents[2] / "scripts" / "tune_triton.py")
tune_triton = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(tune_triton)


def test_head_dim_96_takes_width_128_tiles_causal_only() -> None:
    jobs = tune_triton._jobs([96], ["dkdv", "dq"], None, (True,))
    assert {(kind, d, causal) for kind, d, causal, _ in jobs} == {("dkdv", 96, True), ("dq", 96, True)}
    dkdv = [cfg for kind, _, _, cfg in jobs if kind == "dkdv"]
    dq = [cfg for kind, _, _, cfg in jobs if kind == "dq"]
    assert dkdv[0] == C.bwd_table(True)[128].dkdv and dq[0] == C.bwd_table(True)[128].dq
    assert set(dkdv) == {C.bwd_table(True)[128].dkdv, *C.dkdv_candidates(128)}
    assert set(dq) == {C.bwd_table(True)[128].dq, *C.dq_candidates(128)}
    assert len(dkdv) == len(set(dkdv))  # the table's tile is not timed twice


def test_match_filters_candidates_but_keeps_the_table_tile() -> None:
    jobs = tune_triton._jobs([64], ["dkdv"], ["key_major=True"])
    for causal in (False, True):
        cfgs = [cfg for _, _, c, cfg in jobs if c == causal]
        assert cfgs[0] == C.bwd_table(causal)[64].dkdv
        assert cfgs[1:] and all(cfg.key_major for cfg in cfgs[1:])
