"""An 8-bit KV cache (``--kv-cache-dtype fp8_e4m3``) through real SGLang servers on the CPU with
the real SmolLM2-135M model: our backend against SGLang's torch_native on the same fp8 cache.

(The CUDA kernels' fp8 path, upcast tiles and KV scales, is checked against the torch reference
in tests/test_kernels_sparse_attention.py and tests/test_kernels_sparse_decode.py.)"""

from __future__ import annotations

import pytest

from server_utils import Server
from test_server_e2e import SPARSE_ARGS, _prompts, passkey_hits

pytestmark = pytest.mark.server

FP8_KV = ["--kv-cache-dtype", "fp8_e4m3"]


@pytest.fixture(scope="module")
def ours_fp8() -> Server:
    server = Server(SPARSE_ARGS + FP8_KV).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference_fp8() -> Server:
    server = Server(["--attention-backend", "torch_native"] + FP8_KV).start()
    yield server
    server.stop()


def test_budget_at_least_context_matches_sglang_on_an_fp8_cache(ours_fp8: Server,
                                                                 reference_fp8: Server):
    """Budget >= context on the fp8 cache: SGLang's own dense decode of the same cache, token
    for token (one request at a time, as in test_server_e2e)."""
    for prompt in _prompts(600, seed=1):
        ours = ours_fp8.generate(prompt, max_new_tokens=24,
                                 custom_params={"sparse": {"budget": 8192}})
        reference = reference_fp8.generate(prompt, max_new_tokens=24)
        assert ours["output_ids"] == reference["output_ids"], prompt[:60]
    assert ours["meta_info"]["prompt_tokens"] > 256  # beyond the server's budget


def test_sparse_decode_of_an_fp8_cache_finds_the_pass_key(ours_fp8: Server):
    """Sparse decode (budget 256) over an fp8 cache of ~3,000 tokens: selection and attention
    read the 8-bit keys (a crash here before: torch has no gather over fp8 on the CPU) and
    find the pass key about as often as dense attention of the same cache."""
    hits = passkey_hits(ours_fp8, range(5))
    assert hits["dense"] >= 4, hits
    assert hits["sparse"] >= 4, hits
    assert "Traceback" not in ours_fp8.log_text()
