"""Accuracy suite driver: start a CPU SGLang server with our backend, run the tasks, stop it.

    python -m benchmarks.accuracy.driver --quick            # ~2 min: passkey@1024, 3 samples
    python -m benchmarks.accuracy.driver                    # the full default run (hours on CPU)
    python -m benchmarks.accuracy.driver --server-url http://127.0.0.1:30000 --tasks passkey

One server with ``--attention-backend sglang_ext`` evaluates dense attention and every
(method, budget): each request carries its settings in ``custom_params`` and the radix cache
reuses each sample's prefill. ``--reference`` also starts SGLang's own torch_native backend
afterwards and runs the dense requests there (row method ``torch_native``, with the share of
outputs identical to our dense override). Servers are stopped on exit, Ctrl-C and SIGTERM;
``--time-limit`` bounds the run (it stops between chunks and keeps the rows done so far).

Before running, the driver times one prefill and one sparse decode on the largest context and
prints the estimated duration of this run and of the full default run.
"""

from __future__ import annotations

import argparse
import _thread
import json
import os
import signal
import sys
import threading
import time
import warnings
from typing import Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _p in (REPO, os.path.join(REPO, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import requests  # noqa: E402

from benchmarks.accuracy import runner as R  # noqa: E402
from benchmarks.accuracy import tasks as T  # noqa: E402
from server_utils import LABELS, MODEL_DIR, Server  # noqa: E402  (tests/server_utils.py)

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "accuracy_smollm2.json")
DEFAULT_CONTEXTS = (1024, 2048, 4096)
DEFAULT_BUDGETS = (64, 128, 256, 512)
DEFAULT_SAMPLES = 20
# Blocks of 4 tokens on this CPU model: with 64-dim heads the min/max bound of 16-token blocks
# is too loose to rank a needle's block (see the README, "Measured").
DEFAULT_BLOCK_SIZE = 4
QUICK = dict(tasks=["passkey"], contexts=[1024], methods=["two_level"], budgets=[128], samples=3)

# Time model behind the printed estimate, scaled from the probe (one prefill and one decode
# on the largest context of the run; T0 = that context):
#   prefill(T)  = probe_prefill * (T / T0) * (1 + T / PREFILL_KNEE) / (1 + T0 / PREFILL_KNEE)
#   decode step = probe_step * (1 + T / DECODE_KNEE) / (1 + T0 / DECODE_KNEE)
#   decode time = requests * OUTPUT_FILL * max_new_tokens * step / batch speed-up
# PREFILL_KNEE: for this model (576 wide, 30 layers) attention FLOPs match the linear layers'
# at ~8k tokens. DECODE_KNEE: on the 2-core CPU the per-request attention + selection of the
# reference decode path costs ~30 ms/step at 1k tokens and ~130 ms at 4k, on top of ~140 ms
# of fixed per-step work. OUTPUT_FILL: answers end (EOS) before max_new_tokens (passkey: 8 of
# 12). Checked against a quick run (estimate 11 s, actual 8 s) and a passkey@2048 run on a
# loaded machine (2.4 min vs 3.2 min): expect +-50%.
PREFILL_KNEE = 8192.0
DECODE_KNEE = 4096.0
OUTPUT_FILL = 0.8
BATCH_SPEEDUP_PER_EXTRA_REQUEST = 0.5  # decode throughput gain of each extra concurrent request


def sparse_server_args(block_size: int) -> list[str]:
    """Our backend; method and budget come with each request, the block size too (so the flag
    only sets the default)."""
    args = ["--attention-backend", "sglang_ext", "--sparse-block-size", str(block_size)]
    if os.path.exists(LABELS):
        args += ["--sparse-label-config", LABELS]
    return args


REFERENCE_ARGS = ["--attention-backend", "torch_native"]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(T.TASKS), choices=T.TASKS)
    p.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS),
                   help="prompt lengths in tokens (8192 is the model's limit)")
    p.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS))
    p.add_argument("--methods", nargs="+", default=list(R.METHODS), choices=R.METHODS,
                   help="sparse methods; dense always runs (it prefills each sample)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="samples per (task, context)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per block (4 for this CPU model; 16 is the GPU default)")
    p.add_argument("--sink", type=int, default=R.DEFAULT_SINK, help="max sink (<= budget/8)")
    p.add_argument("--window", type=int, default=R.DEFAULT_WINDOW, help="max window (<= budget/4)")
    p.add_argument("--parallel", type=int, default=2, help="concurrent requests (2-4)")
    p.add_argument("--quick", action="store_true",
                   help="passkey@1024, 3 samples, dense + two_level@128 (overrides the above)")
    p.add_argument("--server-url", default=None, help="use this running server, start none")
    p.add_argument("--reference", action="store_true",
                   help="also run the dense requests on SGLang's torch_native backend")
    p.add_argument("--out", default=DEFAULT_OUT, help="results JSON (merged); .md and .png beside it")
    p.add_argument("--outputs", default=None, help="also write every request's output here (JSONL)")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="minutes; 0 = 3x the estimate + 10 min. Stops between chunks")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    if args.samples < 1 or any(c < 64 for c in args.contexts) or any(b < 2 for b in args.budgets):
        p.error("need --samples >= 1, contexts >= 64 tokens, budgets >= 2")
    if not 1 <= args.parallel <= 16:
        p.error("--parallel must be in 1..16")
    return args


# --------------------------------------------------------------------------------------
# Servers: started here, stopped on every way out
# --------------------------------------------------------------------------------------


class ServerGuard:
    """Starts servers one at a time and stops them on exit, Ctrl-C, SIGTERM or the watchdog."""

    def __init__(self) -> None:
        self.servers: list[Server] = []
        self._interrupted = False

    def start(self, args: list[str], what: str) -> Server:
        print(f"[accuracy] starting {what} server: {' '.join(args)}", flush=True)
        t0 = time.time()
        server = Server(args)
        self.servers.append(server)
        server.start()
        print(f"[accuracy] {what} server up at {server.url} in {time.time() - t0:.0f}s "
              f"(log {server.log_path})", flush=True)
        return server

    def stop_all(self) -> None:
        for s in self.servers:
            s.stop()

    def install_signal_handlers(self) -> None:
        def handler(signum, frame):
            if self._interrupted:
                os._exit(130)  # second Ctrl-C: leave now (servers were stopped by the first)
            self._interrupted = True
            print(f"\n[accuracy] signal {signum}: stopping servers", file=sys.stderr, flush=True)
            # Stop the servers first, so in-flight requests fail at once instead of finishing
            # (the frontend reports each failed request as a warning with a traceback: muted).
            warnings.simplefilter("ignore")
            self.stop_all()
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)

    def watchdog(self, seconds: float) -> threading.Timer:
        def fire() -> None:
            print(f"\n[accuracy] hard time limit reached: stopping servers", file=sys.stderr, flush=True)
            warnings.simplefilter("ignore")
            self.stop_all()
            _thread.interrupt_main()

        t = threading.Timer(seconds, fire)
        t.daemon = True
        t.start()
        return t


# --------------------------------------------------------------------------------------
# Time estimate
# --------------------------------------------------------------------------------------


def probe(url: str, samples: Sequence[T.Sample], settings: Sequence[R.Setting]) -> dict:
    """Time one dense prefill and a 12-token decode under the last (largest) sparse setting,
    on the first sample of the largest context (its prefill is reused by the run)."""
    sample = max(samples, key=lambda s: s.context)
    sample = next(s for s in samples if s.context == sample.context)

    def gen(custom, n):
        t0 = time.time()
        sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        if custom is not None:
            sp["custom_params"] = custom
        r = requests.post(url + "/generate", json={"text": sample.prompt, "sampling_params": sp},
                          timeout=900)
        r.raise_for_status()
        return time.time() - t0, r.json()["meta_info"]

    t_prefill, meta = gen(settings[0].custom_params, 1)
    if meta.get("cached_tokens", 0) > sample.prompt_tokens // 2:
        # Already cached (a server that ran these prompts): time a fresh prefill instead.
        requests.post(url + "/flush_cache", timeout=60)
        t_prefill, meta = gen(settings[0].custom_params, 1)
    steps = 12
    t_dec, meta2 = gen(settings[-1].custom_params, steps + 1)
    return {"context": sample.context, "prefill_s": t_prefill,
            "step_s": t_dec / max(1, meta2.get("completion_tokens", steps + 1))}


def estimate_seconds(p: dict, tasks: Sequence[str], contexts: Sequence[int], samples: int,
                     n_settings: int, parallel: int) -> dict:
    t0 = p["context"]

    def prefill(t: int) -> float:
        return p["prefill_s"] * (t / t0) * (1 + t / PREFILL_KNEE) / (1 + t0 / PREFILL_KNEE)

    def step(t: int) -> float:
        return p["step_s"] * (1 + t / DECODE_KNEE) / (1 + t0 / DECODE_KNEE)

    speedup = 1 + BATCH_SPEEDUP_PER_EXTRA_REQUEST * (max(1, parallel) - 1)
    pre = sum(samples * prefill(c) for _ in tasks for c in contexts)
    dec = sum(samples * n_settings * OUTPUT_FILL * T.MAX_NEW_TOKENS[task] * step(c) / speedup
              for task in tasks for c in contexts)
    return {"prefill": pre, "decode": dec, "total": pre + dec,
            "requests": len(tasks) * len(contexts) * samples * n_settings}


def _hm(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{max(seconds / 60, 0.1):.1f} min"


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    settings = R.sparse_settings(args.methods, args.budgets, args.block_size, args.sink, args.window)
    print(f"[accuracy] tasks {args.tasks}, contexts {args.contexts}, {args.samples} samples each; "
          f"dense + {args.methods} x budgets {args.budgets}; block size {args.block_size} "
          f"(CPU setting for this 64-dim-head model)", flush=True)

    tokenizer = T.load_tokenizer(MODEL_DIR)
    t0 = time.time()
    samples = T.make_samples(args.tasks, args.contexts, args.samples, tokenizer)
    print(f"[accuracy] built {len(samples)} samples in {time.time() - t0:.1f}s; "
          f"{len(samples) * len(settings)} requests", flush=True)

    guard = ServerGuard()
    guard.install_signal_handlers()
    watchdog = None
    header = {
        "model": args.model_name,
        "model_path": MODEL_DIR,
        "commit": R.git_commit(),
        "machine": R.machine_description(),
    }
    outputs = None
    try:
        if args.server_url:
            url = args.server_url.rstrip("/")
            server_desc = f"external: {url}"
        else:
            server_args = sparse_server_args(args.block_size)
            url = guard.start(server_args, "sglang_ext").url
            server_desc = "driver: " + " ".join(server_args)
        info = R.server_info(url)
        backend = info.get("attention_backend") or info.get("decode_attention_backend")
        if "sglang_ext" not in (info.get("attention_backend"), info.get("decode_attention_backend")):
            print(f"[accuracy] WARNING: the server's attention backend is {backend!r}, not "
                  "sglang_ext: sparse settings will be ignored", file=sys.stderr, flush=True)

        p = probe(url, samples, settings)
        est = estimate_seconds(p, args.tasks, args.contexts, args.samples, len(settings), args.parallel)
        full = estimate_seconds(p, T.TASKS, DEFAULT_CONTEXTS, DEFAULT_SAMPLES,
                                1 + len(R.METHODS) * len(DEFAULT_BUDGETS), args.parallel)
        print(f"[accuracy] probe @{p['context']} tokens: prefill {p['prefill_s']:.1f}s "
              f"({p['context'] / p['prefill_s']:.0f} tok/s), decode {p['step_s'] * 1000:.0f} ms/token",
              flush=True)
        print(f"[accuracy] estimate for this run: {_hm(est['total'])} "
              f"(prefill {_hm(est['prefill'])}, decode {_hm(est['decode'])}, {est['requests']} requests)",
              flush=True)
        print(f"[accuracy] estimate for the full default run (7 tasks x 1024/2048/4096 x 20 samples x "
              f"13 settings): {_hm(full['total'])} (prefill {_hm(full['prefill'])}, decode "
              f"{_hm(full['decode'])}, {full['requests']} requests)", flush=True)

        limit = args.time_limit * 60 if args.time_limit > 0 else 3 * est["total"] + 600
        deadline = time.time() + limit
        watchdog = guard.watchdog(limit + 600)
        print(f"[accuracy] time limit {_hm(limit)} (hard stop 10 min later)", flush=True)

        config = {
            "tasks": args.tasks, "contexts": args.contexts, "samples": args.samples,
            "methods": args.methods, "budgets": args.budgets, "block_size": args.block_size,
            "sink_max": args.sink, "window_max": args.window, "candidate_blocks": "auto",
            "parallel": args.parallel, "server": server_desc,
            "attention_backend": backend, "kv_pool_tokens": R.kv_pool_tokens(info),
            "haystack": T.corpus_text()[1], "scoring": T.SCORING,
            "max_new_tokens": {t: T.MAX_NEW_TOKENS[t] for t in args.tasks},
            "quick": bool(args.quick),
            "estimate_seconds": round(est["total"], 1),
            "probe": {k: round(v, 4) if isinstance(v, float) else v for k, v in p.items()},
        }

        def save(rows):
            R.write_results(args.out, rows, {**header, "config": config}, plot=not args.no_plot)

        run_t0 = time.time()
        run = R.run_suite(url, samples, settings, parallel=args.parallel, deadline=deadline,
                          on_rows=save)
        outputs = run.results
        config["run_seconds"] = round(time.time() - run_t0, 1)

        if args.reference and not run.stopped_early:
            if not args.server_url:
                guard.servers[-1].stop()  # one server at a time on a small machine
            ref_url = guard.start(REFERENCE_ARGS, "torch_native").url
            ref_setting = [R.Setting("torch_native", 0, None)]
            done = {(r.sample.task, r.sample.context, r.sample.index) for r in run.results}
            ref = R.run_suite(ref_url, [s for s in samples if (s.task, s.context, s.index) in done],
                              ref_setting, parallel=args.parallel, deadline=deadline)
            R.add_agreement(ref.rows, ref.results, run.results)
            save(ref.rows)
            outputs = run.results + ref.results
            print("[accuracy] torch_native vs our dense override, identical outputs: " + ", ".join(
                f"{r['task']}@{r['context']} {r['same_as_dense']:.0f}%" for r in ref.rows), flush=True)

        config["wall_seconds"] = round(time.time() - t_start, 1)
        doc, md = R.write_results(args.out, [], {**header, "config": config}, plot=not args.no_plot)
        print(md)
        md_path, png_path = R.output_paths(args.out)
        print(f"[accuracy] wrote {args.out}, {md_path}" + ("" if args.no_plot else f", {png_path}"))
        print(f"[accuracy] run {_hm(config['run_seconds'])} (estimated {_hm(est['total'])}), "
              f"wall {_hm(config['wall_seconds'])}", flush=True)
        if run.stopped_early:
            print("[accuracy] time limit reached: rows hold the samples done so far", file=sys.stderr)
            return 3
        return 0
    except KeyboardInterrupt:
        print("[accuracy] interrupted; rows written so far are kept", file=sys.stderr)
        return 130
    finally:
        if watchdog is not None:
            watchdog.cancel()
        guard.stop_all()
        if args.outputs and outputs:
            with open(args.outputs, "w") as f:
                for r in outputs:
                    f.write(json.dumps({"task": r.sample.task, "context": r.sample.context,
                                        "index": r.sample.index, "method": r.setting.method,
                                        "budget": r.setting.budget, "answers": r.sample.answers,
                                        "output": r.output, "credit": r.credit}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
