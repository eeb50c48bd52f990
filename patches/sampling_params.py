"""SamplingParams: validate per-request sparse overrides when a request arrives (400 if bad)."""

from __future__ import annotations

from typing import Any

from sglang_ext.attention.request_overrides import parse_override


def _after_verify(result: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> None:
    from sglang_ext.patches.server_args import active_config

    parse_override(sampling_params.custom_params, active_config())


HOOKS = (
    ("sglang.srt.sampling.sampling_params.SamplingParams.verify", _after_verify, "AFTER"),
)
