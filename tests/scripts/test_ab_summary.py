"""scripts/ab_summary.py: the A/B table from the JSON files scripts/ab_cute.sh leaves (both record formats)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

_SPEC = importlib.util.spec_from_file_location(
    "ab_summary", pathlib.Path(__file__).resolve().parents[2] / "scripts" / "ab_summary.py")
ab_summary = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab_summary)


def test_rounds_and_change_per_cell_and_column(tmp_path: pathlib.Path) -> None:
    def write(name: str, figure: float, wrapped: bool) -> None:
        records = [dict(d=64, causal=True, seqlen=2048, batch=8, cute=figure, cute_first_call_s=1.5,
                        cute_rounds=[figure, figure])]
        (tmp_path / name).write_text(json.dumps(dict(records=records) if wrapped else records))

    write("ab_1_old1.json", 100.0, True)
    write("ab_1_new1.json", 104.0, True)
    write("ab_1_old2.json", 102.0, False)
    write("ab_1_new2.json", 106.0, False)
    rows = ab_summary.summary(tmp_path)
    assert rows[2:] == ["| 1 | 64 | True | 2048 | cute | 100.0 / 102.0 | 104.0 / 106.0 | +4.0 % |"]
