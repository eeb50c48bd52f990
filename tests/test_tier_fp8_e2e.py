"""The CPU KV tier over an 8-bit KV cache end to end: real SGLang servers on the CPU with the real
SmolLM2-135M model, ``--sparse-tier sync --kv-cache-dtype fp8_e4m3`` against the same fp8 server
without the tier.

The tier's host copy holds fp8 rows (one byte per value: host bytes and PCIe bytes per token are
half of bf16's), its extend scratch the pool's stored bytes; the tier server runs with
``SGLANG_EXT_TIER_VERIFY=2`` (every mapped device copy checked against its home at every step,
every working-area page free when idle).
"""

from __future__ import annotations

import pytest

from server_utils import Server
from test_tier_e2e import COMMON as COMMON_BF16
from test_tier_e2e import TIER, _passkey_prompt

pytestmark = pytest.mark.server

# the bf16 tier test's servers, on an fp8 cache
COMMON = COMMON_BF16 + ["--kv-cache-dtype", "fp8_e4m3"]


@pytest.fixture(scope="module")
def untiered_fp8() -> Server:
    server = Server(COMMON).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiered_fp8() -> Server:
    server = Server(COMMON + TIER, env={"SGLANG_EXT_TIER_VERIFY": "2"}).start()
    yield server
    server.stop()


def test_the_fp8_tier_serves_the_untiered_fp8_servers_greedy_tokens(untiered_fp8: Server,
                                                                       tiered_fp8: Server):
    log = tiered_fp8.log_text()
    assert "sglang_ext CPU tier: GPU-homed 1024 tokens" in log
    for seed in range(2):
        key = 10000 + 7919 * seed
        prompt = _passkey_prompt(seed, key)
        got = tiered_fp8.generate(prompt, max_new_tokens=12)
        ref = untiered_fp8.generate(prompt, max_new_tokens=12)
        assert got["meta_info"]["prompt_tokens"] > 1024 + 256  # most of it on the host
        assert got["output_ids"] == ref["output_ids"], (seed, got["text"], ref["text"])
    log = tiered_fp8.log_text()
    assert "Traceback" not in log and "leak" not in log.lower(), tiered_fp8.log_tail()
