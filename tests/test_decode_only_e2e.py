"""Our backend in SGLang's decode-only benchmark mode (``--disaggregation-mode decode
--disaggregation-transfer-backend fake``, what ``benchmarks/e2e_serving.py --decode-only`` starts
on the GPU to measure 128k decode without its prefills): a real CPU server with the real SmolLM2
takes fake-prefilled requests longer than the budget and decodes them sparsely, to the end, over
the random KV it wrote into its pool at start-up (SGLANG_EXT_SYNTHETIC_KV=random, as there)."""

from __future__ import annotations

import pytest
import requests

from server_utils import Server
from test_server_e2e import SPARSE_ARGS

pytestmark = pytest.mark.server

FAKE_BOOTSTRAP = {"bootstrap_host": "2.2.2.2", "bootstrap_room": 0}  # SGLang's fake transfer


def test_decode_only_server_decodes_fake_prefilled_requests_past_the_budget():
    server = Server(SPARSE_ARGS + ["--disaggregation-mode", "decode",
                                   "--disaggregation-transfer-backend", "fake"],
                    health_path="/health", env={"SGLANG_EXT_SYNTHETIC_KV": "random"}).start()
    try:
        prompt = list(range(1000, 1000 + 600))  # past the budget of 256: sparse decode steps
        for _ in range(2):  # two in a row: the first one's pages and row are reused
            r = requests.post(server.url + "/generate", timeout=600, json={
                "input_ids": prompt, **FAKE_BOOTSTRAP,
                "sampling_params": {"max_new_tokens": 24, "temperature": 0,
                                    "ignore_eos": True}})
            r.raise_for_status()
            out = r.json()
            assert len(out["output_ids"]) == 24
            assert out["meta_info"]["prompt_tokens"] == len(prompt)
            assert out["meta_info"]["finish_reason"]["type"] == "length"
        log = server.log_tail(400)
        assert "SGLANG_EXT_SYNTHETIC_KV=random filled" in server.log_tail(100000), log
        assert "Traceback" not in log and "memory leak" not in log.lower(), log
    finally:
        server.stop()
