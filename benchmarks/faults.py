"""The fault table (issue 43): each fault provoked against a real server, its expected and
observed outcome, and the repo test that covers it.

A server is launched with ``--launch "ARGS"`` (``python -m sglang.launch_server ARGS``; the same
command works on the CPU with the bundled SmolLM2 and on the GPU); the live faults run against
it in this order, the last one ending it:

* ``malformed_sparse``: a request with a malformed ``custom_params.sparse`` gets a 400, the
  server lives;
* ``input_ids_outside_vocabulary``: a 400, the server lives;
* ``longer_than_context``: a prompt of context length + 1 tokens gets SGLang's error (a 400),
  the server lives;
* ``host_tier_full`` (only with ``--sparse-tier``): concurrent prompts whose KV together is
  ~1.6x the pool's tokens (GPU-homed + host tier): every one waits in the queue and completes;
* ``abort_during_prefetch`` (only with ``--sparse-tier``): long host-homed requests dropped by
  the client and through ``/abort_request`` mid-decode, while the tier fetches their blocks;
  afterwards the server answers, its log has no line of SGLang's leak check, no traceback and
  no scheduler crash (the server runs with ``SGLANG_EXT_TIER_VERIFY`` = ``--verify``, 1 by
  default: the tier checks at idle that every working-area page is free again);
* ``sigterm_during_decode``: SIGTERM to the server's main process (what a supervisor sends)
  while a request decodes: SGLang drains it and exits within ``--exit-timeout`` seconds; its log
  has no line of SGLang's leak check ("memory leak detected"), no scheduler crash and no
  crashed subprocess.

Start-up refusals (each its own launch, all at once beside the server's start; off with
``--no-startup-refusals``): ``host_memory_too_big`` (``--sparse-tier-host-gb`` ten times the
memory available) and ``label_file_for_another_model`` (the server's ``--sparse-label-config``
with a layer removed) must exit non-zero within ``--refusal-timeout`` seconds, the last line
of stderr one ``sglang_ext: --FLAG ...`` line, no traceback.

Writes ``--out`` (rows ``{fault, expected, observed, passed, test}`` plus ``seconds``; with
``--append`` the rows of other faults already there stay) and exits 1 when a row did not pass.
Only the start-up refusals (``--faults host_memory_too_big label_file_for_another_model``) launch
no server of their own beyond those refused.

    python benchmarks/faults.py --out /tmp/faults_cpu.json --launch "--model-path .models/smollm2 \\
        --device cpu ... --attention-backend sglang_ext --sparse-tier sync ..."
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.ports import with_nccl_port  # noqa: E402
from benchmarks.results_io import git_commit, gpu_name, merge_rows, write_results  # noqa: E402
from benchmarks.soak import (_alive, _error_message, flag_value, launch, log_findings,  # noqa: E402
                             server_facts, stop, stop_on_sigterm, wait_healthy)

# The repo tests that cover each fault (this script observes it live as well).
TESTS = {
    "host_memory_too_big": "tests/test_flags.py::test_bad_flags_stop_startup_with_one_line",
    "host_tier_full": "tests/test_tier_admission.py::test_admission_holds_the_second_prompt_until_"
                      "the_first_ones_is_done, tests/test_tier_pcie_e2e.py",
    "abort_during_prefetch": "tests/test_tier_e2e.py::test_aborts_free_every_page, "
                             "tests/test_memory_tier.py::test_detach_forgets_row",
    "malformed_sparse": "tests/test_bad_inputs.py::test_bad_input_sweep_gets_400s_and_the_server_"
                        "lives",
    "label_file_for_another_model": "tests/test_flags.py::test_label_config_for_another_model_is_"
                                    "rejected, tests/test_flags.py::test_eviction_head_for_"
                                    "another_model_is_rejected",
    "sigterm_during_decode": "tests/test_faults.py::test_fault_table_on_cpu",
    "longer_than_context": "tests/test_bad_inputs.py::test_bad_input_sweep_gets_400s_and_the_"
                           "server_lives",
    "input_ids_outside_vocabulary": "tests/test_bad_inputs.py::test_bad_input_sweep_gets_400s_and_"
                                    "the_server_lives",
}

LIVE = ("malformed_sparse", "input_ids_outside_vocabulary", "longer_than_context",
        "host_tier_full", "abort_during_prefetch", "sigterm_during_decode")
STARTUP = ("host_memory_too_big", "label_file_for_another_model")


def row(fault: str, expected: str, observed: str, passed: bool, seconds: float) -> dict:
    return {"fault": fault, "expected": expected, "observed": observed, "passed": bool(passed),
            "test": TESTS[fault], "seconds": round(seconds, 1)}


# ---------------------------------------------------------------------------- launch arguments

def without(words: list[str], *flags: str) -> list[str]:
    """``words`` with each of ``flags`` and its value removed."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in flags:
            skip = True
            continue
        if any(w.startswith(f + "=") for f in flags):
            continue
        out.append(w)
    return out


def host_too_big_args(words: list[str]) -> list[str]:
    """The server's arguments with a host tier ten times the memory available (the tier on,
    nothing that conflicts with it before the host size is checked)."""
    import psutil

    gb = max(1, math.ceil(psutil.virtual_memory().available / 1e9)) * 10
    words = without(words, "--sparse-tier-host-gb", "--sparse-guard-every")
    if flag_value(words, "--sparse-tier") in (None, "off"):
        words = without(words, "--sparse-tier") + ["--sparse-tier", "sync"]
    return words + ["--sparse-tier-host-gb", str(gb)]


def wrong_labels_args(words: list[str], tmp: str) -> Optional[list[str]]:
    """The server's arguments with its label config made another model's (one layer fewer);
    None without ``--sparse-label-config``."""
    path = flag_value(words, "--sparse-label-config")
    if path is None:
        return None
    with open(path) as f:
        labels = json.load(f)
    labels["model"]["num_layers"] -= 1
    labels["channels"] = labels["channels"][:-1]
    bad = os.path.join(tmp, "labels_other_model.json")
    with open(bad, "w") as f:
        json.dump(labels, f)
    return without(words, "--sparse-label-config") + ["--sparse-label-config", bad]


def start_refusal(words: list[str], port: int, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port",
           str(port), *with_nccl_port(words)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def refusal_row(fault: str, flag: str, proc: Optional[subprocess.Popen], t0: float,
                timeout: float) -> dict:
    expected = f"exit != 0 within {timeout:g} s, last stderr line 'sglang_ext: {flag} ...', " \
               f"no traceback"
    if proc is None:
        return row(fault, expected, f"not run: the server has no {flag}", False, 0.0)
    try:
        _, stderr = proc.communicate(timeout=max(1.0, timeout - (time.time() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return row(fault, expected, f"still running after {timeout:g} s (killed)", False,
                   time.time() - t0)
    lines = stderr.strip().splitlines()
    last = lines[-1] if lines else ""
    passed = (proc.returncode != 0 and last.startswith(f"sglang_ext: {flag}")
              and "Traceback" not in stderr)
    return row(fault, expected, f"exit {proc.returncode}: {last[:300]}"
               + ("; a traceback in stderr" if "Traceback" in stderr else ""),
               passed, time.time() - t0)


# ---------------------------------------------------------------------------- live faults

def post(url: str, body: dict, timeout: float = 300) -> requests.Response:
    return requests.post(url + "/generate", json=body, timeout=timeout)


def bad_request(url: str, fault: str, body: dict, expected_text: str) -> dict:
    t0 = time.time()
    try:
        r = post(url, body)
        status, message = r.status_code, _error_message(r)
    except requests.RequestException as e:
        status, message = None, f"{type(e).__name__}: {e}"[:200]
    alive = _alive(url)
    return row(fault, f"HTTP 400 ({expected_text}), server alive",
               f"HTTP {status}: {message}; server {'alive' if alive else 'gone'}",
               status == 400 and alive, time.time() - t0)


def pool_tokens(url: str, log_path: str) -> Optional[int]:
    """The KV pool's logical tokens (GPU-homed + host tier): /server_info, else the log."""
    try:
        info = requests.get(url + "/server_info", timeout=60).json()
        for place in [info, *(info.get("internal_states") or [])]:
            if isinstance(place, dict) and place.get("max_total_num_tokens"):
                return int(place["max_total_num_tokens"])
    except (requests.RequestException, ValueError):
        pass  # no usable /server_info: the start-up log below says it too
    found = re.findall(r"max_total_num_tokens=(\d+)", open(log_path, errors="replace").read())
    return int(found[-1]) if found else None


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, min(vocab, 30000)) for _ in range(n)]


def host_tier_full(url: str, facts: dict, log_path: str, rng: random.Random) -> dict:
    t0 = time.time()
    expected = "prompts whose KV exceeds the pool wait in the queue and all complete"
    total = pool_tokens(url, log_path)
    if not total or not facts.get("context_len") or not facts.get("vocab_size"):
        return row("host_tier_full", expected, "pool size or model facts unknown", False, 0.0)
    length = max(256, min(facts["context_len"] - 64, int(total * 0.45)))
    n = max(3, math.ceil(1.6 * total / length))
    log_before = len(open(log_path, errors="replace").read())

    def one(i: int) -> tuple[int, Optional[str], int]:
        r = post(url, {"input_ids": random_ids(rng, length, facts["vocab_size"]),
                       "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                           "ignore_eos": True}}, timeout=1800)
        if r.status_code != 200:
            return r.status_code, _error_message(r), 0
        return 200, None, r.json()["meta_info"].get("completion_tokens", 0)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    findings = log_findings(open(log_path, errors="replace").read()[log_before:])
    done = sum(1 for s, _, c in results if s == 200 and c == 8)
    alive = _alive(url)
    observed = (f"{n} prompts of {length} tokens ({n * length} tokens, pool {total}): {done} "
                f"completed, longest queue {findings['max_queue']}, "
                f"{findings['retractions']} retracted, {findings['scheduler_crashes']} "
                f"scheduler crashes; server {'alive' if alive else 'gone'}")
    errors = [f"HTTP {s}: {m}" for s, m, _ in results if s != 200]
    if errors:
        observed += f"; errors: {errors[:2]}"
    return row("host_tier_full", expected, observed,
               done == n and alive and findings["scheduler_crashes"] == 0
               and findings["max_queue"] >= 1, time.time() - t0)


def abort_during_prefetch(url: str, facts: dict, log_path: str, rng: random.Random,
                          length: int) -> dict:
    t0 = time.time()
    expected = ("aborted host-homed requests free their pages: no leak, traceback or crash in "
                "the log, the server answers")
    log_before = len(open(log_path, errors="replace").read())
    length = min(length, facts["context_len"] - 600)
    sampling = {"max_new_tokens": 512, "temperature": 0, "ignore_eos": True}
    # dropped by the client after a few streamed tokens (the tier fetching every step) ...
    dropped = 0
    for i in range(2):
        with requests.post(url + "/generate", stream=True, timeout=600, json={
                "input_ids": random_ids(rng, length, facts["vocab_size"]), "stream": True,
                "sampling_params": sampling}) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= 4 + 3 * i:
                    dropped += 1
                    break
    # ... and through /abort_request, two at once
    rids = [f"fault-abort-{i}-{rng.randrange(10**9)}" for i in range(2)]
    threads = [threading.Thread(target=lambda rid=rid: post(url, {
        "input_ids": random_ids(rng, length, facts["vocab_size"]), "rid": rid,
        "sampling_params": sampling}, timeout=600)) for rid in rids]
    for t in threads:
        t.start()
    time.sleep(2.0)
    for rid in rids:
        requests.post(url + "/abort_request", json={"rid": rid}, timeout=60)
    for t in threads:
        t.join(timeout=600)
    time.sleep(4.0)  # idle: the tier's page check (SGLANG_EXT_TIER_VERIFY) and SGLang's checker
    try:
        ok = post(url, {"text": "Say hello.", "sampling_params": {"max_new_tokens": 4}}) \
            .status_code == 200
    except requests.RequestException:
        ok = False
    text = open(log_path, errors="replace").read()[log_before:]
    findings = log_findings(text)
    leaks = findings["memory_leaks"]
    observed = (f"{dropped} dropped by the client, {len(rids)} through /abort_request; then a "
                f"request {'answered' if ok else 'failed'}; log: {leaks} leak lines, "
                f"{findings['tracebacks']} tracebacks, {findings['scheduler_crashes']} crashes")
    return row("abort_during_prefetch", expected, observed,
               ok and not leaks and not findings["tracebacks"]
               and not findings["scheduler_crashes"], time.time() - t0)


def sigterm_during_decode(url: str, proc: subprocess.Popen, log_path: str,
                          exit_timeout: float, tokens: int) -> dict:
    """SIGTERM to the server's main process (what a supervisor sends) while a request of
    ``tokens`` tokens decodes: SGLang drains the running requests, then exits."""
    t0 = time.time()
    expected = (f"exits within {exit_timeout:g} s; no line of SGLang's leak check, scheduler "
                f"crash or crashed subprocess in the log")
    started = threading.Event()
    result: dict[str, Any] = {"tokens": 0, "finish": None}

    def decode() -> None:
        try:
            with requests.post(url + "/generate", stream=True, timeout=600, json={
                    "text": "Count from one to a thousand: one, two,", "stream": True,
                    "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}) as r:
                for n, line in enumerate(r.iter_lines()):
                    if n >= 3:
                        started.set()
                    if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                        msg = json.loads(line[5:])
                        result["tokens"] = len(msg.get("output_ids", []))
                        fin = msg.get("meta_info", {}).get("finish_reason")
                        result["finish"] = fin.get("type") if isinstance(fin, dict) else fin
        except (requests.RequestException, ValueError):
            pass  # the server went away mid-stream
        finally:
            started.set()

    t = threading.Thread(target=decode, daemon=True)
    t.start()
    started.wait(timeout=120)
    decoding = t.is_alive()
    os.kill(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=exit_timeout)
        exited = True
    except subprocess.TimeoutExpired:
        rc, exited = None, False
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    seconds = time.time() - t0
    t.join(timeout=10)
    text = open(log_path, errors="replace").read()
    # SGLang's own leak check ("... memory leak detected!"), not every line that says "leak"
    # (PyTorch warns that a process group not destroyed "can leak resources" at any exit)
    findings = log_findings(text)
    leaks = findings["memory_leaks"]
    crashed = len(re.findall(r"crashed with exit code", text))
    observed = (f"{'decoding' if decoding else 'not decoding'} at SIGTERM; "
                + (f"exit {rc} after {seconds:.1f} s" if exited else
                   f"still running after {exit_timeout:g} s (killed)")
                + f"; the request got {result['tokens']} of {tokens} tokens "
                f"(finish reason {result['finish']}); log: {leaks} leak lines, "
                f"{findings['scheduler_crashes']} scheduler crashes, {crashed} crashed "
                f"subprocesses")
    return row("sigterm_during_decode", expected, observed,
               decoding and exited and not leaks and not findings["scheduler_crashes"]
               and not crashed, seconds)


# ---------------------------------------------------------------------------- main

def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launch", required=True, help="launch_server arguments (model, backend...)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--server-log", default=None, help="the server's log (default: beside --out)")
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "serving",
                                                  "faults.json"))
    ap.add_argument("--faults", nargs="+", choices=LIVE + STARTUP, default=None,
                    help="only these (default: all that apply)")
    ap.add_argument("--no-startup-refusals", action="store_true",
                    help="skip the faults that need their own server start")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of other faults already in --out (a table built over "
                         "several runs)")
    ap.add_argument("--verify", default="1",
                    help="SGLANG_EXT_TIER_VERIFY of the launched server (0: off)")
    ap.add_argument("--abort-prompt-tokens", type=int, default=4096,
                    help="prompt length of the aborted requests (at most the context - 600)")
    ap.add_argument("--sigterm-decode-tokens", type=int, default=256,
                    help="length of the request decoding when the server gets SIGTERM (SGLang "
                         "drains it before exiting: keep it well within --exit-timeout)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--refusal-timeout", type=float, default=300.0)
    ap.add_argument("--exit-timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    chosen = set(args.faults or LIVE + STARTUP)
    if args.no_startup_refusals:
        chosen -= set(STARTUP)

    words = shlex.split(args.launch)
    tiered = flag_value(words, "--sparse-tier") not in (None, "off")
    url = f"http://127.0.0.1:{args.port}"
    log_path = args.server_log or os.path.splitext(args.out)[0] + "_server.log"
    rows: list[dict] = []
    rng = random.Random(args.seed)
    t_start = time.time()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    # the refusals start first, beside the server's own start (they exit before loading weights)
    tmp = tempfile.mkdtemp(prefix="faults_")
    refusals: list[tuple[str, str, Optional[subprocess.Popen], float]] = []
    port = args.port + 1
    if "host_memory_too_big" in chosen:
        refusals.append(("host_memory_too_big", "--sparse-tier-host-gb",
                         start_refusal(host_too_big_args(words), port, env), time.time()))
        port += 1
    if "label_file_for_another_model" in chosen:
        bad = wrong_labels_args(words, tmp)
        refusals.append(("label_file_for_another_model", "--sparse-label-config",
                         start_refusal(bad, port, env) if bad else None, time.time()))

    os.environ["SGLANG_EXT_TIER_VERIFY"] = args.verify  # inherited by the launched server
    live = [f for f in LIVE if f in chosen]
    proc = launch(args.launch, log_path, args.port) if live else None
    stop_on_sigterm(proc)
    try:
        if proc is not None:
            wait_healthy(url, proc, args.startup_timeout)
            facts = server_facts(url)
            checks: list[tuple[str, Callable[[], dict]]] = [
                ("malformed_sparse", lambda: bad_request(
                    url, "malformed_sparse", {"text": "hi", "sampling_params": {
                        "max_new_tokens": 2,
                        "custom_params": {"sparse": {"method": "magic", "budgett": 3}}}},
                    "custom_params.sparse refused")),
                ("input_ids_outside_vocabulary", lambda: bad_request(
                    url, "input_ids_outside_vocabulary",
                    {"input_ids": [1, facts.get("vocab_size") or 999999999],
                     "sampling_params": {"max_new_tokens": 2}}, "outside the vocabulary")),
                ("longer_than_context", lambda: bad_request(
                    url, "longer_than_context",
                    {"input_ids": [1] * ((facts.get("context_len") or 10**6) + 1),
                     "sampling_params": {"max_new_tokens": 2}}, "SGLang's context check")),
                ("host_tier_full", lambda: host_tier_full(url, facts, log_path, rng)),
                ("abort_during_prefetch", lambda: abort_during_prefetch(
                    url, facts, log_path, rng, args.abort_prompt_tokens)),
                ("sigterm_during_decode", lambda: sigterm_during_decode(
                    url, proc, log_path, args.exit_timeout, args.sigterm_decode_tokens)),
            ]
            for name, check in checks:
                if name not in chosen:
                    continue
                if name in ("host_tier_full", "abort_during_prefetch") and not tiered:
                    continue  # no tier on this server: nothing to fill or prefetch
                if name != "sigterm_during_decode" and proc.poll() is not None:
                    rows.append(row(name, "", f"not run: the server exited ({proc.returncode})",
                                    False, 0.0))
                    continue
                try:
                    rows.append(check())
                except Exception as e:  # a fault that breaks the driver is a failed row
                    rows.append(row(name, "", f"{type(e).__name__}: {e}"[:300], False, 0.0))
    finally:
        stop(proc)
        for fault, flag, refusal, t0 in refusals:
            rows.append(refusal_row(fault, flag, refusal, t0, args.refusal_timeout))

    if args.append:  # the rows of other faults already in --out stay
        rows = merge_rows(args.out, rows, key=lambda r: r["fault"], inherit=("commit",))
    failed = [r["fault"] for r in rows if not r["passed"]]
    write_results(args.out, rows, {
        "commit": git_commit(), "gpu": gpu_name(), "launch": args.launch,
        "tier_verify": args.verify, "wall_seconds": round(time.time() - t_start, 1),
        "passed": not failed, "failed": failed,
    })
    for r in rows:
        print(f"{'PASS' if r['passed'] else 'FAIL'} {r['fault']}: {r['observed']}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
