"""TokenizerManager: malformed request fields become a 400 before anything reaches the scheduler.

SGLang 0.5.16 forwards several client-supplied values to the scheduler unchecked, and some of
them kill it (and with it the whole server) in the forward pass:

* an input id outside ``[0, vocab_size)`` (``{"input_ids": [999999999]}``, a negative id, one bad
  row of a batch): IndexError in the embedding. ``TokenizerManager._validate_input_ids_in_vocab``
  exists but is never called (and would let negative ids through);
* ``input_embeds`` rows of another width than the hidden size, ragged rows, NaN or infinity;
* ``top_logprobs_num`` above the vocabulary (``topk`` fails in the sampler), and a list for
  ``logprob_start_len`` or ``top_logprobs_num`` of a single prompt (compared with an int).

Others answer 500 with a traceback in the log (an empty ``input_embeds``; a batch whose per-item
lists, e.g. ``sampling_params`` or ``return_logprob``, are shorter than the batch; a non-integer
``n``; a ``sampling_params`` list for one prompt), are accepted with a silent reinterpretation
(``n`` <= 0 runs one sample, ``true`` as an input id is token 1, an empty prompt in a batch, a
negative ``top_logprobs_num`` or a ``logprob_start_len`` below -1), or expand without bound
(``"n": 100000`` queues 100000 requests). Each of these now raises ``ValueError``, which SGLang's
HTTP layer turns into a 400 with the message (``{"error": {"message": ...}}`` on ``/generate``, an
OpenAI error body on ``/v1/*``; a streaming request gets it as an error event), as it does for
its own validation errors. Well-formed requests are unaffected.

Two hooks: ``generate_request`` (BEFORE) checks the raw request's shape before SGLang normalizes
it (``n``, per-item list lengths, ``input_embeds`` nesting), and ``_validate_one_request``
(BEFORE, called for every prompt of a request, the batch's included, before any is sent) checks
each prompt's ids, embeddings and logprob fields against the model.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Any, Optional

# The most samples one prompt may ask for (``sampling_params.n``): the OpenAI API's own limit.
# Each sample is a separate request in SGLang's queue.
MAX_PARALLEL_SAMPLES = 128

# GenerateReqInput fields that a batch request may give per prompt, as a list indexed by prompt
# (GenerateReqInput.__getitem__); a shorter list fails there with IndexError (a 500).
_PER_PROMPT_LISTS = (
    "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_sampling_mask", "custom_logit_processor", "lora_path", "return_hidden_states",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
    "decode_tp_size",
)
# Of those, the ones a single prompt must give as one value: SGLang passes a list through to
# the scheduler unchanged.
_SCALAR_WHEN_SINGLE = (
    "return_logprob", "logprob_start_len", "top_logprobs_num", "return_sampling_mask",
)


def _is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool: JSON ``true`` is not a token id."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# ------------------------------------------------------------------- the raw request's shape

def _batch_size(obj: Any) -> Optional[int]:
    """None for a single prompt, else the number of prompts (GenerateReqInput's own rule,
    before ``n`` expands a single prompt into a batch)."""
    if obj.text is not None:
        return None if isinstance(obj.text, str) else len(obj.text)
    if obj.input_ids is not None:
        ids = obj.input_ids
        if not ids or not isinstance(ids[0], list):
            return None  # an empty list is SGLang's own 400 ("input_ids cannot be empty.")
        return len(ids)
    embeds = obj.input_embeds
    if embeds is None:
        return None
    if not isinstance(embeds, list) or not embeds or not isinstance(embeds[0], list) \
            or not embeds[0]:
        raise ValueError("input_embeds must be a non-empty list of embedding rows "
                         "(or a list of such lists for a batch)")
    return len(embeds) if isinstance(embeds[0][0], list) else None


def _parallel_samples(sampling_params: Any) -> None:
    for params in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        if not isinstance(params, dict) or params.get("n") is None:
            continue
        n = params["n"]
        if not _is_int(n) or not 1 <= n <= MAX_PARALLEL_SAMPLES:
            raise ValueError(f"sampling_params.n must be an integer in "
                             f"[1, {MAX_PARALLEL_SAMPLES}], got {n!r}")


def check_request_shape(obj: Any) -> None:
    """ValueError (one line) for a request SGLang's normalization would crash on, expand without
    bound, or pass on malformed to the scheduler."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    if not isinstance(obj, GenerateReqInput):
        return
    if obj.text is None and obj.input_ids is None and obj.input_embeds is None:
        return  # SGLang's own 400 ("Either text, input_ids or input_embeds should be provided.")
    _parallel_samples(obj.sampling_params)
    batch = _batch_size(obj)
    if batch is None:
        for name in _SCALAR_WHEN_SINGLE:
            if isinstance(getattr(obj, name), list):
                raise ValueError(f"{name} must be a single value for a single prompt, "
                                 f"got a list")
        params = obj.sampling_params
        if isinstance(params, list):
            # With n > 1 a single prompt becomes a batch of one, and a one-entry list is
            # SGLang's form; otherwise the list reaches SamplingParams(**list) (a 500).
            n = params[0].get("n", 1) if params and isinstance(params[0], dict) else 1
            if n is None or n <= 1 or len(params) != 1:
                raise ValueError("sampling_params must be one object for a single prompt, "
                                 f"got a list of {len(params)}")
        return
    if batch == 0:
        raise ValueError("a batch request needs at least one prompt")
    for name in _PER_PROMPT_LISTS:
        value = getattr(obj, name)
        if isinstance(value, list) and len(value) != batch:
            raise ValueError(f"{name} has {len(value)} entries for a batch of {batch} prompts")
    ids_logprob = obj.token_ids_logprob
    if isinstance(ids_logprob, list) and ids_logprob and isinstance(ids_logprob[0], list) \
            and len(ids_logprob) != batch:
        raise ValueError(f"token_ids_logprob has {len(ids_logprob)} lists for a batch of "
                         f"{batch} prompts")


# ---------------------------------------------------------------------------- each prompt

def check_input_ids(input_ids: Any, vocab_size: int, allow_empty: bool = False) -> None:
    """ValueError unless ``input_ids`` is a (non-empty) list of token ids in
    ``[0, vocab_size)``. The message names the first bad position, not the whole prompt."""
    if not isinstance(input_ids, (list, tuple)):
        raise ValueError("input_ids must be a list of token ids")
    if len(input_ids) == 0:
        if allow_empty:
            return
        raise ValueError("input_ids cannot be empty.")  # SGLang's own words for one prompt
    if all(type(t) is int for t in input_ids):  # the common case, checked at C speed
        if 0 <= min(input_ids) and max(input_ids) < vocab_size:
            return
    for i, token in enumerate(input_ids):
        if not _is_int(token):
            raise ValueError(f"input_ids[{i}] = {token!r} is not an integer token id")
        if not 0 <= token < vocab_size:
            raise ValueError(f"input_ids[{i}] = {token} is outside the vocabulary "
                             f"[0, {vocab_size})")


def check_input_embeds(input_embeds: Any, hidden_size: int) -> None:
    """ValueError unless ``input_embeds`` is a non-empty list of ``hidden_size``-wide rows of
    finite numbers."""
    if not isinstance(input_embeds, list) or not input_embeds:
        raise ValueError("input_embeds must be a non-empty list of embedding rows")
    for i, row in enumerate(input_embeds):
        if not isinstance(row, list) or len(row) != hidden_size:
            width = len(row) if isinstance(row, list) else type(row).__name__
            raise ValueError(f"input_embeds[{i}] has width {width}; the model's hidden size "
                             f"is {hidden_size}")
        if not all(_is_number(x) and math.isfinite(x) for x in row):
            raise ValueError(f"input_embeds[{i}] holds a value that is not a finite number")


def check_logprob_fields(obj: Any, vocab_size: int) -> None:
    if not isinstance(obj.return_logprob, bool):
        raise ValueError(f"return_logprob must be true or false, got {obj.return_logprob!r}")
    start = obj.logprob_start_len
    if not _is_int(start) or start < -1:
        raise ValueError(f"logprob_start_len must be an integer >= -1 (-1: output tokens "
                         f"only), got {start!r}")
    top = obj.top_logprobs_num
    if not _is_int(top) or not 0 <= top <= vocab_size:
        raise ValueError(f"top_logprobs_num must be an integer in [0, {vocab_size}], "
                         f"got {top!r}")


def check_one_prompt(manager: Any, obj: Any, input_ids: Any) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    model_config = manager.model_config
    vocab_size = model_config.vocab_size
    if getattr(obj, "input_embeds", None) is not None:
        check_input_embeds(obj.input_embeds, model_config.hidden_size)
    elif obj.input_ids is not None:
        check_input_ids(obj.input_ids, vocab_size)  # what the client sent
    elif input_ids is not None and not obj.contains_mm_input():
        # tokenized text (SGLang refuses empty text itself); a multimodal processor's ids may
        # hold placeholders outside the vocabulary, so those are left alone
        check_input_ids(list(input_ids), vocab_size, allow_empty=True)
    if isinstance(obj, GenerateReqInput):
        check_logprob_fields(obj, vocab_size)


# --------------------------------------------------------------------------------- hooks

def _before_generate_request(manager: Any, obj: Any, *args: Any, **kwargs: Any) -> None:
    check_request_shape(obj)


def _before_validate_one_request(manager: Any, obj: Any, input_ids: Any, *args: Any,
                                 **kwargs: Any) -> None:
    check_one_prompt(manager, obj, input_ids)


HOOKS = (
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
     _before_generate_request, "BEFORE"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
     _before_validate_one_request, "BEFORE"),
)
