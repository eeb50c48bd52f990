"""Model loader: dummy weights (``--load-format dummy``) under which greedy decoding is decisive.

SGLang fills dummy weights uniformly in +-1e-3. Every hidden state and logit is then ~0: each
of the vocabulary's tokens gets the same logprob and greedy decoding picks by tie-breaking. A
comparison of attention backends on such a model (our greedy checks on the GPU host, where only
dummy-weight shapes exist) passes whatever the attention computed.

With ``SGLANG_EXT_DUMMY_WEIGHTS=scaled`` in the server's environment, SGLang's own per-parameter
seeded fill is kept and rescaled: matrices to a standard deviation of ``1/sqrt(fan_in)`` (so
activations keep their scale through the layers), the output projection drawn afresh with ``8/sqrt(fan_in)``
(logits with a spread of ~8 nats, so the top two tokens are rarely tied), and 1-D parameters
(norm weights) to ``1 +- 0.1``. Weights stay identical across servers and runs. Unset (the
default), SGLang's fill is untouched; timings are the same either way.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import torch

ENV = "SGLANG_EXT_DUMMY_WEIGHTS"
MODES = ("sglang", "scaled")
_SGLANG_HALF_RANGE = 1e-3  # SGLang's initialize_dummy_weights default
LOGIT_GAIN = 8.0
_LM_HEAD_SEED = 4321


def dummy_weights_mode() -> str:
    mode = os.environ.get(ENV, "sglang") or "sglang"
    if mode not in MODES:
        raise SystemExit(f"sglang_ext: {ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


@torch.no_grad()
def rescale_dummy_weights(model: torch.nn.Module, half_range: float = _SGLANG_HALF_RANGE,
                          tp_rank: int = 0) -> None:
    """Rescale a model filled uniformly in ``+-half_range`` (see the module docstring).

    SGLang seeds every parameter alike, so under ``--tp N`` each rank's shard of the
    vocabulary-parallel output projection holds the same values: token ``t`` and token
    ``t + V/N`` would get exactly equal logits. That projection is drawn again per rank."""
    uniform_std = half_range / math.sqrt(3.0)
    for name, param in model.named_parameters():
        if not torch.is_floating_point(param) or torch.finfo(param.dtype).bits < 16:
            continue
        if param.dim() == 1:
            unit = param.data / half_range  # uniform in [-1, 1], SGLang's seeded draw
            param.data.copy_(1.0 + 0.1 * unit)
            continue
        if name.startswith("lm_head"):
            generator = torch.Generator(device=param.device)
            generator.manual_seed(_LM_HEAD_SEED + tp_rank)
            bound = LOGIT_GAIN * math.sqrt(3.0 / param.shape[-1])
            param.data.uniform_(-bound, bound, generator=generator)
            continue
        param.data.mul_(1.0 / math.sqrt(param.shape[-1]) / uniform_std)


def _around_initialize_dummy_weights(original: Callable, model: torch.nn.Module,
                                     *args: Any, **kwargs: Any) -> None:
    original(model, *args, **kwargs)
    if dummy_weights_mode() == "scaled":
        from sglang_ext.tensor_parallel import attn_tp

        rescale_dummy_weights(model, kwargs.get("high", _SGLANG_HALF_RANGE), attn_tp().rank)


HOOKS = (
    ("sglang.srt.model_loader.loader.initialize_dummy_weights",
     _around_initialize_dummy_weights, "AROUND"),
)


def setup() -> None:
    dummy_weights_mode()  # a bad value fails at start-up with one line, before any loading
