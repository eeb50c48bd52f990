"""The accuracy suite on GPU servers: the served configuration (``--sparse-impl triton``, CUDA
graphs) on a real model, at budgets that are fractions of the context.

    python -m benchmarks.accuracy.gpu_suite --model-dir /tmp/smollm2 --samples 50

For each server configuration (block size x storage) one SGLang server starts with our
backend; every context runs the suite's tasks with dense attention and each method at
``context / ratio`` tokens, all as per-request settings on that one server (requests with
settings other than the server's decode eagerly in groups; see
sglang_ext/attention/mixed_settings.py). Per configuration the driver's files
(``<out-dir>/smollm2_b<bs>_<storage>.json/.md/.png``) hold the rows; ``--combined`` gathers
every configuration's rows, tagged with impl / block_size / storage, into one file with a plot
of score against the budget's share of the context.

``--tiers off async sync`` adds the CPU tier with every page but one homed on the host. The
tier refuses per-request settings on the Triton path, so each (method, budget) of a tiered
configuration gets its own server started with those settings as flags, and the rows come from
requests that carry none (``driver --server-setting``). The combined file's ``tier_gaps`` pair
each tiered row with the untiered row of the same method, budget, context and task.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Iterator, Optional, Sequence

import requests

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

STORAGE_ARGS = {
    "bf16": [],
    # the fp8 server: KV cache, label cache and page summaries in fp8
    "fp8": ["--kv-cache-dtype", "fp8_e4m3", "--sparse-label-dtype", "fp8_e4m3",
            "--sparse-summary-dtype", "fp8_e4m3"],
}
DEFAULT_TASKS = ("passkey", "niah_number", "niah_multikey", "niah_multivalue", "var_tracking",
                 "common_words")


DEFAULT_LABELS = "sparse_labels.json"
TIERS = ("off", "async", "sync")
# every page but one homed on the host (one page of the largest block size stays on the GPU),
# and enough pinned host memory for the suite's parallel 8k-token samples
TIER_ARGS = ["--sparse-tier-gpu-tokens", "32", "--sparse-tier-host-gb", "8"]


def launch_args(model_dir: str, block_size: int, storage: str, port: int,
                context_length: int, labels: str = DEFAULT_LABELS) -> list[str]:
    """``labels``: the label file in ``model_dir`` (channels, or a basis: calibrate --basis)."""
    labels = os.path.join(model_dir, labels)
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir,
            "--host", "127.0.0.1", "--port", str(port),
            "--context-length", str(context_length), "--mem-fraction-static", "0.5",
            "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--cuda-graph-max-bs", "64", "--max-running-requests", "128",
            "--attention-backend", "sglang_ext", "--sparse-impl", "triton",
            "--page-size", str(block_size), "--sparse-block-size", str(block_size),
            "--sparse-label-config", labels, *STORAGE_ARGS[storage]]


def setting_flags(method: str, budget: int, block_size: int) -> list[str]:
    """The server flags of one suite method at ``budget``: what its requests would carry in
    ``custom_params.sparse`` (benchmarks/accuracy/runner.py), as ``--sparse-*`` flags."""
    from benchmarks.accuracy import runner as R

    setting = R.sparse_settings([method], [budget], block_size)[-1]
    flags = []
    for key, value in setting.custom_params["sparse"].items():
        if key == "block_size" or (key == "head_policy" and value is False):
            continue  # the launch's --sparse-block-size; a server has no head policy unless given
        flags += ["--sparse-" + key.replace("_", "-"), str(value)]
    return flags


def wait_healthy(url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            if requests.get(url + "/health_generate", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass  # not listening yet
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout:.0f}s")


@contextlib.contextmanager
def running_server(command: list[str], port: int, log_path: str, start_timeout: float,
                   what: str) -> Iterator[str]:
    """A server started with ``command``, healthy, its URL; stopped on the way out. An error
    inside carries the server log's last lines (its own error, not only what the client saw)."""
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            t0 = time.time()
            wait_healthy(f"http://127.0.0.1:{port}", process, start_timeout)
            print(f"[gpu-suite] {what}: healthy in {time.time() - t0:.0f}s", flush=True)
            yield f"http://127.0.0.1:{port}"
        except Exception as e:
            with open(log_path, errors="replace") as f:
                last = "".join(f.readlines()[-6:]).rstrip()
            raise RuntimeError(f"{e}; {log_path} ends:\n{last}") from e
        finally:
            try:
                os.killpg(process.pid, 15)
            except ProcessLookupError:
                pass  # it exited already (a crash at start-up)
            process.wait(timeout=60)


def config_tag(labels: str, tier: str, sync_steps: int = 0, attend: str = "previous") -> str:
    """What follows ``smollm2_b<bs>_<storage>`` in a configuration's file names: a label file
    other than the channels (sparse_labels_kpca.json -> _kpca), then a tier (_tierasync), then
    the async tier's in-line first steps (_sync4) and what it attends (_resident)."""
    tag = "" if labels == DEFAULT_LABELS else \
        "_" + os.path.splitext(labels)[0].removeprefix("sparse_labels_")
    if tier == "off":
        return tag
    if tier != "async":
        return tag + f"_tier{tier}"
    return (tag + "_tierasync" + (f"_sync{sync_steps}" if sync_steps else "")
            + (f"_{attend}" if attend != "previous" else ""))


def run_config(args: argparse.Namespace, block_size: int, storage: str,
               tier: str = "off", sync_steps: int = 0, attend: str = "previous") -> str:
    """One configuration: the suite at every context; returns the results file. Untiered, one
    server answers every setting per request; tiered, one server per (method, budget)."""
    from benchmarks.accuracy import driver

    tag = config_tag(args.labels, tier, sync_steps, attend)
    out = os.path.join(args.out_dir, f"smollm2_b{block_size}_{storage}{tag}.json")
    port = 30000 + block_size + (1 if storage == "fp8" else 0) + 2 * TIERS.index(tier)
    launch = launch_args(args.model_dir, block_size, storage, port, args.context_length,
                         args.labels)

    def suite(url: str, context: int, methods: Sequence[str], budgets: Sequence[int],
              extra: Sequence[str] = ()) -> None:
        driver.main(["--server-url", url, "--tasks", *args.tasks, "--contexts", str(context),
                     "--budgets", *map(str, budgets), "--methods", *methods,
                     "--samples", str(args.samples), "--block-size", str(block_size),
                     "--parallel", str(args.parallel), "--out", out,
                     "--time-limit", str(args.minutes_per_context), *extra])

    def budgets_at(context: int) -> list[int]:
        return args.budgets or sorted({max(2, context // r) for r in args.ratios})

    if tier == "off":
        log_path = os.path.join(args.out_dir, f"server_b{block_size}_{storage}{tag}.log")
        with running_server(launch, port, log_path, args.start_timeout,
                            f"b{block_size} {storage}{tag}") as url:
            for context in args.contexts:
                suite(url, context, args.methods, budgets_at(context))
        return out
    # the tier refuses per-request settings: a server per (method, budget), settings as flags
    tiered = [*launch, "--sparse-tier", tier, *TIER_ARGS]
    if tier == "async" and sync_steps:
        tiered += ["--sparse-tier-sync-steps", str(sync_steps)]
    if tier == "async" and attend != "previous":
        tiered += ["--sparse-tier-async-attend", attend]
    for budget in sorted({b for c in args.contexts for b in budgets_at(c)}):
        contexts = [c for c in args.contexts if budget in budgets_at(c)]
        for method in args.methods:
            log_path = os.path.join(args.out_dir, f"server_b{block_size}_{storage}{tag}_"
                                                  f"{method}_{budget}.log")
            with running_server([*tiered, *setting_flags(method, budget, block_size)], port,
                                log_path, args.start_timeout,
                                f"b{block_size} {storage}{tag} {method}@{budget}") as url:
                for context in contexts:
                    suite(url, context, [method], [budget], ["--server-setting"])
    return out


def combine(paths: Sequence[str], out: str) -> dict:
    """Every configuration's rows, tagged, in one file (and its plot)."""
    rows, configs = [], []
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        # smollm2_b32_bf16.json; with a label basis _kpca, with a tier _tierasync (config_tag)
        stem = os.path.basename(path)[len("smollm2_b"):-len(".json")]
        block_size, storage, *rest = stem.split("_")
        tiers = [t.removeprefix("tier") for t in rest if t.startswith("tier")]
        # async's in-line first steps and what it attends: async_sync4_resident, a tier of its
        # own in tier_gaps
        variants = [t for t in rest if t.startswith("sync") or t == "resident"]
        basis = [t for t in rest if not t.startswith(("tier", "sync")) and t != "resident"]
        if tiers and variants:
            tiers = ["_".join([tiers[0], *variants])]
        configs.append({"file": os.path.basename(path), "commit": doc.get("commit"),
                        "server": doc.get("config", {}).get("server")})
        for r in doc["rows"]:
            rows.append({"impl": "triton", "block_size": int(block_size), "storage": storage,
                         "labels": basis[0] if basis else "channels",
                         "tier": tiers[0] if tiers else "off",
                         "budget_share": (r["budget"] / r["context"]) if r["budget"] else None,
                         **{k: r.get(k) for k in ("method", "context", "budget", "task",
                                                  "score", "n", "ci_low", "ci_high",
                                                  "dense_score")}})
    from benchmarks.results_io import gpu_name

    doc = {"model": "SmolLM2-135M-Instruct", "gpu": gpu_name(), "configs": configs, "rows": rows}
    if any(r["tier"] != "off" for r in rows):
        doc["tier_gaps"] = tier_gaps(rows)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    plot(doc, out[:-len(".json")] + ".png")
    return doc


def tier_gaps(rows: Sequence[dict]) -> dict:
    """Per tier: each tiered row beside the untiered row of the same configuration, method,
    budget, context and task (the same samples: the suite draws them by index), the points
    lost, and the mean over the cells weighted by samples."""
    def key(r: dict) -> tuple:
        return (r["block_size"], r["storage"], r.get("labels", "channels"), r["method"],
                r["budget"], r["context"], r["task"])

    untiered = {key(r): r for r in rows if r.get("tier", "off") == "off" and r["budget"]}
    out: dict = {}
    for r in rows:
        base = untiered.get(key(r))
        if r.get("tier", "off") == "off" or base is None:
            continue
        out.setdefault(r["tier"], []).append(
            {"method": r["method"], "budget": r["budget"], "context": r["context"],
             "task": r["task"], "n": r["n"], "untiered_n": base["n"], "score": r["score"],
             "untiered_score": base["score"], "gap": round(r["score"] - base["score"], 2)})
    summary = {}
    for tier, cells in out.items():
        weight = sum(c["n"] for c in cells)
        summary[tier] = {"mean_gap": round(sum(c["gap"] * c["n"] for c in cells) / weight, 2),
                         "cells": cells}
    return summary


def plot(doc: dict, path: str) -> None:
    """Mean score over the tasks against the budget's share of the context, per method and
    configuration, one panel per context; dense as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    contexts = sorted({r["context"] for r in rows})
    # (block, storage, labels); files before the label basis have no "labels": the channels
    configs = sorted({(r["block_size"], r["storage"], r.get("labels", "channels"),
                       r.get("tier", "off")) for r in rows})
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.2 * len(contexts), 3.6), squeeze=False,
                             sharey=True, layout="constrained")
    for ax, ctx in zip(axes[0], contexts):
        at = [r for r in rows if r["context"] == ctx]
        dense = [r["score"] for r in at if r["method"] == "dense"]
        if dense:
            ax.axhline(sum(dense) / len(dense), color="black", ls="--", lw=1, label="dense")
        for bs, storage, labels, tier in configs:
            for method in sorted({r["method"] for r in at if r["budget"]}):
                pts: dict = {}
                for r in at:
                    if (r["method"], r["block_size"], r["storage"], r.get("labels", "channels"),
                            r.get("tier", "off")) == (method, bs, storage, labels, tier):
                        pts.setdefault(r["budget_share"], []).append(r["score"])
                xs = sorted(pts)
                if not xs:
                    continue
                ax.plot(xs, [sum(pts[x]) / len(pts[x]) for x in xs], marker="o", ms=3,
                        label=f"{method} b{bs} {storage}, {labels} labels"
                              + ("" if tier == "off" else f", {tier} tier"))
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {ctx}", fontsize=9)
        ax.set_xlabel("budget / context", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean score over tasks", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    # a narrow figure (few contexts) fits two of the long labels per line, not four
    fig.legend(handles, labels, loc="outside lower center", ncol=2 if len(contexts) < 3 else 4,
               fontsize=7, frameon=False)
    fig.suptitle(f"{doc['model']} on the GPU path (Triton, CUDA graphs)", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, help="a converted model with sparse_labels.json")
    p.add_argument("--labels", default=DEFAULT_LABELS,
                   help="the label file in --model-dir (e.g. sparse_labels_kpca.json, a basis: "
                        "results then end in _kpca)")
    p.add_argument("--block-sizes", nargs="+", type=int, default=[32, 16])
    p.add_argument("--storages", nargs="+", default=["bf16"], choices=list(STORAGE_ARGS))
    p.add_argument("--contexts", nargs="+", type=int, default=[2048, 4096, 8000])
    p.add_argument("--ratios", nargs="+", type=int, default=[16, 32, 64],
                   help="budgets are context / ratio")
    p.add_argument("--budgets", nargs="+", type=int, default=None,
                   help="fixed budgets instead of context / ratio (a tiered configuration "
                        "starts a server per budget: one budget across the contexts is cheaper)")
    p.add_argument("--tiers", nargs="+", default=["off"], choices=TIERS,
                   help="configurations without the CPU tier (off) and with it, every page but "
                        "one on the host; the combined file's tier_gaps compare them")
    p.add_argument("--tier-sync-steps", nargs="+", type=int, default=[0],
                   help="the async tier's servers decode each request's first STEPS steps "
                        "with in-line fetches (--sparse-tier-sync-steps; files end in _sync4); "
                        "several values: an async configuration each (0: plain async)")
    p.add_argument("--tier-async-attend", nargs="+", default=["previous"],
                   choices=["previous", "resident"],
                   help="what the async tier's steps attend (--sparse-tier-async-attend; files "
                        "end in _resident); several values: an async configuration each")
    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS))
    p.add_argument("--methods", nargs="+", default=["two_level", "two_level_rerank4",
                                                    "two_level_bound", "ds", "ds_rerank4"])
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--parallel", type=int, default=16)
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--start-timeout", type=float, default=400.0)
    p.add_argument("--minutes-per-context", type=float, default=3.0)
    p.add_argument("--out-dir", default=os.path.join(REPO, "benchmarks", "results", "accuracy"))
    p.add_argument("--combined", default=None,
                   help="also gather every configuration's rows into this JSON (+ .png); a bare "
                        "file name goes into --out-dir")
    args = p.parse_args(argv)
    os.environ["SGLANG_EXT_MODEL_DIR"] = args.model_dir  # the driver's tokenizer
    os.makedirs(args.out_dir, exist_ok=True)
    # (tier, in-line first steps, what it attends): the async tier once per combination of
    # --tier-sync-steps and --tier-async-attend values
    configurations = [(tier, steps, attend) for tier in args.tiers
                      for steps in (args.tier_sync_steps if tier == "async" else [0])
                      for attend in (args.tier_async_attend if tier == "async" else ["previous"])]
    done = []
    for block_size in args.block_sizes:
        for storage in args.storages:
            for tier, sync_steps, attend in configurations:
                try:
                    done.append(run_config(args, block_size, storage, tier, sync_steps, attend))
                except Exception as e:  # noqa: BLE001 - one failed server must not lose others
                    print(f"[gpu-suite] b{block_size} {storage} tier {tier} failed: {e}",
                          file=sys.stderr, flush=True)
    if args.combined and done:
        combined = args.combined if os.path.dirname(args.combined) else \
            os.path.join(args.out_dir, args.combined)
        doc = combine(done, combined)
        for tier, gaps in doc.get("tier_gaps", {}).items():
            print(f"[gpu-suite] {tier} tier vs untiered: {gaps['mean_gap']:+.2f} points over "
                  f"{len(gaps['cells'])} cells", flush=True)
    wanted = len(args.block_sizes) * len(args.storages) * len(configurations)
    return 0 if len(done) == wanted else 1


if __name__ == "__main__":
    sys.exit(main())
