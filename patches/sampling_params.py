"""SamplingParams: validate per-request sparse overrides when a request arrives (400 if bad), and
turn a wrongly typed sampling parameter (e.g. ``"temperature": "hot"``) into the 400 SGLang gives
other bad values, instead of the 500 and traceback its constructor's TypeError causes.

(The second hook wraps TokenizerManager._create_tokenized_object, which builds SamplingParams
from the request: msgspec calls SamplingParams.__post_init__ at C level, so that method cannot be
hooked itself.)"""

from __future__ import annotations

from typing import Any

from sglang_ext.attention.mixed_settings import unsupported_override
from sglang_ext.attention.request_overrides import OVERRIDE_KEY, parse_override


def _after_verify(result: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> None:
    from sglang_ext.patches.server_args import active_config, active_impl, active_is_mla

    custom = sampling_params.custom_params
    params = parse_override(custom, active_config())
    if params is not None and active_is_mla():
        from sglang_ext.selection.mla import mla_unsupported

        unsupported = mla_unsupported(params)
        if unsupported:
            key = unsupported[0][0]
            raise ValueError(f"custom_params.{OVERRIDE_KEY}.{key} {getattr(params, key)!r} "
                             "does not support MLA models (latent KV pool) yet")
    if custom and OVERRIDE_KEY in custom and active_impl() == "triton":
        why = triton_override_refusal(params, active_config(), active_is_mla())
        if why is not None:
            # refuse rather than silently decode with the server-wide settings
            raise ValueError(f"custom_params.{OVERRIDE_KEY}: {why}")


def triton_override_refusal(params: Any, config: Any, is_mla: bool) -> str | None:
    """Why the batched decode cannot serve a request's own setting (one line), or None: it
    serves the request-level settings (attention/mixed_settings.py) next to none of the
    server-wide features that keep per-row state in the kernels."""
    server_wide = [flag for flag, on in (
        ("--sparse-tier", config.tier != "off"),
        ("--sparse-guard-every", config.guard_every > 0),
        ("--sparse-locality-blocks", config.locality_blocks > 0),
        ("--sparse-block-filter async", config.block_filter == "async"),
        ("--sparse-cooperative", config.cooperative == "on"),
        ("an MLA model", is_mla),
    ) if on]
    if server_wide:
        return (f"per-request settings on --sparse-impl triton do not combine with "
                f"{server_wide[0]} (use --sparse-impl reference)")
    return unsupported_override(params, config.block_size)


def _sampling_params_type_error(obj: Any) -> str | None:
    """msgspec's message for a wrongly typed field of the request's sampling parameters."""
    import msgspec

    from sglang.srt.sampling.sampling_params import SamplingParams

    params = getattr(obj, "sampling_params", None)
    for one in params if isinstance(params, list) else [params]:
        if isinstance(one, dict):
            try:
                msgspec.convert(one, SamplingParams, strict=True)
            except msgspec.ValidationError as e:
                return str(e)
            except Exception:
                continue  # not a type error of msgspec's kind: SGLang's own error stands
    return None


def _around_tokenized_object(original: Any, manager: Any, obj: Any, *args: Any,
                             **kwargs: Any) -> Any:
    """A wrongly typed sampling parameter makes SamplingParams.__post_init__ raise TypeError (a
    500 and a traceback in the log); answer it with SGLang's 400 for bad values (ValueError)
    naming the field. Only requests that fail this way are affected."""
    try:
        return original(manager, obj, *args, **kwargs)
    except TypeError:
        why = _sampling_params_type_error(obj)
        if why is None:
            raise
        raise ValueError(f"invalid sampling_params: {why}") from None


HOOKS = (
    ("sglang.srt.sampling.sampling_params.SamplingParams.verify", _after_verify, "AFTER"),
    ("sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object",
     _around_tokenized_object, "AROUND"),
)
