"""The SGLang general plugin (entry point group ``sglang.srt.plugins``).

SGLang calls :func:`register` once in every process (main, scheduler), then applies the hooks.
"""

from __future__ import annotations

import logging
import pkgutil

from sglang_ext import runtime

logger = logging.getLogger(__name__)


def _patch_modules() -> list:
    from sglang_ext.patches import (
        attention_registry,
        cuda_graph,
        kv_cache_configurator,
        model_loader,
        paged_allocator,
        req_to_token_pool,
        sampling_params,
        scheduler,
        server_args,
        tokenizer_manager,
    )

    return [server_args, attention_registry, sampling_params, tokenizer_manager,
            req_to_token_pool, kv_cache_configurator, paged_allocator, model_loader, scheduler,
            cuda_graph]


def register() -> None:
    process = runtime.state()
    if process.plugin_registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_ext.attention import synthetic_kv

    modules = _patch_modules()
    for module in modules:
        for target, _hook, _kind in module.HOOKS:
            _assert_resolves(target)
    for module in modules:
        setup = getattr(module, "setup", None)
        if setup is not None:
            setup()
        for target, hook, kind in module.HOOKS:
            HookRegistry.register(target, hook, HookType[kind])
    synthetic_kv.install()  # benchmarks only: SGLANG_EXT_SYNTHETIC_KV=random
    process.plugin_registered = True


def hook_targets() -> list[str]:
    return [target for module in _patch_modules() for target, _, _ in module.HOOKS]


def _assert_resolves(target: str) -> None:
    """Fail start-up loudly: SGLang's HookRegistry only logs a target it cannot resolve, and a
    silently missing hook would serve with the wrong behaviour. SystemExit is not swallowed by
    the plugin loader's ``except Exception``."""
    module_path, _, attr = target.rpartition(".")
    try:
        owner = pkgutil.resolve_name(module_path)
        getattr(owner, attr)
    except (ImportError, AttributeError) as e:
        raise SystemExit(
            f"sglang_ext: hook target {target} does not resolve in this SGLang ({e}); "
            "sglang_ext needs sglang==0.5.16"
        ) from None
