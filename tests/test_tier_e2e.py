"""The CPU KV tier end to end: real SGLang servers on the CPU with the real SmolLM2-135M model.

Both servers run our backend with the same sparse settings and page size; one has the tier on
(``--sparse-tier sync``) with only 1024 KV slots homed on the "GPU" (the CPU device here), so
every long prompt lives mostly in the host store and is prefilled through the extend scratch. The
tier server runs with ``SGLANG_EXT_TIER_VERIFY=2``: every decode step checks that each mapped
block's device copy (sink, window ring) equals its home copy, and when the last request leaves
it checks that every working-area page is free again (a leak crashes the server, which the
tests see). SGLang's own idle invariant checker runs too.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from server_utils import LABELS, Server

pytestmark = pytest.mark.server

COMMON = [
    "--attention-backend", "sglang_ext", "--sparse-budget", "256", "--sparse-block-size", "4",
    "--sparse-sink", "16", "--sparse-window", "64", "--sparse-label-config", LABELS,
    "--page-size", "4", "--max-running-requests", "4",
    # the tier's block filter on both servers (the untiered one would rank by label maximum)
    "--sparse-block-score", "bound",
]
TIER = ["--sparse-tier", "sync", "--sparse-tier-gpu-tokens", "1024", "--sparse-tier-host-gb", "0.5"]


@pytest.fixture(scope="module")
def untiered() -> Server:
    server = Server(COMMON).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiered() -> Server:
    server = Server(COMMON + TIER + ["--enable-metrics"],
                    env={"SGLANG_EXT_TIER_VERIFY": "2"}).start()
    yield server
    server.stop()


def _haystack(seed: int, words: int) -> str:
    text = open(json.__file__.replace("__init__.py", "decoder.py")).read()
    lines = text.splitlines()
    start = (seed * 37) % max(1, len(lines) - 200)
    return "\n".join(lines[start:]) [: words * 6]


def _passkey_prompt(seed: int, key: int) -> str:
    hay = _haystack(seed, 1600)
    half = len(hay) // 2
    return (f"{hay[:half]}\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
            f"{hay[half:]}\nWhat is the pass key? The pass key is")


def _ids(resp: dict) -> list[int]:
    return resp["output_ids"] if "output_ids" in resp else resp["text"]


def test_tier_startup_reports_layout(tiered: Server):
    log = tiered.log_text()
    assert "sglang_ext CPU tier: GPU-homed 1024 tokens" in log
    assert "host-homed" in log


def test_tier_outputs_equal_untiered_token_for_token(untiered: Server, tiered: Server):
    prompts = [_passkey_prompt(seed, 10000 + 7919 * seed) for seed in range(3)]
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        results[i] = tiered.generate(prompts[i], max_new_tokens=12)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:  # concurrently: several requests spill to the host at once
        t.start()
    for t in threads:
        t.join()
    for i, prompt in enumerate(prompts):
        ref = untiered.generate(prompt, max_new_tokens=12)
        got = results[i]
        assert got["meta_info"]["prompt_tokens"] > 1024 + 256  # most of it on the host
        assert got["text"] == ref["text"], (i, got["text"], ref["text"])
        assert str(10000 + 7919 * i) in got["text"]


def _tier_metrics(server: Server) -> dict[str, float]:
    text = requests.get(server.url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line.startswith("sglang_ext:tier_"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    return values


def test_metrics_endpoint_shows_tier_counters(tiered: Server):
    """--enable-metrics exports the tier's gauges and counters. The transfer counters are
    refreshed every 32 decode steps (they move with the GPU kernels; the CPU reference reads the
    host directly); the occupancy gauges whenever a request starts decoding or leaves."""
    done = threading.Event()
    seen: list[dict[str, float]] = []

    def sample() -> None:
        while not done.is_set():
            seen.append(_tier_metrics(tiered))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        tiered.generate(_passkey_prompt(11, 55555), max_new_tokens=40)
    finally:
        done.set()
        sampler.join()
    values = _tier_metrics(tiered)
    for name in ("wanted_blocks_total", "transferred_blocks_total", "transferred_bytes_total",
                 "hit_rate", "host_hit_rate", "working_area_pages", "working_area_free_pages", "requests",
                 "requests_waiting_for_space"):
        assert "sglang_ext:tier_" + name in values, sorted(values)
    total = values["sglang_ext:tier_working_area_pages"]
    # While the request decoded it held sink, window and working-set pages ...
    busy = [v for v in seen if v.get("sglang_ext:tier_requests", 0) >= 1]
    assert busy and all(0 < v["sglang_ext:tier_working_area_free_pages"] < total for v in busy)
    # ... and once it left, the gauges say so at once (not at the next 32nd decode step).
    assert values["sglang_ext:tier_requests"] == 0
    assert values["sglang_ext:tier_working_area_free_pages"] == total
    assert values["sglang_ext:tier_requests_waiting_for_space"] == 0


def test_waiting_for_space_counts_prompts_larger_than_the_free_slots():
    from types import SimpleNamespace

    from sglang_ext.patches.scheduler import waiting_for_space

    queue = [SimpleNamespace(origin_input_ids=[0] * n) for n in (10, 500, 1000, 20)]
    assert waiting_for_space(queue, 600) == 1
    assert waiting_for_space(queue, 5) == 4
    assert waiting_for_space([], 0) == 0


def test_shared_prefix_is_reused_from_the_host(untiered: Server, tiered: Server):
    prefix = _passkey_prompt(5, 424242)
    first = tiered.generate(prefix + " (first ask)", max_new_tokens=8)
    second = tiered.generate(prefix + " (second ask)", max_new_tokens=8)
    prompt_tokens = second["meta_info"]["prompt_tokens"]
    cached = second["meta_info"].get("cached_tokens", 0)
    # The second request finds the prefix in the radix cache: its pages (mostly host-homed,
    # stored once) are loaded back for the extend instead of being recomputed and stored again.
    assert cached >= prompt_tokens - 16, (cached, prompt_tokens)
    assert second["text"] == untiered.generate(prefix + " (second ask)", max_new_tokens=8)["text"]
    assert first["text"] == untiered.generate(prefix + " (first ask)", max_new_tokens=8)["text"]


def test_aborts_free_every_page(tiered: Server):
    prompt = _passkey_prompt(9, 31337)
    # A streaming request dropped by the client mid-decode ...
    with requests.post(tiered.url + "/generate", stream=True, timeout=600, json={
        "text": prompt, "stream": True,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 3:
                break
    # ... and one aborted through the API.
    rid = "tier-abort-1"
    t = threading.Thread(target=lambda: requests.post(tiered.url + "/generate", timeout=600, json={
        "text": prompt + " again", "rid": rid,
        "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
    }))
    t.start()
    time.sleep(8)
    requests.post(tiered.url + "/abort_request", json={"rid": rid}, timeout=30)
    t.join(timeout=600)
    time.sleep(5)  # idle: the tier's leak check and SGLang's invariant checker run
    assert tiered.process.poll() is None, tiered.log_tail()
    out = tiered.generate("Say hello.", max_new_tokens=4)
    assert out["text"]
    log = tiered.log_text()
    assert "leak" not in log.lower(), tiered.log_tail()
    assert "Traceback" not in log, tiered.log_tail()


def test_retracted_requests_complete_and_free_their_pages():
    """SGLang's retraction test mode (SGLANG_TEST_RETRACT) retracts running requests every few
    steps: a retracted request releases its row (and the tier its pages), comes back through the
    radix cache and finishes; afterwards the tier is empty (leak check at idle)."""
    env = {"SGLANG_EXT_TIER_VERIFY": "1", "SGLANG_TEST_RETRACT": "1",
           "SGLANG_TEST_RETRACT_INTERVAL": "15"}
    server = Server(COMMON + TIER, env=env).start()
    try:
        prompts = [_haystack(20 + i, 700)[:3000] + f"\nItem {i}:" for i in range(3)]
        results: dict[int, dict] = {}

        def run(i: int) -> None:
            results[i] = server.generate(prompts[i], max_new_tokens=48, ignore_eos=True)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r["meta_info"]["completion_tokens"] == 48 for r in results.values())
        time.sleep(3)
        log = server.log_text()
        assert "Testing retraction" in log, "no retraction happened"
        assert server.process.poll() is None, server.log_tail()
        assert "leak" not in log.lower() and "Traceback" not in log, server.log_tail()
    finally:
        server.stop()
