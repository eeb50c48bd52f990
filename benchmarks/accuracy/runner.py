"""Run the accuracy tasks against any running SGLang server through the frontend language.

Each request carries its sparse settings in ``sampling_params.custom_params`` (see "Per-request
settings" in the README), so one server with ``--attention-backend sglang_ext`` decodes the
same samples densely and under every (method, budget). The order makes each sample's prefill
happen once: for a chunk of samples, dense first (it prefills them), then every sparse setting
on the same prompts, which the radix cache serves from the dense request's KV.

Results: one row per (task, context, method, budget), merged into a JSON file, rendered as a
markdown table and a plot (see :func:`write_results`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import requests
import sglang as sgl
from sglang.global_config import global_config
from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

from benchmarks.accuracy import tasks as T
from benchmarks.results_io import git_commit  # noqa: F401  (the suite's results name it)
from sglang_ext.config import (
    LOCALITY_FILTER_SCALE,
    LOCALITY_NEW_SHARE,
    LOCALITY_SHARE,
    locality_blocks_for_share,
    locality_candidate_blocks,
    locality_limited_candidate_blocks,
    locality_new_blocks_for_share,
)
from sglang_ext.progress import progress as progress_bar

METHODS = ("quest", "ds", "two_level")
# two_level variants (Fluxion), each a method name in the rows; "head_policy" needs servers
# started with --sparse-head-policy (the driver's --head-policy).
# "locality" / "locality_learned" are two_level under NOSA's locality constraint with k_e =
# LOCALITY_SHARE (sglang_ext/config.py) of the budget's middle blocks query-agnostic: the
# training-free key_norm score (the one the batched CUDA-graph decode runs), or the trained
# eviction head (servers started with --sparse-eviction-head, the driver's --eviction-head). The
# rest stays query-aware, with a block filter sized for it (locality_candidate_blocks); γ(t) >=
# ~LOCALITY_SHARE. "locality_limited" (below) is what the GPU locality run
# (benchmarks/e2e_serving.py, sglang_ext_tier_locality) serves, so its bytes per step and those
# rows describe one thing.
SHARE_OF_MIDDLE = "share_of_middle"
# A variant key the runner consumes (never sent): keep the automatic block filter (sized for the
# whole middle) instead of one sized for the query-aware rest.
WHOLE_MIDDLE_FILTER = "whole_middle_filter"
# Another: set locality_new_blocks to LOCALITY_NEW_SHARE of the automatic filter.
LIMITED_NEW_BLOCKS = "limited_new_blocks"
# Another: the block filter this many times the automatic one.
FILTER_SCALE = "filter_scale"
VARIANTS = {
    # two_level's block filter by Quest's bound instead of the label maximum (the server's
    # default where it applies, --sparse-block-score)
    "two_level_bound": {"method": "two_level", "head_policy": False, "block_score": "bound"},
    "output_aware": {"method": "two_level", "scoring": "output_aware"},
    # exact rerank (--sparse-rerank): the label scores shortlist 2x / 4x the selected tokens
    # and the exact q.k picks among them; the automatic block filter grows with the factor
    "ds_rerank4": {"method": "ds", "head_policy": False, "rerank": 4},
    "two_level_rerank2": {"method": "two_level", "head_policy": False, "rerank": 2},
    "two_level_rerank4": {"method": "two_level", "head_policy": False, "rerank": 4},
    # floors under the shortlist (--sparse-rerank-min-tokens, 256 before the default became
    # 1024): they only reach small budgets (a shortlist of 4 x the middle below the floor)
    "two_level_rerank4_floor256": {"method": "two_level", "head_policy": False, "rerank": 4,
                                   "rerank_min_tokens": 256},
    "two_level_rerank4_floor512": {"method": "two_level", "head_policy": False, "rerank": 4,
                                   "rerank_min_tokens": 512},
    "two_level_rerank4_floor1024": {"method": "two_level", "head_policy": False, "rerank": 4,
                                    "rerank_min_tokens": 1024},
    # its control: the filter of a plain two_level, too narrow for the shortlist
    "two_level_rerank4_narrow": {"method": "two_level", "head_policy": False, "rerank": 4,
                                 FILTER_SCALE: 1.0},
    # the block filter's cascade (--sparse-block-prefilter; reference decode only): the bound
    # keeps 4x the candidate blocks and the label maximum ranks only those
    "two_level_prefilter4": {"method": "two_level", "head_policy": False, "prefilter": 4},
    "two_level_prefilter4_rerank4": {"method": "two_level", "head_policy": False,
                                     "prefilter": 4, "rerank": 4},
    # the narrower cascade the H100 operator found fastest (F = 2)
    "two_level_prefilter2_rerank4": {"method": "two_level", "head_policy": False,
                                     "prefilter": 2, "rerank": 4},
    # AsyncTLS's asynchronous block filter: blocks ranked by the previous step's query (what
    # --sparse-block-filter async serves on the GPU), tokens by this step's
    "two_level_async": {"method": "two_level", "head_policy": False, "block_filter": "async"},
    # the same with twice the automatic filter: the token stage (this step's query) then
    # picks from more of the blocks the previous step's query ranked high
    "two_level_async_wide": {"method": "two_level", "head_policy": False,
                             "block_filter": "async", FILTER_SCALE: 2.0},
    # its control: the wide filter with this step's query
    "two_level_wide": {"method": "two_level", "head_policy": False, FILTER_SCALE: 2.0},
    "head_policy": {"method": "two_level", "head_policy": True},
    "locality": {"method": "two_level", "head_policy": False, "locality_blocks": SHARE_OF_MIDDLE,
                 "eviction_score": "key_norm"},
    "locality_learned": {"method": "two_level", "head_policy": False,
                         "locality_blocks": SHARE_OF_MIDDLE, "eviction_score": "learned"},
    # The two factors of the locality rows' accuracy loss, one at a time (issue 7): the key_norm
    # score with the automatic filter, and the attention score (reference decode only) with the
    # narrow filter.
    "locality_wide": {"method": "two_level", "head_policy": False,
                      "locality_blocks": SHARE_OF_MIDDLE, "eviction_score": "key_norm",
                      WHOLE_MIDDLE_FILTER: True},
    "locality_attention": {"method": "two_level", "head_policy": False,
                           "locality_blocks": SHARE_OF_MIDDLE, "eviction_score": "attention"},
    # What the GPU locality run serves: key_norm, the automatic filter, and at most
    # LOCALITY_NEW_SHARE of it new per step (the transfers come from the filter's turnover).
    "locality_limited": {"method": "two_level", "head_policy": False,
                         "locality_blocks": SHARE_OF_MIDDLE, "eviction_score": "key_norm",
                         WHOLE_MIDDLE_FILTER: True, LIMITED_NEW_BLOCKS: True},
    # The same with the trained eviction heads (servers with --sparse-eviction-head).
    "locality_limited_learned": {"method": "two_level", "head_policy": False,
                                 "locality_blocks": SHARE_OF_MIDDLE, "eviction_score": "learned",
                                 WHOLE_MIDDLE_FILTER: True, LIMITED_NEW_BLOCKS: True},
}
ALL_METHODS = METHODS + tuple(VARIANTS)
DENSE = "dense"
# Upper bounds of sink / window; small budgets get smaller ones (see sparse_settings).
DEFAULT_SINK = 16
DEFAULT_WINDOW = 64
KEY_FIELDS = ("task", "context", "method", "budget")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --------------------------------------------------------------------------------------
# The frontend backend that adds custom_params to every request
# --------------------------------------------------------------------------------------


class SparseRuntimeEndpoint(RuntimeEndpoint):
    """``sgl.RuntimeEndpoint`` that puts ``custom_params`` into each request's sampling params.

    ``sgl.gen`` has no ``custom_params`` argument. This backend adds ``custom_params`` (given
    here) to every generate request; a program may override it per call with an argument named
    ``custom_params`` (``None`` sends none), so one ``run_batch`` can mix settings.
    """

    def __init__(self, base_url: str, custom_params: Optional[dict] = None, **kwargs: Any):
        super().__init__(base_url, **kwargs)
        self.custom_params = custom_params

    def _custom_params(self, s: Any) -> Optional[dict]:
        args = getattr(s, "arguments", None) or {}
        return args["custom_params"] if "custom_params" in args else self.custom_params

    def _with_custom_params(self, s: Any, sampling_params: Any) -> Any:
        custom = self._custom_params(s)
        if custom is None:
            return sampling_params
        # A per-request copy whose to_srt_kwargs() (what the base class sends as
        # "sampling_params") also carries custom_params; the base class may still adjust the
        # copy's fields (dtype -> regex) before it is serialised.
        params = copy.copy(sampling_params)
        base = params.to_srt_kwargs
        params.to_srt_kwargs = lambda: {**base(), "custom_params": custom}
        return params

    def generate(self, s, sampling_params):
        return super().generate(s, self._with_custom_params(s, sampling_params))

    def generate_stream(self, s, sampling_params):
        return super().generate_stream(s, self._with_custom_params(s, sampling_params))


@sgl.function
def answer_program(s, prompt, max_tokens, custom_params=None):
    # `prompt` is already chat-templated (tasks.py), so it is appended verbatim; custom_params
    # is read by SparseRuntimeEndpoint.
    s += prompt
    s += sgl.gen("answer", max_tokens=max_tokens, temperature=0)


# --------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    method: str  # "dense", a sparse method, or a reference server's name
    budget: int  # 0 when not sparse
    custom_params: Optional[dict]  # what the request carries (None: nothing)

    @property
    def label(self) -> tuple[str, int]:
        return self.method, self.budget


def shrunk_sink_window(budget: int, sink: int = DEFAULT_SINK,
                       window: int = DEFAULT_WINDOW) -> tuple[int, int]:
    """(sink, window) for ``budget``: sink <= budget/8, window <= budget/4 (at least 1)."""
    return min(sink, budget // 8), max(1, min(window, budget // 4))


def sparse_settings(methods: Sequence[str], budgets: Sequence[int], block_size: int,
                    sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
                    locality_share: float = LOCALITY_SHARE,
                    new_share: float = LOCALITY_NEW_SHARE,
                    filter_scale: float = LOCALITY_FILTER_SCALE) -> list[Setting]:
    """Dense first, then every (method, budget). Sink and window shrink for small budgets
    (sink <= budget/8, window <= budget/4) so that budget 64 is valid and still leaves most of
    it to the selected tokens."""
    out = [Setting(DENSE, 0, {"sparse": {"method": DENSE}})]
    for m in methods:
        if m == DENSE:
            continue
        if m not in ALL_METHODS:
            raise ValueError(f"unknown method {m!r}; known: {', '.join(ALL_METHODS)}, dense")
        # A server with a head policy applies it unless told not to.
        how = VARIANTS.get(m, {"method": m, "head_policy": False})
        for b in budgets:
            s, w = shrunk_sink_window(b, sink, window)
            sparse = {**how, "budget": b, "block_size": block_size, "sink": s, "window": w}
            whole_middle = sparse.pop(WHOLE_MIDDLE_FILTER, False)
            scale = sparse.pop(FILTER_SCALE, None)
            if scale is not None:
                sparse["candidate_blocks"] = locality_limited_candidate_blocks(scale, b, s, w,
                                                                               block_size)
            if sparse.pop(LIMITED_NEW_BLOCKS, False):
                sparse["locality_new_blocks"] = locality_new_blocks_for_share(new_share, b, s, w,
                                                                              block_size)
                if filter_scale != 1:
                    sparse["candidate_blocks"] = locality_limited_candidate_blocks(
                        filter_scale, b, s, w, block_size)
            if sparse.get("locality_blocks") == SHARE_OF_MIDDLE:
                k_e = locality_blocks_for_share(locality_share, b, s, w, block_size)
                sparse["locality_blocks"] = k_e
                if not whole_middle:
                    sparse["candidate_blocks"] = locality_candidate_blocks(k_e, b, s, w,
                                                                           block_size)
            out.append(Setting(m, b, {"sparse": sparse}))
    return out


# --------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------


def server_info(url: str) -> dict:
    try:
        r = requests.get(url + "/server_info", timeout=60)
        r.raise_for_status()
        return r.json()
    except (requests.RequestException, ValueError):
        return {}


def kv_pool_tokens(info: dict, default: int = 16384) -> int:
    for key in ("max_total_num_tokens", "max_total_tokens"):
        v = info.get(key)
        if isinstance(v, int) and v > 0:
            return v
    return default


@dataclass
class Result:
    sample: T.Sample
    setting: Setting
    output: str
    credit: float
    meta: dict


@dataclass
class SuiteRun:
    rows: list[dict]
    results: list[Result]
    stopped_early: bool
    prefill_seconds: float = 0.0  # summed wall time of the samples' prefill (warm-up) requests


DENSE_OVERRIDE = {"sparse": {"method": DENSE}}


def _run_requests(endpoint: SparseRuntimeEndpoint, items: list[tuple[T.Sample, Setting]]) -> list[Result]:
    """All ``items`` at once (one thread each), so that the server decodes them in one batch."""
    if not items:
        return []
    batch = [{"prompt": s.prompt, "max_tokens": s.max_new_tokens, "custom_params": st.custom_params}
             for s, st in items]
    states = answer_program.run_batch(batch, backend=endpoint, num_threads=len(batch),
                                      progress_bar=False)
    out = []
    for (sample, setting), state in zip(items, states):
        err = state.error()
        if err is not None:
            raise RuntimeError(f"{sample.task}@{sample.context} #{sample.index} "
                               f"{setting.method}/{setting.budget}: {err}")
        text = state["answer"]
        meta = state.get_meta_info("answer") or {}
        out.append(Result(sample, setting, text, T.score(sample, text), meta))
    return out


def _prefill(endpoint: SparseRuntimeEndpoint, sample: T.Sample, custom_params: Optional[dict]) -> None:
    """Put ``sample``'s prompt into the server's radix cache: a one-token request."""
    state = answer_program.run(prompt=sample.prompt, max_tokens=1, custom_params=custom_params,
                               backend=endpoint)
    err = state.error()
    if err is not None:
        raise RuntimeError(f"{sample.task}@{sample.context} #{sample.index} prefill: {err}")


def group_samples(samples: Iterable[T.Sample]) -> "OrderedDict[tuple[str, int], list[T.Sample]]":
    groups: OrderedDict[tuple[str, int], list[T.Sample]] = OrderedDict()
    for s in samples:
        groups.setdefault((s.task, s.context), []).append(s)
    return groups


def run_suite(urls: "str | Sequence[str]", samples: Sequence[T.Sample], settings: Sequence[Setting],
              *, in_flight: int = 2, prefill_first: bool = True, deadline: Optional[float] = None,
              progress: bool = True, on_rows: Optional[Callable[[list[dict]], None]] = None,
              on_sample: Optional[Callable[[T.Sample, float, float], None]] = None) -> SuiteRun:
    """Run every sample under every setting, on one or more servers.

    Per sample: one request prefills the prompt (``prefill_first``; it decodes one token
    densely), then every setting is sent at once, so each extends the cached prompt by its last
    token and the server decodes all of them in one batch, the first token included on the same
    (dense) path. Each server works on ``in_flight`` samples at a time (one prefills while
    another decodes). Samples are taken in order; ``deadline`` (time.time()) stops taking new
    ones, and rows then hold the samples done. ``on_rows`` receives the rows of each finished
    (task, context) group; ``on_sample(sample, prefill_s, decode_s)`` each finished sample.
    """
    global_config.enable_precache_with_tracing = False  # our prefixes are per sample
    urls = [urls] if isinstance(urls, str) else list(urls)
    endpoints = [SparseRuntimeEndpoint(u) for u in urls]
    groups = group_samples(samples)
    remaining = {key: len(group) for key, group in groups.items()}
    by_group: dict[tuple[str, int], list[Result]] = {key: [] for key in groups}
    todo = list(samples)
    todo.reverse()  # pop() takes them in order
    lock = threading.Lock()
    bar = progress_bar(total=len(samples) * len(settings), unit="req", enabled=progress,
                       dynamic_ncols=True, smoothing=0.05)
    all_rows: list[dict] = []
    all_results: list[Result] = []
    state = {"stopped": False, "prefill": 0.0, "error": None}

    def take() -> Optional[T.Sample]:
        with lock:
            if state["error"] is not None or not todo:
                return None
            if deadline is not None and time.time() > deadline:
                state["stopped"] = True
                return None
            return todo.pop()

    def worker(endpoint: SparseRuntimeEndpoint) -> None:
        try:
            while (sample := take()) is not None:
                t0 = time.time()
                if prefill_first:
                    _prefill(endpoint, sample, settings[0].custom_params)
                t1 = time.time()
                results = _run_requests(endpoint, [(sample, st) for st in settings])
                t2 = time.time()
                with lock:
                    state["prefill"] += t1 - t0
                    key = (sample.task, sample.context)
                    by_group[key] += results
                    remaining[key] -= 1
                    bar.set_description(f"{sample.task}@{sample.context}", refresh=False)
                    bar.update(len(results))
                    if on_sample is not None:
                        on_sample(sample, t1 - t0, t2 - t1)
                    if remaining[key] == 0:
                        rows = make_rows(sorted(by_group[key], key=lambda r: r.sample.index), settings)
                        all_rows.extend(rows)
                        all_results.extend(by_group[key])
                        if rows and on_rows is not None:
                            on_rows(rows)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            with lock:
                if state["error"] is None:
                    state["error"] = e

    threads = [threading.Thread(target=worker, args=(ep,), daemon=True)
               for ep in endpoints for _ in range(max(1, in_flight))]
    try:
        for th in threads:
            th.start()
        for th in threads:
            while th.is_alive():
                th.join(timeout=0.5)
    finally:
        bar.close()
    if state["error"] is not None:
        raise state["error"]
    # Groups cut short by the deadline: rows of the samples done.
    for key, results in by_group.items():
        if remaining[key] and results:
            rows = make_rows(sorted(results, key=lambda r: r.sample.index), settings)
            all_rows.extend(rows)
            all_results.extend(results)
            if on_rows is not None:
                on_rows(rows)
    return SuiteRun(all_rows, all_results, state["stopped"], state["prefill"])


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def wilson_interval(credits: Sequence[float], z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a mean credit in [0, 1] (exact for 0/1 credits), in
    points (0-100)."""
    n = len(credits)
    if n == 0:
        return 0.0, 100.0
    p = sum(credits) / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return 100 * max(0.0, center - half), 100 * min(1.0, center + half)


def make_rows(results: Sequence[Result], settings: Sequence[Setting]) -> list[dict]:
    rows = []
    by_key: OrderedDict[tuple, list[Result]] = OrderedDict()
    dense_credit = {(r.sample.task, r.sample.context, r.sample.index): r.credit
                    for r in results if r.setting.method == DENSE}
    for r in results:
        by_key.setdefault((r.sample.task, r.sample.context) + r.setting.label, []).append(r)
    for (task, context, method, budget), rs in by_key.items():
        sparse = (rs[0].setting.custom_params or {}).get("sparse", {})
        ci_low, ci_high = wilson_interval([r.credit for r in rs])
        same = [dense_credit.get((r.sample.task, r.sample.context, r.sample.index)) for r in rs]
        row = {
            "task": task,
            "context": context,
            "method": method,
            "budget": budget,
            "score": round(100.0 * _mean([r.credit for r in rs]), 2),
            "n": len(rs),
            "ci_low": round(ci_low, 2),
            "ci_high": round(ci_high, 2),
            # dense attention on the same samples (None where a sample has no dense run)
            "dense_score": (round(100.0 * _mean(same), 2)
                            if same and all(c is not None for c in same) else None),
            # Summed request latency (server-side e2e) of the row's requests; requests overlap
            # when parallel > 1, and dense rows include the prefill.
            "seconds": round(sum(float(r.meta.get("e2e_latency") or 0.0) for r in rs), 2),
            "prompt_tokens": round(_mean([r.meta.get("prompt_tokens", 0) for r in rs]), 1),
            "cached_tokens": round(_mean([r.meta.get("cached_tokens", 0) for r in rs]), 1),
            "completion_tokens": round(_mean([r.meta.get("completion_tokens", 0) for r in rs]), 1),
        }
        for k in ("block_size", "sink", "window", "locality_blocks"):
            if k in sparse:
                row[k] = sparse[k]
        rows.append(row)
    return rows


def add_agreement(rows: list[dict], results: Sequence[Result], baseline: Sequence[Result],
                  method: str = DENSE) -> None:
    """Add ``same_as_dense`` to each row: the % of its samples whose output equals the output
    of ``method`` (our dense override) on the same sample in ``baseline``."""
    sample_key = lambda r: (r.sample.task, r.sample.context, r.sample.index)  # noqa: E731
    base = {sample_key(r): r.output for r in baseline if r.setting.method == method}
    for row in rows:
        rs = [r for r in results if (r.sample.task, r.sample.context) == (row["task"], row["context"])
              and r.setting.label == (row["method"], row["budget"])]
        same = sum(base.get(sample_key(r)) == r.output for r in rs)
        row["same_as_dense"] = round(100.0 * same / max(1, len(rs)), 1)


# --------------------------------------------------------------------------------------
# Results: JSON (merged), markdown, plot
# --------------------------------------------------------------------------------------


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, python {platform.python_version()}"


def validate_row(row: dict) -> None:
    """Raise ValueError unless ``row`` is a well-formed result row."""
    for k, typ in (("task", str), ("context", int), ("method", str), ("budget", int),
                   ("n", int), ("score", (int, float)), ("seconds", (int, float))):
        if not isinstance(row.get(k), typ) or isinstance(row.get(k), bool):
            raise ValueError(f"row field {k!r} missing or not {typ}: {row!r}")
    if not 0 <= row["score"] <= 100:
        raise ValueError(f"score out of range: {row!r}")
    if row["n"] < 1 or row["context"] < 1 or row["budget"] < 0 or row["seconds"] < 0:
        raise ValueError(f"bad counts: {row!r}")
    if (row["method"] in ALL_METHODS) != (row["budget"] > 0):
        raise ValueError(f"sparse methods need a budget, others budget 0: {row!r}")


def _row_key(row: dict) -> tuple:
    return tuple(row[k] for k in KEY_FIELDS)


def _order(row: dict) -> tuple:
    task_i = T.TASKS.index(row["task"]) if row["task"] in T.TASKS else len(T.TASKS)
    meth = row["method"]
    meth_i = (0 if meth == DENSE else 1 + ALL_METHODS.index(meth) if meth in ALL_METHODS else 9)
    return task_i, row["task"], row["context"], meth_i, meth, row["budget"]


def merge_results(path: str, rows: Sequence[dict], header: dict) -> dict:
    """Merge ``rows`` into the JSON at ``path`` (same key replaces), update the header fields."""
    doc: dict = {}
    if os.path.exists(path):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
    merged = {_row_key(r): r for r in doc.get("rows", []) if isinstance(r, dict) and all(k in r for k in KEY_FIELDS)}
    for r in rows:
        validate_row(r)
        merged[_row_key(r)] = r
    doc = {**{k: v for k, v in doc.items() if k != "rows"}, **header,
           "rows": sorted(merged.values(), key=_order)}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return doc


def _fmt(x: Optional[float]) -> str:
    return "" if x is None else f"{x:.0f}"


def render_markdown(doc: dict) -> str:
    rows = doc.get("rows", [])
    cfg = doc.get("config", {})
    sparse = sorted({(r["method"], r["budget"]) for r in rows if r["budget"] > 0},
                    key=lambda mb: (_order({"task": "", "context": 0, "method": mb[0], "budget": mb[1]})))
    budgets = sorted({b for _, b in sparse})
    methods = [m for m in ALL_METHODS if any(mm == m for mm, _ in sparse)]
    refs = sorted({r["method"] for r in rows if r["budget"] == 0 and r["method"] != DENSE})
    cell = {_row_key(r): r for r in rows}
    tasks = sorted({r["task"] for r in rows}, key=lambda t: _order({"task": t, "context": 0, "method": DENSE, "budget": 0}))
    contexts = sorted({r["context"] for r in rows})

    def score(task: str, ctx: int, method: str, budget: int) -> Optional[float]:
        if task == "mean":
            vals = [score(t, ctx, method, budget) for t in tasks]
            return None if any(v is None for v in vals) else sum(vals) / len(vals)
        r = cell.get((task, ctx, method, budget))
        return None if r is None else float(r["score"])

    lines = [
        f"Accuracy of {doc.get('model', '?')} (score 0-100; commit {doc.get('commit') or 'uncommitted'}; "
        f"{doc.get('machine', '?')}).",
        "",
        f"Sparse settings: block size {cfg.get('block_size', '?')}, sink <= min(16, budget/8), "
        f"window <= min(64, budget/4), candidate blocks auto; n = samples per cell.",
        "",
    ]
    head = ["task", "context", "n", "dense", *refs, "method", *[str(b) for b in budgets]]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("| " + " | ".join(["---"] * 2 + ["---:"] * (2 + len(refs)) + ["---"] + ["---:"] * len(budgets)) + " |")
    task_list = tasks + (["mean"] if len(tasks) > 1 else [])
    for task in task_list:
        for ctx in contexts:
            dense_row = cell.get((task, ctx, DENSE, 0))
            if task != "mean" and dense_row is None and not any(cell.get((task, ctx, m, b)) for m, b in sparse):
                continue
            n = "" if task == "mean" else str(max((r["n"] for r in rows if r["task"] == task and r["context"] == ctx), default=0))
            first = True
            for method in methods or [""]:
                left = [f"**{task}**" if task == "mean" else task, str(ctx), n,
                        _fmt(score(task, ctx, DENSE, 0)), *[_fmt(score(task, ctx, ref, 0)) for ref in refs]]
                if not first:
                    left = ["", "", "", "", *["" for _ in refs]]
                vals = [_fmt(score(task, ctx, method, b)) for b in budgets]
                lines.append("| " + " | ".join(left + [method] + vals) + " |")
                first = False
    lines.append("")
    return "\n".join(lines)


def render_plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc.get("rows", [])
    if not rows:
        return
    tasks = sorted({r["task"] for r in rows}, key=lambda t: _order({"task": t, "context": 0, "method": DENSE, "budget": 0}))
    cols = tasks + (["mean"] if len(tasks) > 1 else [])
    contexts = sorted({r["context"] for r in rows})
    cell = {_row_key(r): r["score"] for r in rows}
    budgets = sorted({r["budget"] for r in rows if r["budget"] > 0})
    methods = [m for m in ALL_METHODS if any(r["method"] == m for r in rows)]
    refs = sorted({r["method"] for r in rows if r["budget"] == 0 and r["method"] != DENSE})
    colors = {"quest": "tab:blue", "ds": "tab:orange", "two_level": "tab:green",
              "output_aware": "tab:red", "head_policy": "tab:purple", "locality": "tab:brown",
              "locality_learned": "tab:pink", "locality_wide": "tab:olive",
              "locality_attention": "tab:cyan", "locality_limited": "tab:gray",
              "locality_limited_learned": "black", "two_level_async": "goldenrod",
              "two_level_async_wide": "darkgoldenrod", "two_level_wide": "darkgreen",
              "two_level_bound": "lime", "ds_rerank4": "navajowhite",
              "two_level_rerank2": "mediumseagreen", "two_level_rerank4": "seagreen",
              "two_level_rerank4_narrow": "darkseagreen",
              "two_level_rerank4_floor256": "yellowgreen",
              "two_level_rerank4_floor512": "olivedrab",
              "two_level_rerank4_floor1024": "darkolivegreen", "two_level_prefilter4": "teal",
              "two_level_prefilter4_rerank4": "darkslategray",
              "two_level_prefilter2_rerank4": "slategray"}

    def get(task, ctx, method, budget):
        if task == "mean":
            vals = [cell.get((t, ctx, method, budget)) for t in tasks]
            return None if any(v is None for v in vals) else sum(vals) / len(vals)
        return cell.get((task, ctx, method, budget))

    width = max(6.0, 2.9 * len(cols))
    height = 2.5 * len(contexts) + 0.9  # + title on top and legend at the bottom
    fig, axes = plt.subplots(len(contexts), len(cols), figsize=(width, height), squeeze=False,
                             sharey=True, layout="constrained")
    for i, ctx in enumerate(contexts):
        for j, task in enumerate(cols):
            ax = axes[i][j]
            d = get(task, ctx, DENSE, 0)
            if d is not None:
                ax.axhline(d, color="black", ls="--", lw=1.2, label="dense")
            for ref in refs:
                v = get(task, ctx, ref, 0)
                if v is not None:
                    ax.axhline(v, color="gray", ls=":", lw=1.2, label=ref)
            for m in methods:
                pts = [(b, get(task, ctx, m, b)) for b in budgets]
                pts = [(b, v) for b, v in pts if v is not None]
                if pts:
                    ax.plot([b for b, _ in pts], [v for _, v in pts], marker="o", ms=3.5,
                            color=colors.get(m), label=m)
            if budgets:
                ax.set_xscale("log", base=2)
                ax.set_xticks(budgets)
                ax.set_xticklabels([str(b) for b in budgets], fontsize=7)
            ax.set_ylim(-4, 104)
            ax.grid(alpha=0.3)
            ax.set_title(f"{task} @ {ctx}", fontsize=9)
            if i == len(contexts) - 1:
                ax.set_xlabel("budget (tokens)", fontsize=8)
            if j == 0:
                ax.set_ylabel("score", fontsize=8)
    handles, labels = [], []
    for ax in axes.flat:
        for h, l in zip(*ax.get_legend_handles_labels()):
            if l not in labels:
                handles.append(h)
                labels.append(l)
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels), fontsize=8, frameon=False)
    cfg = doc.get("config", {})
    fig.suptitle(f"{doc.get('model', '')}: score vs sparse budget\n(block size "
                 f"{cfg.get('block_size', '?')}; dense = exact attention on the same server)", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def output_paths(json_path: str) -> tuple[str, str]:
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    return stem + ".md", stem + ".png"


def write_results(json_path: str, rows: Sequence[dict], header: dict, *, plot: bool = True) -> tuple[dict, str]:
    """Merge rows into ``json_path``; write the markdown table and plot beside it."""
    doc = merge_results(json_path, rows, header)
    md_path, png_path = output_paths(json_path)
    md = render_markdown(doc)
    with open(md_path, "w") as f:
        f.write(md)
    if plot:
        render_plot(doc, png_path)
    return doc, md
