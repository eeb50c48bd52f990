"""Do two implementations agree? The same suite cells from two results files side by side.

    python -m benchmarks.accuracy.compare_impls \\
        benchmarks/results/accuracy/smollm2_b32_bf16.json \\
        benchmarks/results/accuracy/smollm2_cpu_b32_bf16.json --names triton-h200 reference-cpu

For every (task, context, method, budget) both files hold: each score with its Wilson 95 %
interval, and whether the intervals overlap (the samples are the same ones where the smaller
run's sample indices are a prefix of the larger's: the suite's samples depend only on task,
context and index). Prints a markdown table; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence

KEY = ("task", "context", "method", "budget")


def compare(a: dict, b: dict) -> list[dict]:
    """Rows of the cells both documents hold, in ``a``'s order."""
    theirs = {tuple(r[k] for k in KEY): r for r in b["rows"]}
    out = []
    for r in a["rows"]:
        s = theirs.get(tuple(r[k] for k in KEY))
        if s is None or r.get("ci_low") is None or s.get("ci_low") is None:
            continue
        out.append({**{k: r[k] for k in KEY}, "a": r["score"], "a_n": r["n"],
                    "a_ci": (r["ci_low"], r["ci_high"]), "b": s["score"], "b_n": s["n"],
                    "b_ci": (s["ci_low"], s["ci_high"]),
                    "overlap": r["ci_low"] <= s["ci_high"] and s["ci_low"] <= r["ci_high"]})
    return out


def render(rows: list[dict], names: Sequence[str]) -> str:
    head = ["task", "context", "method", "budget", f"{names[0]} (n)", f"{names[1]} (n)",
            "intervals overlap"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cell = lambda s, n, ci: f"{s:.0f} [{ci[0]:.0f}, {ci[1]:.0f}] ({n})"  # noqa: E731
        lines.append("| " + " | ".join([r["task"], str(r["context"]), r["method"],
                                        str(r["budget"]), cell(r["a"], r["a_n"], r["a_ci"]),
                                        cell(r["b"], r["b_n"], r["b_ci"]),
                                        "yes" if r["overlap"] else "**no**"]) + " |")
    agree = sum(r["overlap"] for r in rows)
    lines.append(f"\n{agree} of {len(rows)} cells agree within their intervals.")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--names", nargs=2, default=["first", "second"])
    p.add_argument("--out", default=None, help="markdown file")
    args = p.parse_args(argv)
    with open(args.first) as f, open(args.second) as g:
        rows = compare(json.load(f), json.load(g))
    text = render(rows, args.names)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
