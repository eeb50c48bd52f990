"""The CPU tier at the recommended setting (a label basis, ``--sparse-rerank``): the exact rerank
reads the shortlist's keys through the tier's page map, so a sync-tier server whose KV lives
mostly on the host decodes what the untiered server decodes, greedy token for token, on the real
model. The kernel-level check, step by step and under both schedules, is in
tests/test_tier_decode_steps.py."""

from __future__ import annotations

import pytest

from server_utils import LABELS_BASIS, Server

pytestmark = pytest.mark.server

# Budget 128 of ~450-token prompts: the label channels shortlist 2 x 128 tokens (floor 64) and
# the exact q.k picks the budget among them.
COMMON = [
    "--attention-backend", "sglang_ext", "--sparse-budget", "128", "--sparse-block-size", "4",
    "--sparse-sink", "16", "--sparse-window", "32", "--sparse-label-config", LABELS_BASIS,
    "--sparse-rerank", "2", "--sparse-rerank-min-tokens", "64", "--page-size", "4",
    "--max-running-requests", "2",
]
TIER = ["--sparse-tier", "sync", "--sparse-tier-gpu-tokens", "256",
        "--sparse-tier-host-gb", "0.25"]


def _prompt(key: int) -> str:
    text = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
            "There and back again. ") * 20
    half = len(text) // 2
    return (f"{text[:half]}\nThe pass key is {key}. Remember it.\n{text[half:]}\n"
            f"What is the pass key? The pass key is")


def test_a_sync_tier_server_with_the_rerank_decodes_what_the_untiered_one_decodes():
    prompt, steps = _prompt(60417), 8
    plain = Server(COMMON).start()
    try:
        expected = plain.generate(prompt, max_new_tokens=steps, ignore_eos=True)
    finally:
        plain.stop()
    tiered = Server(COMMON + TIER, env={"SGLANG_EXT_TIER_VERIFY": "2"}).start()
    try:
        got = tiered.generate(prompt, max_new_tokens=steps, ignore_eos=True)
        log = tiered.log_text()
        assert tiered.process.poll() is None, tiered.log_tail()
    finally:
        tiered.stop()
    assert expected["meta_info"]["prompt_tokens"] > 256 + 128  # host-homed and past the budget
    assert got.get("output_ids") == expected.get("output_ids"), (got["text"], expected["text"])
    assert "Traceback" not in log and "tier leak" not in log, log[-3000:]
