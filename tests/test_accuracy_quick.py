"""The accuracy suite (benchmarks/accuracy): generators and scorer (fast, no server), and the
driver's --quick mode end to end against a real CPU server (marked ``server``)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from server_utils import MODEL_DIR, REPO

sys.path.insert(0, REPO)

from benchmarks.accuracy import runner as R  # noqa: E402
from benchmarks.accuracy import tasks as T  # noqa: E402

HAYSTACK_TASKS = [t for t in T.TASKS if t != "common_words"]


@pytest.fixture(scope="module")
def tokenizer():
    if not os.path.exists(os.path.join(MODEL_DIR, "tokenizer.json")):
        pytest.skip(f"no model at {MODEL_DIR} (make model)")
    return T.load_tokenizer(MODEL_DIR)


@pytest.fixture(scope="module")
def corpus(tokenizer):
    return T.Corpus(tokenizer)


# --------------------------------------------------------------------------------------
# Generators
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", T.TASKS)
@pytest.mark.parametrize("context", [1024, 2048, 4096])
def test_exact_token_length(tokenizer, corpus, task, context):
    for index in range(2):
        s = T.make_sample(task, context, index, tokenizer, corpus)
        n = T.count_tokens(tokenizer, s.prompt)
        assert n == s.prompt_tokens
        assert abs(n - context) <= T.tolerance(task), (task, context, index, n)
        assert s.prompt.startswith("<|im_start|>") and "<|im_start|>assistant\n" in s.prompt
        # the expected answer's length (+ slack), within the task's cap
        assert s.max_new_tokens == T.answer_limit(tokenizer, task, s.answers) <= T.MAX_NEW_TOKENS[task]
        assert s.max_new_tokens >= T.count_tokens(tokenizer, " " + ", ".join(s.answers))


@pytest.mark.parametrize("task", T.TASKS)
def test_deterministic_by_seed(tokenizer, corpus, task):
    a = T.make_sample(task, 1024, 3, tokenizer, corpus)
    b = T.make_sample(task, 1024, 3, tokenizer, T.Corpus(tokenizer))
    assert a == b
    c = T.make_sample(task, 1024, 4, tokenizer, corpus)
    assert c.prompt != a.prompt and c.answers != a.answers


@pytest.mark.parametrize("task", HAYSTACK_TASKS)
def test_needles_sit_where_expected(tokenizer, corpus, task):
    for index in range(3):
        s = T.make_sample(task, 2048, index, tokenizer, corpus)
        start, end = s.body
        assert len(s.needles) == len(s.needle_offsets) == len(s.depths) >= 1
        assert list(s.needle_offsets) == sorted(s.needle_offsets)
        hay_len = end - start - sum(len(n) + 1 for n in s.needles)
        before = 0  # characters of needles placed before this one
        for needle, off, depth in zip(s.needles, s.needle_offsets, s.depths):
            assert s.prompt[off:off + len(needle)] == needle
            assert s.prompt[off - 1] == "\n" or off == start  # on its own line
            # at its depth of the haystack, to within a line or two
            assert abs((off - start - before) / hay_len - depth) < 0.03, (off, start, end, depth)
            before += len(needle) + 1
        for a in s.answers:
            # every expected answer is planted, and occurs nowhere else in the prompt
            planted = sum(n.count(a) for n in s.needles)
            assert planted >= 1
            assert s.prompt.count(a) == planted, a


def test_multi_needle_tasks_shape(tokenizer, corpus):
    mk = T.make_sample("niah_multikey", 1024, 0, tokenizer, corpus)
    keys = [re.search(r"for (\S+) is:", n).group(1) for n in mk.needles]
    assert len(set(keys)) == T.NUM_MULTI and len(mk.answers) == 1
    asked = re.search(r"magic number for (\S+) mentioned", mk.prompt[mk.body[1]:]).group(1)
    assert mk.needles[keys.index(asked)].endswith(f"is: {mk.answers[0]}.")
    mv = T.make_sample("niah_multivalue", 1024, 0, tokenizer, corpus)
    assert len(set(mv.answers)) == T.NUM_MULTI
    vt = T.make_sample("var_tracking", 1024, 0, tokenizer, corpus)
    assert len(vt.answers) == T.VT_HOPS + 1
    assert vt.needles[0].startswith(f"VAR {vt.answers[0]} = ")
    for prev, cur, needle in zip(vt.answers, vt.answers[1:], vt.needles[1:]):
        assert needle == f"VAR {cur} = VAR {prev}."
    uu = T.make_sample("niah_uuid", 1024, 0, tokenizer, corpus)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uu.answers[0])


@pytest.mark.parametrize("context", [1024, 4096])
def test_common_words_answers_are_the_most_frequent(tokenizer, context):
    s = T.make_sample("common_words", context, 1, tokenizer)
    lines = s.prompt[s.body[0]:s.body[1]].split("\n")
    assert all(re.fullmatch(rf"{i + 1}\. [a-z]+", line) for i, line in enumerate(lines))
    counts = collections.Counter(line.split(". ", 1)[1] for line in lines)
    top = counts.most_common(T.CWE_COMMON + 1)
    assert {w for w, _ in top[:T.CWE_COMMON]} == set(s.answers)
    assert top[T.CWE_COMMON - 1][1] > top[T.CWE_COMMON][1]


# --------------------------------------------------------------------------------------
# Scorer
# --------------------------------------------------------------------------------------


def test_scorer():
    assert T.credit(["12345"], " 12345. Remember it.") == 1.0
    assert T.credit(["12345"], "The key is 123456") == 0.0  # inside a longer number: no
    assert T.credit(["12345"], "It is 1234") == 0.0
    assert T.credit(["a1b2-c3"], "uuid: A1B2-C3.") == 1.0  # case-insensitive
    assert T.credit(["QWERT", "ASDFG", "ZXCVB", "POIUY"], "QWERT, asdfg and QWERTY") == 0.5
    assert T.credit(["stat"], "status, statistic") == 0.0
    with pytest.raises(ValueError):
        T.credit([], "anything")
    s = T.Sample("passkey", 8, 0, "p", ("42",), 4, 8)
    assert T.score(s, "42") == 1.0 and T.score(s, "24") == 0.0


# --------------------------------------------------------------------------------------
# Runner pieces that need no server
# --------------------------------------------------------------------------------------


def test_settings_are_valid_overrides():
    from sglang_ext.attention.request_overrides import parse_override
    from sglang_ext.config import SparseConfig

    settings = R.sparse_settings(["quest", "ds", "two_level"], [64, 128, 256, 512], block_size=4)
    assert settings[0].method == "dense" and parse_override(settings[0].custom_params, SparseConfig()) is None
    assert len(settings) == 13
    for st in settings[1:]:
        sel = parse_override(st.custom_params, SparseConfig())  # raises on a bad override
        assert (sel.method, sel.budget, sel.block_size) == (st.method, st.budget, 4)
        assert sel.sink + sel.window <= sel.budget // 2


def test_locality_variants_use_the_shared_share_of_the_selected_blocks(tmp_path):
    """k_e = LOCALITY_SHARE of the middle blocks, the key_norm score the batched decode runs,
    and a block filter sized for the query-aware rest (locality_wide: the automatic one);
    locality_limited, the GPU locality run's setting: the automatic filter, of which
    LOCALITY_NEW_SHARE may be new per step."""
    from sglang_ext.attention.request_overrides import parse_override
    from sglang_ext.config import LOCALITY_NEW_SHARE, LOCALITY_SHARE, build_config
    from sglang_ext.selection.eviction_head import EvictionHeads, save_eviction_heads

    heads = tmp_path / "heads.safetensors"
    save_eviction_heads(EvictionHeads(1, 1, 4), heads, model="tiny")
    base = build_config(eviction_head=str(heads))
    methods = ["locality", "locality_learned", "locality_wide", "locality_attention",
               "locality_limited", "locality_limited_learned"]
    settings = R.sparse_settings(methods, [64, 128, 256], block_size=4)
    score = {"locality": "key_norm", "locality_learned": "learned", "locality_wide": "key_norm",
             "locality_attention": "attention", "locality_limited": "key_norm",
             "locality_limited_learned": "learned"}
    limited = ("locality_limited", "locality_limited_learned")
    whole_middle = ("locality_wide", *limited)
    for st in settings[1:]:
        sel = parse_override(st.custom_params, base)
        middle_blocks = (sel.budget - sel.sink - sel.window) // 4
        assert sel.method == "two_level"
        assert sel.locality_blocks == int(middle_blocks * LOCALITY_SHARE) > 0
        # locality_wide keeps the automatic filter: twice the whole middle
        assert sel.candidate_blocks == 2 * (middle_blocks if st.method in whole_middle
                                            else middle_blocks - sel.locality_blocks)
        assert sel.eviction_score == score[st.method]
        assert sel.locality_new_blocks == (int(sel.candidate_blocks * LOCALITY_NEW_SHARE)
                                           if st.method in limited else 0)
        assert R.WHOLE_MIDDLE_FILTER not in st.custom_params["sparse"]
        assert R.LIMITED_NEW_BLOCKS not in st.custom_params["sparse"]
    learned = next(st for st in settings if st.method == "locality_learned")
    with pytest.raises(ValueError, match="eviction-head"):  # a server without heads: a 400
        parse_override(learned.custom_params, build_config())


def test_async_filter_variants_ask_for_it_and_the_wide_ones_double_the_filter():
    from sglang_ext.attention.request_overrides import parse_override
    from sglang_ext.config import build_config

    base = build_config()
    settings = R.sparse_settings(["two_level", "two_level_async", "two_level_async_wide",
                                  "two_level_wide"], [64, 128], block_size=4)
    sel = {(st.method, st.budget): parse_override(st.custom_params, base) for st in settings[1:]}
    for b in (64, 128):
        plain = sel["two_level", b]
        assert plain.block_filter == "sync"
        # the asynchronous filter ranks blocks by the bound (the label maximum needs this
        # step's query over every middle token)
        assert plain.block_score == "label_max"
        async_ = dict(block_filter="async", block_score="bound")
        assert sel["two_level_async", b] == dataclasses.replace(plain, **async_)
        wide = dataclasses.replace(plain, candidate_blocks=2 * plain.candidate_blocks)
        assert sel["two_level_wide", b] == wide
        assert sel["two_level_async_wide", b] == dataclasses.replace(wide, **async_)
    assert all(R.FILTER_SCALE not in st.custom_params["sparse"] for st in settings)


def test_endpoint_adds_custom_params(monkeypatch):
    import sglang.lang.backend.runtime_endpoint as rt
    from sglang.lang.ir import SglSamplingParams

    sent = []

    class Reply:
        status_code = 200

        def json(self):
            return {"text": "ok", "meta_info": {}}

    monkeypatch.setattr(rt, "http_request", lambda url, json=None, **kw: sent.append(json) or Reply())
    ep = object.__new__(R.SparseRuntimeEndpoint)  # skip the constructor's HTTP round trip
    ep.base_url, ep.api_key, ep.verify, ep.custom_params = "http://x", None, None, {"sparse": {"budget": 64}}

    class S:
        text_, images_ = "prompt", []

        def __init__(self, arguments):
            self.arguments = arguments

    params = SglSamplingParams(max_new_tokens=3)
    ep.generate(S({}), params)
    ep.generate(S({"custom_params": {"sparse": {"method": "dense"}}}), params)
    ep.generate(S({"custom_params": None}), params)
    assert sent[0]["sampling_params"]["custom_params"] == {"sparse": {"budget": 64}}
    assert sent[1]["sampling_params"]["custom_params"] == {"sparse": {"method": "dense"}}
    assert "custom_params" not in sent[2]["sampling_params"]
    assert all(s["sampling_params"]["max_new_tokens"] == 3 for s in sent)
    assert "custom_params" not in params.to_srt_kwargs()  # the caller's params are untouched


def _row(**kw):
    row = {"task": "passkey", "context": 1024, "method": "dense", "budget": 0, "score": 50.0,
           "n": 2, "seconds": 1.0}
    row.update(kw)
    return row


def test_results_merge_and_render(tmp_path):
    path = str(tmp_path / "acc.json")
    header = {"model": "m", "commit": None, "machine": "cpu", "config": {"block_size": 4}}
    R.write_results(path, [_row(), _row(method="quest", budget=64, score=25.0)], header)
    doc, md = R.write_results(path, [_row(method="quest", budget=64, score=75.0),
                                     _row(task="niah_number", score=100.0)], header)
    assert len(doc["rows"]) == 3  # same key replaced, new key added
    assert {(r["task"], r["method"], r["score"]) for r in doc["rows"]} == {
        ("passkey", "dense", 50.0), ("passkey", "quest", 75.0), ("niah_number", "dense", 100.0)}
    assert json.load(open(path)) == doc
    assert "| passkey | 1024 | 2 | 50 | quest | 75 |" in md
    assert os.path.getsize(str(tmp_path / "acc.png")) > 1000
    for bad in (_row(score=101.0), _row(method="quest"), _row(n=0), _row(context="1024")):
        with pytest.raises(ValueError):
            R.validate_row(bad)


def test_reference_agreement_and_column(tmp_path):
    dense = R.Setting("dense", 0, {"sparse": {"method": "dense"}})
    ref = R.Setting("torch_native", 0, None)
    samples = [T.Sample("passkey", 1024, i, f"p{i}", ("1",), 4, 1024) for i in range(4)]
    ours = [R.Result(s, dense, out, 1.0, {}) for s, out in zip(samples, ["a", "b", "c", "d"])]
    theirs = [R.Result(s, ref, out, 1.0, {}) for s, out in zip(samples, ["a", "b", "x", "d"])]
    rows = R.make_rows(theirs, [ref])
    R.add_agreement(rows, theirs, ours)
    assert len(rows) == 1 and rows[0]["method"] == "torch_native" and rows[0]["same_as_dense"] == 75.0
    doc, md = R.write_results(str(tmp_path / "a.json"), rows + R.make_rows(ours, [dense]),
                              {"config": {}}, plot=False)
    assert "| task | context | n | dense | torch_native | method |" in md
    assert "| passkey | 1024 | 4 | 100 | 100 |" in md


# --------------------------------------------------------------------------------------
# End to end: the driver's --quick mode against a real CPU server
# --------------------------------------------------------------------------------------


@pytest.mark.server
def test_quick_mode_end_to_end(tmp_path):
    out = tmp_path / "accuracy.json"
    default_out = os.path.join(REPO, "benchmarks", "results", "accuracy", "accuracy_smollm2.json")
    before = os.path.getmtime(default_out) if os.path.exists(default_out) else None
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.accuracy.driver", "--quick", "--out", str(out),
         "--outputs", str(tmp_path / "outputs.jsonl")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "estimate for the full default run" in proc.stdout
    doc = json.loads(out.read_text())
    assert {"model", "commit", "machine", "config", "rows"} <= set(doc)
    rows = {(r["method"], r["budget"]): r for r in doc["rows"]}
    assert set(rows) == {("dense", 0), ("two_level", 128)}, rows
    for row in rows.values():
        R.validate_row(row)
        assert (row["task"], row["context"], row["n"]) == ("passkey", 1024, 3)
        assert abs(row["prompt_tokens"] - 1024) <= T.tolerance("passkey")  # the server agrees
    # each sample is prefilled once: the sparse requests reuse the dense request's KV
    assert rows[("two_level", 128)]["cached_tokens"] >= 0.9 * rows[("two_level", 128)]["prompt_tokens"]
    assert (tmp_path / "accuracy.md").read_text().count("| passkey | 1024 | 3 |") == 1
    assert (tmp_path / "accuracy.png").stat().st_size > 1000
    lines = [json.loads(x) for x in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(isinstance(x["output"], str) for x in lines)
    after = os.path.getmtime(default_out) if os.path.exists(default_out) else None
    assert after == before  # benchmarks/results untouched
