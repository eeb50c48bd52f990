#!/usr/bin/env python
"""Same-call before/after comparison of a code change on the GPU (issue 40: the decode step as
plan + run). Writes ``refactor_h200.json`` (suite ``refactor``) with one row per compared number.

Two trees, each installed (``pip install --no-deps --target``) into its own site folder under
``--work``, never over each other: the *before* tree (``--before``, default ``.before/``, made
by ``benchmarks/device/export_before.sh`` and carried to the device) and this checkout (*after*).
Every process of a tree (its operator benchmark, its SGLang server, the server's scheduler) runs
with ``PYTHONPATH=<its site>:<the SGLang bundle>`` from a folder holding no source tree, so the
plugin that SGLang finds through its entry point, and every kernel it imports, is that tree's
(``python -m`` puts the working directory first on ``sys.path``: a checkout there would win).
Before measuring, a probe in each environment checks where ``sglang_ext`` is imported from.

Parts (``--parts``; each one's rows are written as soon as it ends):

* ``operator``: each tree's own ``benchmarks/bench_operator.py`` (the kernels' signatures
  differ between the trees) at the headline shape, 128k x batch 32, block 32, budget 2048,
  ``two_level`` by ``label_max`` and (``--compare-block-score``) by the bound, no baselines;
  ``--rounds`` runs per tree in the order before, after, after, before, ... (drift cancels);
  a tree's number is the mean of its runs' medians. Bar: within ``--operator-bar`` (2 %).
* ``serving``: one server per tree in turn, the same client (this tree's
  ``e2e_serving.py`` functions), dummy weights ``SGLANG_EXT_DUMMY_WEIGHTS=scaled``. Each first
  answers the fixed greedy set (``--greedy-prompts`` random-token prompts per
  ``--greedy-lengths``, fixed seeds, requests one at a time, ``--greedy-output-len`` tokens):
  before and after must give identical token ids, with at least one decisive token (top-2
  margin above ``--tie-margin``). Then ``bench_serving`` at ``--input-len`` (32k): output
  throughput and the server log's decode rate within ``--serving-bar`` (3 %).

A bar is two-sided (``|after / before - 1| <= bar``). A row measured on both sides gets
``passed`` true or false; a row that is missing or errored gets ``passed`` null, and so does the
file's top-level ``passed`` while any required row is missing: nothing passes unmeasured.

A device call lasts at most 10 minutes. With a FlashInfer AOT cache absent, both parts together
need about that (two server starts of 1.5-3 min each): run them in two consecutive calls
(``REFACTOR_PARTS=operator``, then ``REFACTOR_PARTS=serving`` of benchmarks/device/run.sh's
``refactor`` step). The driver keeps its file in ``--work`` too; a later call on the still-warm
machine with the same commits and GPU takes the other part's rows from there, so the second
call's file holds both. Otherwise join the calls' files here: ``--merge A.json B.json``.

    python benchmarks/refactor_compare.py --out $OUT [--parts operator serving]
    python benchmarks/refactor_compare.py --dry-run          # the plan, no GPU
    python benchmarks/refactor_compare.py --merge a/refactor_h200.json b/refactor_h200.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from typing import Any, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import results_io  # noqa: E402

RESULTS_NAME = "refactor_h200"
SIDES = ("before", "after")
PARTS = ("operator", "serving")
WORK = "/tmp/sglang_ext_refactor"
# what a tree's site is built from (pyproject.toml maps kernels/ and patches/ into sglang_ext)
PACKAGE_PATHS = ("sglang_ext", "kernels", "patches", "pyproject.toml")
OPERATOR_BAR = 0.02
SERVING_BAR = 0.03
# (metric of bench_operator's row, block score, gated: counts for the verdict)
OPERATOR_METRICS = (("ours_ms", "label_max", True), ("ours_bound_ms", "bound", True),
                    ("ours_select_ms", "label_max", False),
                    ("ours_bound_select_ms", "bound", False))
# (metric, bench_serving / server-log field, lower is better, gated)
SERVING_METRICS = (("output_tok_s", "output_tok_s", False, True),
                   ("decode_tok_s", "decode_tok_s", False, True),
                   ("median_itl_ms", "median_itl_ms", True, False),
                   ("median_ttft_ms", "median_ttft_ms", True, False))
# the rows the verdict needs: (check, metric)
REQUIRED = (("operator", "ours_ms"), ("operator", "ours_bound_ms"),
            ("serving", "output_tok_s"), ("serving", "decode_tok_s"), ("greedy", "output_ids"))
PART_OF_CHECK = {"operator": "operator", "serving": "serving", "greedy": "serving"}
# the probe run in each tree's environment: where the plugin comes from
PROBE_MODULES = ("sglang_ext", "sglang_ext.plugin", "sglang_ext.kernels.sparse_decode")
PROBE = (
    "import importlib, json, importlib.metadata as m\n"
    f"files = {{n: importlib.import_module(n).__file__ for n in {PROBE_MODULES!r}}}\n"
    "eps = [e for e in m.entry_points(group='sglang.srt.plugins') if e.name == 'sglang_ext']\n"
    "dist = str(eps[0].dist.locate_file('')) if eps and eps[0].dist else None\n"
    "print(json.dumps({'files': files, 'entry_point_dist': dist}))\n"
)


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/refactor_compare.py", allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Parts, bars and the two-call recipe: see the module docstring "
               "(docs/benchmarks.md, 'Before/after comparisons').")
    p.add_argument("--out", default=None,
                   help="results folder (default: benchmarks/results/refactor)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--before", default=os.path.join(REPO, ".before"),
                   help="the before tree (export_before.sh; its COMMIT file names the commit)")
    p.add_argument("--after", default=REPO, help="the after tree (default: this checkout)")
    p.add_argument("--before-commit", default=None, help="default: BEFORE/COMMIT")
    p.add_argument("--after-commit", default=None,
                   help="default: $SGLANG_EXT_COMMIT or git HEAD (results_io.git_commit)")
    p.add_argument("--work", default=WORK,
                   help="the sites, logs and the state file (default: %(default)s)")
    p.add_argument("--time-limit", type=float, default=510.0,
                   help="seconds for this run; a part that no longer fits is skipped and says "
                        "so (default %(default)s: a device call has 600 with its set-up)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (installs, commands, server flags); run nothing")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="run nothing: join these results files (two calls' parts) into --out")
    op = p.add_argument_group("operator")
    op.add_argument("--context", type=int, default=131072)
    op.add_argument("--batch", type=int, default=32)
    op.add_argument("--operator-block-size", type=int, default=32)
    op.add_argument("--budget", type=int, default=2048)
    op.add_argument("--rounds", type=int, default=2,
                    help="runs per tree, in the order before, after, after, before, ...")
    op.add_argument("--iters", type=int, default=50, help="bench_operator --iters")
    op.add_argument("--warmup", type=int, default=10, help="bench_operator --warmup")
    op.add_argument("--operator-extra", default="",
                    help="more bench_operator flags for both trees (last, they win)")
    op.add_argument("--operator-bar", type=float, default=OPERATOR_BAR)
    op.add_argument("--operator-seconds", type=float, default=150,
                    help="time the operator part needs (skipped when less is left)")
    sv = p.add_argument_group("serving and greedy outputs")
    sv.add_argument("--model", default=os.path.join(REPO, ".gpu/models/qwen3-8b-shape"))
    sv.add_argument("--tokenizer", default=os.path.join(REPO, ".gpu/models/tokenizer"))
    sv.add_argument("--config", default="sglang_ext_fi_fp8s_bound",
                    help="e2e_serving.py's configuration (default: the headline serving rows')")
    sv.add_argument("--dense-backend", default="triton", choices=["triton", "config"],
                    help="the prefill's backend: triton (no FlashInfer JIT compile, ~4 min on a "
                         "fresh machine) or the configuration's own")
    sv.add_argument("--block-size", type=int, default=32)
    sv.add_argument("--label-channels", type=int, default=16)
    sv.add_argument("--input-len", type=int, default=32768)
    sv.add_argument("--output-len", type=int, default=256)
    sv.add_argument("--num-prompts", type=int, default=8)
    sv.add_argument("--concurrency", type=int, default=8)
    sv.add_argument("--warmup-requests", type=int, default=1)
    sv.add_argument("--extra", default="--mem-fraction-static 0.75 --cuda-graph-max-bs 8 "
                    "--max-running-requests 8", help="more server flags (default: %(default)s)")
    sv.add_argument("--dummy-weights", default="scaled", choices=["scaled", "sglang"],
                    help="SGLANG_EXT_DUMMY_WEIGHTS of both servers (scaled: decisive greedy)")
    sv.add_argument("--port", type=int, default=30000)
    sv.add_argument("--startup-timeout", type=float, default=330)
    sv.add_argument("--serving-bar", type=float, default=SERVING_BAR)
    sv.add_argument("--serving-seconds", type=float, default=360,
                    help="time the serving part needs (skipped when less is left)")
    sv.add_argument("--greedy-prompts", type=int, default=4, help="prompts per length")
    sv.add_argument("--greedy-lengths", type=int, nargs="+", default=[1536, 8192],
                    help="prompt lengths: within the budget (dense-equal) and beyond it")
    sv.add_argument("--greedy-output-len", type=int, default=64)
    sv.add_argument("--tie-margin", type=float, default=0.25,
                    help="nats; only for the diagnosis of a difference (identical is the bar)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.merge and args.dry_run:
        p.error("--merge and --dry-run exclude each other")
    args.out = args.out or results_io.suite_dir(RESULTS_NAME)
    for name in ("before", "after", "work", "model", "tokenizer"):
        setattr(args, name, os.path.abspath(getattr(args, name)))
    return args


# ----------------------------------------------------------------------------- pure parts


def operator_order(rounds: int) -> list[str]:
    """before, after, after, before, before, after, ...: a linear drift cancels in pairs."""
    return [side for r in range(rounds) for side in (SIDES if r % 2 == 0 else SIDES[::-1])]


def operator_flags(args: argparse.Namespace) -> list[str]:
    """bench_operator's flags: the headline case alone, ours with both block scores, no
    baselines (FlashInfer would JIT-compile for minutes), no other variants or stages."""
    bs = str(args.operator_block_size)
    return ["--contexts", str(args.context), "--batches", str(args.batch), "--block-size", bs,
            "--fi-page-size", bs, "--budget", str(args.budget), "--block-score", "label_max",
            "--compare-block-score", "--skip-flashinfer", "--skip-triton", "--no-compare-topk",
            "--no-compare-label-cache", "--no-compare-scatter", "--no-fi-sparse",
            "--no-breakdown", "--compare-block-score-precision", "none",
            "--iters", str(args.iters), "--warmup", str(args.warmup),
            *shlex.split(args.operator_extra)]


def serving_flags(config_flags: list[str], dense_backend: str) -> list[str]:
    """A configuration's server flags with the prefill's backend replaced (``triton``) or kept
    (``config``)."""
    flags = list(config_flags)
    if dense_backend == "config":
        return flags
    if "--sparse-dense-backend" in flags:
        i = flags.index("--sparse-dense-backend")
        flags[i + 1] = dense_backend
    else:
        flags += ["--sparse-dense-backend", dense_backend]
    return flags


def child_pythonpath(site: str, current: str, trees: Sequence[str]) -> str:
    """``site`` first, then the current PYTHONPATH without any entry inside a source tree (the
    GPU host's run.sh puts the checkout there)."""
    def inside(path: str) -> bool:
        path = os.path.abspath(path)
        return any(path == t or path.startswith(t.rstrip(os.sep) + os.sep) for t in trees)

    kept = [p for p in current.split(os.pathsep) if p and not inside(p)]
    return os.pathsep.join([site, *dict.fromkeys(kept)])


def install_command(python: str, source: str, site: str) -> list[str]:
    return [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
            "--no-build-isolation", "--no-compile", "--target", site, source]


def sha256_file(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def provenance_problems(probe: dict[str, Any], site: str, tree: str) -> list[str]:
    """What is wrong with a probe's answer: a module imported from outside the tree's site, the
    entry point's distribution elsewhere, or kernels/sparse_decode.py not the tree's file."""
    problems = []
    prefix = site.rstrip(os.sep) + os.sep
    for name, path in probe.get("files", {}).items():
        if not path or not os.path.abspath(path).startswith(prefix):
            problems.append(f"{name} from {path}, not {site}")
    dist = probe.get("entry_point_dist")
    if not dist or not os.path.abspath(dist).startswith(site.rstrip(os.sep)):
        problems.append(f"the sglang.srt.plugins entry point's distribution is at {dist}")
    kernel = probe.get("files", {}).get("sglang_ext.kernels.sparse_decode")
    source = os.path.join(tree, "kernels", "sparse_decode.py")
    if kernel and os.path.exists(kernel) and os.path.exists(source) \
            and sha256_file(kernel) != sha256_file(source):
        problems.append(f"{kernel} is not {source}")
    return problems


def compare(before: Optional[float], after: Optional[float], bar: Optional[float],
            lower_is_better: bool) -> dict[str, Any]:
    """after / before and its verdict: ``passed`` None when a side is missing or the row has
    no bar (informational), else ``|after / before - 1| <= bar``. ``slower``: whether after is
    the worse one."""
    if before is None or after is None or not before:
        return {"ratio": None, "change": None, "slower": None, "passed": None}
    ratio = after / before
    slower = ratio > 1 if lower_is_better else ratio < 1
    return {"ratio": round(ratio, 5), "change": round(ratio - 1, 5), "slower": slower,
            "passed": None if bar is None else abs(ratio - 1) <= bar + 1e-12}


def mean(values: Sequence[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals and len(vals) == len(values) else None


def operator_rows(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace,
                  errors: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
    """One row per OPERATOR_METRICS entry from each tree's bench_operator rows (one per run,
    the headline case). A run whose ours output was not finite fails the row."""
    rows = []
    for metric, score, gated in OPERATOR_METRICS:
        vals = {s: [r.get(metric) for r in runs.get(s, [])] for s in SIDES}
        sides = {s: mean(vals[s]) if vals[s] else None for s in SIDES}
        row = {"check": "operator", "metric": metric,
               "what": f"{'selection' if 'select' in metric else 'decode'} of one layer, ms "
                       f"(two_level by {score})",
               "context": args.context, "batch": args.batch,
               "block_size": args.operator_block_size, "budget": args.budget,
               "block_score": score, "lower_is_better": True,
               "before": sides["before"], "after": sides["after"],
               "before_runs": vals["before"], "after_runs": vals["after"],
               "bar": args.operator_bar if gated else None, "gated": gated,
               **compare(sides["before"], sides["after"], args.operator_bar if gated else None,
                         True)}
        not_finite = [s for s in SIDES for r in runs.get(s, []) if r.get("ours_finite") is False]
        if not_finite:
            row.update(passed=False if gated else None, error=f"non-finite output: {not_finite}")
        if errors:
            row["error"] = "; ".join(f"{s}: {e}" for s, e in errors.items())
            if row["before"] is None or row["after"] is None:
                row["passed"] = None
        rows.append(row)
    return rows


def serving_rows(servers: dict[str, dict[str, Any]],
                 args: argparse.Namespace, flags: list[str]) -> list[dict[str, Any]]:
    """One row per SERVING_METRICS entry from each server's numbers (``servers[side]``: the
    bench_serving fields, the server log's stats and ``error`` if the server failed). A server
    that completed fewer prompts than sent, logged errors or retracted requests fails the
    gated rows."""
    def trouble(s: dict[str, Any]) -> Optional[str]:
        if s.get("error"):
            return None  # no numbers: the row is unmeasured, not failed
        why = []
        if s.get("completed") != args.num_prompts:
            why.append(f"completed {s.get('completed')} of {args.num_prompts}")
        if s.get("server_errors"):
            why.append(f"{s['server_errors']} server errors")
        if s.get("server_retracted_requests"):
            why.append(f"{s['server_retracted_requests']} retracted")
        return ", ".join(why) or None

    rows = []
    for metric, field, lower, gated in SERVING_METRICS:
        b, a = (servers.get(s, {}).get(field) for s in SIDES)
        bar = args.serving_bar if gated else None
        row = {"check": "serving", "metric": metric, "input_len": args.input_len,
               "output_len": args.output_len, "num_prompts": args.num_prompts,
               "concurrency": args.concurrency, "config": " ".join(flags),
               "lower_is_better": lower, "before": b, "after": a, "bar": bar, "gated": gated,
               **compare(b, a, bar, lower)}
        problems = {s: trouble(servers.get(s, {})) for s in SIDES}
        problems = {s: p for s, p in problems.items() if p}
        errors = {s: servers[s]["error"] for s in SIDES if servers.get(s, {}).get("error")}
        if problems:
            row["problems"] = problems
            if gated:
                row["passed"] = False
        if errors:
            row.update(error=errors, passed=None)
        rows.append(row)
    return rows


def greedy_row(before: Optional[list[dict[str, Any]]], after: Optional[list[dict[str, Any]]],
               args: argparse.Namespace, errors: Optional[dict[str, str]] = None
               ) -> dict[str, Any]:
    """Identical greedy token ids on the fixed set: passed when every prompt's ids are equal and
    at least one token was decisive (a set of near ties tests nothing)."""
    row: dict[str, Any] = {
        "check": "greedy", "metric": "output_ids", "lengths": list(args.greedy_lengths),
        "prompts_per_length": args.greedy_prompts, "output_len": args.greedy_output_len,
        "seeds": "the prompt length", "bar": "identical token ids", "gated": True}
    if errors or before is None or after is None:
        return {**row, "passed": None, "error": errors or "no outputs"}
    from benchmarks.e2e_serving import compare_greedy

    equal = [a["output_ids"] == b["output_ids"] for b, a in zip(before, after)]
    detail = compare_greedy(before, after, args.tie_margin)
    identical = len(before) == len(after) and all(equal)
    decisive = detail["greedy_decisive_tokens"]
    return {**row, "prompts": len(before), "identical": sum(equal),
            "different": [i for i, e in enumerate(equal) if not e],
            "decisive_tokens": decisive, "near_tie_differences": detail["greedy_near_tie"],
            "first_diffs": detail["greedy_first_diffs"],
            "passed": identical and decisive > 0,
            **({} if decisive or not identical else {"why": "no decisive token: tested nothing"})}


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The file's ``passed``: false if a gated row failed, null while a required row is missing
    or unmeasured, true only when every required row was measured and passed."""
    have = {(r["check"], r["metric"]): r for r in rows}
    missing = [f"{c}/{m}" for c, m in REQUIRED if (c, m) not in have]
    unmeasured = [f"{r['check']}/{r['metric']}" for r in rows
                  if r.get("gated") and r.get("passed") is None]
    failed = [f"{r['check']}/{r['metric']}" for r in rows
              if r.get("gated") and r.get("passed") is False]
    passed = False if failed else (None if missing or unmeasured else True)
    return {"passed": passed, "failed": failed, "missing": missing, "unmeasured": unmeasured}


def row_key(row: dict[str, Any]) -> tuple[str, str]:
    return row["check"], row["metric"]


def merge_docs(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Join results files of one comparison (same before / after commits and GPU): later rows
    replace earlier ones of the same (check, metric); each part's settings and status are
    kept; the verdict is taken again."""
    if not docs:
        raise ValueError("nothing to merge")
    ident = [(d.get("before_commit"), d.get("after_commit"), d.get("gpu")) for d in docs]
    if len(set(ident)) > 1:
        raise ValueError(f"these files compare different things (before, after, GPU): {ident}")
    merged: dict[str, Any] = {}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        for key in ("config", "parts", "provenance", "servers"):
            merged[key] = {**merged.get(key, {}), **(doc.get(key) or {})}
        for k, v in doc.items():
            if k not in ("config", "parts", "provenance", "servers", "rows"):
                merged[k] = v
        for r in doc.get("rows", []):
            rows[row_key(r)] = r
    merged["rows"] = list(rows.values())
    merged.update(verdict(merged["rows"]))
    return merged


def carried_state(state: Optional[dict[str, Any]], ident: tuple[Any, Any, Any],
                  parts: Sequence[str]) -> dict[str, Any]:
    """What an earlier run's state file gives this run: its rows, settings and status of the
    parts this run does not measure, when it compared the same commits on the same GPU."""
    if not state or (state.get("before_commit"), state.get("after_commit"),
                     state.get("gpu")) != ident:
        return {}
    keep_rows = [r for r in state.get("rows", []) if PART_OF_CHECK.get(r["check"]) not in parts]
    return {"rows": keep_rows,
            "config": {k: v for k, v in (state.get("config") or {}).items() if k not in parts},
            "parts": {k: v for k, v in (state.get("parts") or {}).items() if k not in parts},
            "servers": {} if "serving" in parts else state.get("servers") or {}}


def format_table(doc: dict[str, Any]) -> str:
    lines = [f"{'check':9} {'metric':22} {'before':>10} {'after':>10} {'after/bef':>9} "
             f"{'bar':>6}  passed"]
    for r in doc["rows"]:
        def num(x: Any) -> str:
            return "-" if not isinstance(x, (int, float)) or isinstance(x, bool) \
                else f"{x:.4g}"
        if r["check"] == "greedy":
            lines.append(f"{'greedy':9} {'output_ids':22} "
                         f"{str(r.get('identical', '-')) + '/' + str(r.get('prompts', '-')):>21} "
                         f"{'':>9} {'equal':>6}  {r.get('passed')}"
                         f" ({r.get('decisive_tokens', 0)} decisive tokens)")
            continue
        bar = f"{r['bar']:.0%}" if isinstance(r.get("bar"), float) else "-"
        lines.append(f"{r['check']:9} {r['metric']:22} {num(r.get('before')):>10} "
                     f"{num(r.get('after')):>10} {num(r.get('ratio')):>9} {bar:>6}  "
                     f"{r.get('passed') if r.get('gated') else '(info)'}")
    lines.append(f"passed: {doc.get('passed')}"
                 + "".join(f"; {k}: {', '.join(doc[k])}" for k in ("failed", "missing",
                                                                 "unmeasured") if doc.get(k)))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the GPU run


class Run:
    """One run of the driver: the two trees, their sites and environments, the results."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.time()
        self.trees = {"before": args.before, "after": args.after}
        self.sites = {s: os.path.join(args.work, f"site_{s}") for s in SIDES}
        self.logs = os.path.join(args.work, "logs")
        self.state_path = os.path.join(args.work, f"{RESULTS_NAME}.json")
        self.commits = {"before": args.before_commit or read_commit(args.before),
                        "after": args.after_commit or results_io.git_commit()}

    def same_commit_warning(self) -> Optional[str]:
        if self.commits["before"][:7] != self.commits["after"][:7]:
            return None
        return (f"before and after both name {self.commits['after'][:12]}: give the after "
                "tree's own commit (run.sh COMMIT, $SGLANG_EXT_COMMIT or --after-commit)")

    def elapsed(self) -> float:
        return time.time() - self.t0

    def left(self) -> float:
        return self.args.time_limit - self.elapsed()

    def env(self, side: str) -> dict[str, str]:
        pp = child_pythonpath(self.sites[side], os.environ.get("PYTHONPATH", ""),
                              list(self.trees.values()))
        return {"PYTHONPATH": pp, "SGLANG_EXT_COMMIT": self.commits[side]}

    def cwd(self, side: str) -> str:
        """A folder without a source tree: ``python -m`` puts it first on sys.path."""
        path = os.path.join(self.args.work, f"run_{side}")
        os.makedirs(path, exist_ok=True)
        return path

    # ------------------------------------------------------------------ set-up

    def install(self) -> dict[str, Any]:
        """Each tree copied (package paths only) and installed into its own fresh site; then a
        probe in each environment says where the plugin is imported from."""
        out = {}
        for side in SIDES:
            src = os.path.join(self.args.work, f"src_{side}")
            for path in (src, self.sites[side]):
                shutil.rmtree(path, ignore_errors=True)
            os.makedirs(src)
            for name in PACKAGE_PATHS:
                origin = os.path.join(self.trees[side], name)
                if os.path.isdir(origin):
                    shutil.copytree(origin, os.path.join(src, name), ignore=shutil.ignore_patterns(
                        "__pycache__", "*.pyc", "build", "*.egg-info"))
                else:
                    shutil.copy2(origin, src)
            cmd = install_command(sys.executable, src, self.sites[side])
            print("+", shlex.join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            probe = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ,
                                   **self.env(side)}, cwd=self.cwd(side), capture_output=True,
                                   text=True, timeout=300)
            if probe.returncode != 0:
                raise RuntimeError(f"{side}: the probe failed:\n{probe.stderr[-2000:]}")
            found = json.loads(probe.stdout.strip().splitlines()[-1])
            problems = provenance_problems(found, self.sites[side], self.trees[side])
            if problems:
                raise RuntimeError(f"{side}: the plugin is not this tree's: {problems}")
            kernel = os.path.join(self.trees[side], "kernels", "sparse_decode.py")
            out[side] = {"commit": self.commits[side], "site": self.sites[side], **found,
                         "sparse_decode_sha256": sha256_file(kernel)}
            print(f"{side}: {self.commits[side]}, sglang_ext from {found['files']['sglang_ext']}",
                  flush=True)
        if out["before"]["sparse_decode_sha256"] == out["after"]["sparse_decode_sha256"]:
            print("note: kernels/sparse_decode.py is the same file in both trees", flush=True)
        return out

    # ------------------------------------------------------------------ operator

    def operator_command(self, side: str, tag: str) -> list[str]:
        script = os.path.join(self.trees[side], "benchmarks", "bench_operator.py")
        return [sys.executable, script, "--out", os.path.join(self.logs, "operator"),
                "--tag", tag, *operator_flags(self.args)]

    def run_operator(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from sglang_ext.progress import progress

        args = self.args
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SIDES}
        errors: dict[str, str] = {}
        configs: dict[str, Any] = {}
        order = operator_order(args.rounds)
        for i, side in enumerate(progress(order, desc="operator runs", unit="run")):
            tag = f"refactor_{side}_{i}"
            cmd = self.operator_command(side, tag)
            log = os.path.join(self.logs, f"operator_{side}_{i}.log")
            path = os.path.join(self.logs, "operator", f"operator_h200_{tag}.json")
            if os.path.exists(path):  # an earlier call's (bench_operator merges into it)
                os.remove(path)
            print("+", shlex.join(cmd), flush=True)
            with open(log, "w") as f:
                rc = subprocess.run(cmd, env={**os.environ, **self.env(side)}, cwd=self.cwd(side),
                                    stdout=f, stderr=subprocess.STDOUT).returncode
            print("".join(tail_lines(log, 4)), end="", flush=True)
            if rc != 0 or not os.path.exists(path):
                errors[side] = f"bench_operator exited {rc} (run {i}; {os.path.basename(log)})"
                continue
            with open(path) as f:
                doc = json.load(f)
            row = next((r for r in doc["rows"] if r.get("context") == args.context
                        and r.get("batch") == args.batch), None)
            if row is None:
                errors[side] = f"no {args.context} x {args.batch} row (run {i})"
                continue
            runs[side].append(row)
            configs[side] = {k: v for k, v in doc.get("config", {}).items()
                             if k not in ("wall_s",)}
        config = {"order": order, "flags": operator_flags(args), "iters": args.iters,
                  "bench_operator_config": configs,
                  "value": "mean over a tree's runs of bench_operator's median (CUDA graphs, "
                           "L2 flushed before each call)"}
        return operator_rows(runs, args, errors or None), config

    # ------------------------------------------------------------------ serving + greedy

    def run_serving(self) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
        from benchmarks import e2e_serving as e2e
        from sglang_ext.progress import progress

        args = self.args
        label_config = e2e.synthetic_label_config(args.model, args.label_channels, self.logs) \
            if args.label_channels else None
        flags = serving_flags(e2e.ours_flags(args.config, args.block_size, label_config),
                              args.dense_backend)
        extra = shlex.split(args.extra)
        context_len = int(max(args.input_len, *args.greedy_lengths) * 1.25) + \
            max(args.output_len, args.greedy_output_len) + 64
        servers: dict[str, dict[str, Any]] = {}
        greedy: dict[str, list[dict[str, Any]]] = {}
        greedy_errors: dict[str, str] = {}
        for side in progress(list(SIDES), desc="servers", unit="server"):
            log_path = os.path.join(self.logs, f"server_{side}.log")
            bench_path = os.path.join(self.logs, f"bench_{side}.jsonl")
            env = {**self.env(side), "SGLANG_EXT_DUMMY_WEIGHTS": args.dummy_weights}
            info: dict[str, Any] = {}
            proc = e2e.launch(args.model, args.tokenizer, flags, args.port, context_len,
                              log_path, extra, env, cwd=self.cwd(side))
            try:
                t = time.time()
                e2e.wait_healthy(proc, args.port, max(60.0, min(args.startup_timeout,
                                                                self.left() - 60)), log_path)
                info["healthy_s"] = round(time.time() - t, 1)
                print(f"{side}: healthy after {info['healthy_s']:.0f}s", flush=True)
                try:
                    outs = []
                    for n in args.greedy_lengths:
                        outs += e2e.greedy_outputs(args.port, args.greedy_prompts, n,
                                                   args.greedy_output_len, seed=n)
                    greedy[side] = outs
                    with open(os.path.join(self.logs, f"greedy_{side}.json"), "w") as f:
                        json.dump(outs, f)
                except Exception as e:  # noqa: BLE001 - the benchmark still runs
                    greedy_errors[side] = f"{type(e).__name__}: {e}"[:500]
                start = os.path.getsize(log_path)
                result = e2e.bench(args.port, args.tokenizer, args.input_len, args.output_len,
                                   args.num_prompts, args.concurrency, bench_path,
                                   args.warmup_requests)
                end = os.path.getsize(log_path)
                with open(log_path, errors="replace") as f:
                    stats = e2e.span_log_stats(f.read(), start, end)
                info.update({
                    "completed": result.get("completed"),
                    "output_tok_s": result.get("output_throughput"),
                    "input_tok_s": result.get("input_throughput"),
                    "median_itl_ms": result.get("median_itl_ms"),
                    "median_tpot_ms": result.get("median_tpot_ms"),
                    "median_ttft_ms": result.get("median_ttft_ms"),
                    **{k: stats.get(k) for k in (
                        "decode_tok_s", "decode_tok_s_by_running", "server_errors",
                        "server_retracted_requests", "server_max_running",
                        "server_prefill_tokens", "max_total_num_tokens", "device_kv_gb")}})
            except Exception as e:  # noqa: BLE001 - recorded; the other side still runs
                info["error"] = f"{type(e).__name__}: {e}"[:1500]
                greedy_errors.setdefault(side, "the server failed")
                print(f"{side}: {info['error']}", flush=True)
            finally:
                e2e.stop(proc)
            servers[side] = info
            print(f"{side}: {json.dumps(info)}", flush=True)
        rows = serving_rows(servers, args, flags + extra)
        rows.append(greedy_row(greedy.get("before"), greedy.get("after"), args,
                               greedy_errors or None))
        config = {"config": args.config, "dense_backend": args.dense_backend,
                  "flags": flags + extra, "dummy_weights": args.dummy_weights,
                  "model": os.path.basename(args.model), "context_length": context_len,
                  "input_len": args.input_len, "output_len": args.output_len,
                  "num_prompts": args.num_prompts, "concurrency": args.concurrency,
                  "warmup_requests": args.warmup_requests,
                  "greedy": {"lengths": args.greedy_lengths, "prompts_per_length":
                             args.greedy_prompts, "output_len": args.greedy_output_len,
                             "prompts": "e2e_serving.greedy_outputs(seed=length): random ids "
                                        "in [1000, 40000), one request at a time"}}
        return rows, config, servers

    # ------------------------------------------------------------------ results

    def write(self, doc: dict[str, Any]) -> None:
        for path in (os.path.join(self.args.out, f"{RESULTS_NAME}.json"), self.state_path):
            results_io.write_results(path, doc["rows"],
                                     {k: v for k, v in doc.items() if k != "rows"})
        archive = os.path.join(self.args.out, f"{RESULTS_NAME}_logs.tar.xz")
        with tarfile.open(archive, "w:xz") as tar:  # server logs, bench outputs, operator JSON
            tar.add(self.logs, arcname="logs")


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "sglang"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def read_commit(tree: str) -> str:
    path = os.path.join(tree, "COMMIT")
    if not os.path.exists(path):
        raise SystemExit(f"refactor_compare: no {path} (bash benchmarks/device/export_before.sh)")
    with open(path) as f:
        return f.read().strip()


def tail_lines(path: str, n: int) -> list[str]:
    with open(path, errors="replace") as f:
        return f.readlines()[-n:]


def plan(run: Run) -> list[str]:
    """The dry run's lines: what a real run would install and start."""
    args = run.args
    lines = [f"before: {run.trees['before']} ({run.commits['before']})",
             f"after:  {run.trees['after']} ({run.commits['after']})"]
    if run.same_commit_warning():
        lines.append("warning: " + run.same_commit_warning())
    for side in SIDES:
        lines.append("+ " + shlex.join(install_command(
            sys.executable, os.path.join(args.work, f"src_{side}"), run.sites[side])))
        lines.append(f"  {side} environment: PYTHONPATH={run.env(side)['PYTHONPATH']}, "
                     f"cwd {os.path.join(args.work, f'run_{side}')}")
    if "operator" in args.parts:
        for i, side in enumerate(operator_order(args.rounds)):
            lines.append(f"+ [{side}] " + shlex.join(run.operator_command(
                side, f"refactor_{side}_{i}")))
    if "serving" in args.parts:
        from benchmarks import e2e_serving as e2e

        flags = serving_flags(e2e.ours_flags(args.config, args.block_size, "LABELS.json"),
                              args.dense_backend)
        lines.append(f"servers (before, then after; SGLANG_EXT_DUMMY_WEIGHTS="
                     f"{args.dummy_weights}): {shlex.join(flags + shlex.split(args.extra))}")
        lines.append(f"greedy: {args.greedy_prompts} prompts x {args.greedy_lengths} tokens, "
                     f"{args.greedy_output_len} out; bench_serving {args.num_prompts} x "
                     f"{args.input_len} -> {args.output_len}, concurrency {args.concurrency}")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.merge:
        docs = []
        for path in args.merge:
            with open(path) as f:
                docs.append(json.load(f))
        doc = merge_docs(docs)
        path = os.path.join(args.out, f"{RESULTS_NAME}.json")
        results_io.write_results(path, doc["rows"], {k: v for k, v in doc.items() if k != "rows"})
        print(format_table(doc))
        print(f"wrote {path}")
        return 0
    run = Run(args)
    if args.dry_run:
        print("\n".join(plan(run)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("refactor_compare: needs a CUDA GPU and none is visible", file=sys.stderr)
        return 1
    os.makedirs(run.logs, exist_ok=True)
    os.makedirs(args.out, exist_ok=True)
    gpu = results_io.gpu_name()
    ident = (run.commits["before"], run.commits["after"], gpu)
    state = None
    if os.path.exists(run.state_path):
        with open(run.state_path) as f:
            state = json.load(f)
    earlier = carried_state(state, ident, args.parts)
    if earlier.get("rows"):
        print(f"carried from {run.state_path}: {len(earlier['rows'])} rows of "
              f"{', '.join(earlier['parts']) or 'an earlier call'}", flush=True)
    doc: dict[str, Any] = {
        "commit": run.commits["after"], "gpu": gpu, "before_commit": run.commits["before"],
        "after_commit": run.commits["after"],
        "what": "issue 40: the same measurements of the tree before the plan + run refactor "
                "and after it, in one call on one GPU",
        "bars": {"operator": args.operator_bar, "serving": args.serving_bar,
                 "greedy": "identical token ids, at least one decisive token",
                 "rule": "|after / before - 1| <= bar"},
        "config": earlier.get("config", {}), "parts": earlier.get("parts", {}),
        "servers": earlier.get("servers", {}),
        "versions": versions(),
        "rows": list(earlier.get("rows", [])),
    }
    doc.update(verdict(doc["rows"]))
    if run.same_commit_warning():
        doc["warning"] = run.same_commit_warning()
        print("warning: " + doc["warning"], flush=True)
    status = 0
    try:
        doc["provenance"] = run.install()
    except Exception as e:  # noqa: BLE001 - nothing can be measured
        print(f"set-up failed: {type(e).__name__}: {e}", file=sys.stderr)
        doc["parts"].update({p: {"status": f"not run: set-up failed: {e}"[:500]}
                             for p in args.parts})
        doc.update(verdict(doc["rows"]))
        run.write(doc)
        return 1
    needs = {"operator": args.operator_seconds, "serving": args.serving_seconds}
    for part in [p for p in PARTS if p in args.parts]:
        if run.left() < needs[part]:
            doc["parts"][part] = {"status": f"skipped: {run.left():.0f} s left of "
                                            f"--time-limit {args.time_limit:.0f}, needs "
                                            f"~{needs[part]:.0f}"}
            print(f"{part}: {doc['parts'][part]['status']}", flush=True)
            status = 1
            continue
        t = time.time()
        print(f"=== {part} ({run.elapsed():.0f} s in)", flush=True)
        try:
            if part == "operator":
                rows, config = run.run_operator()
            else:
                rows, config, doc["servers"] = run.run_serving()
            status_text = "measured"
        except Exception as e:  # noqa: BLE001 - recorded; the other part still runs
            rows, config = [], {}
            status_text = f"error: {type(e).__name__}: {e}"[:1000]
            print(f"{part}: {status_text}", file=sys.stderr)
            status = 1
        keys = {row_key(r) for r in rows}
        doc["rows"] = [r for r in doc["rows"] if row_key(r) not in keys] + rows
        doc["config"][part] = config
        doc["parts"][part] = {"status": status_text, "wall_s": round(time.time() - t, 1)}
        doc.update(verdict(doc["rows"]))
        run.write(doc)
    print(format_table(doc))
    print(f"wrote {os.path.join(args.out, RESULTS_NAME + '.json')} in {run.elapsed():.0f} s")
    return status or (0 if doc["passed"] is not False else 1)


if __name__ == "__main__":
    sys.exit(main())
