"""The tier admission's PCIe term end to end: two SmolLM2 servers on the CPU with every request's
KV on the host, one whose PCIe term admits one host-homed request's transfers per step
(``--sparse-tier-pcie-gbps`` x ``--sparse-tier-step-ms`` below two requests' bound), one without
the term (``--sparse-tier-pcie-gbps 0``). Three concurrent requests: the first server runs them
one after the other (the others wait in SGLang's queue, nothing is dropped), the second together;
the greedy outputs are the same.

(On the CPU the reference decode reads host-homed keys straight from host memory, so nothing is
measured as transferred here; the prediction and the holds are what the tier stats line shows.)
"""

from __future__ import annotations

import json
import re
import threading

import pytest

from server_utils import LABELS, Server
from test_tier_e2e import _haystack

pytestmark = pytest.mark.server

COMMON = [
    "--attention-backend", "sglang_ext", "--sparse-budget", "128", "--sparse-block-size", "4",
    "--sparse-sink", "16", "--sparse-window", "32", "--sparse-label-config", LABELS,
    "--page-size", "4", "--max-running-requests", "4", "--sparse-block-score", "bound",
    "--sparse-tier", "sync", "--sparse-tier-gpu-tokens", "64", "--sparse-tier-host-gb", "0.25",
]
# SmolLM2-135M: 30 layers, 3 kv heads, 64 dims; block 4, 40 candidate blocks (twice the 20 the
# budget's middle needs): a host-homed request is predicted to move at most 40 x 3 x 30 x 1 KiB
# = 3.7 MB per step. 5 MB per step (1 GB/s x 5 ms) holds one.
TERM_ON = ["--sparse-tier-pcie-gbps", "1", "--sparse-tier-step-ms", "5"]
TERM_OFF = ["--sparse-tier-pcie-gbps", "0"]
ENV = {"SGLANG_EXT_TIER_LOG_EVERY": "2"}


@pytest.fixture(scope="module")
def servers() -> tuple[Server, Server]:
    on, off = Server(COMMON + TERM_ON, env=ENV), Server(COMMON + TERM_OFF, env=ENV)
    errors: list[BaseException] = []

    def start(server: Server) -> None:
        try:
            server.start()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(s,)) for s in (on, off)]
    for t in threads:  # both start-ups at once
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield on, off
    finally:
        on.stop()
        off.stop()


def _prompt(i: int) -> str:
    key = 31000 + 977 * i
    hay = _haystack(40 + i, 300)
    return f"{hay[:800]}\nThe pass key is {key}. Remember it.\n{hay[800:]}\nThe pass key is"


def _concurrently(server: Server, prompts: list[str]) -> list[dict]:
    results: dict[int, dict] = {}

    def run(i: int) -> None:
        results[i] = server.generate(prompts[i], max_new_tokens=6)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[i] for i in range(len(prompts))]


def _last_tier_stats(server: Server) -> dict:
    lines = re.findall(r"sglang_ext tier stats: (\{.*\})", server.log_text())
    assert lines, server.log_tail()
    return json.loads(lines[-1])


def test_the_pcie_term_holds_requests_back_and_leaves_outputs_unchanged(servers):
    on, off = servers
    prompts = [_prompt(i) for i in range(3)]
    got, want = _concurrently(on, prompts), _concurrently(off, prompts)
    for g, w in zip(got, want):
        assert g["meta_info"]["prompt_tokens"] > 256  # on the host, beyond the budget
        assert g["output_ids"] == w["output_ids"], (g["text"], w["text"])
    stats_on, stats_off = _last_tier_stats(on), _last_tier_stats(off)
    # two of the three waited for the first to finish; the server without the term held none
    assert stats_on["pcie_holds"] >= 1, stats_on
    assert stats_on["step_budget_bytes"] == 5_000_000
    assert 0 < stats_on["predicted_bytes_per_step"] <= stats_on["step_budget_bytes"]
    assert stats_off["pcie_holds"] == 0 and stats_off["step_budget_bytes"] == 0
    assert stats_on["bytes_per_step"] <= stats_on["predicted_bytes_per_step"]
    for server in (on, off):
        assert "Traceback" not in server.log_text(), server.log_tail()
