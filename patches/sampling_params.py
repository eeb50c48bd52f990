"""SamplingParams: validate per-request sparse overrides when a request arrives (400 if bad)."""

from __future__ import annotations

from typing import Any

from sglang_ext.attention.request_overrides import OVERRIDE_KEY, parse_override


def _after_verify(result: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> None:
    from sglang_ext.patches.server_args import active_config, active_impl

    custom = sampling_params.custom_params
    parse_override(custom, active_config())
    if custom and OVERRIDE_KEY in custom and active_impl() == "triton":
        # The batched kernels run one static configuration inside the CUDA graph: refuse
        # rather than silently decode with the server-wide settings.
        raise ValueError(
            f"custom_params.{OVERRIDE_KEY} needs a server started with --sparse-impl reference "
            "(this one decodes with the server-wide settings in CUDA graphs)"
        )


HOOKS = (
    ("sglang.srt.sampling.sampling_params.SamplingParams.verify", _after_verify, "AFTER"),
)
