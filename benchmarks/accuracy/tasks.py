"""RULER-style long-context tasks with an exact context length, in the served model's tokens.

Every task builds one chat prompt (the model's own chat template) of ``context`` tokens, plus
the short strings the answer must contain. The haystack is real English prose that ships with
the interpreter: the docstrings of the standard library (the same text the label channels are
calibrated on, ``sglang_ext.selection.calibrate.stdlib_docstring_text``), read in file-name
order and cut at a seed-chosen line, so nothing comes from the network.

Tasks (names as in the results):

* ``passkey`` — one "pass key" (5 digits) hidden at a random depth.
* ``niah_number`` / ``niah_uuid`` — one "special magic number" for a key; the value is a
  7-digit number or a UUID.
* ``niah_multikey`` — four needles with different keys; the question asks for one of them.
* ``niah_multivalue`` — four needles with the same key; all four values must be returned.
* ``var_tracking`` — a chain of ``VAR X = ...`` assignments spread through the haystack; all
  variables that end up holding the value must be named.
* ``common_words`` — a numbered list of words (the context itself, no haystack); the five words
  that occur most often must be named.

Scoring (``contains_all``): a sample's credit is the fraction of its expected strings that occur
in the output as whole words (not inside a longer run of letters/digits), case-insensitively;
tasks with one expected string score 0 or 1. A task's score is the mean credit x 100.

Samples depend only on (task, context, seed index, tokenizer, interpreter version).
"""

from __future__ import annotations

import bisect
import functools
import random
import re
import string
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Sequence

TASKS = (
    "passkey",
    "niah_number",
    "niah_uuid",
    "niah_multikey",
    "niah_multivalue",
    "var_tracking",
    "common_words",
)

# Upper bound of the new tokens each task may generate (digits and UUID characters are about
# one token each for SmolLM2's tokenizer). A sample's own limit is tighter: see answer_limit.
MAX_NEW_TOKENS = {
    "passkey": 12,
    "niah_number": 16,
    "niah_uuid": 44,
    "niah_multikey": 16,
    "niah_multivalue": 48,
    "var_tracking": 36,
    "common_words": 32,
}
# Tokens allowed beyond the expected answer written as a list (quotes, a closing period).
ANSWER_SLACK = 2

# Haystack tasks land exactly on the target (rarely off by one where a cut merges tokens);
# the word list of common_words moves in whole entries of a few tokens.
TOLERANCE = {"common_words": 4}
DEFAULT_TOLERANCE = 2

NUM_MULTI = 4  # needles in the multi-key / multi-value tasks
VT_HOPS = 4  # assignments after the first one in the variable chain
CWE_COMMON = 5  # words to name in common_words
CWE_RARE_FREQ = 3  # occurrences of every other word
SCORING = "contains_all"


@dataclass(frozen=True)
class Sample:
    task: str
    context: int  # requested prompt length in tokens
    index: int  # seed index within (task, context)
    prompt: str  # full chat-templated prompt, ending with the start of the answer
    answers: tuple[str, ...]  # strings the output must contain
    max_new_tokens: int
    prompt_tokens: int  # measured with the tokenizer, no special tokens added
    needles: tuple[str, ...] = ()  # inserted sentences (haystack tasks)
    needle_offsets: tuple[int, ...] = ()  # character offset of each needle in `prompt`
    depths: tuple[float, ...] = ()  # requested depth of each needle in the haystack (0..1)
    body: tuple[int, int] = (0, 0)  # character span of the context (haystack / word list)
    scoring: str = SCORING


# --------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------


def answer_limit(tokenizer: Any, task: str, answers: Sequence[str]) -> int:
    """New tokens a sample may generate: its expected answer as the model writes it (" A." after
    the prompt's answer prefix; several answers as "A, B, C" or as a list "\n\n1. A\n2. B ...",
    whichever is longer), plus ANSWER_SLACK, at most MAX_NEW_TOKENS[task]. Decoding dominates
    the suite's run time, and a model that has not written the answer by then is not going to."""
    need = count_tokens(tokenizer, " " + ", ".join(answers) + ".")
    if len(answers) > 1:
        listed = "\n\n" + "\n".join(f"{i + 1}. {a}" for i, a in enumerate(answers))
        need = max(need, count_tokens(tokenizer, listed))
    return min(MAX_NEW_TOKENS[task], need + ANSWER_SLACK)


def _word_pattern(answer: str) -> re.Pattern[str]:
    return re.compile(r"(?<![0-9A-Za-z])" + re.escape(answer) + r"(?![0-9A-Za-z])", re.IGNORECASE)


def credit(answers: Sequence[str], output: str) -> float:
    """Fraction of ``answers`` found in ``output`` as whole words (case-insensitive)."""
    if not answers:
        raise ValueError("a sample needs at least one expected answer")
    found = sum(1 for a in answers if _word_pattern(a).search(output))
    return found / len(answers)


def score(sample: Sample, output: str) -> float:
    if sample.scoring != SCORING:
        raise ValueError(f"unknown scoring rule {sample.scoring!r}")
    return credit(sample.answers, output)


# --------------------------------------------------------------------------------------
# Haystack text
# --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=2)
def corpus_text(min_chars: int = 400_000) -> tuple[str, str]:
    """(text, description) of the standard-library docstrings, ~100k tokens."""
    from sglang_ext.selection.calibrate import stdlib_docstring_text

    return stdlib_docstring_text(min_chars)


@functools.lru_cache(maxsize=2)
def word_pool() -> tuple[str, ...]:
    """Distinct plain lowercase words (4-10 letters) of the haystack text, sorted."""
    text, _ = corpus_text()
    return tuple(sorted(set(re.findall(r"(?<![A-Za-z_])[a-z]{4,10}(?![A-Za-z_0-9])", text))))


class Corpus:
    """The haystack text with its token offsets, for cutting windows of a given token length."""

    def __init__(self, tokenizer: Any):
        self.text, self.source = corpus_text()
        self.lower = self.text.lower()
        enc = tokenizer(self.text, add_special_tokens=False, return_offsets_mapping=True)
        self.starts = [s for s, _ in enc["offset_mapping"]]
        self.ends = [e for _, e in enc["offset_mapping"]]
        self.num_tokens = len(self.starts)

    def line_start(self, rng: random.Random, span_tokens: int) -> int:
        """A random token index that begins a line, leaving ``span_tokens`` tokens after it."""
        last = self.num_tokens - span_tokens - 1
        if last <= 0:
            raise ValueError(f"haystack text too short for {span_tokens} tokens")
        tok = rng.randrange(0, last)
        nl = self.text.find("\n", self.starts[tok])
        if nl < 0:
            return 0
        i = bisect.bisect_left(self.starts, nl + 1)
        return i if i < last else 0

    def window(self, first_token: int, num_tokens: int) -> str:
        num_tokens = max(0, min(num_tokens, self.num_tokens - first_token))
        if num_tokens == 0:
            return ""
        return self.text[self.starts[first_token]: self.ends[first_token + num_tokens - 1]]


# --------------------------------------------------------------------------------------
# Prompt assembly
# --------------------------------------------------------------------------------------

_SLOT = "\u0000BODY\u0000"


def chat_frame(tokenizer: Any, instruction: str, question: str, answer_prefix: str) -> tuple[str, str]:
    """(head, tail) of the chat-templated prompt around the context body.

    ``head`` ends with the instruction, ``tail`` holds the question, the template's assistant
    turn opening and the start of the answer (so a small model answers in the expected form).
    """
    messages = [{"role": "user", "content": instruction + _SLOT + question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(_SLOT)
    return head, tail + answer_prefix


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def insert_lines(hay: str, needles: Sequence[str], depths: Sequence[float]) -> tuple[str, list[int]]:
    """Put each needle on its own line at the line start nearest its depth (needles keep their
    order; depths must be sorted). Returns the text and each needle's character offset."""
    cuts: list[int] = []
    for d in depths:
        want = int(round(d * len(hay)))
        before = hay.rfind("\n", 0, want)
        after = hay.find("\n", want)
        options = [p + 1 for p in (before, after) if p >= 0] or [0]
        cut = min(options, key=lambda p: abs(p - want))
        cuts.append(max(cut, cuts[-1] if cuts else 0))
    out: list[str] = []
    offsets: list[int] = []
    prev = 0
    length = 0
    for cut, needle in zip(cuts, needles):
        piece = hay[prev:cut]  # empty, or ends with a newline (cuts are line starts)
        out.append(piece)
        length += len(piece)
        offsets.append(length)
        out.append(needle + "\n")
        length += len(needle) + 1
        prev = cut
    out.append(hay[prev:])
    return "".join(out), offsets


def fit_haystack(
    tokenizer: Any,
    corpus: Corpus,
    rng: random.Random,
    context: int,
    head: str,
    tail: str,
    needles: Sequence[str],
    depths: Sequence[float],
) -> tuple[str, int, list[int], tuple[int, int]]:
    """Cut the haystack so that head + haystack-with-needles + tail is ``context`` tokens.

    Returns (prompt, its token count, needle offsets in the prompt, body span)."""
    first = corpus.line_start(rng, context + 64)

    def build(n_hay: int) -> tuple[str, list[int]]:
        body, offsets = insert_lines(corpus.window(first, n_hay), needles, depths)
        return head + body + tail, [len(head) + o for o in offsets]

    fixed = count_tokens(tokenizer, build(0)[0])
    n_hay = max(0, context - fixed)
    best: tuple[int, str, int, list[int]] | None = None
    seen = set()
    for _ in range(12):
        prompt, offsets = build(n_hay)
        n = count_tokens(tokenizer, prompt)
        if best is None or abs(n - context) < best[0]:
            best = (abs(n - context), prompt, n, offsets)
        if n == context or n_hay in seen:
            break
        seen.add(n_hay)
        n_hay = max(0, n_hay + context - n)
    assert best is not None
    _, prompt, n, offsets = best
    return prompt, n, offsets, (len(head), len(prompt) - len(tail))


# --------------------------------------------------------------------------------------
# Value generators
# --------------------------------------------------------------------------------------


def _fresh(rng: random.Random, make: Callable[[random.Random], str], avoid: set[str], text_lower: str) -> str:
    """A value not used yet and absent from the haystack text (so it occurs only as planted)."""
    while True:
        v = make(rng)
        if v not in avoid and v.lower() not in text_lower:
            avoid.add(v)
            return v


def _number(digits: int) -> Callable[[random.Random], str]:
    return lambda rng: str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _key(rng: random.Random) -> str:
    pool = word_pool()
    return f"{rng.choice(pool)}-{rng.choice(pool)}"


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


def _depths(rng: random.Random, k: int) -> list[float]:
    return sorted(rng.uniform(0.02, 0.98) for _ in range(k))


# --------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------

_NIAH_INTRO = ("Some special magic {kind} are hidden within the following text. Make sure to "
               "memorize them. I will quiz you about the {kind} afterwards.\n\n")


def _needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _haystack_sample(task: str, context: int, index: int, tokenizer: Any, corpus: Corpus,
                     rng: random.Random) -> Sample:
    text = corpus.lower
    used: set[str] = set()
    if task == "passkey":
        key = _fresh(rng, _number(5), used, text)
        needles = [f"The pass key is {key}. Remember it. {key} is the pass key."]
        answers = (key,)
        instruction = ("There is an important info hidden inside a lot of irrelevant text. Find it "
                       "and memorize it. I will quiz you about the important information there.\n\n")
        question = "\n\nWhat is the pass key? Answer with the number only."
        prefix = "The pass key is"
    elif task in ("niah_number", "niah_uuid", "niah_multikey", "niah_multivalue"):
        is_uuid = task == "niah_uuid"
        kind = "uuids" if is_uuid else "numbers"
        one = "uuid" if is_uuid else "number"
        make = _uuid if is_uuid else _number(7)
        if task == "niah_multikey":
            keys = [_fresh(rng, _key, used, text) for _ in range(NUM_MULTI)]
            values = [_fresh(rng, make, used, text) for _ in keys]
            pairs = list(zip(keys, values))
            asked = rng.randrange(NUM_MULTI)
            key, answers = keys[asked], (values[asked],)
        elif task == "niah_multivalue":
            key = _fresh(rng, _key, used, text)
            values = [_fresh(rng, make, used, text) for _ in range(NUM_MULTI)]
            pairs = [(key, v) for v in values]
            answers = tuple(values)
        else:
            key = _fresh(rng, _key, used, text)
            value = _fresh(rng, make, used, text)
            pairs, answers = [(key, value)], (value,)
        needles = [_needle(k, v, kind) for k, v in pairs]
        instruction = _NIAH_INTRO.format(kind=kind)
        if task == "niah_multivalue":
            question = f"\n\nWhat are all the special magic {kind} for {key} mentioned in the provided text?"
            prefix = f"The special magic {kind} for {key} mentioned in the provided text are"
        else:
            question = f"\n\nWhat is the special magic {one} for {key} mentioned in the provided text?"
            prefix = f"The special magic {one} for {key} mentioned in the provided text is"
    elif task == "var_tracking":
        names = [_fresh(rng, _var_name, used, text) for _ in range(VT_HOPS + 1)]
        value = _fresh(rng, _number(5), used, text)
        needles = [f"VAR {names[0]} = {value}."] + [
            f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, len(names))
        ]
        answers = tuple(names)
        instruction = ("Memorize and track the chain of variable assignments hidden in the "
                       "following text.\n\n")
        question = (f"\n\nQuestion: Find all variables that are assigned the value {value} in the "
                    "text above.")
        prefix = (f"Answer: According to the chain of variable assignments in the text above, "
                  f"{len(names)} variables are assigned the value {value}, they are:")
    else:
        raise ValueError(f"unknown haystack task {task!r}")
    depths = _depths(rng, len(needles))
    head, tail = chat_frame(tokenizer, instruction, question, prefix)
    prompt, n, offsets, body = fit_haystack(tokenizer, corpus, rng, context, head, tail, needles, depths)
    return Sample(task, context, index, prompt, answers, answer_limit(tokenizer, task, answers), n,
                  tuple(needles), tuple(offsets), tuple(depths), body)


def _common_words_sample(context: int, index: int, tokenizer: Any, rng: random.Random) -> Sample:
    pool = list(word_pool())
    rng.shuffle(pool)
    common, rare_pool = pool[:CWE_COMMON], pool[CWE_COMMON:]
    instruction = ("Below is a numbered list of words. In these words, some appear more often "
                   "than others. Memorize the ones that appear most often.\n\n")
    question = f"\n\nQuestion: What are the {CWE_COMMON} most common words in the above list?"
    prefix = f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
    head, tail = chat_frame(tokenizer, instruction, question, prefix)
    fixed = count_tokens(tokenizer, head + tail)
    # ~4-7 tokens per "N. word" line; common words take about a fifth of the list.
    entries_guess = max(4 * CWE_COMMON, (context - fixed) // 5)
    common_freq = max(8, entries_guess // (5 * CWE_COMMON))
    order_seed = rng.random()

    def build(n_rare_entries: int) -> str:
        words = [w for w in common for _ in range(common_freq)]
        full, part = divmod(n_rare_entries, CWE_RARE_FREQ)
        for i in range(full):
            words += [rare_pool[i]] * CWE_RARE_FREQ
        words += [rare_pool[full]] * part
        random.Random(order_seed).shuffle(words)
        body = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words))
        return head + body + tail

    def measure(n_rare: int) -> tuple[int, str, int, int]:
        if n_rare // CWE_RARE_FREQ >= len(rare_pool):
            raise ValueError(f"common_words: not enough distinct words for {context} tokens")
        prompt = build(n_rare)
        n = count_tokens(tokenizer, prompt)
        return abs(n - context), prompt, n, n_rare

    # Newton-like steps on the number of rare entries, then single entries around the best.
    best = cur = measure(0)
    seen = {0}
    for _ in range(16):
        _, _, n, n_rare = cur
        if n == context:
            break
        per_entry = max(3.0, (n - fixed) / (n_rare + CWE_COMMON * common_freq))
        nxt = max(0, n_rare + int(round((context - n) / per_entry)))
        if nxt in seen:
            break
        seen.add(nxt)
        cur = measure(nxt)
        best = min(best, cur, key=lambda r: r[0])
    for step in (1, -1):
        while best[3] + step >= 0 and best[0] > 0:
            cand = measure(best[3] + step)
            if cand[0] >= best[0]:
                break
            best = cand
    _, prompt, n, _ = best
    return Sample("common_words", context, index, prompt, tuple(common),
                  answer_limit(tokenizer, "common_words", common), n,
                  body=(len(head), len(prompt) - len(tail)))


def make_sample(task: str, context: int, index: int, tokenizer: Any, corpus: Corpus | None = None) -> Sample:
    """Sample ``index`` of ``task`` at ``context`` tokens; the same arguments give the same sample."""
    rng = random.Random(f"sglang_ext-accuracy:{task}:{context}:{index}")
    if task == "common_words":
        return _common_words_sample(context, index, tokenizer, rng)
    return _haystack_sample(task, context, index, tokenizer, corpus or Corpus(tokenizer), rng)


def make_samples(tasks: Sequence[str], contexts: Sequence[int], n: int, tokenizer: Any) -> list[Sample]:
    """All samples, grouped by (task, context) in the given order."""
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks {sorted(unknown)}; known: {', '.join(TASKS)}")
    corpus = Corpus(tokenizer) if any(t != "common_words" for t in tasks) else None
    return [make_sample(t, c, i, tokenizer, corpus) for t in tasks for c in contexts for i in range(n)]


def tolerance(task: str) -> int:
    return TOLERANCE.get(task, DEFAULT_TOLERANCE)


def load_tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the 100k-token haystack is longer than model_max_length
    return AutoTokenizer.from_pretrained(model_path)
