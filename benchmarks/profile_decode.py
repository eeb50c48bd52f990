"""Where a served decode step's time goes, per configuration (issue 8's "where the step time goes").

Launches each configuration's SGLang server (the same configurations and launch as
``benchmarks/e2e_serving.py``), sends ``--num-prompts`` requests of ``--input-len`` random
tokens with long outputs, waits until the server decodes all of them at once, then records
``--steps`` decode steps with SGLang's own profiler (``/start_profile``: torch's profiler, the
kernels of CUDA-graph replays included) and reads the trace back:

* ``step_ms``: the window's span over the steps recorded;
* ``compute_busy_ms``: per step, the union of kernel time on the stream that runs the most
  kernel time (the model's); ``idle_ms`` = ``step_ms`` - that: launch and scheduling gaps
  (CPU work between steps: SGLang's scheduler, our host-side metadata);
* ``side_stream_ms``: kernel time on the other streams (the tier's prefetch gathers), which
  overlaps the compute stream;
* ``categories``: kernel time per step by what the kernel does (``CATEGORIES``: our selection
  stages, sparse attention, the tier's gathers, write-through and working-set updates, the
  locality constraint, FlashInfer, GEMMs, everything else).

Writes ``OUT/decode_profile_h200.json`` (rows ``config``, ``input_len``, ``num_prompts``,
``steps_in_trace``, ``step_ms``, ...) and a stacked-bar plot. Example (on the device machine)::

    SGLANG_EXT_DUMMY_WEIGHTS=scaled SGLANG_EXT_TIER_GPU_TOKENS=16 python3 \\
        benchmarks/profile_decode.py --out $OUT --configs sglang_ext_fi sglang_ext_tier_locality_fi \\
        --input-len 65536 --num-prompts 2 --extra "--mem-fraction-static 0.8"
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from typing import Any, Iterable, Optional

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.e2e_serving import (  # noqa: E402
    CONFIGS,
    launch,
    ours_flags,
    stop,
    synthetic_label_config,
    wait_healthy,
)
from benchmarks.results_io import git_commit, gpu_name, write_results  # noqa: E402
from sglang_ext.progress import progress  # noqa: E402

# (category, kernel-name pattern), first match wins; names are Triton kernels' function names
# (kernels/*.py), FlashInfer's and the GEMM libraries' kernel names.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("block_scores", r"_quest_block_scores_kernel"),
    ("topk", r"_topk_kernel"),
    ("token_scores", r"_label_token_scores_kernel"),
    ("assemble", r"_topk_assemble_kernel|_assemble_slots_kernel"),
    ("sparse_attention", r"_sparse_attn_(split|merge)_kernel"),
    ("tier_gather", r"_gather_host_blocks_kernel"),
    ("tier_write_through", r"_scatter_to_host_kernel"),
    ("tier_working_set", r"_update_working_set_kernel"),
    ("locality", r"_locality_\w+_kernel|_fresh_scores_kernel|_admit_kernel|"
                 r"_record_filter_kernel|_update_page_scores_kernel"),
    ("summaries", r"_update_runs_kernel"),
    ("flashinfer", r"(?i)flashinfer|BatchDecode|BatchPrefill|SinglePrefill"),
    ("gemm", r"(?i)gemm|cutlass|nvjet|cublas|sm90_xmma|matmul"),
)
_COMPILED = [(name, re.compile(pattern)) for name, pattern in CATEGORIES]
OTHER_KERNELS = 8  # the longest uncategorised kernels a profile names


def category(kernel_name: str) -> str:
    for name, pattern in _COMPILED:
        if pattern.search(kernel_name):
            return name
    return "other"


def _union_ms(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length (ms) of the union of ``[start, end)`` intervals given in microseconds."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def summarize_trace(events: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per-step numbers of a chrome trace's GPU kernels (``cat`` "kernel"). A decode step under
    CUDA graphs is one ``cudaGraphLaunch``: where the trace has those, they count the steps
    (SGLang's window holds about ``steps`` of them, give or take one at its edges)."""
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("dur") is not None]
    if not kernels or steps <= 0:
        raise ValueError("the trace holds no GPU kernels")
    steps = sum(1 for e in events if e.get("name") == "cudaGraphLaunch") or steps
    by_stream: dict[Any, list[dict[str, Any]]] = {}
    for e in kernels:
        by_stream.setdefault(e.get("args", {}).get("stream"), []).append(e)
    compute = max(by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s]))
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    step_ms = (end - start) / 1e3 / steps
    busy = _union_ms((e["ts"], e["ts"] + e["dur"]) for e in by_stream[compute]) / steps
    side = sum(e["dur"] for s, es in by_stream.items() if s != compute for e in es) / 1e3 / steps
    cats: dict[str, float] = {}
    others: dict[str, float] = {}  # what "other" is made of, by kernel name
    for e in kernels:
        c = category(e["name"])
        cats[c] = cats.get(c, 0.0) + e["dur"] / 1e3 / steps
        if c == "other":
            others[e["name"]] = others.get(e["name"], 0.0) + e["dur"] / 1e3 / steps
    return {"steps_in_trace": steps, "step_ms": round(step_ms, 4),
            "compute_busy_ms": round(busy, 4),
            "idle_ms": round(step_ms - busy, 4), "side_stream_ms": round(side, 4),
            "kernels_per_step": round(len(kernels) / steps, 1),
            "categories": {k: round(v, 4) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top_other_kernels": {k[:120]: round(v, 4) for k, v in
                                  sorted(others.items(), key=lambda kv: -kv[1])[:OTHER_KERNELS]}}


def read_trace(trace_dir: str) -> list[dict[str, Any]]:
    """The events of the newest trace SGLang's profiler wrote in ``trace_dir``."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True),
                   key=os.path.getmtime)
    if not paths:
        raise FileNotFoundError(f"no profiler trace in {trace_dir}")
    opener = gzip.open if paths[-1].endswith(".gz") else open
    with opener(paths[-1], "rt") as f:
        return json.load(f)["traceEvents"]


def _generate(port: int, input_ids: list[int], max_new_tokens: int, errors: list[str]) -> None:
    try:
        r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=3600, json={
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                "temperature": 0}})
        if not r.ok:
            errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
    except requests.RequestException as e:
        errors.append(str(e))


_BATCH_LINE = re.compile(r"(Prefill|Decode) batch, .*?#running-req: (\d+)(?:.*?#queue-req: (\d+))?")


def full_batch_reached(log_text: str, num_prompts: int, stable: int = 3) -> Optional[int]:
    """The number of requests decoding once the server decodes its full batch (else None):
    every request running and none queued, or (a pool that holds fewer than asked) its last
    ``stable`` batch lines are decode lines with one running count, the largest so far and
    at least half of ``num_prompts`` (so not a warm-up request decoding alone)."""
    lines = _BATCH_LINE.findall(log_text)
    decodes = [(int(r), int(q or 0)) for kind, r, q in lines if kind == "Decode"]
    if not decodes:
        return None
    running, queued = decodes[-1]
    if running >= num_prompts and queued == 0:
        return running
    last = lines[-stable:]
    steady = (len(last) == stable and all(kind == "Decode" and int(r) == running
                                          for kind, r, _ in last)
              and running == max(r for r, _ in decodes) and running >= max(2, num_prompts / 2))
    return running if steady else None


def wait_all_decoding(log_path: str, num_prompts: int, timeout: float,
                      cancel: Optional[threading.Event] = None, log_offset: int = 0) -> int:
    """Until the server's log shows its full batch decoding (:func:`full_batch_reached`; its
    size is returned), or ``cancel`` is set (the requests are gone). Only the log past
    ``log_offset`` counts: a server reused for another benchmark has already logged the last
    one's full batch, which would start the profiler during this one's prefill."""
    deadline = time.time() + timeout
    while time.time() < deadline and not (cancel is not None and cancel.is_set()):
        with open(log_path, "rb") as f:  # bytes: a text file cannot seek to a size
            f.seek(log_offset)
            running = full_batch_reached(f.read().decode(errors="replace"), num_prompts)
        if running is not None:
            return running
        time.sleep(1)
    raise TimeoutError(f"{num_prompts} requests were never all decoding at once")


def profile_running_server(port: int, log_path: str, num_running: int, steps: int,
                           timeout: float, cancel: Optional[threading.Event] = None,
                           log_offset: int = 0) -> dict[str, Any]:
    """Once the server's decode log shows ``num_running`` requests decoding and none queued,
    record ``steps`` decode steps with SGLang's profiler and summarize them. The trace goes to a
    temporary folder (it is not a result: a device call brings back only a few files).
    ``cancel``: give up waiting (the requests are done). ``running`` in the result: how many
    requests decoded in the recorded steps. ``log_offset``: where this benchmark's log starts."""
    running = wait_all_decoding(log_path, num_running, timeout, cancel, log_offset)
    with tempfile.TemporaryDirectory(prefix="sglang_ext_trace_") as trace_dir:
        requests.post(f"http://127.0.0.1:{port}/start_profile", timeout=600, json={
            "output_dir": trace_dir, "num_steps": steps, "activities": ["GPU"],
            "with_stack": False, "record_shapes": False}).raise_for_status()
        # num_steps stops the profiler by itself; its trace is written once that step is done
        deadline = time.time() + timeout
        while time.time() < deadline and not glob.glob(os.path.join(trace_dir, "**", "*.json*"),
                                                        recursive=True):
            time.sleep(2)
        time.sleep(5)  # the file is written in one go; let it finish
        return dict(summarize_trace(read_trace(trace_dir), steps), running=running)


def profile_config(args: argparse.Namespace, name: str, label_config: Optional[str]) -> dict[str, Any]:
    log_path = os.path.join(args.out, f"server_profile_{name}.log")
    flags = ours_flags(name, 0, label_config)
    context_len = args.input_len + args.output_len + 256
    proc = launch(args.model, args.tokenizer, flags, args.port, context_len, log_path,
                  args.extra.split())
    errors: list[str] = []
    try:
        wait_healthy(proc, args.port, args.startup_timeout, log_path)
        rng = random.Random(0)
        threads = [threading.Thread(target=_generate, daemon=True, args=(
            args.port, [rng.randrange(100, 30000) for _ in range(args.input_len)],
            args.output_len, errors)) for _ in range(args.num_prompts)]
        for t in threads:
            t.start()
        row = profile_running_server(args.port, log_path, args.num_prompts, args.steps,
                                     args.decode_timeout)
    finally:
        stop(proc)
    row.update(config=name, flags=" ".join(flags + args.extra.split()), input_len=args.input_len,
               num_prompts=args.num_prompts, steps_asked=args.steps, request_errors=len(errors))
    print(json.dumps(row), flush=True)
    return row


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, _ in CATEGORIES] + ["other"]
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(rows), 4.5))
    labels = [f"{r['config']}\n{r['num_prompts']} x {r['input_len'] // 1024}k" for r in rows]
    bottom = [0.0] * len(rows)
    for n in names:
        ys = [r["categories"].get(n, 0.0) for r in rows]
        if any(ys):
            ax.bar(labels, ys, bottom=bottom, label=n)
            bottom = [b + y for b, y in zip(bottom, ys)]
    ax.scatter(labels, [r["step_ms"] for r in rows], color="black", marker="_", s=600,
               label="step (wall)", zorder=3)
    ax.set_ylabel("ms per decode step (kernel time, all streams)")
    ax.legend(fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(REPO, ".gpu/models/qwen3-8b-shape"))
    p.add_argument("--tokenizer", default=os.path.join(REPO, ".gpu/models/tokenizer"))
    p.add_argument("--configs", nargs="+", required=True, choices=sorted(CONFIGS))
    p.add_argument("--input-len", type=int, default=65536)
    p.add_argument("--output-len", type=int, default=2048,
                   help="long enough that every request still decodes when the window ends")
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="decode steps recorded")
    p.add_argument("--extra", default="", help="extra server flags for every config")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks/results/serving"))
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--startup-timeout", type=float, default=400)
    p.add_argument("--decode-timeout", type=float, default=300,
                   help="seconds for every prompt's prefill, and for the trace to appear")
    p.add_argument("--label-channels", type=int, default=16)
    p.add_argument("--results-name", default="decode_profile_h200")
    return p


def main() -> int:
    args = build_parser().parse_args()
    os.makedirs(args.out, exist_ok=True)
    label_config = synthetic_label_config(args.model, args.label_channels, args.out) \
        if args.label_channels else None
    rows, failures = [], []
    for name in progress(args.configs, desc="servers", unit="server"):
        try:
            rows.append(profile_config(args, name, label_config))
        except (RuntimeError, TimeoutError, ValueError, FileNotFoundError,
                requests.RequestException) as e:
            failures.append(f"{name}: {e}"[:2000])
            print(f"{name}: failed: {e}", flush=True)
    meta = {"commit": git_commit(), "gpu": gpu_name(), "model": os.path.basename(args.model),
            "dummy_weights": os.environ.get("SGLANG_EXT_DUMMY_WEIGHTS", "sglang"),
            "failures": failures}
    path = os.path.join(args.out, f"{args.results_name}.json")
    write_results(path, rows, meta)
    if rows:
        plot(rows, path[:-5] + ".png", f"{meta['gpu']}: one decode step, profiled in the server")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
