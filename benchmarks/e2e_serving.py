"""End-to-end serving benchmark on the GPU: SGLang full attention vs our backend, one run.

Launches, one after another, an SGLang server per configuration on dummy-weight model shapes
(``--load-format dummy``), drives each with ``python -m sglang.bench_serving`` (random-ids), and
writes rows to ``OUT/e2e_h200.json`` plus a plot. Example (on the device machine)::

    python benchmarks/e2e_serving.py --out $OUT --input-len 32768 --output-len 256 \
        --num-prompts 8 --configs flashinfer sglang_ext

Each configuration is one server start (~90 s with decode CUDA graphs); the prefill CUDA graph is
disabled to save ~80 s per start. Several ``--input-len`` values reuse each server: one
bench_serving run per length, each row's server statistics read from its own span of the server
log (the tier's cumulative counters as differences).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import results_io  # noqa: E402
from benchmarks.results_io import git_commit, gpu_name, write_results  # noqa: E402
from benchmarks.soak import TIE_MARGIN, mismatch  # noqa: E402
from sglang_ext.attention.synthetic_kv import ENV as SYNTHETIC_KV  # noqa: E402
from sglang_ext.progress import progress  # noqa: E402
from sglang_ext.config import (  # noqa: E402
    LOCALITY_FILTER_SCALE,
    LOCALITY_NEW_SHARE,
    LOCALITY_SHARE,
    locality_blocks_for_share,
    locality_limited_candidate_blocks,
    locality_new_blocks_for_share,
)

CONFIGS: dict[str, list[str]] = {
    "flashinfer": ["--attention-backend", "flashinfer"],
    "triton": ["--attention-backend", "triton"],
    # SGLang's Triton decode kernel as the full-attention baseline, with FlashInfer's prefill
    # (SGLang's hybrid backend): the Triton extend takes ~40 s per 128k prompt, which would eat
    # the time box without changing the decode being compared
    "triton_decode": ["--prefill-attention-backend", "flashinfer",
                      "--decode-attention-backend", "triton"],
    "sglang_ext": ["--attention-backend", "sglang_ext", "--sparse-budget", "2048",
                   "--sparse-block-size", "16"],
    # with the CPU KV tier (AsyncTLS schedule); host size from $SGLANG_EXT_TIER_HOST_GB, GPU-homed
    # tokens from $SGLANG_EXT_TIER_GPU_TOKENS (0 = what the GPU holds; 16 = every page on the host)
    "sglang_ext_tier": ["--attention-backend", "sglang_ext", "--sparse-budget", "2048",
                        "--sparse-block-size", "16", "--sparse-tier", "async",
                        "--sparse-tier-host-gb", os.environ.get("SGLANG_EXT_TIER_HOST_GB", "64"),
                        "--sparse-tier-gpu-tokens",
                        os.environ.get("SGLANG_EXT_TIER_GPU_TOKENS", "0"),
                        # the hidden-transfer fraction in the tier stats (issue 4's server bar);
                        # $SGLANG_EXT_TIER_TIMING=off where the device clock is unavailable
                        "--sparse-tier-timing", os.environ.get("SGLANG_EXT_TIER_TIMING", "on")],
    # the accuracy guard: probes every 16 steps and widens budgets (up to 4x) where recall < 0.9
    "sglang_ext_guard": ["--attention-backend", "sglang_ext", "--sparse-budget", "2048",
                         "--sparse-block-size", "16", "--sparse-guard-every", "16"],
    # the guard's probes alone: a recall threshold it never meets, so budgets never move
    "sglang_ext_probe": ["--attention-backend", "sglang_ext", "--sparse-budget", "2048",
                         "--sparse-block-size", "16", "--sparse-guard-every", "16",
                         "--sparse-guard-recall", "0.000001"],
    # the same, with FlashInfer (instead of SGLang's triton) running the dense prefill
    "sglang_ext_fi": ["--attention-backend", "sglang_ext", "--sparse-budget", "2048",
                      "--sparse-block-size", "16", "--sparse-dense-backend", "flashinfer"],
}
# fp8 label cache: half its memory (more KV tokens, so more requests) and half the token
# scoring's label reads
CONFIGS["sglang_ext_fi_fp8"] = CONFIGS["sglang_ext_fi"] + ["--sparse-label-dtype", "fp8_e4m3"]
# and fp8 page summaries (min down, max up): half the block scoring's reads, more KV tokens again
CONFIGS["sglang_ext_fi_fp8s"] = CONFIGS["sglang_ext_fi_fp8"] + ["--sparse-summary-dtype",
                                                               "fp8_e4m3"]
# An fp8 KV cache (SGLang's --kv-cache-dtype): half the bytes per token, so twice the requests
# that one GPU holds at a length; full attention over the same cache as its own baseline
FP8_KV = ["--kv-cache-dtype", "fp8_e4m3"]
CONFIGS["flashinfer_fp8kv"] = CONFIGS["flashinfer"] + FP8_KV
CONFIGS["sglang_ext_fi_fp8s_fp8kv"] = CONFIGS["sglang_ext_fi_fp8s"] + FP8_KV
# the same with both top-k at 8-bit digits (the widths before the per-stage defaults): a control
CONFIGS["sglang_ext_fi_fp8s_fp8kv_radix8"] = CONFIGS["sglang_ext_fi_fp8s_fp8kv"]
# The block filter by Quest's bound (the only one before --sparse-block-score; the plain names
# now rank blocks by the label maximum, the faithful default): the earlier serving rows' setting
BOUND = ["--sparse-block-score", "bound"]
for _name in ("sglang_ext_fi", "sglang_ext_fi_fp8s", "sglang_ext_fi_fp8s_fp8kv"):
    CONFIGS[_name + "_bound"] = CONFIGS[_name] + BOUND
# The exact rerank (--sparse-rerank 4: the label scores shortlist 4x the budget's tokens and the
# exact q.k picks among them; the automatic block filter grows with it)
RERANK = ["--sparse-rerank", "4"]
for _name in ("sglang_ext_fi", "sglang_ext_fi_fp8s", "sglang_ext_fi_fp8s_fp8kv",
              "sglang_ext_fi_fp8s_fp8kv_bound"):
    CONFIGS[_name + "_rerank4"] = CONFIGS[_name] + RERANK
# Environment a configuration's server gets beside its flags (shown in its rows)
CONFIG_ENV: dict[str, dict[str, str]] = {
    "sglang_ext_fi_fp8s_fp8kv_radix8": {"SGLANG_EXT_TOPK_RADIX_BITS": "8,8"}}
# AsyncTLS's block filter one step ahead on a side stream, beside the GEMMs
CONFIGS["sglang_ext_fi_async"] = CONFIGS["sglang_ext_fi"] + ["--sparse-block-filter", "async"]
# the tier with FlashInfer's prefill (SGLang's triton extend takes ~40 s per 128k prompt)
CONFIGS["sglang_ext_tier_fi"] = CONFIGS["sglang_ext_tier"] + ["--sparse-dense-backend", "flashinfer"]

# The tier with NOSA's locality constraint at the same budget: the accuracy suite's
# locality_limited setting (sglang_ext/config.py: LOCALITY_SHARE of the 123 middle blocks of
# 2048 - 16 - 64 tokens query-agnostic, key_norm score, the automatic block filter of which at
# most LOCALITY_NEW_SHARE may be new per step), so the working set is E_t (which persists) plus
# the filter, whose turnover per step the limit bounds.
def locality_args(block_size: int = 16, budget: int = 2048) -> list[str]:
    """The locality flags at ``block_size``: ``k_e``, the new-block limit and the filter are
    counted in blocks, so they are derived again for each block size (the same shares)."""
    shape = dict(budget=budget, sink=16, window=64, block_size=block_size)
    return ["--sparse-locality-blocks", str(locality_blocks_for_share(LOCALITY_SHARE, **shape)),
            "--sparse-eviction-score", "key_norm",
            "--sparse-locality-new-blocks",
            str(locality_new_blocks_for_share(LOCALITY_NEW_SHARE, **shape)),
            "--sparse-candidate-blocks",
            str(locality_limited_candidate_blocks(LOCALITY_FILTER_SCALE, **shape))]


CONFIGS["sglang_ext_tier_locality"] = CONFIGS["sglang_ext_tier"] + locality_args()
# the same with FlashInfer's prefill: the tier configuration for 128k serving runs
CONFIGS["sglang_ext_tier_locality_fi"] = CONFIGS["sglang_ext_tier_locality"] + [
    "--sparse-dense-backend", "flashinfer"]


def launch(model: str, tokenizer: str, args: list[str], port: int, context_len: int,
           log_path: str, extra: list[str],
           env_extra: Optional[dict[str, str]] = None,
           cwd: Optional[str] = None) -> subprocess.Popen:
    """Start a server (its own process group) logging to ``log_path``. ``cwd``: the server's
    working directory (default this process's); ``python -m`` puts it first on ``sys.path``,
    so a folder holding a source tree's ``sglang_ext/`` there would be imported instead of the
    one ``PYTHONPATH`` names (benchmarks/refactor_compare.py starts servers elsewhere)."""
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", model,
        "--tokenizer-path", tokenizer, "--load-format", "dummy", "--sampling-backend", "pytorch",
        "--grammar-backend", "none", "--context-length", str(context_len),
        "--mem-fraction-static", "0.85", "--cuda-graph-backend-prefill", "disabled",
        "--host", "127.0.0.1", "--port", str(port), *args, *extra,
    ]
    print("+", " ".join(cmd), flush=True)
    log = open(log_path, "w")
    # random-ids prompts re-tokenize a little longer than asked: the context is set with
    # headroom, which SGLang allows past the model config only with this variable.
    env = dict(os.environ, SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN="1", **(env_extra or {}))
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env, cwd=cwd)


# SGLang's decode-only benchmark mode (--decode-only): a decode server whose requests arrive
# "prefilled" by a fake KV transfer (bench_serving --fake-prefill), so a 128k run measures
# decode without its prefills. The fake transfer writes no KV: our servers fill their pools
# with random keys and values first (sglang_ext/attention/synthetic_kv.py), so that the
# selection ranks keys with a spread instead of ties over SGLang's zeroed pool.
DECODE_ONLY_FLAGS = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "fake"]


def server_env(args: argparse.Namespace, name: Optional[str] = None) -> dict[str, str]:
    """Environment a configuration's server gets beside this process's: its CONFIG_ENV, and
    for a decode-only run SGLANG_EXT_SYNTHETIC_KV=random (set in this process's environment,
    that wins, e.g. ``off`` to decode over the zeroed pool)."""
    env = dict(CONFIG_ENV.get(name, {})) if name else {}
    if args.decode_only:
        env[SYNTHETIC_KV] = os.environ.get(SYNTHETIC_KV, "random")
    return env


def server_extra(args: argparse.Namespace) -> list[str]:
    """The server flags every config gets from the command line."""
    return (args.extra.split() + (["--tp", str(args.tp)] if args.tp > 1 else [])
            + (DECODE_ONLY_FLAGS if args.decode_only else []))


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float, log_path: str,
                 path: str = "/health_generate") -> None:
    """Wait for ``path`` to answer (a decode-only server cannot serve /health_generate's
    test generation without a prefill: /health, which answers once its warm-up ran)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{tail(log_path)}")
        try:
            if requests.get(f"http://127.0.0.1:{port}{path}", timeout=60).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(3)
    raise TimeoutError(f"server not healthy after {timeout}s:\n{tail(log_path)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


GIB = 1 << 30  # the "GB" of SGLang's "KV Cache is allocated" line


def server_log_stats(log_text: str) -> dict[str, int]:
    """What the server log says happened. bench_serving counts error replies as completed, so
    the driver also checks that the server really prefilled the prompts and decoded."""
    errors = [line for line in log_text.splitlines()
              if "Traceback" in line or "memory leak" in line or "] Error:" in line]
    capacity = re.findall(r"max_total_num_tokens=(\d+)", log_text)
    kv = re.findall(r"KV Cache is allocated\..*K size: ([\d.]+) GB, V size: ([\d.]+) GB", log_text)
    host = re.findall(r"host store ([\d.]+) GB", log_text)
    tier = re.findall(r"sglang_ext tier stats: (\{.*\})", log_text)
    guard = re.findall(r"sglang_ext guard: (\d+) probes, (\d+) raised, (\d+) lowered", log_text)
    running = [int(n) for n in re.findall(r"#running-req: (\d+)", log_text)]
    # SGLang retracts running requests when its KV pool runs out mid-decode (a warning line)
    retracted = re.findall(r"Retract requests\. #retracted_reqs: (\d+)", log_text)
    decode_lines = [(int(n), float(t)) for n, t in re.findall(
        r"Decode batch, #running-req: (\d+),.*gen throughput \(token/s\): ([\d.]+)", log_text)]
    decode = [t for _, t in decode_lines]
    by_running: dict[str, float] = {}
    for n, t in decode_lines:
        by_running[str(n)] = max(t, by_running.get(str(n), 0.0))
    return {
        "max_total_num_tokens": int(capacity[-1]) if capacity else None,
        # per rank: the device KV pool SGLang allocated and the pinned host store of the tier,
        # both in GB of 1e9 bytes (SGLang's log line counts GiB; ours, GB)
        "device_kv_gb": round((float(kv[0][0]) + float(kv[0][1])) * GIB / 1e9, 3) if kv else None,
        "host_store_gb": float(host[0]) if host else None,
        "tier_stats": json.loads(tier[-1]) if tier else None,
        "guard_probes_raised_lowered": [int(x) for x in guard[-1]] if guard else None,
        "server_errors": len(errors),
        "server_retracted_requests": sum(int(n) for n in retracted),
        # requests decoding at once (the server's count; bench_serving's is the client's)
        "server_max_running": max(running) if running else None,
        # decode throughput without the prefill time that bench_serving's output throughput
        # includes: the best of SGLang's decode log intervals (one line per
        # --decode-log-interval steps, 40 by default, each averaged over its interval)
        "decode_tok_s": max(decode) if decode else None,
        # the best interval per running count (a line counts the requests running at its end):
        # runs whose requests arrive over seconds are compared at equal batch sizes
        "decode_tok_s_by_running": dict(sorted(by_running.items(), key=lambda kv: int(kv[0]))),
        "server_prefill_tokens": sum(int(m) for m in re.findall(r"#new-token: (\d+)", log_text)),
        "server_decode_log_lines": log_text.count("Decode batch"),
    }


# The tier stats line's cumulative counters (the rest are gauges or ratios of these).
TIER_COUNTERS = ("wanted_blocks", "transferred_blocks", "transfer_s", "exposed_transfer_s",
                 "decode_steps", "transferred_bytes", "host_wanted_blocks")


def span_log_stats(log_text: str, start: int, end: int) -> dict[str, Any]:
    """``server_log_stats`` of one benchmark's span ``[start, end)`` of a server log that served
    several: the start-up facts (capacity, KV sizes) from the whole log, the tier counters as
    the difference from the last tier stats line before the span (ratios recomputed)."""
    stats = server_log_stats(log_text[start:end])
    whole = server_log_stats(log_text[:end])
    for key in ("max_total_num_tokens", "device_kv_gb", "host_store_gb"):
        stats[key] = whole[key]
    before = server_log_stats(log_text[:start])["tier_stats"] if start else None
    tier = stats["tier_stats"]
    if tier and before:
        tier = {**tier, **{k: tier[k] - before.get(k, 0) for k in TIER_COUNTERS if k in tier}}
        if "wanted_blocks" in tier and "transferred_blocks" in tier:
            tier["hit_rate"] = 1 - tier["transferred_blocks"] / tier["wanted_blocks"] \
                if tier["wanted_blocks"] else 1.0
        if "host_wanted_blocks" in tier and "transferred_blocks" in tier:
            tier["host_hit_rate"] = 1 - tier["transferred_blocks"] / tier["host_wanted_blocks"] \
                if tier["host_wanted_blocks"] else 1.0
        if "transfer_s" in tier and "exposed_transfer_s" in tier:
            tier["hidden_fraction"] = 1 - tier["exposed_transfer_s"] / tier["transfer_s"] \
                if tier["transfer_s"] else None
        stats["tier_stats"] = tier
    return stats


def capacity_vs_limit(rows: list[dict[str, Any]], baseline: str = "flashinfer") -> None:
    """For each tier row, beside the same run's full-attention row: the KV capacity it reached
    relative to full attention's (``capacity_ratio``, logical tokens), the physical limit of that
    ratio, (full attention's device KV bytes + the tier's pinned host bytes) / full attention's
    device KV bytes (``capacity_limit``), and the share of the limit reached
    (``capacity_vs_limit``), and the same in requests running at once (``running_ratio``,
    ``running_vs_limit``). Everything comes from the servers' logs."""
    base = next((r for r in rows if r["backend"] == baseline), None)
    if base is None or not base.get("max_total_num_tokens") or not base.get("device_kv_gb"):
        return
    for r in rows:
        if not r.get("host_store_gb") or not r.get("max_total_num_tokens"):
            continue
        ratio = r["max_total_num_tokens"] / base["max_total_num_tokens"]
        limit = (base["device_kv_gb"] + r["host_store_gb"]) / base["device_kv_gb"]
        r.update(capacity_ratio=round(ratio, 3), capacity_limit=round(limit, 3),
                 capacity_vs_limit=round(ratio / limit, 3))
        if r.get("server_max_running") and base.get("server_max_running"):
            # the same in requests running at once (SGLang's #running-req)
            running = r["server_max_running"] / base["server_max_running"]
            r.update(running_ratio=round(running, 3), running_vs_limit=round(running / limit, 3))


def tier_traffic(flags: list[str], tier_stats: dict[str, Any] | None) -> dict[str, Any]:
    """A tier row's host->GPU traffic per decode step (from the server's last cumulative tier
    stats line) and the settings it depends on: budget and locality constraint on/off."""
    if not tier_stats or not tier_stats.get("decode_steps"):
        return {}
    value = lambda flag, default: flags[flags.index(flag) + 1] if flag in flags else default  # noqa: E731
    return {"budget": int(value("--sparse-budget", 2048)),
            "locality": "on" if int(value("--sparse-locality-blocks", 0)) > 0 else "off",
            "bytes_per_step": tier_stats["transferred_bytes"] / tier_stats["decode_steps"]}


def count_or_auto(text: str) -> Optional[int]:
    """argparse type of --num-prompts / --concurrency: a count, or ``auto`` (None): what each
    server can hold at each length (:func:`auto_concurrency`)."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor 'auto'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


# bench_serving's random-ids prompts reach the server as text, which re-tokenizes longer: on the
# H200 a 131,072-token prompt held 137,6xx tokens and a 32,768-token one ~34,630 (both servers'
# decode logs, e2e_h200.json at 028d3a0)
RETOKENIZED_GROWTH = 1.05
# beside a request's prompt and outputs, the decode room SGLang keeps (a decode-only server's
# --num-reserved-decode-tokens default)
DECODE_HEADROOM = 512


def auto_concurrency(log_text: str, input_len: int, output_len: int, page: int = 16) -> int:
    """The most requests of ``input_len`` + ``output_len`` tokens that a started server holds
    at once (the issue's "largest concurrency that configuration can hold"): its KV tokens
    (SGLang's ``max_total_num_tokens``; with our CPU tier, GPU- and host-homed together) over
    one request's, rounded up to whole pages, capped by its ``max_running_requests``. A request
    counts its prompt as re-tokenized (RETOKENIZED_GROWTH), its outputs and DECODE_HEADROOM.
    On the H200 this is what ran: FlashInfer's pool of 698,122 tokens admitted 5 requests of
    128k + 1k and 19 of 32k + 1k; ours, 1,480,384 tokens, at most 10 of 128k + 512 or 1k (not
    the 11 that prompt + 3 outputs gave). With our CPU tier, each home (GPU rows, host store)
    is counted for whole requests: at 128k + 1k the H200's tier server ran 4 + 4 of the 9 its
    total would hold. (The profile's trigger also takes a steady smaller batch.)"""
    tokens = re.findall(r"max_total_num_tokens=(\d+)", log_text)
    running = re.findall(r"max_running_requests=(\d+)", log_text)
    if not tokens or not running:
        raise RuntimeError("the server log has no max_total_num_tokens / max_running_requests")
    per_request = -(-(math.ceil(input_len * RETOKENIZED_GROWTH) + output_len
                      + DECODE_HEADROOM) // page) * page
    homes = re.findall(r"CPU tier: GPU-homed (\d+) tokens, host-homed (\d+) tokens", log_text)
    held = sum(int(n) // per_request for n in homes[-1]) if homes \
        else int(tokens[-1]) // per_request
    return max(1, min(int(running[-1]), held))


def locality_vs_two_level(rows: list[dict[str, Any]]) -> None:
    """Each locality row's bytes per step over the plain tier row's at the same context and
    budget (``bytes_vs_two_level``; the issue's bar is <= 0.5)."""
    for r in rows:
        if r.get("locality") != "on":
            continue
        base = next((o for o in rows if o.get("locality") == "off"
                     and (o["context"], o["budget"]) == (r["context"], r["budget"])
                     and o.get("bytes_per_step")), None)
        if base is not None:
            r["bytes_vs_two_level"] = round(r["bytes_per_step"] / base["bytes_per_step"], 3)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Output throughput (whole run, prefill included), median inter-token latency (the
    decode step) and, for tier runs, host->GPU bytes per decode step, per backend and input
    length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_tok_s", "output tokens/s (whole run)"),
              ("median_itl_ms", "median ITL = decode step (ms)")]
    if any(r.get("decode_tok_s") for r in rows):  # the decode bar: the server's own log
        panels.insert(0, ("decode_tok_s", "decode tokens/s (server log, best 40 steps)"))
    if any(r.get("bytes_per_step") is not None for r in rows):  # tier runs
        panels.append(("bytes_per_step", "host->GPU bytes per decode step"))
    limits = [r for r in rows if r.get("capacity_limit")]
    if limits:  # capacity runs: what each server held, the physical limit dashed
        panels = [("server_max_running", "requests running at once"),
                  ("max_total_num_tokens", "KV tokens (logical)")] + panels
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))

    newest = newest_by_series(rows)
    backends = list(dict.fromkeys(series_name(r) for r in rows))
    contexts = sorted({r["input_len"] for r in rows})
    width = 0.8 / len(backends)
    for ax, (key, label) in zip(axes, panels):
        for i, backend in enumerate(backends):
            ys = [(newest[(backend, c)].get(key) or 0) if (backend, c) in newest else 0
                  for c in contexts]
            ax.bar([j + i * width for j in range(len(contexts))], ys, width, label=backend)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(contexts))],
                      [f"{c // 1024}k" for c in contexts])
        ax.set_xlabel("input tokens")
        ax.set_ylabel(label)
        for r in limits:  # over its own input length's bars only
            base = next((o for o in rows if o["backend"] == "flashinfer"
                         and o["input_len"] == r["input_len"] and o.get("model") == r.get("model")
                         and o.get("tp", 1) == r.get("tp", 1)), None)
            if key in ("server_max_running", "max_total_num_tokens") and base and base.get(key):
                j = contexts.index(r["input_len"])
                ax.hlines(base[key] * r["capacity_limit"], j - width / 2, j + 0.8 - width / 2,
                          ls="--", color="gray",
                          label=f"limit at {r['input_len'] // 1024}k: flashinfer x "
                                f"{r['capacity_limit']:.2f}")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def tail(path: str, n: int = 40) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def bench(port: int, tokenizer: str, input_len: int, output_len: int, num_prompts: int,
          concurrency: int, out_file: str, warmup_requests: int = 1,
          fake_prefill: bool = False) -> dict[str, Any]:
    cmd = bench_command(port, tokenizer, input_len, output_len, num_prompts, concurrency,
                        out_file, warmup_requests, fake_prefill)
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    with open(out_file) as f:
        return json.loads(f.readlines()[-1])


def bench_command(port: int, tokenizer: str, input_len: int, output_len: int, num_prompts: int,
                  concurrency: int, out_file: str, warmup_requests: int = 1,
                  fake_prefill: bool = False) -> list[str]:
    """sglang.bench_serving's command line (random token ids; ``fake_prefill``: requests
    for a decode-only server, DECODE_ONLY_FLAGS)."""
    return [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--port", str(port),
        "--host", "127.0.0.1", "--tokenizer", tokenizer, "--dataset-name", "random-ids",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--random-range-ratio", "1.0", "--num-prompts", str(num_prompts),
        "--max-concurrency", str(concurrency), "--output-file", out_file,
        "--warmup-requests", str(warmup_requests), *(["--fake-prefill"] if fake_prefill else []),
    ]


def greedy_outputs(port: int, num_prompts: int, prompt_len: int, output_len: int,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Greedy continuations of fixed random-token prompts, with the top-2 logprobs of every
    output token (to tell a near tie from a real difference when comparing servers)."""
    import random

    rng = random.Random(seed)
    outs = []
    for _ in range(num_prompts):
        ids = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
        r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=600, json={
            "input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": output_len, "temperature": 0,
                                "ignore_eos": True}})
        r.raise_for_status()
        outs.append(r.json())
    return outs


def compare_greedy(reference: list[dict[str, Any]], outputs: list[dict[str, Any]],
                   tie_margin: float) -> dict[str, Any]:
    """Per prompt: equal, or where it first differs and whether the reference was at a near
    tie there (top-2 margin <= ``tie_margin``). ``decisive_tokens``: matched tokens whose
    reference top-2 margin exceeded the tie margin (how much the check really tested);
    ``first_diffs``: per differing prompt, the token and both sides' top-2 margins there."""
    mismatches, near_ties, equal, decisive, first_diffs = [], 0, 0, 0, []
    for i, (ref, out) in enumerate(zip(reference, outputs)):
        ids, ref_ids = out["output_ids"], ref["output_ids"]
        tops = ref["meta_info"].get("output_top_logprobs") or []
        same = next((j for j, (a, b) in enumerate(zip(ids, ref_ids)) if a != b),
                    min(len(ids), len(ref_ids)))
        decisive += sum(1 for t in tops[:same] if t and len(t) >= 2 and t[0][0] - t[1][0] > tie_margin)
        why = mismatch(ref, ids, tie_margin)
        if why is not None:
            mismatches.append(f"prompt {i}: {why}")
        elif ids == ref_ids:
            equal += 1
        else:
            near_ties += 1
        if ids != ref_ids:
            first_diffs.append({"prompt": i, "token": same,
                                "reference_margin": _top2_margin(ref, same),
                                "output_margin": _top2_margin(out, same)})
    return {"greedy_prompts": len(outputs), "greedy_equal": equal,
            "greedy_near_tie": near_ties, "greedy_mismatches": mismatches,
            "greedy_decisive_tokens": decisive, "greedy_first_diffs": first_diffs}


def _top2_margin(reply: dict[str, Any], pos: int) -> Optional[float]:
    tops = reply["meta_info"].get("output_top_logprobs") or []
    if pos < len(tops) and tops[pos] and len(tops[pos]) >= 2:
        return round(tops[pos][0][0] - tops[pos][1][0], 4)
    return None


def merge_rows(path: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows already in ``path`` with this run's rows replacing those of the same backend,
    input length, TP size, model and commit. Rows of other commits stay: each ours row's speedup
    is against its own run's flashinfer row, which must stay beside it."""
    return results_io.merge_rows(
        path, rows, key=lambda r: (r["backend"], r["input_len"], r["tp"], r["model"],
                                   r.get("commit")),
        defaults={"tp": 1})


def block_size_of(row: dict[str, Any]) -> Optional[int]:
    """Our block size in a row's config (None for the full-attention baselines)."""
    words = row.get("config", "").split()
    if "--sparse-block-size" in words:
        return int(words[words.index("--sparse-block-size") + 1])
    return None


def newest_by_series(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """``(series, input_len) -> row``: where several runs (commits) measured a series at one
    length, the newest (the last row: merged files append the new run's rows)."""
    return {(series_name(r), r["input_len"]): r for r in rows}


def series_name(row: dict[str, Any]) -> str:
    """One plot series per backend, block size, model and TP size."""
    tp = row.get("tp", 1)
    block = block_size_of(row)
    return (f"{row['backend']}{f' bs{block}' if block else ''} "
            f"({row.get('model', '?')}{f', tp {tp}' if tp > 1 else ''})")


def synthetic_label_config(model_path: str, channels: int, out_dir: str,
                           basis: bool = False) -> str:
    """A label config of ``channels`` random distinct channels per (layer, kv head) for the
    model's shape: with dummy weights there is nothing to calibrate, but the decode step then
    reads label channels (and the label cache) as it does with a calibrated config. With
    ``basis``, the labels are instead the leading coordinates of a random orthonormal basis
    per kv head (the shape and cost of ``calibrate --basis kpca``: two small rotations per
    layer), saved beside the config."""
    import random

    from sglang_ext.selection.calibrate import FORMAT, dumps_label_config, write_label_basis

    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    layers, kv_heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads",
                                                           cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rng = random.Random(0)
    payload: dict[str, Any] = {
        "format": FORMAT, "label_channels": channels,
        "model": {"num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim},
    }
    name = f"labels_{os.path.basename(model_path)}_{channels}{'_basis' if basis else ''}"
    path = os.path.join(out_dir, f"{name}.json")
    if basis:
        import torch

        gen = torch.Generator().manual_seed(0)
        rotation = torch.linalg.qr(torch.randn(layers, kv_heads, head_dim, head_dim,
                                               generator=gen)).Q
        payload["calibration"] = {"synthetic": "random orthonormal basis for dummy weights "
                                               "(timing only)"}
        # with a basis the labels are its leading coordinates
        payload["channels"] = [[list(range(channels))] * kv_heads] * layers
        payload["basis"] = write_label_basis(Path(out_dir) / f"{name}.basis.pt", "kpca",
                                             rotation, rotation)
    else:
        payload["calibration"] = {"synthetic": "random channels for dummy weights (timing only)"}
        payload["channels"] = [[sorted(rng.sample(range(head_dim), channels))
                                for _ in range(kv_heads)] for _ in range(layers)]
    with open(path, "w") as f:
        f.write(dumps_label_config(payload))
    return path


def ours_flags(name: str, block_size: int, label_config: str | None) -> list[str]:
    """The configuration's flags, with --block-size / --label-channels applied to ours."""
    flags = list(CONFIGS[name])
    if "sglang_ext" not in name:
        return flags
    if block_size:
        flags[flags.index("--sparse-block-size") + 1] = str(block_size)
        if "--sparse-locality-blocks" in flags:
            start = flags.index("--sparse-locality-blocks")
            fresh = locality_args(block_size)
            flags[start:start + len(fresh)] = fresh
    if label_config:
        flags += ["--sparse-label-config", label_config]
    return flags


def kv_cache_dtype(config: str) -> str:
    """The ``--kv-cache-dtype`` of a row's server flags ("auto" when not given)."""
    found = re.search(r"--kv-cache-dtype[ =](\S+)", config or "")
    return found.group(1) if found else "auto"


def finish_rows(rows: list[dict[str, Any]], results_path: str, meta: dict[str, Any],
                append: bool, plot_path: Optional[str] = None) -> None:
    """The fields that compare rows (capacity and speedups against the same input length's
    flashinfer row, locality against two_level), then the results file and, with
    ``plot_path``, the plot. A row on another KV cache dtype (``--kv-cache-dtype``) is also
    compared with the full-attention FlashInfer row of its own dtype where the run has one
    (``decode_speedup_vs_flashinfer_same_kv``): the part of its speedup that is not the cache's
    smaller bytes."""
    for n in sorted({r["input_len"] for r in rows}):
        same = [r for r in rows if r["input_len"] == n]
        capacity_vs_limit(same)
        base = next((r for r in same if r["backend"] == "flashinfer"), None)
        for r in same:
            r["speedup_vs_flashinfer"] = r["output_tok_s"] / base["output_tok_s"] \
                if base and base["output_tok_s"] and r["output_tok_s"] is not None else None
            r["decode_speedup_vs_flashinfer"] = r["decode_tok_s"] / base["decode_tok_s"] \
                if base and base.get("decode_tok_s") and r.get("decode_tok_s") else None
            dtype = kv_cache_dtype(r.get("config", ""))
            if dtype == "auto":
                continue
            r["kv_cache_dtype"] = dtype
            twin = same_kv_full_attention(r, same)
            r["decode_speedup_vs_flashinfer_same_kv"] = \
                r["decode_tok_s"] / twin["decode_tok_s"] if twin and r.get("decode_tok_s") \
                else None
    all_rows = merge_rows(results_path, rows) if append else rows
    locality_vs_two_level(all_rows)
    write_results(results_path, all_rows, meta)
    if plot_path:
        plot_results(all_rows, plot_path, meta["gpu"])


def plot_results(rows: list[dict[str, Any]], plot_path: str, gpu: str) -> None:
    """The results plot and, where rows have decode profiles, the profile plot beside it."""
    plot(rows, plot_path, f"{gpu}, dummy weights, bench_serving random-ids")
    profiled = [r for r in rows if r.get("decode_profile", {}).get("categories")]
    if profiled:
        plot_profiles(profiled, plot_path[:-4] + "_profile.png",
                      f"{gpu}: one decode step at each row's full batch, profiled "
                      f"in the server during its benchmark")


def same_kv_full_attention(row: dict[str, Any],
                           rows: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The newest FlashInfer full-attention row among ``rows`` with ``row``'s KV cache dtype,
    input length, model and TP size that measured a decode rate, or None."""
    dtype = kv_cache_dtype(row.get("config", ""))
    twins = [o for o in rows if o["backend"].startswith("flashinfer")
             and kv_cache_dtype(o.get("config", "")) == dtype
             and o["input_len"] == row["input_len"] and o.get("model") == row.get("model")
             and o.get("tp", 1) == row.get("tp", 1) and o.get("decode_tok_s")]
    return twins[-1] if twins else None


def same_kv_from_other_calls(rows: list[dict[str, Any]]) -> None:
    """A row on another KV cache dtype whose call had no full-attention row on that dtype (both
    servers at 128k do not fit one call's time box beside the default-cache pair) takes its
    same-cache ratio from the newest such flashinfer row of the same length, model and TP in the
    file, and says so (``same_kv_baseline_commit``, ``same_kv_from_another_call``)."""
    for r in rows:
        if r.get("kv_cache_dtype") is None or r.get("decode_speedup_vs_flashinfer_same_kv") \
                or r["backend"].startswith("flashinfer") or not r.get("decode_tok_s"):
            continue
        twin = same_kv_full_attention(r, rows)
        if twin:
            r["decode_speedup_vs_flashinfer_same_kv"] = r["decode_tok_s"] / twin["decode_tok_s"]
            r["same_kv_baseline_commit"] = twin.get("commit")
            r["same_kv_from_another_call"] = True


def merge_calls(call_paths: list[str], results_path: str, plot_path: str) -> int:
    """Merge the rows of other runs' results files (a device call's ``$OUT``) into
    ``results_path`` (rows of the same backend, length, TP, model and commit replaced) and
    redraw its plots. Each call's speedups were computed in that call, against its own
    flashinfer row; a row without its own ``dummy_weights`` gets its call's. The results
    file's top-level fields (its note) stay; a file not there yet starts with the first call's."""
    rows: list[dict[str, Any]] = []
    meta: dict[str, Any] = {}
    for path in call_paths:
        with open(path) as f:
            call = json.load(f)
        rows += [{"dummy_weights": call.get("dummy_weights", "sglang"), **r} for r in call["rows"]]
        meta = meta or {k: v for k, v in call.items() if k != "rows"}  # a new file: the first call's
    if os.path.exists(results_path):
        with open(results_path) as f:
            meta = {k: v for k, v in json.load(f).items() if k != "rows"}
    all_rows = merge_rows(results_path, rows)
    locality_vs_two_level(all_rows)
    same_kv_from_other_calls(all_rows)
    write_results(results_path, all_rows, meta)
    plot_results(all_rows, plot_path, meta.get("gpu", "GPU"))
    print(f"{results_path}: {len(rows)} rows merged, {len(all_rows)} in all", flush=True)
    return 0


def plot_profiles(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """The rows' decode profiles (``--profile-steps``) as profile_decode.py plots its own: kernel
    time per stage, stacked, beside the step's wall time."""
    from benchmarks.profile_decode import plot as plot_stages

    plot_stages([dict(r["decode_profile"], config=series_name(r).split(" (")[0],
                      input_len=r["input_len"],
                      num_prompts=r["decode_profile"].get("running", r["concurrency"]))
                 for r in rows], path, title)


def bench_load(args: argparse.Namespace, log_text: str, input_len: int) -> tuple[int, int]:
    """(prompts, concurrency) of one benchmark on a started server (``auto`` resolved from its
    log)."""
    concurrency = args.concurrency
    if concurrency is None:
        concurrency = auto_concurrency(log_text, input_len, args.output_len)
    prompts = concurrency if args.num_prompts is None else args.num_prompts
    return prompts, concurrency


def start_decode_profile(args: argparse.Namespace, log_path: str, running: int,
                         profiles: dict[int, dict[str, Any]], input_len: int,
                         log_offset: int = 0) -> tuple[threading.Thread, threading.Event]:
    """Beside a benchmark: once ``running`` requests decode (in the server log past
    ``log_offset``, where this benchmark's part begins), ``--profile-steps`` decode steps under
    SGLang's profiler, summarized into ``profiles[input_len]`` (or why not). Set the returned
    event when the benchmark is over (a wait for a full batch then gives up)."""
    from benchmarks.profile_decode import profile_running_server

    done = threading.Event()

    def run() -> None:
        try:
            profiles[input_len] = profile_running_server(
                args.port, log_path, running, args.profile_steps, timeout=1800, cancel=done,
                log_offset=log_offset)
        except (RuntimeError, TimeoutError, ValueError, FileNotFoundError,
                requests.RequestException) as e:
            profiles[input_len] = {"error": str(e)[:500]}
        print(f"decode profile at {input_len}: {json.dumps(profiles[input_len])}", flush=True)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def build_parser() -> argparse.ArgumentParser:
    """The command line (a function of its own so that CPU tests parse run.sh's calls)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.path.join(REPO, ".gpu/models/qwen3-8b-shape"))
    p.add_argument("--tokenizer", default=os.path.join(REPO, ".gpu/models/tokenizer"))
    p.add_argument("--configs", nargs="+", default=["flashinfer", "sglang_ext"], choices=sorted(CONFIGS))
    p.add_argument("--input-len", type=int, nargs="+", default=[32768],
                   help="prompt lengths; several reuse each server (one bench_serving run each)")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=count_or_auto, default=8,
                   help="bench_serving prompts; 0 = no benchmark (only --greedy-check); auto = "
                        "the concurrency")
    p.add_argument("--concurrency", type=count_or_auto, default=8,
                   help="bench_serving's --max-concurrency; auto = what each server holds at "
                        "each length (its KV tokens over a request's, at most its "
                        "--max-running-requests)")
    p.add_argument("--profile-steps", type=int, default=0, metavar="N",
                   help="during each benchmark, once its requests all decode, record N decode "
                        "steps with SGLang's profiler (benchmarks/profile_decode.py): the row's "
                        "decode_profile says where the step time goes")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="bench_serving's warmup requests per run (each one a full-length prefill; "
                        "0 saves ~40 s per 128k run where TTFT is not what is measured)")
    p.add_argument("--extra", default="", help="extra server flags for every config")
    p.add_argument("--decode-only", action="store_true",
                   help="SGLang's decode-only benchmark mode on every server (" +
                        " ".join(DECODE_ONLY_FLAGS) + ", bench_serving --fake-prefill): no "
                        "prefills, the decode runs over random KV each server writes into its "
                        "pool at start-up (SGLANG_EXT_SYNTHETIC_KV=random; rows get "
                        "decode_only: true; TTFT and input throughput mean nothing there)")
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/ "
                   "SUITE, the suite of --results-name: e2e_h200 -> serving, locality_h200 -> "
                   "locality)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--startup-timeout", type=float, default=400)
    p.add_argument("--block-size", type=int, default=0,
                   help="ours: --sparse-block-size (= the page size); 0 keeps the config's 16")
    p.add_argument("--collect", action="store_true",
                   help="launch nothing: build the results from the bench_<config>.jsonl and "
                        "server_<config>.log files already in --out (a run the time box cut "
                        "short; give --gpu). A config with a server log but no bench file "
                        "gets a row of the log's numbers alone (bench_cut: true); one with "
                        "neither is left out")
    p.add_argument("--merge", nargs="+", default=None, metavar="CALL_JSON",
                   help="launch nothing: merge these results files (other runs' --out, e.g. "
                        "device calls') into --out's results file and redraw its plots")
    p.add_argument("--gpu", default=None, help="GPU name for the results (default: this "
                   "machine's; needed with --collect on a machine without it)")
    p.add_argument("--results-name", default="e2e_h200",
                   help="results file stem in --out (JSON and plot)")
    p.add_argument("--tp", type=int, default=1, help="--tp of every server (tensor parallel)")
    p.add_argument("--greedy-check", type=int, default=0, metavar="N",
                   help="before the benchmark, N greedy requests of fixed random tokens on every "
                        "server, compared with the first config's (near-tie aware)")
    p.add_argument("--greedy-prompt-len", type=int, default=1536,
                   help="their prompt length; keep prompt + output within ours' budget to "
                        "compare exact (budget >= context) decoding")
    p.add_argument("--greedy-output-len", type=int, default=64)
    p.add_argument("--tie-margin", type=float, default=TIE_MARGIN,
                   help="nats: a first difference at a reference top-2 margin of at most this "
                        "is a near tie, not a mismatch (benchmarks/soak.py: TIE_MARGIN)")
    p.add_argument("--append", action="store_true",
                   help="merge the rows into the results file already in --out (other context "
                        "lengths, TP sizes) instead of replacing it")
    p.add_argument("--label-channels", type=int, default=16,
                   help="ours: random label channels per kv head (dummy weights have nothing to "
                        "calibrate); 0 = none, token scores then use every channel")
    p.add_argument("--label-basis", action="store_true",
                   help="ours: the labels as leading coordinates of a random orthonormal basis "
                        "per kv head, the cost of the recommended calibrate --basis kpca")
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    args.out = args.out or results_io.suite_dir(args.results_name)
    if args.collect and not args.gpu:
        p.error("--collect needs --gpu (the name of the GPU the run was on)")
    if args.collect and len(args.input_len) > 1:
        p.error("--collect reads one run's files: give one --input-len")

    if args.merge:
        stem = os.path.join(args.out, args.results_name)
        return merge_calls(args.merge, stem + ".json", stem + ".png")

    os.makedirs(args.out, exist_ok=True)
    if args.label_basis and not args.label_channels:
        p.error("--label-basis needs --label-channels > 0")
    label_config = synthetic_label_config(args.model, args.label_channels, args.out,
                                          basis=args.label_basis) \
        if args.label_channels else None
    rows: list[dict[str, Any]] = []
    lengths = args.input_len
    context_len = int(max(lengths) * 1.25) + args.output_len + 64
    extra = server_extra(args)
    greedy_ref = None
    results_path = os.path.join(args.out, f"{args.results_name}.json")
    meta = {"commit": git_commit(), "gpu": args.gpu or gpu_name(),
            "model": os.path.basename(args.model),
            # patches/model_loader.py: "scaled" makes greedy comparisons decisive
            "dummy_weights": os.environ.get("SGLANG_EXT_DUMMY_WEIGHTS", "sglang")}
    if args.collect:
        meta["collected"] = "rows built from the run's bench/server files (--collect)"
    for name in progress(args.configs, desc="servers", unit="server"):
        log_path = os.path.join(args.out, f"server_{name}.log")
        greedy_path = os.path.join(args.out, f"greedy_{name}.json")
        bench_paths = {n: os.path.join(args.out, f"bench_{name}.jsonl" if len(lengths) == 1
                                       else f"bench_{name}_{n}.jsonl") for n in lengths}
        flags = ours_flags(name, args.block_size, label_config)
        env = server_env(args, name)
        results: dict[int, dict[str, Any]] = {}
        spans: dict[int, tuple[int, int]] = {}  # each length's span of the server log
        load: dict[int, tuple[int, int]] = {}  # each length's (prompts, concurrency)
        profiles: dict[int, dict[str, Any]] = {}  # each length's decode profile
        if args.collect:
            [n] = lengths
            if args.num_prompts == 0:
                results[n] = {"completed": 0}
            elif not os.path.exists(bench_paths[n]):
                if not os.path.exists(log_path):
                    print(f"{name}: no {bench_paths[n]} and no server log, left out", flush=True)
                    continue
                # the time box cut the benchmark: the server's own numbers (its decode log
                # lines, running requests, tier stats) are all the row has
                print(f"{name}: no {bench_paths[n]}: a row from the server log only", flush=True)
                results[n] = {"completed": None, "bench_cut": True}
            else:
                with open(bench_paths[n]) as f:
                    results[n] = json.loads(f.readlines()[-1])
            with open(log_path, errors="replace") as f:
                load[n] = bench_load(args, f.read(), n)
        else:
            proc = launch(args.model, args.tokenizer, flags, args.port, context_len,
                          log_path, extra, env)
            try:
                t0 = time.time()
                wait_healthy(proc, args.port, args.startup_timeout, log_path,
                             "/health" if args.decode_only else "/health_generate")
                print(f"{name}: healthy after {time.time() - t0:.0f}s", flush=True)
                if args.greedy_check:
                    with open(greedy_path, "w") as f:
                        json.dump(greedy_outputs(args.port, args.greedy_check,
                                                 args.greedy_prompt_len, args.greedy_output_len), f)
                for i, n in enumerate(lengths):
                    # a span starts where the last ended (the first at the log's start, so
                    # start-up errors count) and the last one ends where the log does
                    start = 0 if i == 0 else os.path.getsize(log_path)
                    with open(log_path, errors="replace") as f:
                        load[n] = prompts, concurrency = bench_load(args, f.read(), n)
                    profiler = start_decode_profile(args, log_path, concurrency, profiles, n,
                                                    start) \
                        if prompts and args.profile_steps else None
                    results[n] = bench(args.port, args.tokenizer, n, args.output_len,
                                       prompts, concurrency, bench_paths[n],
                                       args.warmup_requests, args.decode_only) \
                        if prompts else {"completed": 0}
                    if profiler is not None:
                        profiler[1].set()
                        profiler[0].join(timeout=120)
                    spans[n] = (start, os.path.getsize(log_path))
            finally:
                stop(proc)
        greedy: dict[str, Any] = {}
        if args.greedy_check and os.path.exists(greedy_path):
            with open(greedy_path) as f:
                outputs = json.load(f)
            if greedy_ref is None:
                greedy_ref = (name, outputs)
            else:
                greedy = {"greedy_reference": greedy_ref[0],
                          **compare_greedy(greedy_ref[1], outputs, args.tie_margin)}
        log_text = open(log_path, errors="replace").read()
        for i, n in enumerate(lengths):
            if n not in results:
                continue
            start, end = spans.get(n, (0, len(log_text)))
            if i == len(lengths) - 1:
                end = len(log_text)  # the shutdown's lines too
            stats = span_log_stats(log_text, start, end) if len(lengths) > 1 \
                else server_log_stats(log_text)
            result = results[n]
            rows.append({
                "input_len": n, "output_len": args.output_len, "backend": name,
                "tp": args.tp, "model": os.path.basename(args.model), "commit": git_commit(),
                "config": " ".join(flags + extra),
                "num_prompts": load[n][0], "concurrency": load[n][1],
                "completed": result.get("completed"),
                "output_tok_s": result.get("output_throughput"),
                "input_tok_s": result.get("input_throughput"),
                "median_tpot_ms": result.get("median_tpot_ms"),
                "median_itl_ms": result.get("median_itl_ms"),
                "median_ttft_ms": result.get("median_ttft_ms"),
                "max_concurrent_requests": result.get("max_concurrent_requests"),
                **stats, **(greedy if i == 0 else {}), "context": n,
                **tier_traffic(flags, stats.get("tier_stats")),
                **({"decode_profile": profiles[n]} if n in profiles else {}),
                **({"bench_cut": True} if result.get("bench_cut") else {}),
                **({"decode_only": True} if args.decode_only else {}),
                **({"server_env": env} if env else {}),
            })
            print(json.dumps(rows[-1]), flush=True)
        # what has been measured so far survives a run cut by the time box
        finish_rows(rows, results_path, meta, args.append)
    finish_rows(rows, results_path, meta, args.append, plot_path=os.path.join(
        args.out, f"{args.results_name}.png"))
    print(f"{'backend':28} {'in':>7} {'out':>5} {'conc':>4} {'tok/s':>8} {'TPOT ms':>8} "
          f"{'TTFT ms':>9} {'x FI':>6} {'decode':>8} {'x FI':>6}")
    for r in rows:
        if r["output_tok_s"] is None:
            continue
        sp, dsp = r["speedup_vs_flashinfer"], r["decode_speedup_vs_flashinfer"]
        print(f"{r['backend']:28} {r['input_len']:7d} {r['output_len']:5d} {r['concurrency']:4d} "
              f"{r['output_tok_s']:8.1f} {r['median_tpot_ms'] or 0:8.1f} "
              f"{r['median_ttft_ms'] or 0:9.0f} {sp if sp is None else round(sp, 2)!s:>6} "
              f"{r.get('decode_tok_s') or 0:8.1f} {dsp if dsp is None else round(dsp, 2)!s:>6}")
    for r in rows:
        if "greedy_equal" in r:
            print(f"{r['backend']}: greedy vs {r['greedy_reference']}: {r['greedy_equal']} equal, "
                  f"{r['greedy_near_tie']} differ at a near tie, mismatches {r['greedy_mismatches']}"
                  f" ({r['greedy_decisive_tokens']} decisive tokens)")
    ok = all(r["completed"] == r["num_prompts"] and r["server_errors"] == 0
             and r["server_retracted_requests"] == 0
             and r["server_prefill_tokens"] >= 0.9 * r["num_prompts"] * r["input_len"]
             and not r.get("greedy_mismatches")
             # a comparison where every token was a near tie tested nothing
             and r.get("greedy_decisive_tokens", 1) > 0 for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
