"""Soak test of a serving SGLang server with our backend: concurrency, aborts, shared prefixes,
full tiers, malformed requests; bounded in count and time, loopback only.

What one run does (``--requests`` requests, at most ``--concurrency`` in flight, stops at
``--time-limit``):

* mixed prompt lengths (``--lengths``, tokens of the standard library's docstrings), every request
  streaming; some share a long prefix with an earlier one (radix-cache hits, ``--shared``);
* ``--abort-frac`` of them (exactly, rounded) are aborted mid-decode, half by the client closing
  the stream, half through ``POST /abort_request`` with the request's ``rid``;
* ``--reference`` prompts are first run alone on the idle server (greedy, with top-2 logprobs),
  then again inside the load: the outputs must match; a difference counts as a mismatch unless
  the reference's top-2 margin at the first differing token is at most ``--tie-margin`` nats (a
  near tie that batching's rounding may flip, not corrupted KV);
* with ``--dense-launch "ARGS"``, a dense-attention server (e.g. SGLang's flashinfer backend) is
  started first on the same port for ``--dense-reference`` prompts of ``--dense-lengths``
  (within our budget, so our decode attends every token), then stopped; inside the load those
  prompts' outputs must equal the dense server's, under the same near-tie rule;
* a burst of malformed requests (bad JSON, bad sampling params, bad ``custom_params.sparse``)
  must each get a 4xx, and the server must still answer afterwards;
* at the end: every finished output is well formed (non-empty ids, as many as reported, finish
  reason set), the server is healthy, and its log (``--server-log``) shows no traceback, no
  "memory leak" and no scheduler crash; retracted requests (SGLang's "KV cache pool is full")
  and the longest queue are counted;
  ``/metrics`` (when enabled) is sampled for our counters.

Writes a JSON report (``--out``) and exits 1 when anything failed. ``--launch "ARGS"`` starts
``python -m sglang.launch_server ARGS`` itself (log to ``--server-log``) and stops it after.

    python benchmarks/soak.py --url http://127.0.0.1:30000 --server-log server.log
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Optional

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.results_io import git_commit, gpu_name, write_results  # noqa: E402

MALFORMED: list[tuple[str, Any]] = [
    ("not json", "{not json"),
    ("negative max_new_tokens", {"text": "hi", "sampling_params": {"max_new_tokens": -3}}),
    ("temperature as text", {"text": "hi", "sampling_params": {"temperature": "hot"}}),
    ("unknown sparse key", {"text": "hi", "sampling_params": {"max_new_tokens": 2,
                            "custom_params": {"sparse": {"budgett": 64}}}}),
    ("bad sparse method", {"text": "hi", "sampling_params": {"max_new_tokens": 2,
                           "custom_params": {"sparse": {"method": "magic"}}}}),
    ("bad sparse budget", {"text": "hi", "sampling_params": {"max_new_tokens": 2,
                           "custom_params": {"sparse": {"budget": -1}}}}),
]


@dataclass
class Outcome:
    index: int
    kind: str  # "plain", "shared", "reference", "abort-client", "abort-api"
    prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    malformed: Optional[str] = None
    seconds: float = 0.0
    skipped: bool = False  # not started: --time-limit had passed


def corpus_lines() -> list[str]:
    from sglang_ext.selection.calibrate import stdlib_docstring_text

    text, _ = stdlib_docstring_text(300_000)
    return [line for line in text.splitlines() if line.strip()]


def parse_length(text: str) -> tuple[int, float]:
    """``LEN`` or ``LEN:WEIGHT`` (``--lengths``)."""
    length, _, weight = text.partition(":")
    try:
        n, w = int(length), float(weight) if weight else 1.0
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEN or LEN:WEIGHT") from None
    if n <= 0 or not w > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: length and weight must be > 0")
    return n, w


def draw_length(rng: random.Random, lengths: list[tuple[int, float]]) -> int:
    return rng.choices([n for n, _ in lengths], weights=[w for _, w in lengths])[0]


def make_prompt(lines: list[str], rng: random.Random, approx_tokens: int) -> str:
    """~``approx_tokens`` tokens (4 characters each, roughly) of consecutive docstring lines."""
    start = rng.randrange(0, len(lines) - 1)
    out, size = [], 0
    i = start
    while size < approx_tokens * 4:
        out.append(lines[i % len(lines)])
        size += len(out[-1]) + 1
        i += 1
    return "\n".join(out) + "\n\nSummarize the text above."


def _stream(url: str, payload: dict, out: Outcome, stop_after: Optional[int]) -> None:
    """One streaming /generate; with ``stop_after`` the client drops it after that many chunks."""
    with requests.post(url + "/generate", json={**payload, "stream": True}, stream=True,
                       timeout=1800) as r:
        if r.status_code != 200:
            out.error = f"HTTP {r.status_code}: {r.text[:200]}"
            return
        chunks = 0
        for line in r.iter_lines():
            if not line or not line.startswith(b"data:"):
                continue
            body = line[5:].strip()
            if body == b"[DONE]":
                break
            msg = json.loads(body)
            if "error" in msg:
                out.error = str(msg["error"])[:200]
                return
            out.output_ids = msg.get("output_ids", out.output_ids)
            meta = msg.get("meta_info", {})
            out.prompt_tokens = meta.get("prompt_tokens", out.prompt_tokens)
            fin = meta.get("finish_reason")
            if fin:
                out.finish_reason = fin.get("type") if isinstance(fin, dict) else str(fin)
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                return  # closing the connection: SGLang aborts the request


def run_one(url: str, outcome: Outcome, prompt: str, max_new_tokens: int, rid: str,
            abort_after: Optional[float]) -> Outcome:
    t0 = time.time()
    payload = {"text": prompt, "rid": rid, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0,
        "ignore_eos": outcome.kind.startswith("abort")}}
    try:
        if outcome.kind == "abort-api":
            timer = threading.Timer(abort_after or 1.0, lambda: requests.post(
                url + "/abort_request", json={"rid": rid}, timeout=60))
            timer.start()
            try:
                _stream(url, payload, outcome, None)
            finally:
                timer.cancel()
        else:
            _stream(url, payload, outcome, 3 if outcome.kind == "abort-client" else None)
    except requests.RequestException as e:
        outcome.error = f"{type(e).__name__}: {e}"[:200]
    outcome.seconds = time.time() - t0
    return outcome


def reference_run(url: str, prompt: str, max_new_tokens: int) -> dict:
    r = requests.post(url + "/generate", timeout=1800, json={
        "text": prompt, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
    r.raise_for_status()
    return r.json()


# One bf16 step of a logit in [32, 64) is 0.25, and a logprob difference is a logit difference:
# two top-2 logits one step apart are as close as bf16 can tell apart, and a different kernel's
# rounding flips them. Measured: SGLang's own flashinfer and triton full attention at --tp 2
# disagree at exactly such margins (benchmarks/results/serving/tp2_greedy_h200.json, the
# flashinfer row).
TIE_MARGIN = 0.25


def mismatch(reference: dict, output_ids: list[int], tie_margin: float) -> Optional[str]:
    """None when ``output_ids`` equal the reference's, or differ first at a near tie."""
    ref_ids = reference["output_ids"]
    if output_ids == ref_ids:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(output_ids, ref_ids)) if a != b),
               min(len(output_ids), len(ref_ids)))
    tops = reference["meta_info"].get("output_top_logprobs") or []
    if pos < len(tops) and tops[pos] and len(tops[pos]) >= 2:
        margin = tops[pos][0][0] - tops[pos][1][0]
        if margin <= tie_margin:
            return None
        return f"differs at token {pos} (reference top-2 margin {margin:.3f} nats)"
    return f"differs at token {pos} (lengths {len(output_ids)} / {len(ref_ids)})"


def malformed_sweep(url: str) -> list[dict]:
    results = []
    for name, body in MALFORMED:
        if isinstance(body, str):
            r = requests.post(url + "/generate", data=body, timeout=60,
                              headers={"Content-Type": "application/json"})
        else:
            r = requests.post(url + "/generate", json=body, timeout=60)
        results.append({"case": name, "status": r.status_code,
                        "ok": 400 <= r.status_code < 500})
    return results


def log_findings(text: str) -> dict[str, Any]:
    return {
        "tracebacks": text.count("Traceback"),
        "memory_leaks": len(re.findall(r"memory leak", text, re.IGNORECASE)),
        "scheduler_crashes": text.count("Scheduler hit an exception"),
        # SGLang's "KV cache pool is full. Retract requests. #retracted_reqs: N" (not its
        # retraction test mode, and not the retraction_policy in the server_args line)
        "retractions": sum(int(n) for n in re.findall(
            r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)", text)),
        "max_queue": max([int(x) for x in re.findall(r"#queue-req: (\d+)", text)] or [0]),
        "guard_lines": len(re.findall(r"sglang_ext guard", text)),
        "tier_stat_lines": len(re.findall(r"sglang_ext tier stats", text)),
    }


def sample_metrics(url: str) -> dict[str, float]:
    try:
        text = requests.get(url + "/metrics", timeout=30).text
    except requests.RequestException:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("sglang_ext:"):
            name, _, value = line.rpartition(" ")
            try:
                out[name.split("{")[0]] = float(value)
            except ValueError:
                continue  # not a sample line (e.g. a label value with spaces)
    return out


def launch(args: str, log_path: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port",
           str(port), *shlex.split(args)]
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: Optional[subprocess.Popen]) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_healthy(url: str, proc: Optional[subprocess.Popen], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if requests.get(url + "/health_generate", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass  # not up yet: retry until the deadline
        time.sleep(2)
    raise TimeoutError(f"server not healthy after {timeout} s")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="a running server (else --launch)")
    ap.add_argument("--launch", default=None, help="launch_server arguments (model, backend...)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--server-log", default=None, help="the server's log, read at the end")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--lengths", type=parse_length, nargs="+",
                    default=[(64, 1.0), (400, 1.0), (1200, 1.0), (2400, 1.0)],
                    help="approximate prompt lengths in tokens, each LEN or LEN:WEIGHT (drawn "
                         "with these weights, 1 when not given): a few 128k prompts among many "
                         "short ones keep a GPU soak inside its time box")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--abort-frac", type=float, default=0.1)
    ap.add_argument("--shared", type=float, default=0.2, help="share of shared-prefix requests")
    ap.add_argument("--reference", type=int, default=4, help="prompts checked against an idle run")
    ap.add_argument("--dense-launch", default=None, metavar="ARGS",
                    help="launch_server arguments of a dense-attention server (e.g. the same model "
                         "with --attention-backend flashinfer), run before ours on the same port "
                         "for the --dense-reference prompts")
    ap.add_argument("--dense-reference", type=int, default=4,
                    help="prompts (of --dense-lengths) whose outputs under load must equal the "
                         "dense server's; with --dense-launch")
    ap.add_argument("--dense-lengths", type=parse_length, nargs="+", default=None,
                    help="their lengths, LEN[:WEIGHT]: prompt + --max-new-tokens within our "
                         "budget, where our decode attends every token (default: --lengths)")
    ap.add_argument("--tie-margin", type=float, default=TIE_MARGIN,
                    help="nats: a first difference where the reference's top-2 logprobs are at "
                         "most this far apart is a near tie, not a mismatch (see TIE_MARGIN)")
    ap.add_argument("--time-limit", type=float, default=900.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out",
                    default=os.path.join(REPO, "benchmarks", "results", "serving", "soak.json"))
    args = ap.parse_args(argv)
    if not args.url and not args.launch:
        ap.error("give --url or --launch")

    if args.dense_launch and not args.launch:
        ap.error("--dense-launch needs --launch (both servers use --port, one after the other)")

    url = args.url or f"http://127.0.0.1:{args.port}"
    log_path = args.server_log or os.path.splitext(args.out)[0] + "_server.log"
    t0 = time.time()
    lines = corpus_lines()
    dense_refs: list[tuple[str, dict]] = []
    if args.dense_launch:
        dense_rng = random.Random(args.seed + 1)
        prompts = [make_prompt(lines, dense_rng, draw_length(dense_rng, args.dense_lengths or args.lengths))
                   for _ in range(args.dense_reference)]
        dense_log = os.path.splitext(log_path)[0] + "_dense.log"
        proc = launch(args.dense_launch, dense_log, args.port)
        try:
            wait_healthy(url, proc, args.startup_timeout)
            dense_refs = [(p, reference_run(url, p, args.max_new_tokens)) for p in prompts]
        finally:
            stop(proc)
    proc = launch(args.launch, log_path, args.port) if args.launch else None
    try:
        wait_healthy(url, proc, args.startup_timeout)
        report = soak(url, args, lines, dense_refs)
    finally:
        stop(proc)
    findings = log_findings(open(log_path, errors="replace").read()) \
        if os.path.exists(log_path) else {}
    report["server_log"] = findings
    report["wall_seconds"] = round(time.time() - t0, 1)
    failures = list(report["failures"])
    for key in ("tracebacks", "memory_leaks", "scheduler_crashes"):
        if findings.get(key):
            failures.append(f"server log: {findings[key]} {key}")
    report["failures"] = failures
    report["ok"] = not failures
    rows = report.pop("rows")
    write_results(args.out, rows, {"commit": git_commit(), "gpu": gpu_name(), **report})
    print(json.dumps({k: v for k, v in report.items() if k != "reference"}, indent=1))
    return 0 if not failures else 1


def soak(url: str, args: argparse.Namespace, lines: list[str],
         dense_refs: list[tuple[str, dict]]) -> dict[str, Any]:
    """``dense_refs``: (prompt, the dense server's reply) pairs, checked as ``dense-reference``
    requests inside the load."""
    from tqdm import tqdm

    rng = random.Random(args.seed)
    failures: list[str] = []

    # The reference prompts, alone on the idle server first.
    ref_prompts = [make_prompt(lines, rng, draw_length(rng, args.lengths)) for _ in range(args.reference)]
    references = [reference_run(url, p, args.max_new_tokens) for p in ref_prompts] \
        + [reply for _, reply in dense_refs]
    fixed = [("reference", p) for p in ref_prompts] + [("dense-reference", p) for p, _ in dense_refs]

    # The load: kinds drawn up front so the mix is reproducible; exactly round(abort_frac * n)
    # of the other requests are aborted, half by the client, half through /abort_request.
    plan: list[tuple[str, str]] = []
    earlier: list[str] = []
    others = list(range(len(fixed), args.requests))
    aborted = rng.sample(others, round(args.abort_frac * len(others)))
    abort_kind = {i: "abort-client" if j % 2 == 0 else "abort-api" for j, i in enumerate(aborted)}
    for i in range(args.requests):
        if i < len(fixed):
            plan.append(fixed[i])
            continue
        if i in abort_kind:
            kind = abort_kind[i]
        elif rng.random() < args.shared and earlier:
            kind = "shared"
        else:
            kind = "plain"
        if kind == "shared":
            prompt = rng.choice(earlier) + f"\nAnd in one word, question {i}?"
        else:
            prompt = make_prompt(lines, rng, draw_length(rng, args.lengths))
            earlier.append(prompt)
        plan.append((kind, prompt))
    rng.shuffle(plan)

    metrics_during: dict[str, float] = {}
    load_done = threading.Event()

    def sampler() -> None:  # our counters while the load runs
        while not load_done.wait(5.0):
            metrics_during.update(sample_metrics(url))

    threading.Thread(target=sampler, daemon=True).start()
    deadline = time.time() + args.time_limit

    def skip(o: Outcome) -> Outcome:
        o.skipped = True
        return o

    outcomes: list[Outcome] = []
    bar = tqdm(total=len(plan), desc="soak", unit="req", file=sys.stderr,
               # a log file (the GPU runs) gets a line every 30 s instead of a live bar
               mininterval=0.1 if sys.stderr.isatty() else 30.0)
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = []
        for i, (kind, prompt) in enumerate(plan):
            outcome = Outcome(index=i, kind=kind)
            futures.append(pool.submit(
                lambda o=outcome, p=prompt, i=i: (
                    run_one(url, o, p, args.max_new_tokens if not o.kind.startswith("abort")
                            else 4 * args.max_new_tokens + 64, f"soak-{args.seed}-{i}",
                            abort_after=1.0 + rng.random()) if time.time() < deadline
                    else skip(o))))
        for f in futures:
            outcomes.append(f.result())
            bar.update(1)
    bar.close()
    load_done.set()
    metrics_after = sample_metrics(url)

    # Checks.
    by_prompt = {p: i for i, (_, p) in enumerate(fixed)}
    mismatches = []
    skipped = sum(1 for o in outcomes if o.skipped)
    if skipped:
        failures.append(f"{skipped} of {len(outcomes)} requests not started before "
                        f"--time-limit {args.time_limit:g} s")
    for (kind, prompt), o in zip(plan, outcomes):
        if o.kind.startswith("abort") or o.skipped:
            continue
        if o.error:
            failures.append(f"request {o.index} ({o.kind}): {o.error}")
            continue
        if not o.output_ids or o.finish_reason is None:
            failures.append(f"request {o.index} ({o.kind}): not finished / empty output")
        if o.kind in ("reference", "dense-reference"):
            why = mismatch(references[by_prompt[prompt]], o.output_ids, args.tie_margin)
            if why:
                mismatches.append(f"request {o.index}: {why}")
    failures += mismatches
    malformed = malformed_sweep(url)
    failures += [f"malformed request '{m['case']}' got HTTP {m['status']}" for m in malformed
                 if not m["ok"]]
    try:
        wait_healthy(url, None, 120)
        healthy_after = True
    except (TimeoutError, RuntimeError):
        healthy_after = False
        failures.append("server not healthy after the soak")

    kinds: dict[str, int] = {}
    for o in outcomes:
        kinds[o.kind] = kinds.get(o.kind, 0) + 1
    rows = [{"index": o.index, "kind": o.kind, "prompt_tokens": o.prompt_tokens,
             "output_tokens": len(o.output_ids), "finish_reason": o.finish_reason,
             "error": o.error, "seconds": round(o.seconds, 2), "skipped": o.skipped}
            for o in outcomes]
    return {
        "rows": rows,
        "config": {k: v for k, v in vars(args).items() if k not in ("url",)},
        "kinds": kinds,
        "completed": sum(1 for o in outcomes if o.finish_reason and not o.kind.startswith("abort")),
        "skipped": skipped,
        "aborted": sum(1 for o in outcomes if o.kind.startswith("abort") and not o.skipped),
        "max_prompt_tokens": max((o.prompt_tokens for o in outcomes), default=0),
        "reference_checked": sum(1 for o in outcomes if o.kind == "reference"),
        "dense_reference_checked": sum(1 for o in outcomes if o.kind == "dense-reference"),
        "mismatches": mismatches,
        "malformed": malformed,
        "healthy_after": healthy_after,
        "metrics_during": metrics_during,
        "metrics_after": metrics_after,
        "failures": failures,
    }


if __name__ == "__main__":
    sys.exit(main())
