"""The batched decode (``--sparse-impl triton``): static-shape kernels, captured in SGLang's decode
CUDA graph.

:class:`KernelDecoder` owns what lives beside SGLang's KV pool for it (page summaries, the label
cache, the kernels' workspaces) and the features the configuration enables; once per step it
builds a :class:`KernelDecodePlan`, whose ``run`` each layer calls.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from torch import Tensor

from sglang_ext.attention import request_overrides
from sglang_ext.attention.decode_plan import (
    DecodeContext,
    DecodeFeature,
    LayerStep,
    decode_rows,
    kv_read_scales,
    kv_write_scales,
    write_kv,
)
from sglang_ext.attention.features.guard import KernelGuard, guard_policy
from sglang_ext.attention.mixed_settings import MixedSettingsDecode, RowGroup, group_rows
from sglang_ext.attention.side_buffers import PageSummaries, allocate_label_cache
from sglang_ext.kernels.sparse_decode import (
    LayerCache,
    SelectionInputs,
    SparseDecodeWorkspace,
    sparse_decode_batched,
)
from sglang_ext.selection.guard import widened

logger = logging.getLogger(__name__)
TOPK_RADIX_BITS_ENV = "SGLANG_EXT_TOPK_RADIX_BITS"


def topk_radix_bits_override() -> Optional[tuple[int, int]]:
    """``SGLANG_EXT_TOPK_RADIX_BITS=BLOCK,TOKEN`` (each 5..8): the digit widths of the block and
    the token top-k instead of the measured defaults (kernels/sparse_decode.py, e.g. ``8,8`` for
    rows of tied scores); unset: None. A bad value stops start-up in one line."""
    text = os.environ.get(TOPK_RADIX_BITS_ENV, "")
    if not text:
        return None
    try:
        bits = tuple(int(x) for x in text.split(","))
    except ValueError:
        bits = ()
    if len(bits) != 2 or not all(5 <= b <= 8 for b in bits):
        raise SystemExit(f"sglang_ext: {TOPK_RADIX_BITS_ENV}={text!r} is not BLOCK,TOKEN digit "
                         "widths, each in 5..8")
    return bits  # type: ignore[return-value]


def fused_write_pool(ctx: DecodeContext) -> bool:
    """Whether decode may write its KV with kernels/decode_write.py instead of the pool's
    set_kv_buffer: SGLang's own token-major MHA pool (not the CPU tier's, an MLA latent pool,
    the head-major or vectorised layouts, a quantised FP4 cache).
    ``SGLANG_EXT_FUSED_KV_WRITE=0`` turns it off (the unfused path, e.g. to compare)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = ctx.token_to_kv_pool
    return (os.environ.get("SGLANG_EXT_FUSED_KV_WRITE", "1") != "0"
            and ctx.tiered is None and ctx.kv_lora_rank is None
            and type(pool) is MHATokenToKVPool
            and getattr(pool, "kv_cache_layout", "nhd") == "nhd"
            and not getattr(pool, "use_hnd", False)
            and not getattr(pool, "is_quantized_kv_cache", False))


class KernelDecoder:
    needs_cpu_seq_lens = False  # the kernels read lengths on the device: no per-step copy

    def __init__(self, ctx: DecodeContext) -> None:
        config = ctx.config
        if ctx.page_size != config.block_size:
            raise ValueError(
                f"--sparse-impl triton needs --page-size == --sparse-block-size "
                f"(got {ctx.page_size} and {config.block_size})"
            )
        self.ctx = ctx
        self.summaries = PageSummaries.allocate(ctx.token_to_kv_pool, ctx.page_size, ctx.device,
                                                config.summary_dtype)
        self.labels: Optional[list[Tensor]] = None
        if ctx.files.label_channels is not None and config.keeps_label_cache:
            self.labels = allocate_label_cache(ctx.token_to_kv_pool, ctx.files.label_channels,
                                               config.label_dtype, ctx.page_size, ctx.device)
        self.kernel_params = ctx.default_params
        self.topk_radix_bits = topk_radix_bits_override()
        self._workspaces: list[SparseDecodeWorkspace] = []
        self._mixed: Optional[MixedSettingsDecode] = None
        self.features = self._build_features()
        self._fused_write: Optional[bool] = None  # decided at the first decode step

    def _build_features(self) -> list[DecodeFeature]:
        """The features the configuration enables, in the order their layer hooks run."""
        ctx, config = self.ctx, self.ctx.config
        features: list[DecodeFeature] = []
        policy = guard_policy(config)
        if policy is not None:
            # per-request budgets up to the maximum: the workspace is sized for that
            self.kernel_params = widened(ctx.default_params, policy.max_budget)
        if config.block_filter == "async":
            from sglang_ext.attention.features.async_filter import KernelAsyncFilter

            features.append(KernelAsyncFilter(self))
        if policy is not None:
            features.append(KernelGuard(ctx, policy))
        locality = None
        if config.locality_blocks > 0:
            from sglang_ext.attention.features.locality import KernelLocality

            locality = KernelLocality(ctx)
            features.append(locality)
        if ctx.tiered is not None:
            from sglang_ext.attention.features.tier import TierDriver

            tier = TierDriver(ctx)
            features.append(tier)
            if config.cooperative == "on":
                from sglang_ext.attention.features.cooperative import (
                    KernelCooperative,
                    build_cooperative_tier,
                )

                cooperative = build_cooperative_tier(ctx)
                tier.stats_sources.append(cooperative.read_stats)
                features.append(KernelCooperative(self, cooperative, locality))
        return features

    def feature(self, kind: type) -> Optional[Any]:
        """The enabled feature of this class, if any."""
        return next((f for f in self.features if isinstance(f, kind)), None)

    # ------------------------------------------------------------------ per batch

    def before_batch(self, forward_batch: Any) -> None:
        for feature in self.features:
            feature.before_batch(forward_batch)

    def plan(self, forward_batch: Any) -> "KernelDecodePlan":
        row_groups = None
        pool = self.ctx.req_to_token_pool
        if request_overrides.has_overriding_rows(pool):
            # rows with their own settings: an eager step in groups (mixed_settings)
            row_groups = group_rows(
                [request_overrides.lookup(pool, row, self.ctx.default_params)
                 for row in forward_batch.req_pool_indices.tolist()], self.ctx.device)
        return KernelDecodePlan(self, forward_batch, row_groups)

    def workspace(self, batch: int) -> SparseDecodeWorkspace:
        """Scratch that fits `batch`. Workspaces are never freed or replaced: captured CUDA
        graphs keep pointing at the one they were captured with, and eager batches larger than
        the graphs' maximum get a larger one of their own."""
        fitting = [ws for ws in self._workspaces if ws.max_batch >= batch]
        if fitting:
            return min(fitting, key=lambda ws: ws.max_batch)
        pool = self.ctx.token_to_kv_pool
        # [.., Hkv, Dv] with this rank's kv heads; MLA pools: one latent head, Dv = R
        _, num_kv_heads, head_dim_v = pool.get_value_buffer(pool.start_layer).shape
        workspace = SparseDecodeWorkspace(
            max_batch=batch, num_q_heads=self.ctx.num_q_heads, num_kv_heads=num_kv_heads,
            head_dim_v=head_dim_v, params=self.kernel_params, max_blocks=self.ctx.max_blocks,
            device=self.ctx.device, dtype=self.ctx.dtype, topk_radix_bits=self.topk_radix_bits,
        )
        self._workspaces.append(workspace)
        return workspace

    def mixed(self) -> MixedSettingsDecode:
        if self._mixed is None:
            pool = self.ctx.token_to_kv_pool
            _, num_kv_heads, head_dim_v = pool.get_value_buffer(pool.start_layer).shape
            self._mixed = MixedSettingsDecode(self.ctx.num_q_heads, num_kv_heads, head_dim_v,
                                              self.ctx.max_blocks, self.ctx.device,
                                              self.ctx.dtype, self.topk_radix_bits)
        return self._mixed

    # ------------------------------------------------------------------ per layer

    def layer_cache(self, layer: Any) -> LayerCache:
        index = self.ctx.layer_index(layer)
        pool = self.ctx.token_to_kv_pool
        k_scale, v_scale = kv_read_scales(layer)
        return LayerCache(
            k_buffer=pool.get_key_buffer(layer.layer_id),
            v_buffer=pool.get_value_buffer(layer.layer_id),
            kmin=self.summaries.kmin[index], kmax=self.summaries.kmax[index],
            channels=self.ctx.label_channels(layer.layer_id),
            labels=None if self.labels is None else self.labels[index],
            k_scale=k_scale, v_scale=v_scale)

    def extend_shortcut(self, *args: Any) -> Optional[Tensor]:
        return None  # extends run on the dense delegate

    def after_extend_layer(self, layer: Any, q: Tensor, k: Optional[Tensor],
                           v: Optional[Tensor], forward_batch: Any, save_kv_cache: bool) -> None:
        if self._wrote_kv(k, save_kv_cache):
            self.kv_written(layer, k, v, forward_batch.out_cache_loc)
        step = LayerStep(self.ctx.layer_index(layer),
                         q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                         self.layer_cache(layer), layer.scaling)
        for feature in self.features:
            feature.after_extend_layer(step, forward_batch)

    def _wrote_kv(self, k: Optional[Tensor], save_kv_cache: bool) -> bool:
        """Whether this layer's call wrote KV at out_cache_loc. MLA models write their latent
        rows themselves before an extend without a cached prefix (set_mla_kv_buffer, then
        attention with save_kv_cache=False); every other MLA call stores them itself."""
        return self.ctx.kv_lora_rank is not None or (save_kv_cache and k is not None)

    def kv_written(self, layer: Any, k: Optional[Tensor], v: Optional[Tensor],
                   loc: Tensor) -> None:
        """Fold the keys just written (prefill or decode) into their pages' min/max, store
        their label channels in the label cache, and tell the features."""
        ctx = self.ctx
        pool = ctx.token_to_kv_pool
        index = ctx.layer_index(layer)
        if ctx.kv_lora_rank is not None:
            # The rows stored: an MLA extend's k is then the per-head MHA key (qk_nope + rope
            # dims of each query head), not the latent row the pool holds. With the CPU tier
            # they are where the extend's attention reads them (the scratch, or GPU-homed rows).
            rows = loc if ctx.tiered is None else ctx.tiered.written_rows(loc, layer.layer_id)
            keys = pool.get_key_buffer(layer.layer_id).index_select(0, rows)
        else:
            keys = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
            kv_dtype = pool.get_key_buffer(layer.layer_id).dtype
            if kv_dtype.itemsize == 1 and keys.dtype != kv_dtype:
                # an fp8 KV cache: summarise (and label) the keys as stored, not before rounding,
                # so the Quest bound holds for what the attention reads
                keys = keys.to(kv_dtype).to(keys.dtype)
        self.summaries.update(index, keys, loc)
        if self.labels is not None:
            from sglang_ext.kernels.label_cache import update_label_cache

            update_label_cache(self.labels[index], keys, loc,
                               ctx.files.label_channels[layer.layer_id])
        values = None if v is None or ctx.kv_lora_rank is not None else \
            v.reshape(-1, layer.tp_k_head_num, layer.v_head_dim)
        for feature in self.features:
            feature.kv_written(index, keys, values, loc)

    def write_decode_kv(self, layer: Any, cache: LayerCache, k: Optional[Tensor],
                        v: Optional[Tensor], forward_batch: Any, save_kv_cache: bool) -> None:
        """This decode step's KV, page summaries and labels of one layer: in one launch
        (kernels/decode_write.py) where it writes exactly what set_kv_buffer and kv_written
        write, else SGLang's write and then kv_written."""
        loc = forward_batch.out_cache_loc
        if save_kv_cache and k is not None and v is not None:
            if self._write_fused(layer, cache, k, v, loc):
                return
            write_kv(self.ctx.token_to_kv_pool, layer, k, v, loc)
        if self._wrote_kv(k, save_kv_cache):
            self.kv_written(layer, k, v, loc)

    def _write_fused(self, layer: Any, cache: LayerCache, k: Tensor, v: Tensor,
                     loc: Tensor) -> bool:
        """False: nothing was written (the pool, a feature or the dtypes rule it out)."""
        if self._fused_write is None:
            self._fused_write = fused_write_pool(self.ctx) and not any(
                f.blocks_fused_write for f in self.features)
        if not self._fused_write:
            return False
        from sglang_ext.kernels.decode_write import fused_write_supported, write_decode_kv

        if not fused_write_supported(cache.k_buffer.dtype, k.dtype, cache.kmin.dtype,
                                     None if cache.labels is None else cache.labels.dtype):
            return False
        if kv_write_scales(layer) and None in (getattr(layer, "k_scale_float", None),
                                               getattr(layer, "v_scale_float", None)):
            return False  # scales only as tensors: set_kv_buffer divides by those
        write_decode_kv(
            k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim),
            v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim),
            loc, cache.k_buffer, cache.v_buffer, cache.kmin, cache.kmax,
            self.ctx.config.block_size, cache.labels,
            None if cache.labels is None else cache.channels,
            k_scale=cache.k_scale, v_scale=cache.v_scale)
        return True


class KernelDecodePlan:
    """One decode step of the batched decode: the batch's rows, the workspace, and either the
    features' pipeline or (rows with their own settings) the grouped eager decode."""

    def __init__(self, decoder: KernelDecoder, forward_batch: Any,
                 row_groups: Optional[list[RowGroup]]) -> None:
        self.decoder = decoder
        self.forward_batch = forward_batch
        self.rows = decode_rows(decoder.ctx.req_to_token, forward_batch)
        self.workspace = decoder.workspace(forward_batch.req_pool_indices.shape[0])
        self.row_groups = row_groups
        self.features = decoder.features
        self.needs_lse = any(f.needs_lse for f in self.features)
        self._layers_left = decoder.ctx.num_layers

    def run(self, layer: Any, q: Tensor, k: Optional[Tensor], v: Optional[Tensor],
            save_kv_cache: bool) -> Tensor:
        decoder = self.decoder
        cache = decoder.layer_cache(layer)
        decoder.write_decode_kv(layer, cache, k, v, self.forward_batch, save_kv_cache)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        step = LayerStep(decoder.ctx.layer_index(layer), q, cache, layer.scaling)
        if self.row_groups is not None:
            out = decoder.mixed().decode(self.row_groups, q, step.cache, self.rows, step.scaling)
        else:
            out = self._run_features(step, layer.v_head_dim)
        return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def _run_features(self, step: LayerStep, head_dim_v: int) -> Tensor:
        first, self._layers_left = self._layers_left == self.decoder.ctx.num_layers, \
            self._layers_left - 1
        if first:
            for feature in self.features:
                feature.start_layers(self)
        out = next((o for o in (f.decode_layer(self, step) for f in self.features)
                    if o is not None), None)
        if out is None:
            inputs: dict[str, Any] = {}
            for feature in self.features:
                inputs.update(feature.layer_inputs(self, step))
            q = step.q
            out = sparse_decode_batched(
                q, step.cache, self.rows, self.decoder.kernel_params, step.scaling,
                workspace=self.workspace, inputs=SelectionInputs(**inputs),
                return_lse=self.needs_lse,
                # a tensor of this layer's own: the workspace's output is shared by all layers
                out=q.new_empty((q.shape[0], q.shape[1], head_dim_v)))
            lse = None
            if self.needs_lse:
                out, lse = out
            for feature in self.features:
                feature.after_layer(self, step, lse)
        if self._layers_left == 0:
            for feature in self.features:
                feature.end_layers(self)
            # SGLang runs a captured step's layers several times from one plan (warm-up runs,
            # then the capture): each run starts and ends the step, or the graph misses both
            self._layers_left = self.decoder.ctx.num_layers
        return out
