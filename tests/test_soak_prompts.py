"""The soak driver's prompts stay within the server's context (benchmarks/soak.py: PromptFitter,
no server): a drawn prompt longer than the limit, as the server's tokenizer counts it, is cut to
fit with its closing instruction kept; one that fits is left as drawn."""

from __future__ import annotations

import random

from benchmarks.soak import PROMPT_TAIL, PromptFitter, make_prompt, prompt_fitter


class CharCountingFitter(PromptFitter):
    """Counts one token per 3 characters (denser than the drawing's 4): drawn prompts overshoot."""

    def count(self, text: str) -> int:
        return len(text) // 3


LINES = [f"line {i} of the corpus, with some words in it" for i in range(5000)]


def test_long_prompt_is_cut_to_the_limit_and_keeps_its_tail():
    fitter = CharCountingFitter("http://unused", max_tokens=2000)
    prompt = make_prompt(LINES, random.Random(0), 3000, fitter.fit)
    assert prompt.endswith(PROMPT_TAIL)
    assert fitter.count(prompt) <= 2000
    assert fitter.count(prompt) > 1900  # cut to the limit, not far below it
    assert fitter.count(make_prompt(LINES, random.Random(0), 3000)) > 2000  # it did overshoot


def test_prompt_within_the_limit_is_unchanged():
    fitter = CharCountingFitter("http://unused", max_tokens=8000)
    assert make_prompt(LINES, random.Random(1), 1000, fitter.fit) \
        == make_prompt(LINES, random.Random(1), 1000)


def test_fitter_leaves_room_for_the_answer_and_unknown_context_fits_nothing():
    fitter = prompt_fitter("http://unused", {"context_len": 8192}, max_new_tokens=32)
    assert fitter is not None and fitter.max_tokens < 8192 - 32
    assert prompt_fitter("http://unused", {}, max_new_tokens=32) is None
