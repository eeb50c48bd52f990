"""Accuracy suite driver: start CPU SGLang servers with our backend, run the tasks, stop them.

    python -m benchmarks.accuracy.driver --quick            # ~1 min: passkey@1024, 3 samples
    python -m benchmarks.accuracy.driver                    # the full default run (~55 min on 2 cores)
    python -m benchmarks.accuracy.driver --server-url http://127.0.0.1:30000 --tasks passkey

A server with ``--attention-backend sglang_ext`` evaluates dense attention and every
(method, budget): each request carries its settings in ``custom_params``. Per sample, one
request prefills the prompt into the radix cache, then all settings decode it together in one
batch. On a CPU the driver starts one server per two cores' worth of work (``--servers``, 2 by
default, one torch thread each: the decode step is many small ops that a second thread barely
speeds up) and splits the samples between them. ``--reference`` also starts SGLang's own
torch_native backend afterwards and runs the dense requests there (row method ``torch_native``,
with the share of outputs identical to our dense override). Servers are stopped on exit, Ctrl-C
and SIGTERM; ``--time-limit`` bounds the run (it stops taking samples and keeps the rows done).

Before the rest, the driver runs two samples of the largest context per server, one after the
other, times the second ones' prefill and decode, and prints the estimated duration of this run
and of the full default run.
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
from sglang_ext.selection.params import LABEL_DTYPES, SUMMARY_DTYPE_NAMES  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "accuracy", "accuracy_smollm2.json")
DEFAULT_CONTEXTS = (1024, 2048, 4096)
DEFAULT_BUDGETS = (64, 128, 256, 512)
DEFAULT_SAMPLES = 20
# Blocks of 4 tokens on this CPU model: with 64-dim heads the min/max bound of 16-token blocks
# is too loose to rank a needle's block (see the README, "Measured").
DEFAULT_BLOCK_SIZE = 4
QUICK = dict(tasks=["passkey"], contexts=[1024], methods=["two_level"], budgets=[128], samples=3,
             servers=1)

# Time model behind the printed estimate, scaled from the probe (a sample of the largest
# context T0 on a server that has run one before: its prefill, and its decode = every setting
# at once):
#   prefill(T)       = probe_prefill * (T / T0) * (1 + T / PREFILL_KNEE) / (1 + T0 / PREFILL_KNEE)
#   decode(T, task)  = probe_decode * (limit(task) / limit(probe task)) * (n_settings / probe's)
#                      * (1 + T / DECODE_KNEE) / (1 + T0 / DECODE_KNEE)
#   total            = sum over samples / servers
# PREFILL_KNEE: for this model (576 wide, 30 layers) attention FLOPs match the linear layers'
# at ~8k tokens. DECODE_KNEE: a decode step of 13 requests on one core took ~0.42 s at 1k and
# ~0.72 s at 4k tokens (selection and attention grow with the context, the rest does not).
PREFILL_KNEE = 8192.0
DECODE_KNEE = 3072.0
# Server flags for the suite: no prefill chunking up to the largest context (torch_native's
# extend recomputes attention over the whole prefix for every chunk). An explicit memory
# fraction: SGLang's automatic one reserves 1.5 MB per chunked-prefill token against the
# smallest NUMA node's MemTotal, which some VMs report at half the machine's memory (12.5 of
# 24 GB seen here), and then comes out negative (-0.039) and stops start-up. The KV pool is
# capped by --max-total-tokens (tests/server_utils.CPU_ARGS) either way.
SUITE_SERVER_ARGS = ["--chunked-prefill-size", "8192", "--max-running-requests", "64",
                     "--mem-fraction-static", "0.8"]


def sparse_server_args(block_size: int, dense_decode: str = "float32",
                       head_policy: Optional[str] = None,
                       eviction_head: Optional[str] = None,
                       label_dtype: str = "auto", summary_dtype: str = "auto",
                       kv_cache_dtype: str = "auto",
                       label_config: Optional[str] = None) -> list[str]:
    """Our backend; method and budget come with each request, the block size too (so the flag
    only sets the default). ``dense_decode``: how the dense requests decode (float32 by default:
    the same attention as SGLang's bf16 SDPA call, ~8x faster per request on a CPU).
    ``head_policy``: a per-head policy file (the ``head_policy`` method's requests use it).
    ``eviction_head``: trained eviction heads (the ``locality_learned`` and
    ``locality_limited_learned`` methods' requests). ``label_dtype``: how the label channels
    are stored (``--sparse-label-dtype``; server-wide, so one run per dtype), ``summary_dtype``
    the page summaries (``--sparse-summary-dtype``, likewise), ``kv_cache_dtype`` SGLang's KV
    cache (``--kv-cache-dtype``: every method, dense included, reads the same 8-bit cache).
    ``label_config``: the label file (default: ``make model``'s channels, when present; one
    with a basis changes every request's q/k basis, so one run per file)."""
    args = ["--attention-backend", "sglang_ext", "--sparse-block-size", str(block_size),
            "--sparse-dense-decode", dense_decode]
    label_config = label_config or (LABELS if os.path.exists(LABELS) else None)
    if label_config:
        args += ["--sparse-label-config", label_config]
    if label_dtype != "auto":
        args += ["--sparse-label-dtype", label_dtype]
    if summary_dtype != "auto":
        args += ["--sparse-summary-dtype", summary_dtype]
    if kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", kv_cache_dtype]
    if head_policy:
        args += ["--sparse-head-policy", head_policy]
    if eviction_head:
        args += ["--sparse-eviction-head", eviction_head]
    return args + SUITE_SERVER_ARGS


REFERENCE_ARGS = ["--attention-backend", "torch_native"] + SUITE_SERVER_ARGS


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(T.TASKS), choices=T.TASKS)
    p.add_argument("--contexts", nargs="+", type=int, default=list(DEFAULT_CONTEXTS),
                   help="prompt lengths in tokens (8192 is the model's limit)")
    p.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS))
    p.add_argument("--methods", nargs="+", default=list(R.METHODS), choices=R.ALL_METHODS,
                   help="sparse methods; dense always runs (it prefills each sample); "
                        "output_aware / head_policy are two_level variants (Fluxion), locality / "
                        "locality_learned two_level under NOSA's locality constraint")
    p.add_argument("--head-policy", default=None,
                   help="per-head policy for the servers (python -m "
                        "sglang_ext.selection.head_policy); needed by --methods head_policy")
    p.add_argument("--eviction-head", default=None,
                   help="trained eviction heads for the servers (python -m "
                        "sglang_ext.selection.train_eviction); needed by --methods "
                        "locality_learned and locality_limited_learned")
    p.add_argument("--label-config", default=None,
                   help="the servers' --sparse-label-config (default: make model's label "
                        "channels; e.g. .models/smollm2/sparse_labels_kpca.json for its basis)")
    p.add_argument("--label-dtype", default="auto", choices=LABEL_DTYPES,
                   help="the servers' --sparse-label-dtype (fp8_e4m3: the label channels rounded "
                        "to fp8, as the fp8 label cache stores them)")
    p.add_argument("--summary-dtype", default="auto", choices=SUMMARY_DTYPE_NAMES,
                   help="the servers' --sparse-summary-dtype (fp8_e4m3: each block's key min "
                        "rounded down and max up to fp8, as the fp8 summaries store them)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8_e5m2"],
                   help="the servers' --kv-cache-dtype (fp8: keys and values stored in 8 bits, "
                        "for the dense column as for the sparse ones)")
    p.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="samples per (task, context)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per block (4 for this CPU model; 16 is the GPU default)")
    p.add_argument("--dense-decode", default="float32", choices=["float32", "sglang"],
                   help="--sparse-dense-decode of the servers: how dense requests decode "
                        "(sglang: bit-identical to torch_native, ~8x slower per dense request)")
    p.add_argument("--sink", type=int, default=R.DEFAULT_SINK, help="max sink (<= budget/8)")
    p.add_argument("--window", type=int, default=R.DEFAULT_WINDOW, help="max window (<= budget/4)")
    p.add_argument("--locality-share", type=float, default=R.LOCALITY_SHARE,
                   help="locality methods: share of the budget's middle blocks that is "
                        "query-agnostic (k_e); the GPU locality run uses the default")
    p.add_argument("--locality-new-share", type=float, default=R.LOCALITY_NEW_SHARE,
                   help="locality_limited: share of the automatic block filter that may be new "
                        "per step (locality_new_blocks); the GPU locality run uses the default")
    p.add_argument("--locality-filter-scale", type=float, default=R.LOCALITY_FILTER_SCALE,
                   help="locality_limited: its block filter is this many times the automatic "
                        "one; the GPU locality run uses the default")
    p.add_argument("--servers", type=int, default=2,
                   help="servers started (each gets cores/servers torch threads); "
                        "with --server-url, the URLs given")
    p.add_argument("--parallel", type=int, default=2,
                   help="samples in flight per server (each sends all its settings at once)")
    p.add_argument("--quick", action="store_true",
                   help="passkey@1024, 3 samples, dense + two_level@128, one server "
                        "(overrides the above)")
    p.add_argument("--server-url", nargs="+", default=None,
                   help="use these running servers, start none")
    p.add_argument("--server-setting", action="store_true",
                   help="send no per-request settings: every request decodes with the server's "
                        "own flags (a server that refuses custom_params.sparse, e.g. the CPU "
                        "tier on --sparse-impl triton); rows are named by the one --methods and "
                        "--budgets value the server was started with, and have no dense column")
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
    if not 1 <= args.parallel <= 16 or not 1 <= args.servers <= 8:
        p.error("--parallel must be in 1..16, --servers in 1..8")
    if not 0.0 <= args.locality_share <= 1.0:
        p.error("--locality-share must be in [0, 1]")
    if not 0.0 < args.locality_new_share <= 1.0:
        p.error("--locality-new-share must be in (0, 1]")
    if args.locality_filter_scale <= 0:
        p.error("--locality-filter-scale must be > 0")
    if args.server_setting and (len(args.methods) != 1 or len(args.budgets) != 1
                                or not args.server_url or args.reference):
        p.error("--server-setting needs --server-url, one --methods and one --budgets value "
                "(the server's), and no --reference")
    return args


# --------------------------------------------------------------------------------------
# Servers: started here, stopped on every way out
# --------------------------------------------------------------------------------------


class ServerGuard:
    """Starts servers one at a time and stops them on exit, Ctrl-C, SIGTERM or the watchdog."""

    def __init__(self) -> None:
        self.servers: list[Server] = []
        self._interrupted = False

    def start(self, args: list[str], what: str, count: int = 1) -> list[Server]:
        """Start ``count`` servers with ``args`` at once; return them when all are healthy."""
        print(f"[accuracy] starting {count} {what} server(s): {' '.join(args)}", flush=True)
        t0 = time.time()
        servers = [Server(args) for _ in range(count)]
        self.servers += servers
        errors: list[BaseException] = []

        def start_one(server: Server) -> None:
            try:
                server.start()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        threads = [threading.Thread(target=start_one, args=(sv,), daemon=True) for sv in servers]
        for th in threads:
            th.start()
        for th in threads:
            while th.is_alive():
                th.join(timeout=0.5)
        if errors:
            raise errors[0]
        for sv in servers:
            print(f"[accuracy] {what} server up at {sv.url} in {time.time() - t0:.0f}s "
                  f"(log {sv.log_path})", flush=True)
        return servers

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
            print("\n[accuracy] hard time limit reached: stopping servers", file=sys.stderr, flush=True)
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


def probe_samples(samples: Sequence[T.Sample], n: int) -> list[T.Sample]:
    """The first ``n`` samples of the largest context (the probe runs them; results are kept)."""
    top = max(s.context for s in samples)
    return [s for s in samples if s.context == top][:n]


def estimate_seconds(p: dict, samples: Sequence[T.Sample], n_settings: int, servers: int) -> dict:
    """Seconds for ``samples`` (with their own answer limits) from the probe ``p``."""
    t0 = p["context"]

    def prefill(t: int) -> float:
        return p["prefill_s"] * (t / t0) * (1 + t / PREFILL_KNEE) / (1 + t0 / PREFILL_KNEE)

    def decode(t: int, limit: int) -> float:
        return (p["decode_s"] * (limit / p["limit"]) * (n_settings / p["settings"])
                * (1 + t / DECODE_KNEE) / (1 + t0 / DECODE_KNEE))

    pre = sum(prefill(s.context) for s in samples) / servers
    dec = sum(decode(s.context, s.max_new_tokens) for s in samples) / servers
    return {"prefill": pre, "decode": dec, "total": pre + dec, "requests": len(samples) * n_settings}


def _hm(seconds: float) -> str:
    m = int(round(seconds / 60))
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{max(seconds / 60, 0.1):.1f} min"


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    if "head_policy" in args.methods and not args.head_policy and not args.server_url:
        raise SystemExit("accuracy: --methods head_policy needs --head-policy FILE")
    for learned in ("locality_learned", "locality_limited_learned"):
        if learned in args.methods and not args.eviction_head and not args.server_url:
            raise SystemExit(f"accuracy: --methods {learned} needs --eviction-head FILE")
    if args.server_setting:
        # the server's flags decide; the row names what it was started with
        settings = [R.Setting(args.methods[0], args.budgets[0], None)]
    else:
        settings = R.sparse_settings(args.methods, args.budgets, args.block_size, args.sink,
                                     args.window, args.locality_share, args.locality_new_share,
                                     args.locality_filter_scale)
    print(f"[accuracy] tasks {args.tasks}, contexts {args.contexts}, {args.samples} samples "
          f"each; {'' if args.server_setting else 'dense + '}{args.methods} x budgets "
          f"{args.budgets}; block size {args.block_size}", flush=True)

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
    threads_per_server = max(1, (os.cpu_count() or 1) // args.servers)
    try:
        if args.server_url:
            urls = [u.rstrip("/") for u in args.server_url]
            server_desc = f"external: {' '.join(urls)}"
        else:
            server_args = sparse_server_args(args.block_size, args.dense_decode, args.head_policy,
                                             args.eviction_head, args.label_dtype,
                                             args.summary_dtype, args.kv_cache_dtype,
                                             args.label_config)
            # One torch (OpenMP) thread per core and server, so servers do not preempt each other.
            os.environ["OMP_NUM_THREADS"] = str(threads_per_server)
            urls = [sv.url for sv in guard.start(server_args, "sglang_ext", args.servers)]
            server_desc = (f"driver: {args.servers} x ({' '.join(server_args)}), "
                           f"OMP_NUM_THREADS={threads_per_server}")
        info = R.server_info(urls[0])
        backend = info.get("attention_backend") or info.get("decode_attention_backend")
        if "sglang_ext" not in (info.get("attention_backend"), info.get("decode_attention_backend")):
            print(f"[accuracy] WARNING: the server's attention backend is {backend!r}, not "
                  "sglang_ext: sparse settings will be ignored", file=sys.stderr, flush=True)

        config = {
            "tasks": args.tasks, "contexts": args.contexts, "samples": args.samples,
            "methods": args.methods, "budgets": args.budgets, "block_size": args.block_size,
            "sink_max": args.sink, "window_max": args.window, "candidate_blocks": "auto",
            "locality_share": args.locality_share, "locality_new_share": args.locality_new_share,
            "locality_filter_scale": args.locality_filter_scale,
            "servers": len(urls), "samples_in_flight_per_server": args.parallel,
            "server": server_desc, "attention_backend": backend,
            "kv_pool_tokens": R.kv_pool_tokens(info),
            "haystack": T.corpus_text()[1], "scoring": T.SCORING,
            "max_new_tokens": {t: T.MAX_NEW_TOKENS[t] for t in args.tasks},
            "max_new_tokens_rule": f"per sample: expected answer's tokens (inline or listed, "
                                   f"whichever is longer) + {T.ANSWER_SLACK}, at most the above",
            "quick": bool(args.quick),
            "server_setting": bool(args.server_setting),
        }

        def save(rows):
            R.write_results(args.out, rows, {**header, "config": config}, plot=not args.no_plot)

        # Probe: the first samples of the largest context, two per server one after the other
        # (a server's first requests run slow); the second ones are timed. Results are kept.
        probe = probe_samples(samples, 2 * len(urls))
        first = probe[-1]
        run_t0 = time.time()
        timings: list[tuple[float, float]] = []
        probe_run = R.run_suite(urls, probe, settings, in_flight=1, progress=False,
                                on_sample=lambda s, pre, dec: timings.append((pre, dec)))
        timed = timings[len(urls):] or timings
        p = {"context": first.context, "task": first.task, "limit": first.max_new_tokens,
             "settings": len(settings),
             "prefill_s": sorted(t[0] for t in timed)[len(timed) // 2],
             "decode_s": sorted(t[1] for t in timed)[len(timed) // 2]}
        rest = [s for s in samples if all(s is not q for q in probe)]
        est = estimate_seconds(p, rest, len(settings), len(urls))
        full_samples = T.make_samples(T.TASKS, DEFAULT_CONTEXTS, DEFAULT_SAMPLES, tokenizer) \
            if (list(args.tasks), list(args.contexts), args.samples) != (list(T.TASKS), list(DEFAULT_CONTEXTS), DEFAULT_SAMPLES) \
            else samples
        full_n = 1 + len(R.METHODS) * len(DEFAULT_BUDGETS)
        full = estimate_seconds(p, full_samples, full_n, args.servers if not args.server_url else len(urls))
        print(f"[accuracy] probe {first.task}@{first.context}: prefill {p['prefill_s']:.1f}s "
              f"({first.context / p['prefill_s']:.0f} tok/s), decode of {len(settings)} settings "
              f"x <= {first.max_new_tokens} tokens {p['decode_s']:.1f}s", flush=True)
        print(f"[accuracy] estimate for the rest of this run: {_hm(est['total'])} "
              f"(prefill {_hm(est['prefill'])}, decode {_hm(est['decode'])}, {est['requests']} "
              f"requests on {len(urls)} server(s))", flush=True)
        print(f"[accuracy] estimate for the full default run (7 tasks x 1024/2048/4096 x 20 samples x "
              f"13 settings): {_hm(full['total'])} (prefill {_hm(full['prefill'])}, decode "
              f"{_hm(full['decode'])}, {full['requests']} requests)", flush=True)
        config["estimate_seconds"] = round(est["total"] + p["prefill_s"] + p["decode_s"], 1)
        config["probe"] = {k: round(v, 3) if isinstance(v, float) else v for k, v in p.items()}

        limit = args.time_limit * 60 if args.time_limit > 0 else 3 * est["total"] + 600
        deadline = time.time() + limit
        watchdog = guard.watchdog(limit + 600)
        print(f"[accuracy] time limit {_hm(limit)} (hard stop 10 min later)", flush=True)

        run = R.run_suite(urls, rest, settings, in_flight=args.parallel, deadline=deadline,
                          on_rows=save)
        results = probe_run.results + run.results
        rows = R.make_rows(sorted(results, key=lambda r: (r.sample.task, r.sample.context, r.sample.index)),
                           settings)
        outputs = results
        config["run_seconds"] = round(time.time() - run_t0, 1)
        config["prefill_seconds_summed"] = round(probe_run.prefill_seconds + run.prefill_seconds, 1)
        save(rows)

        if args.reference and not run.stopped_early:
            if not args.server_url:
                for sv in guard.servers:
                    sv.stop()  # one kind of server at a time on a small machine
            ref_urls = [sv.url for sv in guard.start(REFERENCE_ARGS, "torch_native", args.servers)] \
                if not args.server_url else urls
            ref_setting = [R.Setting("torch_native", 0, None)]
            done = {(r.sample.task, r.sample.context, r.sample.index) for r in results}
            ref = R.run_suite(ref_urls, [s for s in samples if (s.task, s.context, s.index) in done],
                              ref_setting, in_flight=args.parallel, prefill_first=False,
                              deadline=deadline)
            R.add_agreement(ref.rows, ref.results, results)
            save(ref.rows)
            outputs = results + ref.results
            print("[accuracy] torch_native vs our dense override, identical outputs: " + ", ".join(
                f"{r['task']}@{r['context']} {r['same_as_dense']:.0f}%" for r in ref.rows), flush=True)

        config["wall_seconds"] = round(time.time() - t_start, 1)
        doc, md = R.write_results(args.out, [], {**header, "config": config}, plot=not args.no_plot)
        print(md)
        md_path, png_path = R.output_paths(args.out)
        print(f"[accuracy] wrote {args.out}, {md_path}" + ("" if args.no_plot else f", {png_path}"))
        print(f"[accuracy] run {_hm(config['run_seconds'])} (estimated {_hm(config['estimate_seconds'])}), "
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
                                        "output": r.output, "credit": r.credit,
                                        "completion_tokens": r.meta.get("completion_tokens")}) + "\n")


if __name__ == "__main__":
    sys.exit(main())
