"""Malformed request fields get a 400 and leave the server running (patches/tokenizer_manager.py).

The unit tests call the validation directly; the server test sends benchmarks/soak.py's MALFORMED
sweep (the one the GPU soak sends) to a real CPU server with our backend and the real model. Run
on SGLang 0.5.16 alone, an out-of-vocabulary or negative input id, a badly shaped input_embeds or a
top_logprobs_num past the vocabulary kills the scheduler and with it the server."""

from __future__ import annotations

import pytest
import requests

from server_utils import LABELS, Server

from benchmarks.soak import MALFORMED, malformed_sweep, server_facts
from sglang_ext.patches import tokenizer_manager as tm

VOCAB, HIDDEN = 49152, 576


def _request(**fields):
    from sglang.srt.managers.io_struct import GenerateReqInput

    return GenerateReqInput(**fields)


def _one_prompt(**fields):
    obj = _request(**fields)
    obj.normalize_batch_and_arguments()
    return obj


class _Manager:
    class model_config:  # noqa: N801 - stands in for TokenizerManager.model_config
        vocab_size = VOCAB
        hidden_size = HIDDEN


# ------------------------------------------------------------------------------- unit tests

@pytest.mark.parametrize("ids, message", [
    ([999999999], "input_ids[0] = 999999999 is outside the vocabulary [0, 49152)"),
    ([1, 2, VOCAB], f"input_ids[2] = {VOCAB} is outside the vocabulary"),
    ([1, -5], "input_ids[1] = -5 is outside the vocabulary"),
    ([1, True], "input_ids[1] = True is not an integer token id"),
    ([], "input_ids cannot be empty"),
])
def test_bad_input_ids_are_refused_in_one_line(ids, message):
    with pytest.raises(ValueError) as e:
        tm.check_input_ids(ids, VOCAB)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_good_input_ids_pass():
    tm.check_input_ids([0, 1, VOCAB - 1], VOCAB)
    tm.check_input_ids(list(range(VOCAB)), VOCAB)
    tm.check_input_ids([], VOCAB, allow_empty=True)


def test_long_bad_prompt_message_names_the_position_not_the_prompt():
    ids = [5] * 100_000 + [VOCAB + 7]
    with pytest.raises(ValueError) as e:
        tm.check_input_ids(ids, VOCAB)
    assert len(str(e.value)) < 120 and "input_ids[100000]" in str(e.value)


@pytest.mark.parametrize("embeds, message", [
    ([], "non-empty list"),
    ([[0.1, 0.2]], "input_embeds[0] has width 2"),
    ([[0.1] * HIDDEN, [0.1] * 3], "input_embeds[1] has width 3"),
    ([[0.1] * (HIDDEN - 1) + [float("nan")]], "not a finite number"),
    ([[0.1] * (HIDDEN - 1) + [float("inf")]], "not a finite number"),
])
def test_bad_input_embeds_are_refused(embeds, message):
    with pytest.raises(ValueError) as e:
        tm.check_input_embeds(embeds, HIDDEN)
    assert message in str(e.value)


@pytest.mark.parametrize("fields, message", [
    (dict(text="hi", sampling_params={"n": 100000}), "sampling_params.n must be an integer"),
    (dict(text="hi", sampling_params={"n": 0}), "sampling_params.n"),
    (dict(text="hi", sampling_params={"n": "many"}), "sampling_params.n"),
    (dict(text="hi", sampling_params={"n": True}), "sampling_params.n"),
    (dict(text="hi", return_logprob=[True]), "return_logprob must be a single value"),
    (dict(text="hi", sampling_params=[{"max_new_tokens": 2}]), "one object for a single prompt"),
    (dict(input_ids=[[1, 2], [3]], sampling_params=[{}]),
     "sampling_params has 1 entries for a batch of 2 prompts"),
    (dict(text=["a", "b", "c"], top_logprobs_num=[1, 2]), "top_logprobs_num has 2 entries"),
    (dict(input_ids=[[1, 2], [3]], token_ids_logprob=[[1]]), "token_ids_logprob has 1 lists"),
    (dict(input_embeds=[]), "input_embeds must be a non-empty list"),
    (dict(input_embeds=[[]]), "input_embeds must be a non-empty list"),
])
def test_bad_request_shapes_are_refused_before_normalization(fields, message):
    with pytest.raises(ValueError) as e:
        tm.check_request_shape(_request(**fields))
    assert message in str(e.value)


@pytest.mark.parametrize("fields", [
    dict(text="hi"),
    dict(text="hi", sampling_params={"n": 4}),
    dict(text="hi", sampling_params=[{"n": 2}]),  # one prompt, n > 1: SGLang's batch of one
    dict(text=["a", "b"], sampling_params=[{}, {}], return_logprob=[True, False]),
    dict(input_ids=[[1, 2], [3]], token_ids_logprob=[5, 6]),  # one flat list for every prompt
    dict(input_embeds=[[0.1] * HIDDEN]),
])
def test_good_request_shapes_pass(fields):
    tm.check_request_shape(_request(**fields))


@pytest.mark.parametrize("fields, message", [
    (dict(text="hi", return_logprob=True, logprob_start_len=-7), "logprob_start_len must be"),
    (dict(text="hi", return_logprob=True, top_logprobs_num=VOCAB + 1), "top_logprobs_num must"),
    (dict(text="hi", return_logprob=True, top_logprobs_num=-1), "top_logprobs_num must"),
    (dict(input_ids=[1, 999999999]), "input_ids[1] = 999999999"),
    (dict(input_embeds=[[0.5] * 3]), "has width 3"),
])
def test_bad_prompt_fields_are_refused(fields, message):
    obj = _one_prompt(**fields)
    with pytest.raises(ValueError) as e:
        tm.check_one_prompt(_Manager, obj, obj.input_ids)
    assert message in str(e.value)


def test_good_prompt_fields_pass():
    obj = _one_prompt(text="hi", return_logprob=True, logprob_start_len=0,
                      top_logprobs_num=VOCAB)
    tm.check_one_prompt(_Manager, obj, [1, 2])  # tokenized text
    obj = _one_prompt(input_ids=[0, VOCAB - 1])
    tm.check_one_prompt(_Manager, obj, obj.input_ids)


def test_every_batch_prompt_is_checked_before_any_is_sent():
    """The batch's per-prompt objects are what _validate_one_request sees (obj[i])."""
    obj = _request(input_ids=[[1, 2, 3], [999999999]], sampling_params={"max_new_tokens": 2})
    obj.normalize_batch_and_arguments()
    tm.check_one_prompt(_Manager, obj[0], obj[0].input_ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tm.check_one_prompt(_Manager, obj[1], obj[1].input_ids)


def test_the_sweep_names_are_unique_and_all_expect_a_client_error():
    names = [c.name for c in MALFORMED]
    assert len(names) == len(set(names))
    assert all(400 <= c.status < 500 for c in MALFORMED)


# ---------------------------------------------------------------------- on a real server

# --disable-radix-cache: SGLang refuses every input_embeds request while the radix cache is on, so
# without it the embeddings cases would never reach our checks.
SERVER_ARGS = [
    "--attention-backend", "sglang_ext", "--sparse-budget", "256", "--sparse-block-size", "4",
    "--sparse-label-config", LABELS, "--disable-radix-cache",
]


@pytest.fixture(scope="module")
def server() -> Server:
    s = Server(SERVER_ARGS).start()
    yield s
    s.stop()


@pytest.mark.server
def test_bad_input_sweep_gets_400s_and_the_server_lives(server: Server):
    facts = server_facts(server.url)
    assert facts["context_len"] == 8192
    assert (facts["vocab_size"], facts["hidden_size"]) == (VOCAB, HIDDEN)
    assert facts["disable_radix_cache"] and not facts["allow_auto_truncate"]

    rows = malformed_sweep(server.url, facts)
    assert [r["case"] for r in rows] == [c.name for c in MALFORMED]  # none stopped the sweep
    assert not [r["case"] for r in rows if r.get("skipped")]
    wrong = [(r["case"], r["expected"], r["status"], r["alive_after"], r["message"])
             for r in rows if not r["ok"]]
    assert not wrong
    by_case = {r["case"]: r["message"] for r in rows}
    assert by_case["input id past the vocabulary"] == \
        "input_ids[0] = 999999999 is outside the vocabulary [0, 49152)"
    assert "outside the vocabulary" in by_case["batch with one out-of-vocabulary prompt"]
    assert "outside the vocabulary" in by_case["out-of-vocabulary prompt on /v1/completions"]
    assert "hidden size is 576" in by_case["input_embeds with ragged rows"]
    assert "top_logprobs_num must be" in by_case["top_logprobs_num past the vocabulary"]
    assert "longer than the model's context length" in by_case["prompt longer than the context"]

    # Well-formed neighbours of the bad inputs still work.
    ok = requests.post(server.url + "/generate", timeout=300, json={
        "input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 2, "n": 2,
                                                                "temperature": 0}})
    assert ok.status_code == 200 and len(ok.json()) == 4
    ok = requests.post(server.url + "/generate", timeout=300, json={
        "input_embeds": [[0.01] * HIDDEN] * 3, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
    out = server.generate("The capital of France is", max_new_tokens=8)
    assert "Paris" in out["text"]

    # A streaming request gets the same message as an error event.
    with requests.post(server.url + "/generate", stream=True, timeout=300, json={
            "input_ids": [999999999], "stream": True}) as r:
        first = next(line for line in r.iter_lines() if line)
    assert b"outside the vocabulary" in first and b'"code":400' in first

    assert server.process.poll() is None
    log = server.log_text()
    assert "Traceback" not in log and "Scheduler hit an exception" not in log
