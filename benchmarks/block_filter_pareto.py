"""Block filters: accuracy on real weights against operator time, one table and one plot.

    python benchmarks/block_filter_pareto.py \\
        --accuracy benchmarks/results/accuracy/smollm2_b32_bf16.json \\
        --operator benchmarks/results/operator/operator_h200_label_max_b32.json

Accuracy: the GPU suite's rows (``benchmarks.accuracy.gpu_suite``; SmolLM2 on the served
Triton path), each method's mean change against dense on the same samples, over the tasks and
contexts, at each budget share of the context. Time: the operator benchmark's one-layer decode
step at the given context and batch (``bench_operator.py``: ``ours`` with the file's block
score, ``ours_<other>`` with the other one, FlashInfer's full attention).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

# accuracy method (gpu_suite rows) -> the operator file's block score
BLOCK_SCORE_OF = {"two_level": "label_max", "two_level_bound": "bound"}


def accuracy_drops(rows: list[dict]) -> dict[tuple[str, int], tuple[float, float, int]]:
    """(method, budget share 1/r) -> (mean score, mean score - same-sample dense, cells)."""
    cells: dict = {}
    for r in rows:
        if not r.get("budget") or r.get("dense_score") is None:
            continue
        share = round(r["context"] / r["budget"])
        cells.setdefault((r["method"], share), []).append((r["score"], r["score"] - r["dense_score"]))
    return {k: (sum(s for s, _ in v) / len(v), sum(d for _, d in v) / len(v), len(v))
            for k, v in cells.items()}


def operator_times(doc: dict, context: int, batch: int) -> dict[str, float]:
    """block score (or "flashinfer") -> ms per layer at (context, batch)."""
    score = doc["config"].get("block_score", "bound")
    other = "bound" if score == "label_max" else "label_max"
    for r in doc["rows"]:
        if (r["context"], r["batch"]) == (context, batch):
            out = {score: r["ours_ms"], "flashinfer": r["flashinfer_ms"]}
            if r.get(f"ours_{other}_ms"):
                out[other] = r[f"ours_{other}_ms"]
            return out
    return {}


def table(acc: dict, times: dict, label: str) -> list[dict]:
    rows = []
    for (method, share), (score, drop, cells) in sorted(acc.items()):
        ms = times.get(BLOCK_SCORE_OF.get(method, ""))
        rows.append({"method": method, "budget_share": f"1/{share}", "mean_score": round(score, 1),
                     "mean_change_vs_dense": round(drop, 1), "cells": cells,
                     "operator_ms": None if ms is None else round(ms, 3), "speedup_vs_flashinfer":
                     round(times["flashinfer"] / ms, 2) if ms and times.get("flashinfer") else None,
                     "config": label})
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
    for r in rows:
        if r["operator_ms"] is None:
            continue
        ax.scatter(r["operator_ms"], r["mean_change_vs_dense"], s=30)
        ax.annotate(f"{r['method']} {r['budget_share']} {r['config']}",
                    (r["operator_ms"], r["mean_change_vs_dense"]), fontsize=7,
                    xytext=(4, 2), textcoords="offset points")
    ax.axhline(0, color="black", lw=1, ls="--")
    ax.set_xlabel("operator ms per layer (H200, 128k x 32; lower is faster)", fontsize=8)
    ax.set_ylabel("mean score change vs dense (points)", fontsize=8)
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--accuracy", nargs="+", required=True, help="gpu_suite results JSON(s)")
    p.add_argument("--operator", required=True, help="bench_operator results JSON")
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--out", default=None, help="JSON (a .md and .png beside it)")
    args = p.parse_args(argv)
    with open(args.operator) as f:
        op = json.load(f)
    times = operator_times(op, args.context, args.batch)
    rows = []
    for path in args.accuracy:
        with open(path) as f:
            doc = json.load(f)
        label = os.path.basename(path).removesuffix(".json").removeprefix("smollm2_")
        rows += table(accuracy_drops(doc["rows"]), times, label)
    head = ["method", "budget_share", "config", "mean_score", "mean_change_vs_dense", "cells",
            "operator_ms", "speedup_vs_flashinfer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("" if r[h] is None else str(r[h]) for h in head) + " |"
              for r in rows]
    lines.append(f"\nFlashInfer full attention: {times.get('flashinfer')} ms per layer at "
                 f"{args.context} x {args.batch}; operator commit {op.get('commit')}.")
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"operator": args.operator, "accuracy": args.accuracy,
                       "context": args.context, "batch": args.batch, "rows": rows}, f, indent=1)
        with open(args.out.removesuffix(".json") + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
        plot(rows, args.out.removesuffix(".json") + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
