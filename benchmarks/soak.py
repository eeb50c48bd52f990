"""Soak test of a serving SGLang server with our backend: concurrency, aborts, shared prefixes,
full tiers, malformed requests; bounded in count and time, loopback only.

What one run does (``--requests`` requests, at most ``--concurrency`` in flight, stops at
``--time-limit``):

* mixed prompt lengths (``--lengths``, tokens of the standard library's docstrings), streaming
  (``--non-stream-frac`` of the plain and shared requests, and of those aborted through the API,
  are sent without streaming); some share a long prefix with an earlier one (radix-cache hits,
  ``--shared``);
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
* with ``--dense-twins K``, after the load K of its prompts longer than the sparse budget run
  again alone, sparse and with ``custom_params.sparse.method = dense`` on the same server:
  ``dense_twin_agreement`` reports the top-1 agreement of the first ``--twin-tokens`` greedy
  tokens (mean, and per power-of-two prompt-length bucket) and the share of equal sequences;
  ``--dense-twins-within`` prompts within the budget must give equal outputs
  (``identical_when_dense``);
* a sweep of bad inputs (``MALFORMED``: bad JSON, out-of-vocabulary, negative or non-integer
  input ids, badly shaped ``input_embeds``, out-of-range ``n``, ``max_new_tokens``, logprob
  fields, batches mixing good and bad prompts, a prompt longer than the context, bad
  ``custom_params.sparse``) must each get its status (400), and the server must answer
  ``/health`` after each;
* at the end: every finished output is well formed (non-empty ids, as many as reported, finish
  reason set), the server is healthy, and its log (``--server-log``) shows no traceback, no
  "memory leak" and no scheduler crash; retracted requests (SGLang's "KV cache pool is full")
  and the longest queue are counted;
  ``/metrics`` (when enabled) is sampled for our counters.

Writes a JSON report (``--out``) and exits 1 when anything failed. Beside the details, its top
level has ``requests`` (all sent to the server under test), ``crashes``, ``leaks`` and
``errors`` (unexpected failures, and each bad input with its expected and observed status).
``--launch "ARGS"`` starts ``python -m sglang.launch_server ARGS`` itself (log to
``--server-log``) and stops it after.

``--merge NAME=REPORT.json ... --out X.json`` writes one report from several runs (phases on
different servers, e.g. benchmarks/device/soak_real.sh): the top-level keys summed over the
phases, each phase's report and server flags under ``phases`` (``merge_reports``).

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
from typing import Any, Callable, Optional

import requests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.ports import with_nccl_port  # noqa: E402
from benchmarks.results_io import git_commit, gpu_name, write_results  # noqa: E402

@dataclass(frozen=True)
class BadInput:
    """One deliberately bad request and the status it must get.

    ``body``: JSON text sent as is (a ``str``), a request body (a ``dict``, sent with
    ``json.dumps``, so NaN stays NaN), or ``fn(facts) -> dict | None`` for a body that depends on
    the model (``server_facts``: ``context_len``, ``vocab_size``, ``hidden_size``); None means
    the facts it needs are unknown, or the case does not apply to this server: it is skipped."""

    name: str
    body: Any
    status: int = 400
    path: str = "/generate"


def _ids_body(ids: Any) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}


def _embeds_body(embeds: Any) -> dict:
    return {"input_embeds": embeds, "sampling_params": {"max_new_tokens": 2}}


def _text_body(**fields: Any) -> dict:
    sampling = fields.pop("sampling_params", {})
    return {"text": "hi", **fields, "sampling_params": {"max_new_tokens": 2, **sampling}}


def _needs(*keys: str) -> Any:
    """Decorator: the body function is skipped (returns None) unless the facts have ``keys``."""
    def wrap(fn: Any) -> Any:
        def body(facts: dict) -> Optional[dict]:
            return fn(facts) if all(facts.get(k) for k in keys) else None
        return body
    return wrap


@_needs("context_len")
def _over_context(facts: dict) -> Optional[dict]:
    if facts.get("allow_auto_truncate"):
        return None  # the server truncates instead (--allow-auto-truncate)
    return _ids_body([1] * (facts["context_len"] + 1))


def _huge_max_new_tokens(facts: dict) -> Optional[dict]:
    if facts.get("allow_auto_truncate"):
        return None  # the server clips max_new_tokens to the context instead
    return _text_body(sampling_params={"max_new_tokens": 10**12})


# Every one must get its status (all 400: SGLang's answer to a ValueError in validation, or to a
# request body FastAPI cannot parse), and none may disturb the server: patches/
# tokenizer_manager.py turns those that killed SGLang 0.5.16's scheduler (out-of-vocabulary ids,
# badly shaped input_embeds, top_logprobs_num past the vocabulary) or answered 500 into 400s.
# docs/reliability.md lists what a client sees for each.
MALFORMED: list[BadInput] = [
    BadInput("not json", "{not json"),
    BadInput("negative max_new_tokens", _text_body(sampling_params={"max_new_tokens": -3})),
    BadInput("temperature as text", _text_body(sampling_params={"temperature": "hot"})),
    BadInput("unknown sparse key", _text_body(
        sampling_params={"custom_params": {"sparse": {"budgett": 64}}})),
    BadInput("bad sparse method", _text_body(
        sampling_params={"custom_params": {"sparse": {"method": "magic"}}})),
    BadInput("bad sparse budget", _text_body(
        sampling_params={"custom_params": {"sparse": {"budget": -1}}})),
    # input ids
    BadInput("input id past the vocabulary", _ids_body([999999999])),
    BadInput("input id equal to the vocabulary size",
             _needs("vocab_size")(lambda f: _ids_body([1, f["vocab_size"]]))),
    BadInput("negative input id", _ids_body([1, -5, 3])),
    BadInput("fractional input id", _ids_body([1.5, 2])),
    BadInput("input ids as strings", _ids_body(["1", "2"])),
    BadInput("input ids as one string", _ids_body("1 2 3")),
    BadInput("boolean input ids", _ids_body([True, False])),
    BadInput("empty input_ids", _ids_body([])),
    BadInput("empty prompt in a batch", _ids_body([[1, 2], []])),
    BadInput("batch with one out-of-vocabulary prompt", _ids_body([[1, 2, 3], [999999999]])),
    BadInput("prompt longer than the context", _over_context),
    # input embeddings (a server with the radix cache refuses every input_embeds: also a 400)
    BadInput("empty input_embeds", _embeds_body([])),
    BadInput("input_embeds too narrow", _embeds_body([[0.1, 0.2]])),
    BadInput("input_embeds with ragged rows",
             _needs("hidden_size")(lambda f: _embeds_body([[0.1] * f["hidden_size"], [0.1] * 3]))),
    BadInput("input_embeds with NaN", _needs("hidden_size")(
        lambda f: _embeds_body([[0.1] * (f["hidden_size"] - 1) + [float("nan")]]))),
    # sampling and logprob fields
    BadInput("n of 100000", _text_body(sampling_params={"n": 100000, "max_new_tokens": 1})),
    BadInput("n of 0", _text_body(sampling_params={"n": 0})),
    BadInput("n as text", _text_body(sampling_params={"n": "many"})),
    BadInput("max_new_tokens past the context", _huge_max_new_tokens),
    BadInput("logprob_start_len past the prompt",
             _text_body(return_logprob=True, logprob_start_len=10**6)),
    BadInput("logprob_start_len below -1", _text_body(return_logprob=True, logprob_start_len=-7)),
    BadInput("top_logprobs_num past the vocabulary",
             _text_body(return_logprob=True, top_logprobs_num=10**6)),
    BadInput("negative top_logprobs_num", _text_body(return_logprob=True, top_logprobs_num=-3)),
    BadInput("return_logprob as text", _text_body(return_logprob="maybe")),
    BadInput("return_logprob as a number", _text_body(return_logprob=5)),
    BadInput("return_logprob list for one prompt", _text_body(return_logprob=[True])),
    BadInput("token_ids_logprob past the vocabulary",
             _text_body(return_logprob=True, token_ids_logprob=[999999999])),
    BadInput("logit_bias past the vocabulary",
             _text_body(sampling_params={"logit_bias": {"999999999": 1.0}})),
    BadInput("batch with too few sampling_params",
             {"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": [{"max_new_tokens": 2}]}),
    BadInput("batch with too few return_logprob", {
        "input_ids": [[1, 2, 3], [4, 5]], "return_logprob": [True],
        "sampling_params": {"max_new_tokens": 2}}),
    BadInput("out-of-vocabulary prompt on /v1/completions",
             {"model": "default", "prompt": [999999999], "max_tokens": 2},
             path="/v1/completions"),
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
    stream: bool = True  # False: one plain POST /generate, the whole answer at once


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


PROMPT_TAIL = "\n\nSummarize the text above."


# room left in the context for a shared prompt's added question ("And in one word, question N?")
SHARED_QUESTION_TOKENS = 16


def make_prompt(lines: list[str], rng: random.Random, approx_tokens: int,
                fit: Optional[Callable[[list[str]], list[str]]] = None) -> str:
    """~``approx_tokens`` tokens (4 characters each, roughly) of consecutive docstring lines;
    ``fit`` (``PromptFitter.fit``) cuts them to what the server's context holds."""
    start = rng.randrange(0, len(lines) - 1)
    out, size = [], 0
    i = start
    while size < approx_tokens * 4:
        out.append(lines[i % len(lines)])
        size += len(out[-1]) + 1
        i += 1
    if fit is not None:
        out = fit(out)
    return "\n".join(out) + PROMPT_TAIL


class PromptFitter:
    """Keeps a drawn prompt within ``max_tokens`` as the server counts them (``/tokenize``).
    Four characters a token is only an average: on code-heavy docstrings a 7,000-token draw
    reached 8,282 tokens, which an 8k-context server refuses (HTTP 400) - a driver error, not
    the server's."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens

    def count(self, text: str) -> int:
        r = requests.post(self.url + "/tokenize", json={"prompt": text}, timeout=60)
        r.raise_for_status()
        return int(r.json()["count"])

    def fit(self, prompt_lines: list[str]) -> list[str]:
        while len(prompt_lines) > 1:
            tokens = self.count("\n".join(prompt_lines) + PROMPT_TAIL)
            if tokens <= self.max_tokens:
                break
            # drop lines in proportion to the excess (2 % more, so it converges in a step or two)
            keep = int(len(prompt_lines) * self.max_tokens / tokens * 0.98)
            prompt_lines = prompt_lines[:max(1, min(keep, len(prompt_lines) - 1))]
        return prompt_lines


def prompt_fitter(url: str, facts: dict[str, Any], max_new_tokens: int) -> Optional[PromptFitter]:
    """A fitter for the server's context (its ``context_len`` fact), leaving room for the
    answer and for a shared prompt's added question; None when the context is unknown."""
    context_len = facts.get("context_len")
    if not context_len:
        return None
    return PromptFitter(url, int(context_len) - max_new_tokens - SHARED_QUESTION_TOKENS)


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


def _blocking(url: str, payload: dict, out: Outcome) -> None:
    """One non-streaming /generate (an aborted one answers with finish reason ``abort``)."""
    r = requests.post(url + "/generate", json=payload, timeout=1800)
    if r.status_code != 200:
        out.error = f"HTTP {r.status_code}: {r.text[:200]}"
        return
    msg = r.json()
    out.output_ids = msg.get("output_ids", [])
    meta = msg.get("meta_info", {})
    out.prompt_tokens = meta.get("prompt_tokens", 0)
    fin = meta.get("finish_reason")
    if fin:
        out.finish_reason = fin.get("type") if isinstance(fin, dict) else str(fin)


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
                if outcome.stream:
                    _stream(url, payload, outcome, None)
                else:
                    _blocking(url, payload, outcome)
            finally:
                timer.cancel()
        elif not outcome.stream:
            _blocking(url, payload, outcome)
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


def server_facts(url: str) -> dict[str, Any]:
    """What the model-dependent bad inputs need: the context length (``/v1/models``), vocabulary
    and hidden size (the model folder's config.json, when ``/model_info`` names a local one) and
    whether the server truncates long inputs (``/server_info``). Missing facts stay out."""
    facts: dict[str, Any] = {}
    try:
        models = requests.get(url + "/v1/models", timeout=60).json()
        facts["context_len"] = models["data"][0].get("max_model_len")
    except (requests.RequestException, ValueError, KeyError, IndexError):
        pass  # unknown: the cases that need it are skipped
    try:
        info = requests.get(url + "/server_info", timeout=60).json()
        facts["allow_auto_truncate"] = bool(info.get("allow_auto_truncate"))
        facts["disable_radix_cache"] = bool(info.get("disable_radix_cache"))
    except (requests.RequestException, ValueError):
        pass  # unknown: taken as off (SGLang's defaults)
    try:
        model_path = requests.get(url + "/model_info", timeout=60).json().get("model_path")
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
        config = {**config.get("text_config", {}), **config}
        facts["vocab_size"] = config.get("vocab_size")
        facts["hidden_size"] = config.get("hidden_size")
    except (requests.RequestException, ValueError, TypeError, OSError):
        pass  # unknown: the cases that need the vocabulary or hidden size are skipped
    return facts


def _alive(url: str) -> bool:
    try:
        return requests.get(url + "/health", timeout=60).status_code == 200
    except requests.RequestException:
        return False


def malformed_sweep(url: str, facts: Optional[dict[str, Any]] = None,
                    cases: Optional[list[BadInput]] = None) -> list[dict]:
    """Each bad input once, in order: its expected and observed status, the error message (one
    line when it is ours or SGLang's ValueError), and whether the server still answers
    ``/health`` afterwards. Stops at the first case after which the server is gone."""
    facts = server_facts(url) if facts is None else facts
    results = []
    for case in MALFORMED if cases is None else cases:
        body = case.body(facts) if callable(case.body) else case.body
        row: dict[str, Any] = {"case": case.name, "expected": case.status, "status": None,
                               "ok": False, "message": None, "alive_after": None}
        if body is None:
            row.update(skipped="not applicable to this server, or its model facts are unknown",
                       ok=True)
            results.append(row)
            continue
        data = body if isinstance(body, str) else json.dumps(body)
        try:
            r = requests.post(url + case.path, data=data, timeout=300,
                              headers={"Content-Type": "application/json"})
            row["status"] = r.status_code
            row["message"] = _error_message(r)
        except requests.RequestException as e:
            row["message"] = f"{type(e).__name__}: {e}"[:300]
        row["alive_after"] = _alive(url)
        row["ok"] = row["status"] == case.status and row["alive_after"]
        results.append(row)
        if not row["alive_after"]:
            break
    return results


def _error_message(r: requests.Response) -> Optional[str]:
    if r.status_code == 200:
        return None
    try:
        body = r.json()
    except ValueError:
        return r.text[:300]
    error = body.get("error", body) if isinstance(body, dict) else body
    message = error.get("message", error) if isinstance(error, dict) else error
    return str(message)[:300]


DENSE_OVERRIDE = {"sparse": {"method": "dense"}}  # docs/per-request.md


def flag_value(words: list[str], flag: str) -> Optional[str]:
    """The value of ``flag`` among launch_server argument words (``FLAG V`` or ``FLAG=V``)."""
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag + "="):
            return word.partition("=")[2]
    return None


def launch_budget(launch: Optional[str]) -> int:
    """``--sparse-budget`` of a launch_server argument string, else sglang_ext's default."""
    value = flag_value(shlex.split(launch or ""), "--sparse-budget")
    if value is not None:
        return int(value)
    from sglang_ext.config import SparseConfig

    return SparseConfig().budget


def twin_run(url: str, prompt: str, tokens: int, dense: bool,
             extra_key: Optional[str] = None) -> dict:
    """One greedy request of exactly ``tokens`` tokens (EOS ignored) with top-2 logprobs, sparse
    (the server's settings) or dense (``custom_params.sparse.method = dense``). A distinct
    ``extra_key`` keeps the radix cache from sharing the prompt's KV with its twin."""
    sampling: dict[str, Any] = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if dense:
        sampling["custom_params"] = DENSE_OVERRIDE
    payload: dict[str, Any] = {"text": prompt, "return_logprob": True, "top_logprobs_num": 2,
                               "sampling_params": sampling}
    if extra_key is not None:
        payload["extra_key"] = extra_key
    r = requests.post(url + "/generate", json=payload, timeout=1800)
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {_error_message(r)}")
    return r.json()


def compare_twins(sparse: dict, dense: dict, tokens: int, tie_margin: float) -> dict[str, Any]:
    """Top-1 agreement of the first ``tokens`` greedy tokens (position by position), whether the
    sequences match, and the first difference with the dense twin's top-2 margin there."""
    a, b = sparse["output_ids"][:tokens], dense["output_ids"][:tokens]
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)
    margin = None
    tops = dense["meta_info"].get("output_top_logprobs") or []
    if first is not None and first < len(tops) and tops[first] and len(tops[first]) >= 2:
        margin = round(tops[first][0][0] - tops[first][1][0], 4)
    return {
        "prompt_tokens": dense["meta_info"].get("prompt_tokens", 0),
        "tokens": n,
        "top1_agreement": round(sum(x == y for x, y in zip(a, b)) / n, 4) if n else None,
        "match": first is None,
        "first_difference": first,
        "dense_top2_margin_there": margin,
        "near_tie": margin is not None and margin <= tie_margin,
    }


def length_bucket(tokens: int) -> str:
    """Power-of-two prompt-length bucket, e.g. ``"1024-2047"``."""
    lo = 1 << max(tokens, 1).bit_length() - 1
    return f"{lo}-{2 * lo - 1}"


def summarize_twins(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(group: list[dict[str, Any]]) -> dict[str, Any]:
        scored = [r["top1_agreement"] for r in group if r["top1_agreement"] is not None]
        return {"prompts": len(group),
                "top1_mean": round(sum(scored) / len(scored), 4) if scored else None,
                "sequence_match_rate": round(sum(r["match"] for r in group) / len(group), 4)
                if group else None}

    buckets: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: r["prompt_tokens"]):
        buckets.setdefault(length_bucket(r["prompt_tokens"]), []).append(r)
    return {**stats(rows), "by_length": {k: stats(v) for k, v in buckets.items()},
            "near_tie_first_differences": sum(r["near_tie"] for r in rows), "rows": rows}


def dense_twins(url: str, candidates: list[tuple[str, int]], args: argparse.Namespace,
                rng: random.Random) -> dict[str, Any]:
    """``candidates``: (prompt, prompt tokens) of the load's finished requests. Each sampled
    prompt runs alone, sparse then dense, on the idle server. Beyond the budget the pair shares
    the prompt's KV through the radix cache (one prefill, as the load left it); within it each
    request prefills alone (distinct ``extra_key``s), so both take the same arithmetic up to
    the decode, where budget >= context makes ours attend every token: outputs must be equal."""
    tokens, budget = args.twin_tokens, args.sparse_budget
    unique = list(dict.fromkeys(candidates))
    over = [c for c in unique if c[1] > budget]
    within = [c for c in unique if c[1] + tokens <= budget]
    over = rng.sample(over, min(args.dense_twins, len(over)))
    within = rng.sample(within, min(args.dense_twins_within, len(within)))
    out: dict[str, Any] = {"budget": budget, "tokens": tokens, "requests": 0, "errors": []}
    over_rows, within_rows = [], []
    for group, rows, fresh in ((over, over_rows, False), (within, within_rows, True)):
        for i, (prompt, _) in enumerate(group):
            try:
                sparse = twin_run(url, prompt, tokens, False, fresh and f"twin-{i}-sparse" or None)
                out["requests"] += 1
                dense = twin_run(url, prompt, tokens, True, fresh and f"twin-{i}-dense" or None)
                out["requests"] += 1
            except (RuntimeError, requests.RequestException) as e:
                out["errors"].append(f"twin of a {'within' if fresh else 'beyond'}-budget "
                                     f"prompt: {e}"[:300])
                continue
            rows.append(compare_twins(sparse, dense, tokens, args.tie_margin))
    out["agreement"] = summarize_twins(over_rows)
    out["within_budget"] = {"prompts": len(within_rows), "rows": within_rows,
                            "differing": [r for r in within_rows if not r["match"]]}
    out["identical_when_dense"] = (all(r["match"] for r in within_rows)
                                   if within_rows else None)
    return out


def reliability_summary(report: dict[str, Any], findings: dict[str, Any]) -> dict[str, Any]:
    """The reliability issue's top-level keys: ``requests`` (every request sent to the server
    under test), ``crashes`` (scheduler crashes in its log; 1 when the server was found gone
    without one), ``leaks`` ("memory leak" lines in its log; None without a log) and ``errors``
    (failed requests and log tracebacks beyond the deliberately bad inputs, and each bad input
    with its expected and observed status)."""
    sent = report.get("requests_by_phase", {})
    have_log = bool(findings)
    crashes = findings.get("scheduler_crashes", 0)
    if not report.get("healthy_after", True) and not crashes:
        crashes = 1
    return {
        "requests": sum(sent.values()),
        "crashes": crashes,
        "leaks": findings.get("memory_leaks", 0) if have_log else None,
        "errors": {
            "unexpected": report.get("unexpected_errors", []),
            "log_tracebacks": findings.get("tracebacks") if have_log else None,
            "bad_inputs": [{"case": m["case"], "expected": m["expected"],
                            "observed": m["status"], "ok": m["ok"],
                            **({"skipped": m["skipped"]} if m.get("skipped") else {}),
                            **({"message": m["message"]} if m.get("message") else {})}
                           for m in report.get("malformed", [])],
        },
    }


def merge_reports(phases: dict[str, Optional[dict[str, Any]]], *, model: Optional[str] = None,
                  commit: Optional[str] = None, gpu: Optional[str] = None,
                  note: Optional[str] = None) -> dict[str, Any]:
    """One report from the reports of a soak's phases, each run by ``main`` on its own server
    (``phases``: name -> report, None for a phase that wrote none). Top level: ``requests``,
    ``crashes``, ``leaks`` (None when no phase knows) summed; ``errors`` with each phase's
    unexpected errors and bad inputs (tagged with the phase), the log tracebacks summed and
    ``count`` (unexpected errors + tracebacks + bad inputs answered otherwise than expected);
    ``dense_twin_agreement`` and ``identical_when_dense`` from the phase that ran the twins
    (``dense_twins_phase``; ``identical_when_dense`` is False when any phase found a
    difference); ``ok`` only when every phase wrote an ok report; ``failures`` tagged with the
    phase; ``phases``: name -> {``server_flags`` (its --launch), ``report``}."""
    merged: dict[str, Any] = {"model": model, "commit": commit, "gpu": gpu, "note": note,
                              "requests": 0, "crashes": 0, "leaks": None}
    errors: dict[str, Any] = {"unexpected": [], "log_tracebacks": 0, "bad_inputs": [],
                              "count": 0}
    failures: list[str] = []
    twins_phase, agreement, identical = None, None, None
    out_phases: dict[str, Any] = {}
    for name, report in phases.items():
        if report is None:
            failures.append(f"{name}: no report (the phase did not finish)")
            out_phases[name] = {"server_flags": None, "report": None}
            continue
        merged["requests"] += report.get("requests") or 0
        merged["crashes"] += report.get("crashes") or 0
        if report.get("leaks") is not None:
            merged["leaks"] = (merged["leaks"] or 0) + report["leaks"]
        errs = report.get("errors") or {}
        errors["unexpected"] += [f"{name}: {e}" for e in errs.get("unexpected", [])]
        errors["log_tracebacks"] += errs.get("log_tracebacks") or 0
        errors["bad_inputs"] += [{"phase": name, **b} for b in errs.get("bad_inputs", [])]
        failures += [f"{name}: {f}" for f in report.get("failures", [])]
        if not report.get("ok") and not report.get("failures"):
            failures.append(f"{name}: report not ok")
        if "dense_twin_agreement" in report and twins_phase is None:
            twins_phase, agreement = name, report["dense_twin_agreement"]
        if report.get("identical_when_dense") is not None:
            identical = report["identical_when_dense"] if identical is None \
                else identical and report["identical_when_dense"]
        out_phases[name] = {"server_flags": (report.get("config") or {}).get("launch"),
                            "report": report}
    errors["count"] = (len(errors["unexpected"]) + errors["log_tracebacks"]
                       + sum(1 for b in errors["bad_inputs"] if not b.get("ok")))
    merged.update(errors=errors, dense_twin_agreement=agreement, identical_when_dense=identical,
                  dense_twins_phase=twins_phase, ok=not failures, failures=failures,
                  phases=out_phases)
    return merged


def merge_main(args: argparse.Namespace) -> int:
    """``--merge NAME=REPORT ...``: a missing or unreadable report counts as a failed phase."""
    phases: dict[str, Optional[dict[str, Any]]] = {}
    for item in args.merge:
        name, sep, path = item.partition("=")
        if not sep:
            name, path = os.path.splitext(os.path.basename(item))[0], item
        try:
            with open(path) as f:
                phases[name] = json.load(f)
        except (OSError, ValueError):
            phases[name] = None
    merged = merge_reports(phases, model=args.model, commit=git_commit(), gpu=gpu_name(),
                           note=args.note)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
        f.write("\n")
    print(json.dumps({k: merged[k] for k in ("requests", "crashes", "leaks", "ok",
                                             "identical_when_dense", "failures")}, indent=1))
    return 0 if merged["ok"] else 1


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
           str(port), *with_nccl_port(shlex.split(args))]
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


def stop_on_sigterm(proc: Optional[subprocess.Popen]) -> None:
    """On SIGTERM (e.g. ``timeout`` around a phase of benchmarks/device/soak_real.sh), stop the
    launched server (its own session: it would outlive this process) and exit."""
    def handler(signum: int, frame: Any) -> None:
        stop(proc)
        os._exit(128 + signum)

    if proc is not None:
        signal.signal(signal.SIGTERM, handler)


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
    ap.add_argument("--non-stream-frac", type=float, default=0.0,
                    help="share of the plain, shared and API-aborted requests sent without "
                         "streaming (drawn with their own seed: 0 leaves the plan unchanged)")
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
    ap.add_argument("--dense-twins", type=int, default=0, metavar="K",
                    help="after the load, K of its prompts longer than the sparse budget are run "
                         "again alone, sparse and with custom_params.sparse.method=dense on the "
                         "same server: dense_twin_agreement in the report (0: off)")
    ap.add_argument("--dense-twins-within", type=int, default=2, metavar="K",
                    help="with --dense-twins: also K prompts within the budget (prompt + "
                         "--twin-tokens <= budget), whose sparse output must equal the dense "
                         "twin's exactly (identical_when_dense)")
    ap.add_argument("--twin-tokens", type=int, default=None, metavar="N",
                    help="greedy tokens compared per twin pair (default --max-new-tokens)")
    ap.add_argument("--sparse-budget", type=int, default=None,
                    help="the server's --sparse-budget, for --dense-twins (default: read from "
                         "--launch, else sglang_ext's default)")
    ap.add_argument("--tie-margin", type=float, default=TIE_MARGIN,
                    help="nats: a first difference where the reference's top-2 logprobs are at "
                         "most this far apart is a near tie, not a mismatch (see TIE_MARGIN)")
    ap.add_argument("--time-limit", type=float, default=900.0)
    ap.add_argument("--bad-inputs", choices=("on", "off"), default="on",
                    help="send the malformed-request sweep after the load")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out",
                    default=os.path.join(REPO, "benchmarks", "results", "serving", "soak.json"))
    ap.add_argument("--merge", nargs="+", default=None, metavar="NAME=REPORT",
                    help="merge these reports (each a phase of one soak, on its own server) into "
                         "--out instead of running one; see merge_reports")
    ap.add_argument("--model", default=None, help="with --merge: the model, in the merged report")
    ap.add_argument("--note", default=None, help="with --merge: a note in the merged report")
    args = ap.parse_args(argv)
    if args.merge:
        return merge_main(args)
    if not args.non_stream_frac >= 0.0 or args.non_stream_frac > 1.0:
        ap.error("--non-stream-frac must be in [0, 1]")
    if not args.url and not args.launch:
        ap.error("give --url or --launch")

    if args.dense_launch and not args.launch:
        ap.error("--dense-launch needs --launch (both servers use --port, one after the other)")
    if args.twin_tokens is None:
        args.twin_tokens = args.max_new_tokens
    if args.sparse_budget is None:
        args.sparse_budget = launch_budget(args.launch)

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
        stop_on_sigterm(proc)
        try:
            wait_healthy(url, proc, args.startup_timeout)
            dense_refs = [(p, reference_run(url, p, args.max_new_tokens)) for p in prompts]
        finally:
            stop(proc)
    proc = launch(args.launch, log_path, args.port) if args.launch else None
    stop_on_sigterm(proc)
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
    report.update(reliability_summary(report, findings))
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

    phase_start = time.time()
    phase_seconds: dict[str, float] = {}  # wall time of each phase, in the report

    def phase_done(name: str) -> None:
        nonlocal phase_start
        phase_seconds[name] = round(time.time() - phase_start, 1)
        phase_start = time.time()

    # The reference prompts, alone on the idle server first.
    fitter = prompt_fitter(url, server_facts(url), args.max_new_tokens)
    fit = fitter.fit if fitter is not None else None
    ref_prompts = [make_prompt(lines, rng, draw_length(rng, args.lengths), fit)
                   for _ in range(args.reference)]
    references = [reference_run(url, p, args.max_new_tokens) for p in ref_prompts] \
        + [reply for _, reply in dense_refs]
    fixed = [("reference", p) for p in ref_prompts] + [("dense-reference", p) for p, _ in dense_refs]
    phase_done("idle_references")

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
            prompt = make_prompt(lines, rng, draw_length(rng, args.lengths), fit)
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

    # Which requests go without streaming: their own generator, so the plan above (and every
    # run without --non-stream-frac) stays as it was.
    stream_rng = random.Random(args.seed + 3)
    blocking = {i for i, (kind, _) in enumerate(plan)
                if kind in ("plain", "shared", "abort-api")
                and stream_rng.random() < args.non_stream_frac}

    outcomes: list[Outcome] = []
    bar = tqdm(total=len(plan), desc="soak", unit="req", file=sys.stderr,
               # a log file (the GPU runs) gets a line every 30 s instead of a live bar
               mininterval=0.1 if sys.stderr.isatty() else 30.0)
    with ThreadPoolExecutor(args.concurrency) as pool:
        futures = []
        for i, (kind, prompt) in enumerate(plan):
            outcome = Outcome(index=i, kind=kind, stream=i not in blocking)
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
    phase_done("load")

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
    unexpected = [f"request {o.index} ({o.kind}): {o.error}" for o in outcomes
                  if o.error and not o.kind.startswith("abort") and not o.skipped]

    twins: dict[str, Any] = {}
    if args.dense_twins > 0:
        candidates = [(prompt, o.prompt_tokens) for (_, prompt), o in zip(plan, outcomes)
                      if not o.kind.startswith("abort") and not o.skipped and not o.error
                      and o.finish_reason and o.prompt_tokens]
        twins = dense_twins(url, candidates, args, random.Random(args.seed + 2))
        unexpected += twins["errors"]
        failures += [f"dense twin: {e}" for e in twins["errors"]]
        if twins["identical_when_dense"] is False:
            failures.append("identical_when_dense: a within-budget prompt's sparse output "
                            "differs from its dense twin's")
        if twins["identical_when_dense"] is None and args.dense_twins_within > 0:
            failures.append(f"identical_when_dense: no finished prompt within the budget "
                            f"({args.sparse_budget} tokens) to check")

    phase_done("dense_twins")
    facts = server_facts(url)
    # (a soak split over servers sends the sweep to one of them: ~40 s each)
    malformed = malformed_sweep(url, facts) if args.bad_inputs == "on" else []
    phase_done("bad_inputs")
    failures += [f"bad input '{m['case']}': expected HTTP {m['expected']}, got {m['status']}"
                 + ("" if m["alive_after"] else " and the server is gone")
                 for m in malformed if not m["ok"]]
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
             "error": o.error, "seconds": round(o.seconds, 2), "skipped": o.skipped,
             "stream": o.stream}
            for o in outcomes]
    return {
        "rows": rows,
        "config": {k: v for k, v in vars(args).items() if k not in ("url",)},
        "kinds": kinds,
        "non_streaming": sum(1 for o in outcomes if not o.stream and not o.skipped),
        "completed": sum(1 for o in outcomes if o.finish_reason and not o.kind.startswith("abort")),
        "skipped": skipped,
        "aborted": sum(1 for o in outcomes if o.kind.startswith("abort") and not o.skipped),
        "max_prompt_tokens": max((o.prompt_tokens for o in outcomes), default=0),
        "reference_checked": sum(1 for o in outcomes if o.kind == "reference"),
        "dense_reference_checked": sum(1 for o in outcomes if o.kind == "dense-reference"),
        "mismatches": mismatches,
        "malformed": malformed,
        "server_facts": facts,
        "unexpected_errors": unexpected,
        "phase_seconds": phase_seconds,
        "requests_by_phase": {
            "idle_references": len(ref_prompts),
            "load": sum(1 for o in outcomes if not o.skipped),
            "dense_twins": twins.get("requests", 0),
            "bad_inputs": sum(1 for m in malformed if not m.get("skipped")),
        },
        **({"dense_twin_agreement": twins["agreement"],
            "identical_when_dense": twins["identical_when_dense"],
            "dense_twins": {k: v for k, v in twins.items()
                            if k not in ("agreement", "identical_when_dense")}}
           if twins else {}),
        "healthy_after": healthy_after,
        "metrics_during": metrics_during,
        "metrics_after": metrics_after,
        "failures": failures,
    }


if __name__ == "__main__":
    sys.exit(main())
