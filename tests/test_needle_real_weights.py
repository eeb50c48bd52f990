"""Real weights on the CPU: a small needle set through the product's selection
(``select_token_mask``) at the recommended block size and budget ratio, against dense
attention on the same samples, and against the min/max bound filter, which drops needles at
this block size (so the set can tell a filter that keeps them from one that does not).

SmolLM2-135M (converted by ``make setup``) in float32 through transformers; the prompt is
prefilled densely once, then each setting decodes greedily from it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from benchmarks.accuracy import tasks as T
from benchmarks.accuracy.longgen import Entry, decode, load_model
from benchmarks.accuracy.runner import shrunk_sink_window
from sglang_ext.config import build_config
from sglang_ext.selection import SelectionParams

MODEL_DIR = os.environ.get("SGLANG_EXT_MODEL_DIR", ".models/smollm2")
LABELS = os.path.join(MODEL_DIR, "sparse_labels.json")
# What the README recommends on the GPU: 32-token blocks, a budget of 1/16 of the context.
BLOCK_SIZE = 32
BUDGET_SHARE = 16
CONTEXT = 2048
SAMPLES = 10

pytestmark = pytest.mark.skipif(not os.path.isfile(LABELS),
                                reason="needs the converted model and labels (make setup)")


def _params(block_score: str) -> SelectionParams:
    budget = CONTEXT // BUDGET_SHARE
    sink, window = shrunk_sink_window(budget)
    cfg = build_config(budget=budget, block_size=BLOCK_SIZE, sink=sink, window=window,
                       block_score=block_score)
    return SelectionParams("two_level", cfg.budget, cfg.block_size,
                           cfg.effective_candidate_blocks, cfg.sink, cfg.window,
                           block_score=cfg.effective_block_score)


@pytest.fixture(scope="module")
def hits() -> dict[str, int]:
    model, tokenizer, hook = load_model(MODEL_DIR, LABELS, 16)
    settings = {"dense": None, "label_max": _params("auto"), "bound": _params("bound")}
    assert settings["label_max"].block_score == "label_max"  # the default where it applies
    eos = [tokenizer.eos_token_id]
    count = dict.fromkeys(settings, 0)
    for sample in T.make_samples(["passkey"], [CONTEXT], SAMPLES, tokenizer):
        ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        entries = [Entry(p, None, hook.channels.shape[1]) for p in settings.values()]
        runs = decode(model, hook, entries, ids, sample.max_new_tokens, eos, share_prefill=True)
        for name, run in zip(settings, runs):
            count[name] += int(T.score(sample, tokenizer.decode(run["tokens"])) == 1.0)
    return count


def test_the_default_block_filter_keeps_the_needle(hits):
    assert hits["dense"] >= SAMPLES // 2, f"dense finds too few needles to judge by: {hits}"
    assert hits["label_max"] >= hits["dense"] - 1, hits


def test_the_set_detects_a_filter_that_drops_needles(hits):
    """The control: Quest's bound at 32-token blocks loses needles here."""
    assert hits["bound"] < hits["dense"] - 1, hits
