"""Reports of `python -m fa_backend bench --json` results: a PNG plot and Markdown tables.

    python -m fa_backend.bench_report RESULT.json [--plot OUT.png] [--markdown]
"""

from __future__ import annotations

import json
import sys


LABELS = {"triton": "fa_backend (triton)", "flex": "FlexAttention (compiled)", "flash_attn": "flash_attn (FA2)",
          "fa4": "FlashAttention-4 (CuTe)", "cute": "fa_backend (CuTe)"}


def plot(result: dict, path: str) -> None:
    """PNG of TFLOP/s against seqlen, one panel per (d, causal) column and fwd/bwd row, one line per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    groups = sorted({(r["d"], r["causal"]) for r in records})
    backends = list(dict.fromkeys(r["backend"] for r in records))
    standard = all(r["batch"] == max(1, 16384 // r["seqlen"]) and r["heads"] == max(1, 2048 // r["d"]) for r in records)
    xlabel = "seqlen (batch = 16k / seqlen, heads = 2048 / d)" if standard else "seqlen (shapes as given)"
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    for col, (d, causal) in enumerate(groups):
        for row, direction in enumerate(("fwd", "bwd")):
            ax = axes[row][col]
            for b in backends:
                pts = sorted((r["seqlen"], r[f"{direction}_tflops"]) for r in records
                             if r["backend"] == b and r["d"] == d and r["causal"] == causal and r[f"{direction}_tflops"])
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, marker="o", lw=2.5 if b == "triton" else 1.2, label=LABELS.get(b, f"SDPA {b}"))
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction}, d={d}, {'causal' if causal else 'non-causal'}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    env = result.get("environment", {})
    dtypes = ", ".join(dict.fromkeys(r.get("dtype", "") for r in records))
    fig.suptitle(f"{env.get('gpu', '')}, {dtypes}, torch {env.get('torch', '')}, triton {env.get('triton', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(result: dict) -> str:
    """One table per (direction, d, causal): TFLOP/s of each backend and our ratio to each peer."""
    records = result["records"]
    backends = list(dict.fromkeys(r["backend"] for r in records))
    peers = [b for b in backends if b != "triton"]
    out = []
    for d, causal in sorted({(r["d"], r["causal"]) for r in records}):
        for direction in ("fwd", "bwd"):
            rows = [r for r in records if r["d"] == d and r["causal"] == causal]
            out.append(f"\n**{direction}, d={d}, {'causal' if causal else 'non-causal'}** (TFLOP/s)\n")
            out.append("| seqlen | " + " | ".join(backends) + " | " + " | ".join(f"ours / {p}" for p in peers) + " |")
            out.append("|---:" * (1 + len(backends) + len(peers)) + "|")
            for s in sorted({r["seqlen"] for r in rows}):
                by = {r["backend"]: r[f"{direction}_tflops"] for r in rows if r["seqlen"] == s}
                ours = by.get("triton")
                cells = [f"{by[b]:.0f}" if by.get(b) else "-" for b in backends]
                ratios = [f"{ours / by[p]:.2f}x" if ours and by.get(p) else "-" for p in peers]
                out.append(f"| {s} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_file")
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables")
    args = parser.parse_args(argv)
    with open(args.json_file) as f:
        result = json.load(f)
    if args.plot:
        plot(result, args.plot)
    if args.markdown:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
