"""KVCacheConfigurator: leave room for the sparse decode's side buffers, and with
``--sparse-tier`` on, size the logical KV space as GPU + host and build the tiered pool
(sglang_ext/memory_tier/tiered_pool.py).

The batched (CUDA) decode keeps, per layer, the page summaries (key min/max, ``2 D /
block_size`` values per token) and the label cache (``r`` values per token) beside the KV pool;
they are allocated after it, so ``_derive_pool_sizes`` shrinks SGLang's token count by their
share of the per-token bytes (unless ``--max-total-tokens`` fixes it): the pool plus our buffers
then take what SGLang profiled for the KV alone. With the tier they cover every logical token
(host-homed ones too), and the GPU-homed part gives up their room.

Three AROUND hooks; the rest is inert unless the tier is on:

* ``_derive_pool_sizes``: SGLang profiled ``D`` device KV slots; the tier splits them into
  GPU-homed slots ``G`` and its working area ``W`` and adds ``H`` host-homed slots, so the
  allocator, the scheduler's ``max_total_num_tokens`` and the invariant checker all see the
  logical capacity ``G + H`` (consistently: the allocator class is SGLang's own);
* ``_build_mha_kv_pool``: builds :class:`TieredKVPool` (``G + W`` device rows) instead of the
  plain pool, with every argument SGLang passes;
* ``_build_mla_kv_pool`` (MLA models' latent pool): builds :class:`TieredMLAKVPool` with the
  arguments that factory gives ``MLATokenToKVPool`` (it takes no pool class to swap in).

Sizes are per layout (selection/mla.py's ``kv_layout``): an MLA token is one latent row of
``R + P`` values per layer (one "kv head" on every rank, no separate V), an MHA token
``Hkv / tp`` heads of K and V.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from sglang_ext import runtime

logger = logging.getLogger(__name__)



def _tier_config(configurator: Any) -> Optional[Any]:
    from sglang_ext.patches.server_args import config_of, uses_sparse_backend

    server_args = configurator.server_args
    if not uses_sparse_backend(server_args):
        return None
    cfg = config_of(server_args)
    return cfg if cfg.tier != "off" else None


def summary_bytes(cfg: Any, kv_bytes: int) -> int:
    """Bytes per page-summary value: one with --sparse-summary-dtype fp8_e4m3, else the KV
    dtype's (float32 under an 8-bit KV: PageSummaries)."""
    if cfg.summary_dtype == "fp8_e4m3":
        return 1
    return kv_bytes if kv_bytes >= 2 else 4


def side_buffer_share(cfg: Any, head_dim: int, v_head_dim: int, kv_bytes: int,
                      label_cache: bool = True) -> float:
    """Bytes of the batched decode's side buffers per byte of KV, per token (with the tier:
    per logical token): page summaries (kmin + kmax, :func:`summary_bytes` per value), for
    methods that score tokens by label channels with a label config, the label cache (KV
    dtype, or one byte per channel with fp8 labels; ``label_cache=False``: the decode keeps
    none, e.g. the CPU reference), and with the locality constraint its page eviction scores
    (its per-row state is logged, not here).
    ``v_head_dim`` counts the value dims stored beside the key: 0 for an MLA pool, whose one
    row of R + P values per token is both (selection/mla.py's KVLayout)."""
    side = 2 * head_dim / cfg.block_size * summary_bytes(cfg, kv_bytes)
    if cfg.keeps_label_cache and label_cache:
        label_bytes = 1 if cfg.label_dtype == "fp8_e4m3" else kv_bytes
        side += min(cfg.label_channels, head_dim) * label_bytes
    if cfg.locality_blocks > 0:
        side += 2 * 4 / cfg.block_size  # locality: two float32 eviction-score values per page
    return side / ((head_dim + v_head_dim) * kv_bytes)


def _leave_room_for_side_buffers(self: Any, sizes: Any) -> Any:
    from sglang_ext.attention.sparse_backend import resolve_impl
    from sglang_ext.patches.server_args import config_of, uses_sparse_backend

    server_args = self.server_args
    if (not uses_sparse_backend(server_args) or getattr(self, "is_hybrid_swa", False)
            or server_args.max_total_tokens is not None):
        return sizes
    cfg = config_of(server_args)
    if cfg.tier != "off" or resolve_impl(cfg, server_args.device) != "triton":
        return sizes
    import msgspec

    from sglang_ext.selection.mla import kv_layout

    layout = kv_layout(self.model_config)
    kv_bytes = self.kv_cache_dtype.itemsize if hasattr(self.kv_cache_dtype, "itemsize") else 2
    share = side_buffer_share(cfg, layout.head_dim, layout.stored_v_dims, kv_bytes)
    page = server_args.page_size or 1
    tokens = int(sizes.max_total_num_tokens / (1.0 + share)) // page * page
    logger.info("sglang_ext: %d KV slots instead of %d leave room for the page summaries and "
                "label cache (%.1f%% of the KV bytes)", tokens, sizes.max_total_num_tokens,
                100 * share)
    return msgspec.structs.replace(sizes, max_total_num_tokens=tokens)


def host_tokens_per_rank(cfg: Any, bytes_per_token: int) -> int:
    """Host-tier tokens of this rank. ``--sparse-tier-host-gb`` is the server's total: every
    rank's process pins its share. The ranks agree on the smallest share (measured host memory
    differs between ranks that measure at different moments), so their logical capacities,
    which each rank's scheduler admits against, are equal."""
    from sglang_ext.config import tier_host_bytes
    from sglang_ext.tensor_parallel import agree_min, world_size

    [tokens] = agree_min([tier_host_bytes(cfg) // world_size() // bytes_per_token])
    return tokens


def _around_derive_pool_sizes(original: Callable, self: Any, *, config: Any) -> Any:
    sizes = original(self, config=config)
    cfg = _tier_config(self)
    if cfg is None:
        return _leave_room_for_side_buffers(self, sizes)
    import msgspec

    from sglang_ext.attention.request_overrides import selection_params
    from sglang_ext.attention.sparse_backend import resolve_impl
    from sglang_ext.kernels.sparse_decode import selection_sizes
    from sglang_ext.memory_tier.tiered_pool import plan_layout
    from sglang_ext.selection.mla import is_mla_model, kv_layout

    mc = self.model_config
    from sglang.srt.mem_cache.kv_cache_configurator import get_parallel

    layout = kv_layout(mc)
    # An MLA latent row is replicated on every TP rank; MHA kv heads are split among them.
    heads = 1 if is_mla_model(mc) else mc.get_num_kv_heads(get_parallel().attn_tp_size)
    row_dims = layout.head_dim + layout.stored_v_dims
    layers = self.layer_info.num_effective_layers
    elem = self.kv_cache_dtype.itemsize if hasattr(self.kv_cache_dtype, "itemsize") else 2
    bytes_per_token = layers * heads * row_dims * elem
    host_tokens = host_tokens_per_rank(cfg, bytes_per_token)
    params = selection_params(cfg)
    k_blocks = selection_sizes(params).k_blocks
    server_args = self.server_args
    batch_tokens = max(server_args.max_prefill_tokens or 0, server_args.chunked_prefill_size or 0)
    max_prefill = mc.context_len + batch_tokens
    try:
        layout_planned = plan_layout(
            device_tokens=sizes.max_total_num_tokens, host_tokens=host_tokens,
            page_size=cfg.block_size, max_running_requests=sizes.max_running_requests,
            max_prefill_tokens=max_prefill, num_slots=max(k_blocks, 1), sink=cfg.sink,
            window=cfg.window,
            # the side buffers of every logical token, host-homed ones included
            side_tokens_per_token=side_buffer_share(
                cfg, layout.head_dim, layout.stored_v_dims, elem,
                label_cache=resolve_impl(cfg, server_args.device) == "triton"),
            gpu_tokens=cfg.tier_gpu_tokens, layers=layers,
        )
    except ValueError as e:
        raise SystemExit(f"sglang_ext: {e}") from None
    runtime.state().tier_layout = layout_planned  # what the pool builders below read
    logger.info("sglang_ext CPU tier: %s (SGLang profiled %d device slots)",
                layout_planned.describe(), sizes.max_total_num_tokens)
    return msgspec.structs.replace(sizes, max_total_num_tokens=layout_planned.logical_tokens)


def _around_build_mha_kv_pool(original: Callable, self: Any, *, max_total_num_tokens: int,
                              mha_pool_class: type, quant_method: Any = None) -> Any:
    cfg = _tier_config(self)
    layout = runtime.state().tier_layout
    if cfg is None or layout is None:
        return original(self, max_total_num_tokens=max_total_num_tokens,
                        mha_pool_class=mha_pool_class, quant_method=quant_method)
    from sglang_ext.memory_tier.tiered_pool import TieredKVPool

    def build(_logical_size: int, **kwargs: Any) -> TieredKVPool:
        return TieredKVPool(layout=layout, mode=cfg.tier, timing=cfg.tier_timing == "on",
                            sync_steps=cfg.tier_sync_steps,
                            attend_resident=cfg.tier_async_attend == "resident", **kwargs)

    return original(self, max_total_num_tokens=max_total_num_tokens,
                    mha_pool_class=build, quant_method=quant_method)


def _around_build_mla_kv_pool(original: Callable, self: Any, *,
                              max_total_num_tokens: int) -> Any:
    cfg = _tier_config(self)
    layout = runtime.state().tier_layout
    if cfg is None or layout is None:
        return original(self, max_total_num_tokens=max_total_num_tokens)
    from sglang_ext.memory_tier.tiered_pool import TieredMLAKVPool

    # SGLang's factory builds MLATokenToKVPool itself; these are the arguments it passes.
    mc = self.model_config
    return TieredMLAKVPool(
        page_size=self.server_args.page_size, dtype=self.kv_cache_dtype,
        kv_lora_rank=mc.kv_lora_rank, qk_rope_head_dim=mc.qk_rope_head_dim,
        layer_num=self.layer_info.num_effective_layers, device=self.device,
        enable_memory_saver=self.server_args.enable_memory_saver,
        start_layer=self.layer_info.start_layer, end_layer=self.layer_info.end_layer,
        layout=layout, mode=cfg.tier, timing=cfg.tier_timing == "on",
        sync_steps=cfg.tier_sync_steps, attend_resident=cfg.tier_async_attend == "resident",
    )


HOOKS = (
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._derive_pool_sizes",
     _around_derive_pool_sizes, "AROUND"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool",
     _around_build_mha_kv_pool, "AROUND"),
    ("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mla_kv_pool",
     _around_build_mla_kv_pool, "AROUND"),
)
