"""A label basis end to end: real SGLang servers on the CPU with the real SmolLM2-135M model, one
with the label channels (``sparse_labels.json``), one with the same number of leading coordinates
of the calibrated kpca basis (the keys' principal directions) (``sparse_labels_kpca.json``, ``make model``).

The basis server changes the basis of every layer's queries and keys at the backend's entry
(attention/qk_basis.py): its KV cache holds k', and q'·k' = q·k. A per-request ``dense`` request
is then exact attention on both servers and must decode the same tokens; sparse requests rank
tokens by the basis's coordinates.
"""

from __future__ import annotations

import pytest
import requests

from server_utils import LABELS, LABELS_BASIS, Server
from test_tier_e2e import _passkey_prompt

pytestmark = pytest.mark.server

COMMON = ["--attention-backend", "sglang_ext", "--sparse-budget", "256", "--sparse-block-size",
          "4", "--page-size", "4", "--max-running-requests", "4"]
DENSE = {"custom_params": {"sparse": {"method": "dense"}}}


@pytest.fixture(scope="module")
def channels() -> Server:
    server = Server(COMMON + ["--sparse-label-config", LABELS]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def basis() -> Server:
    server = Server(COMMON + ["--sparse-label-config", LABELS_BASIS]).start()
    yield server
    server.stop()


def _greedy(server: Server, prompt: str) -> tuple[list[int], list[float], list[float]]:
    """Greedy ids, each one's logprob, and its margin over the runner-up."""
    payload = {"text": prompt, "return_logprob": True, "top_logprobs_num": 2,
               "sampling_params": {"max_new_tokens": 24, "temperature": 0, **DENSE}}
    response = requests.post(server.url + "/generate", json=payload, timeout=600)
    response.raise_for_status()
    out = response.json()
    meta = out["meta_info"]
    assert meta["prompt_tokens"] > 1024
    chosen = [lp for lp, _, _ in meta["output_token_logprobs"]]
    margins = [top[0][0] - top[1][0] for top in meta["output_top_logprobs"]]
    return out["output_ids"], chosen, margins


def test_dense_requests_decode_the_same_tokens_in_the_basis(channels: Server, basis: Server):
    """Exact attention in either basis, to the rounding of k' in the KV dtype: the same greedy
    tokens with logprobs within a few bf16 steps, until a near tie (the runner-up within 0.3
    nats: two steps of a bf16 logit here, 0.25) may go either way. A wrong basis moves logprobs by
    far more and diverges at once."""
    matched = 0
    for seed in range(3):
        prompt = _passkey_prompt(seed, 30000 + 7919 * seed)
        want, want_lp, margins = _greedy(channels, prompt)
        got, got_lp, _ = _greedy(basis, prompt)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        deltas = [round(abs(a - b), 4) for a, b in zip(got_lp[:same], want_lp[:same])]
        report = (f"seed {seed}: same for {same} tokens, largest logprob gaps "
                  f"{sorted(deltas)[-3:]}, runner-up margins {[round(m, 3) for m in margins]}")
        assert max(deltas, default=0.0) < 0.25, report
        if same < len(want):
            assert margins[same] < 0.3, report
        matched += same
    assert matched >= 24, matched


def test_sparse_requests_rank_by_the_basis_and_find_the_pass_key(basis: Server):
    found = 0
    for seed in range(3):
        key = 40000 + 7919 * seed
        out = basis.generate(_passkey_prompt(seed, key), max_new_tokens=12)
        found += str(key) in out["text"]
    assert found >= 2, found
    log = basis.log_text()
    assert "sglang_ext label basis: labels are the leading 16 coordinates" in log
    assert "Traceback" not in log
