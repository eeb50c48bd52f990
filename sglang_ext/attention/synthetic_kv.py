"""Synthetic KV for SGLang's decode-only benchmark mode (``SGLANG_EXT_SYNTHETIC_KV=random``).

SGLang measures a decode server alone with ``--disaggregation-mode decode
--disaggregation-transfer-backend fake`` and ``bench_serving --fake-prefill``: requests arrive
as if their KV had been transferred, but the fake transfer writes nothing, so every prompt
position decodes over whatever the pool holds. SGLang's pools start zeroed. Full attention
costs the same whatever it reads; our selection does not: zero keys give every block and token
the same score, and the radix top-k (kernels/topk.py) runs all of its passes on ties, which no
real prompt produces.

With ``SGLANG_EXT_SYNTHETIC_KV=random`` in the server's environment, the plugin installs a
benchmark hook (:func:`install`) that fills every
KV slot of every layer with seeded standard-normal keys and values once at start-up (as stored:
rounded to the cache's dtype), and builds their page summaries and label cache from those keys,
as a prefill would have. The selection then ranks keys with a real spread. For benchmarks only:
what the model generates over random KV means nothing; what a step costs is what it measures.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

ENV = "SGLANG_EXT_SYNTHETIC_KV"
MODES = ("off", "random")
SEED = 1234
# slots written per launch: [chunk, Hkv, D] bf16 keys and values (~0.5 GB at Qwen3-8B's 8 x 128)
CHUNK_TOKENS = 1 << 18


def synthetic_kv_mode() -> str:
    """The mode asked for in the environment (``off`` when unset); a bad value stops start-up."""
    mode = os.environ.get(ENV, "off") or "off"
    if mode not in MODES:
        raise SystemExit(f"sglang_ext: {ENV}={mode!r} is not one of {', '.join(MODES)}")
    return mode


def install() -> None:
    """The benchmark hook (plugin.py, every process): with ``SGLANG_EXT_SYNTHETIC_KV=random``,
    fill each sparse backend's pool once it is built. A bad value stops start-up."""
    if synthetic_kv_mode() == "random":
        from sglang_ext import runtime

        listeners = runtime.state().backend_listeners
        if fill_synthetic_kv not in listeners:
            listeners.append(fill_synthetic_kv)


def unsupported_reason(backend: Any) -> str | None:
    """Why this backend's pool cannot be filled (None: it can)."""
    ctx = backend.ctx
    if ctx.tiered is not None:
        return "the CPU tier (--sparse-tier)"
    if ctx.kv_lora_rank is not None:
        return "MLA models (a latent KV pool)"
    if ctx.config.locality_blocks > 0:
        return "the locality constraint (its page eviction scores)"
    return None


@torch.no_grad()
def fill_synthetic_kv(backend: Any, seed: int = SEED, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Fill every slot of the backend's KV pool with random keys and values, and fold the keys
    into its page summaries and label cache (when it keeps them). Returns the slots filled per
    layer. Chunks start on page boundaries, so each page's summary is rebuilt from its keys."""
    from sglang_ext.kernels.label_cache import update_label_cache

    reason = unsupported_reason(backend)
    if reason is not None:
        raise ValueError(f"sglang_ext: {ENV}=random does not support {reason}")
    pool = backend.token_to_kv_pool
    page = backend.config.block_size
    # the batched decode's side buffers (the reference decode keeps none)
    summaries = getattr(backend.decoder, "summaries", None)
    labels = getattr(backend.decoder, "labels", None)
    chunk_tokens = max(page, chunk_tokens // page * page)
    generator = torch.Generator(device=backend.device).manual_seed(seed)
    dtype = torch.bfloat16 if backend.model_runner.dtype == torch.bfloat16 else torch.float16
    num_slots = 0
    for layer_id in range(pool.start_layer, pool.start_layer + pool.layer_num):
        k_buf, v_buf = pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id)
        num_slots = k_buf.shape[0]
        index = layer_id - pool.start_layer
        for start in range(0, num_slots, chunk_tokens):
            end = min(num_slots, start + chunk_tokens)
            shape = (end - start, *k_buf.shape[1:])
            # drawn in the model's dtype, stored in the cache's; summarised as stored
            keys = torch.randn(shape, generator=generator, device=backend.device, dtype=dtype)
            values = torch.randn((end - start, *v_buf.shape[1:]), generator=generator,
                                 device=backend.device, dtype=dtype)
            k_buf[start:end].copy_(keys)
            v_buf[start:end].copy_(values)
            if summaries is None and labels is None:
                continue
            stored = k_buf[start:end].to(dtype)
            loc = torch.arange(start, end, device=backend.device, dtype=torch.int64)
            if summaries is not None:
                summaries.update(index, stored, loc)
            if labels is not None:
                update_label_cache(labels[index], stored, loc,
                                   backend.ctx.files.label_channels[layer_id])
    if torch.device(backend.device).type == "cuda":
        torch.cuda.empty_cache()  # the chunks' transient GBs go back before CUDA graphs capture
    logger.info("sglang_ext: %s=random filled %d KV slots x %d layers with random keys and "
                "values (their page summaries and labels too): a decode-only benchmark's KV",
                ENV, num_slots, pool.layer_num)
    return num_slots
