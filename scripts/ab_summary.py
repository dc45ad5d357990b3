"""The table of an A/B run (scripts/ab_cute.sh): per command, cell (d, causal, seqlen) and timed column, the old and new
rounds and the change of their means.

Usage: python scripts/ab_summary.py DIR   (reads DIR/ab_<k>_<new|old><round>.json, as bench_cute.py or time_cute_bwd.py
write them: a list of records or {"records": [...]}; or {"rows": [...]}, as fa_backend.bench_decode and bench_varlen do)
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import statistics
import sys

NAME = re.compile(r"ab_(\d+)_(new|old)(\d+)\.json$")
KEY = ("d", "causal", "seqlen")
LABELS = ("runner", "direction", "case", "backend", "layout")
NUMERIC_LABELS = ("hkv", "batch")  # decode rows: one cell per (hkv, batch, seqlen, layout)


def records(path: pathlib.Path) -> list[dict]:
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        return data["records"] if "records" in data else data["rows"]
    return data


def summary(directory: pathlib.Path) -> list[str]:
    """Markdown rows: command, d, causal, seqlen, column, old rounds, new rounds, change of the means."""
    # (command, cell, column) -> side -> [figure per round, in round order]
    figures: dict = collections.defaultdict(lambda: {"new": [], "old": []})
    for path in sorted(directory.glob("ab_*.json"), key=lambda p: (int(NAME.search(p.name)[3]), p.name)):
        match = NAME.search(path.name)
        if match is None:
            continue
        command, side = int(match[1]), match[2]
        for record in records(path):
            cell = tuple(record.get(k) for k in KEY)
            # scripts whose records name what was timed (time_keep_bits.py: direction and case; runners) keep
            # those apart in the column
            label = " ".join([str(record[k]) for k in LABELS if isinstance(record.get(k), str)]
                             + [f"{k}={record[k]}" for k in NUMERIC_LABELS if k in record and "d" not in record])
            for column, value in record.items():
                if column in KEY or isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if column.endswith("_s") or column in ("batch", "heads"):  # first-call times, shapes
                    continue
                figures[command, cell, f"{label}: {column}" if label else column][side].append(float(value))
    rows = ["| cmd | d | causal | s | column | old | new | change |", "|---|---|---|---:|---|---:|---:|---:|"]
    def order(item):
        (command, cell, column), _ = item
        return command, tuple((v is None, str(type(v)), v if v is not None else 0) for v in cell), column

    for (command, (d, causal, seqlen), column), sides in sorted(figures.items(), key=order):
        old, new = sides["old"], sides["new"]
        if not old or not new:
            continue
        change = 100 * (statistics.mean(new) / statistics.mean(old) - 1)
        rows.append(f"| {command} | {d} | {causal} | {seqlen} | {column} | {' / '.join(f'{x:.1f}' for x in old)} | "
                    f"{' / '.join(f'{x:.1f}' for x in new)} | {change:+.1f} % |")
    return rows


if __name__ == "__main__":
    print("\n".join(summary(pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "out"))))
