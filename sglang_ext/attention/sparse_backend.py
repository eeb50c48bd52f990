"""``sglang_ext``: SGLang attention backend with two-level sparse decode.

Prefill/extend is dense and delegated to one of SGLang's own backends (the "dense delegate");
decode selects, per request and kv head, the tokens to attend (quest / ds / two_level) and
attends over them only. Contexts within the budget decode densely, computed exactly as SGLang's
torch_native backend does, so that a budget ≥ context reproduces SGLang token for token.

Two decode implementations (``--sparse-impl``):

* ``reference`` (the CPU default): plain torch, one request at a time, block summaries recomputed
  from the keys every step; honours per-request overrides. Not capturable in a CUDA graph.
* ``triton`` (the CUDA default): the batched, static-shape kernels of ``sglang_ext.kernels``;
  block summaries are kept per KV page (page size = block size) and updated as KV is written,
  in prefill and decode; captured in SGLang's decode CUDA graph. Uses the server-wide settings.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_ext.attention import request_overrides
from sglang_ext.attention.mixed_settings import MixedSettingsDecode, RowGroup, group_rows
from sglang_ext.attention.request_overrides import RequestSparsity
from sglang_ext.config import SparseConfig
from sglang_ext.memory_tier.tiered_pool import TieredPool
from sglang_ext.selection import select_token_mask, sparse_attention
from sglang_ext.selection.calibrate import load_label_config
from sglang_ext.selection.guard import (
    GuardPolicy,
    RequestGuard,
    next_budget,
    row_top_k,
    selection_recall,
    widened,
)
from sglang_ext.selection.mla import kv_layout, mla_config, mla_unsupported, pool_kv_lora_rank
from sglang_ext.selection.params import SelectionParams, summary_storage_dtype
from sglang_ext.selection.reference import BatchedSparseDecode
from sglang_ext.tensor_parallel import attn_tp, rank_kv_heads

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# decode steps between two log lines of the CPU tier's counters (benchmarks log more often)
TIER_LOG_EVERY = int(os.environ.get("SGLANG_EXT_TIER_LOG_EVERY", "256"))
# decode steps between two refreshes of the tier's /metrics counters (each reads the device)
TIER_METRICS_EVERY = int(os.environ.get("SGLANG_EXT_TIER_METRICS_EVERY", "32"))
LOCALITY_LOG_EVERY = 512  # (request, layer) selections between two locality log lines
LOCALITY_READ_EVERY = 64  # decode steps between two reads of the CUDA locality γ counters
GUARD_REPORT_EVERY = 128  # decode steps between two reads of the CUDA guard's counters
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


def _kv_write_scales(layer: Any) -> tuple[Any, ...]:
    """The layer's (k_scale, v_scale) for ``set_kv_buffer`` where it has any (a checkpoint's
    fp8 KV scales), else nothing: the pool's plain cast."""
    k_scale, v_scale = getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
    return () if k_scale is None and v_scale is None else (k_scale, v_scale)


def _kv_read_scales(layer: Any) -> tuple[float, float]:
    """A layer's (k_scale, v_scale) as floats (``RadixAttention.k_scale_float``), 1.0 where the
    checkpoint has none."""
    scales = (getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None))
    return tuple(1.0 if x is None else float(x) for x in scales)  # type: ignore[return-value]


def fused_write_pool(backend: Any) -> bool:
    """Whether a backend's decode may write its KV with kernels/decode_write.py instead of
    the pool's set_kv_buffer: the batched decode over SGLang's own token-major MHA pool (not
    the CPU tier's, an MLA latent pool, the head-major or vectorised layouts, a quantised FP4
    cache), without the locality constraint (which folds eviction scores of the same keys).
    ``SGLANG_EXT_FUSED_KV_WRITE=0`` turns it off (the unfused path, e.g. to compare)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = backend.token_to_kv_pool
    return (os.environ.get("SGLANG_EXT_FUSED_KV_WRITE", "1") != "0"
            and backend.impl == "triton" and backend.tiered is None
            and backend.kv_lora_rank is None and backend.locality is None
            and type(pool) is MHATokenToKVPool
            and getattr(pool, "kv_cache_layout", "nhd") == "nhd"
            and not getattr(pool, "use_hnd", False)
            and not getattr(pool, "is_quantized_kv_cache", False))


@dataclass
class PageSummaries:
    """Per-layer running key min/max of every KV page (the Quest block summaries).

    Kept in the KV dtype when it is bf16/fp16 (exact for keys of that dtype, half the bytes of
    float32 for the decode step to read), float32 otherwise (e.g. an fp8 KV cache), or in fp8
    rounded outward with --sparse-summary-dtype fp8_e4m3 (``summary_storage_dtype``)."""

    kmin: list[torch.Tensor]  # per layer: [num_pages, Hkv, D], see summary_dtype
    kmax: list[torch.Tensor]
    page_size: int

    @classmethod
    def allocate(cls, pool: Any, page_size: int, device: Any,
                 summary_dtype: str = "auto") -> "PageSummaries":
        from sglang_ext.kernels.block_summary import allocate_block_summaries

        k0 = pool.get_key_buffer(pool.start_layer)
        dtype = summary_storage_dtype(summary_dtype, k0.dtype)
        # Summaries are keyed by logical page: with the CPU tier that is more than the device.
        num_slots = getattr(pool, "logical_size", k0.shape[0] - page_size) + page_size
        kmin, kmax = [], []
        for _ in range(pool.layer_num):
            lo, hi = allocate_block_summaries(
                num_slots, k0.shape[1], k0.shape[2], page_size, device, dtype=dtype
            )
            kmin.append(lo)
            kmax.append(hi)
        return cls(kmin, kmax, page_size)

    def update(self, layer_index: int, k: torch.Tensor, loc: torch.Tensor) -> None:
        from sglang_ext.kernels.block_summary import update_block_summaries

        update_block_summaries(self.kmin[layer_index], self.kmax[layer_index], k, loc, self.page_size)


@dataclass
class DecodeMetadata:
    """Host-side view of one decode batch, built once per step and shared by all layers."""

    req_pool_indices: list[int]
    seq_lens: list[int]
    sparsity: list[RequestSparsity]  # per request: its selection params, None = dense
    # Accuracy guard (reference decode): per request, its guard when it probes this step.
    guards: Optional[list[Optional[RequestGuard]]] = None
    # The sparse requests' batched selection (index work shared by all layers), built lazily.
    sparse_plan: Optional[tuple[torch.Tensor, BatchedSparseDecode]] = None


class SparseDecodeBackend(AttentionBackend):
    """Dense extend via a delegate backend; sparse decode via the reference selection."""

    def __init__(self, model_runner: ModelRunner, config: SparseConfig) -> None:
        super().__init__()
        self.model_runner = model_runner
        self.config = config
        self.device = model_runner.device
        self.impl = resolve_impl(config, self.device)
        # The reference path loops over requests on the host; the kernels never need host
        # lengths, which keeps the overlap scheduler free of a per-step device->host copy.
        self.needs_cpu_seq_lens = self.impl == "reference"
        # SGLang reads the pools from the active backend (forward_context), so expose them.
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        # MLA pools (selection/mla.py): one latent row [R + P] per token, V its [:R] view.
        self.kv_lora_rank = pool_kv_lora_rank(self.token_to_kv_pool)
        if self.kv_lora_rank is not None:
            config = self.config = mla_config(config)
        if self.kv_lora_rank is not None and mla_unsupported(config):
            raise ValueError(f"sglang_ext: {mla_unsupported(config)[0][1]} does not support MLA "
                             "models (latent KV pool) yet")
        self._dense: Optional[AttentionBackend] = None
        self.decode_metadata: Optional[DecodeMetadata] = None
        self.row_groups: Optional[list[RowGroup]] = None  # a step's rows by setting, if mixed
        self._mixed: Optional[MixedSettingsDecode] = None
        self.default_params = request_overrides.selection_params(config)
        # The accuracy guard (--sparse-guard-every): per-request budgets between the configured
        # one and its maximum; the batched kernels run in a workspace sized for the maximum.
        self.guard: Optional[GuardPolicy] = None
        self.kernel_params = self.default_params
        self._guard_totals = [0, 0, 0]  # probes, raised, lowered
        self._guard_steps = 0
        self._guard_metrics = None
        if config.guard_every > 0:
            self.guard = GuardPolicy(config.guard_every, config.guard_recall, config.budget,
                                     config.effective_guard_max_budget)
            self.kernel_params = widened(self.default_params, self.guard.max_budget)
            if getattr(getattr(model_runner, "server_args", None), "enable_metrics", False):
                from sglang_ext.selection.guard import GuardMetrics

                self._guard_metrics = GuardMetrics()
        self.label_channels = self._load_label_channels(model_runner, config)
        # [num_layers, this rank's kv heads] True where a kv head streams (--sparse-head-policy)
        self.streaming_heads = self._load_head_policy(model_runner, config)
        self.summaries: Optional[PageSummaries] = None
        self.labels: Optional[list[torch.Tensor]] = None  # per layer, see _allocate_label_cache
        # whether decode writes KV, summaries and labels in one launch (fused_write_pool;
        # decided at the first decode step, once the pool and the side buffers exist)
        self._fused_write_pool: Optional[bool] = None
        self._topk_radix_bits = topk_radix_bits_override()
        self._workspaces: list[Any] = []
        # The CPU tier (--sparse-tier): KV addressed through its pool's homes and page maps.
        self.tiered: Optional[TieredPool] = (
            self.token_to_kv_pool if isinstance(self.token_to_kv_pool, TieredPool) else None
        )
        self._tier_verify = self.tiered is not None and self.tiered.verify >= 2
        self._tier_steps = 0
        self._locality_steps = 0
        self._locality_metrics = None
        # NOSA's locality constraint in the batched decode (kernels/locality.py): device state
        # by request row and KV page, and the γ counters read every LOCALITY_READ_EVERY steps.
        self.locality: Optional[Any] = None
        self._locality_heads: Optional[list[Any]] = None
        self._locality_kernel_steps = 0
        self._locality_log_totals = [0.0, 0, float("inf")]
        # NOSA's trained eviction heads (--sparse-eviction-head), this rank's kv heads.
        self.eviction_heads = self._load_eviction_heads(model_runner, config)
        # Any request may ask for the locality constraint (custom_params), so always export it.
        if getattr(getattr(model_runner, "server_args", None), "enable_metrics", False):
            from sglang_ext.selection.locality import LocalityMetrics

            self._locality_metrics = LocalityMetrics()
        self._tier_metrics = None
        # K + V bytes of one (layer, kv head) block the tier moves
        self._tier_page_bytes = self.tiered.tier_page_bytes if self.tiered is not None else 0
        if self.tiered is not None and getattr(model_runner.server_args, "enable_metrics", False):
            from sglang_ext.memory_tier.metrics import TierMetrics

            self._tier_metrics = self.tiered.metrics = TierMetrics(
                page_bytes=self._tier_page_bytes, every=TIER_METRICS_EVERY)
        if self.tiered is not None:
            self.tiered.bind(self.req_to_token_pool.req_to_token)
            self.needs_cpu_seq_lens = True  # host-side lengths start a request's decoding
        # Fluxion's cooperative attention (--sparse-cooperative): CPU workers attend some of a
        # sync-tier step's misses from host memory (memory_tier/cooperative_decode.py).
        self.cooperative: Optional[Any] = None
        if self.tiered is not None and config.cooperative == "on":
            self.cooperative = self._build_cooperative()
        if self.impl == "triton":
            page_size = model_runner.server_args.page_size
            if page_size != config.block_size:
                raise ValueError(
                    f"--sparse-impl triton needs --page-size == --sparse-block-size "
                    f"(got {page_size} and {config.block_size})"
                )
            self.summaries = PageSummaries.allocate(self.token_to_kv_pool, page_size, self.device,
                                                    config.summary_dtype)
            self.labels = self._allocate_label_cache()
            if self.guard is not None:
                self._allocate_guard_state()
            if config.locality_blocks > 0:
                self._allocate_locality_state()
        # AsyncTLS's block filter one step ahead (--sparse-block-filter async, or per request
        # on the reference decode): on a side stream in the batched decode, from each row's
        # previous queries in the reference one.
        # (MLA pools refuse it with the other settings they lack: mla_unsupported, above.)
        from sglang_ext.attention.async_block_filter import PreviousQueries

        self.block_filter: Optional[Any] = None
        self.previous_queries = PreviousQueries()
        if config.block_filter == "async" and self.impl == "triton":
            self._allocate_block_filter()
        # decode-only benchmarks (attention/synthetic_kv.py): KV that the fake transfer never wrote
        from sglang_ext.attention.synthetic_kv import fill_synthetic_kv, synthetic_kv_mode

        if synthetic_kv_mode() == "random":
            fill_synthetic_kv(self)

    # ------------------------------------------------------------------ set-up

    def _build_cooperative(self) -> Any:
        from sglang_ext.config import cooperative_worker_threads
        from sglang_ext.memory_tier.cooperative_decode import CooperativeTier

        pool = self.tiered
        threads = cooperative_worker_threads(self.config)
        logger.info("sglang_ext cooperative attention: %d CPU worker threads", threads)
        return CooperativeTier(pool.host, pool.layout.gpu_tokens, pool.layout.page_size, threads)

    def _allocate_label_cache(self) -> Optional[list[torch.Tensor]]:
        """The label channels of every key, per layer (kernels/label_cache.py), for methods
        that score tokens by label channels: the token scoring then reads r contiguous values
        per key instead of gathering them from the key rows (r/D of the key cache's memory);
        see SparseConfig.keeps_label_cache for when."""
        if self.label_channels is None or not self.config.keeps_label_cache:
            return None
        from sglang_ext.kernels.label_cache import allocate_label_cache
        from sglang_ext.selection.params import label_storage_dtype

        pool = self.token_to_kv_pool
        k0 = pool.get_key_buffer(pool.start_layer)
        r = self.label_channels.shape[-1]
        dtype = label_storage_dtype(self.config.label_dtype, k0.dtype)
        labels = [allocate_label_cache(k0.shape[0], k0.shape[1], r, self.device, dtype)
                  for _ in range(pool.layer_num)]
        logger.info("sglang_ext label cache: %d channels of %d in %s, %.2f GiB", r, k0.shape[2],
                    str(dtype).removeprefix("torch."),
                    sum(t.numel() * t.element_size() for t in labels) / 2**30)
        return labels

    def _allocate_guard_state(self) -> None:
        """Device state of the guard for the batched decode: every row's budget, the probe
        control (probe?, kv head) filled before each step, counters, the probe's buffers."""
        from sglang_ext.kernels.guard_probe import GuardProbe

        req_to_token = self.req_to_token_pool.req_to_token
        rows = req_to_token.shape[0]
        pool = self.token_to_kv_pool
        dev = self.device
        self._guard_budget = torch.full((rows,), self.guard.base_budget, dtype=torch.int32,
                                        device=dev)
        self._guard_streak = torch.zeros(rows, dtype=torch.int32, device=dev)
        self._guard_ctrl = torch.zeros(2, dtype=torch.int32, device=dev)
        self._guard_counts = torch.zeros(3, dtype=torch.int64, device=dev)
        self._guard_row_ks: Any = None
        self._guard_probe = GuardProbe(
            max_batch=rows, num_q_heads=self._rank_q_heads(), num_kv_heads=pool.head_num,
            head_dim=pool.get_key_buffer(pool.start_layer).shape[-1],
            min_len=self.guard.max_budget, max_context=req_to_token.shape[1], device=dev,
        )

    def _allocate_block_filter(self) -> None:
        from sglang_ext.attention.async_block_filter import AsyncBlockFilter

        pool = self.token_to_kv_pool
        _, num_kv_heads, head_dim = pool.get_key_buffer(pool.start_layer).shape
        rows = self.req_to_token_pool.req_to_token.shape[0]
        # Sized for every request row: a decode batch never holds more requests than rows.
        self.block_filter = AsyncBlockFilter(
            num_layers=pool.end_layer - pool.start_layer, rows=rows, num_kv_heads=num_kv_heads,
            k_blocks=self._ensure_workspace(1).k_blocks, max_batch=rows,
            num_q_heads=self._rank_q_heads(), head_dim=head_dim, device=self.device,
            dtype=self.model_runner.dtype)
        logger.info("sglang_ext: asynchronous block filter on (%d blocks per kv head chosen a "
                    "step ahead on a side stream), %.1f MiB of device state",
                    self.block_filter.k_blocks, self.block_filter.nbytes() / 2**20)

    def _select_blocks(self, layer_index: int, forward_batch: ForwardBatch, batch: int) -> Any:
        """The layer's block filter for the batch: (q [B, Hq, D], table [rows, Hkv, k]) ->
        each request's blocks written into its row of the table."""
        from sglang_ext.kernels.sparse_decode import select_blocks_batched

        args = (self.summaries.kmin[layer_index], self.summaries.kmax[layer_index],
                self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices,
                forward_batch.seq_lens, self.kernel_params, self._ensure_workspace(batch))
        return lambda q, table: select_blocks_batched(q, *args, out_table=table)

    def _allocate_locality_state(self) -> None:
        """Device state of the locality constraint for the batched decode: per request row the
        kept sets, the seen watermark and the γ bitmaps; per KV page (logical, like the page
        summaries) the eviction scores; for ``learned`` each layer's eviction-head tensors."""
        from sglang_ext.kernels.locality import LocalityKernelState, eviction_head_tensors

        pool = self.token_to_kv_pool
        req_to_token = self.req_to_token_pool.req_to_token
        bs = self.config.block_size
        k0 = pool.get_key_buffer(pool.start_layer)
        self.locality = LocalityKernelState(
            num_layers=pool.layer_num, rows=req_to_token.shape[0], num_kv_heads=pool.head_num,
            k_e=self.config.locality_blocks, max_blocks=-(-req_to_token.shape[1] // bs),
            num_slots=getattr(pool, "logical_size", k0.shape[0] - bs) + bs, page_size=bs,
            device=self.device, limit_new_blocks=self.config.locality_new_blocks > 0,
        )
        if self.config.eviction_score == "learned":
            self._locality_heads = [
                eviction_head_tensors(self.eviction_heads, pool.start_layer + i)
                for i in range(pool.layer_num)
            ]
        logger.info("sglang_ext locality: k_e=%d blocks, %s score, at most %s new filter blocks "
                    "per step, %.2f GiB of device state", self.config.locality_blocks,
                    self.config.eviction_score, self.config.locality_new_blocks or "any",
                    self.locality.nbytes() / 2**30)

    def _locality_report(self) -> None:
        """Batched decode: now and then read the γ counters (a host sync), export them, and
        log their running summary."""
        self._locality_kernel_steps += 1
        if self._locality_kernel_steps % LOCALITY_READ_EVERY:
            return
        total, count, minimum = self.locality.take_gamma_stats()
        if count == 0:
            return
        if self._locality_metrics is not None:
            self._locality_metrics.observe_many(total, count, minimum)
        log = self._locality_log_totals
        log[0] += total
        log[1] += count
        log[2] = min(log[2], minimum)
        if log[1] >= LOCALITY_LOG_EVERY:
            logger.info("sglang_ext locality: %d selections gamma mean %.3f min %.3f (k_e=%d)",
                        log[1], log[0] / log[1], log[2], self.config.locality_blocks)
            self._locality_log_totals = [0.0, 0, float("inf")]

    def _rank_q_heads(self) -> int:
        """Query heads this rank computes (all of them without --tp)."""
        return self.model_runner.model_config.num_attention_heads // attn_tp().size

    @staticmethod
    def _load_label_channels(
        model_runner: ModelRunner, config: SparseConfig
    ) -> Optional[torch.Tensor]:
        """[num_layers, this rank's kv heads, r] channel ids for token scores, or None (all
        channels). The file covers the model's every kv head; under --tp a rank keeps its own."""
        if config.label_config is None:
            return None
        mc = model_runner.model_config
        layout = kv_layout(mc)
        total_heads = layout.num_kv_heads
        channels = load_label_config(
            config.label_config,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=total_heads,
            head_dim=layout.head_dim,
        )
        if config.label_channels > channels.shape[-1]:
            raise ValueError(
                f"--sparse-label-channels {config.label_channels} exceeds the "
                f"{channels.shape[-1]} channels calibrated in {config.label_config}"
            )
        tp = attn_tp()
        heads = rank_kv_heads(total_heads, tp.size, tp.rank)
        return channels[:, heads.start:heads.stop, : config.label_channels].to(model_runner.device)

    @staticmethod
    def _load_head_policy(model_runner: ModelRunner, config: SparseConfig) -> Optional[torch.Tensor]:
        if config.head_policy is None:
            return None
        from sglang_ext.selection.head_policy import load_head_policy

        mc = model_runner.model_config
        total_heads = mc.get_total_num_kv_heads()
        policy = load_head_policy(config.head_policy, num_layers=mc.num_hidden_layers,
                                  num_kv_heads=total_heads)
        tp = attn_tp()
        heads = rank_kv_heads(total_heads, tp.size, tp.rank)
        logger.info("sglang_ext head policy: %d of %d kv heads stream (sink + window only)",
                    int(policy.sum()), policy.numel())
        return policy[:, heads.start:heads.stop]

    @staticmethod
    def _load_eviction_heads(model_runner: ModelRunner, config: SparseConfig) -> Optional[Any]:
        if config.eviction_head is None:
            return None
        from sglang_ext.selection.eviction_head import load_eviction_heads

        mc = model_runner.model_config
        total_heads = mc.get_total_num_kv_heads()
        heads = load_eviction_heads(config.eviction_head, num_layers=mc.num_hidden_layers,
                                    num_kv_heads=total_heads, head_dim=mc.head_dim)
        tp = attn_tp()
        mine = rank_kv_heads(total_heads, tp.size, tp.rank)
        return heads.kv_heads(mine.start, mine.stop).to(model_runner.device)

    def _dense_backend(self) -> AttentionBackend:
        """The SGLang backend that runs prefill/extend (built lazily: under HybridAttnBackend
        SGLang sends extend elsewhere and this one is never needed)."""
        if self._dense is None:
            from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

            name = self.config.dense_backend
            if name == "auto":
                name = "torch_native" if self.device == "cpu" else "triton"
            runner = self.model_runner
            if self.tiered is not None:
                # The dense backend reads prefixes through req_to_token: give it the table of
                # device rows (writes are translated by the pool itself).
                runner = _WithReqToToken(runner, self.tiered.dev_req_to_token)
            self._dense = ATTENTION_BACKENDS[name](runner)
        return self._dense

    # --------------------------------------------------------------- metadata

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if self.tiered is not None:
            if mode.is_idle():
                self.tiered.end_extend()
            else:
                self._prepare_tier(forward_batch)
        if mode.is_decode_or_idle():
            if mode.is_idle() or self.impl == "triton":
                # The kernels read req_pool_indices / seq_lens from the batch on the device.
                self.decode_metadata = None
                self.row_groups = None
                if not mode.is_idle() and request_overrides.has_overriding_rows(
                        self.req_to_token_pool):
                    # rows with their own settings: an eager step in groups (mixed_settings)
                    self.row_groups = group_rows(
                        [request_overrides.lookup(self.req_to_token_pool, row,
                                                  self.default_params)
                         for row in forward_batch.req_pool_indices.tolist()], self.device)
                if self.guard is not None and not mode.is_idle():
                    self._guard_step_control()
                if self.locality is not None and not mode.is_idle():
                    self._locality_report()
                return
            seq_lens_cpu = forward_batch.seq_lens_cpu
            if seq_lens_cpu is None:
                seq_lens_cpu = forward_batch.seq_lens.cpu()
            rows = forward_batch.req_pool_indices.tolist()
            self.decode_metadata = DecodeMetadata(
                req_pool_indices=rows,
                seq_lens=seq_lens_cpu.tolist(),
                sparsity=[
                    request_overrides.lookup(self.req_to_token_pool, row, self.default_params)
                    for row in rows
                ],
            )
            if self.guard is not None:
                self._guard_plan(self.decode_metadata)
        else:
            if self.guard is not None:
                self._guard_reset_rows(forward_batch)
            if self.locality is not None:
                # A request being prefilled starts with no kept set (rows are reused).
                self.locality.reset_rows(forward_batch.req_pool_indices)
            self._dense_backend().init_forward_metadata(forward_batch)

    # ---------------------------------------------------------- accuracy guard

    def _guard_reset_rows(self, forward_batch: ForwardBatch) -> None:
        """A request being prefilled starts at its base budget (rows are reused)."""
        if self.impl == "triton":
            rows = forward_batch.req_pool_indices.long()
            self._guard_budget.index_fill_(0, rows, self.guard.base_budget)
            self._guard_streak.index_fill_(0, rows, 0)
            return
        states = request_overrides.row_state(self.req_to_token_pool)
        for row in forward_batch.req_pool_indices.tolist():
            states.get(row, {}).pop("guard", None)

    def _guard_plan(self, meta: DecodeMetadata) -> None:
        """Reference decode: each sparse request's current budget, and which requests probe."""
        states = request_overrides.row_state(self.req_to_token_pool)
        num_kv_heads = self.token_to_kv_pool.get_key_buffer(
            self.token_to_kv_pool.start_layer).shape[1]
        meta.guards = [None] * len(meta.seq_lens)
        for i, (row, seq_len, params) in enumerate(
            zip(meta.req_pool_indices, meta.seq_lens, meta.sparsity)
        ):
            if params is None:
                continue
            row_states = states.setdefault(row, {})
            guard = row_states.get("guard")
            if guard is None:
                guard = row_states["guard"] = RequestGuard(self.guard, params, num_kv_heads)
            meta.sparsity[i] = guard.begin_step(seq_len)
            if guard.probe_head is not None:
                meta.guards[i] = guard

    def _guard_finish_reference(self, meta: DecodeMetadata) -> None:
        """After the last layer: move the probed requests' budgets (reference decode)."""
        for i, guard in enumerate(meta.guards):
            if guard is None:
                continue
            head = guard.probe_head
            recall, old, new = guard.finish_step()
            self._guard_totals[0] += 1
            if new != old:
                self._guard_totals[1 if new > old else 2] += 1
                logger.info("sglang_ext guard: request row %d recall %.3f (kv head %d): budget "
                            "%d -> %d", meta.req_pool_indices[i], recall, head, old, new)
        if self._guard_metrics is not None:
            self._guard_metrics.update(*self._guard_totals)

    def _guard_step_control(self) -> None:
        """Batched decode: tell this step's probe kernels whether to run and on which kv head
        (two device fills, no sync); now and then read and report the counters."""
        step = self._guard_steps
        self._guard_steps += 1
        num_kv_heads = self.token_to_kv_pool.head_num
        self._guard_ctrl[0].fill_(int(self.guard.is_probe_step(step)))
        self._guard_ctrl[1].fill_(self.guard.probe_head(step, num_kv_heads))
        if step and step % GUARD_REPORT_EVERY == 0:  # a host sync: rarely
            totals = self._guard_counts.tolist()
            logger.info("sglang_ext guard: %d probes, %d raised, %d lowered", *totals)
            if self._guard_metrics is not None:
                self._guard_metrics.update(*totals)

    def _guard_finish_kernels(self, forward_batch: ForwardBatch) -> None:
        """After the last layer (batched decode, inside the CUDA graph): the probed requests'
        new budgets, computed on the device; padding entries (length 1) and dense requests
        change nothing, and duplicate padding rows add zeros."""
        rows = forward_batch.req_pool_indices.long()
        batch = rows.shape[0]
        recall = self._guard_probe.recall_sum[:batch] / self.token_to_kv_pool.layer_num
        old, old_streak = self._guard_budget[rows], self._guard_streak[rows]
        new, streak = next_budget(self.guard, old, old_streak, recall)
        probed = (self._guard_ctrl[0] != 0) & (forward_batch.seq_lens > self.guard.max_budget)
        zero = torch.zeros_like(old)
        delta = torch.where(probed, new - old, zero)
        self._guard_budget.index_put_((rows,), delta, accumulate=True)
        self._guard_streak.index_put_((rows,), torch.where(probed, streak - old_streak, zero),
                                      accumulate=True)
        self._guard_counts += torch.stack([probed.sum(), (delta > 0).sum(), (delta < 0).sum()])

    def _prepare_tier(self, forward_batch: ForwardBatch) -> None:
        """Host-side tier work before a batch: plan the extend scratch (extend), start decoding
        requests whose prefill is done and map each decode token's block (decode)."""
        pool = self.tiered
        req_to_token = self.req_to_token_pool.req_to_token
        if forward_batch.forward_mode.is_decode():
            pending = pool.pending_rows()
            if pending:  # requests decoding for the first time (one host sync, then none)
                for row in forward_batch.req_pool_indices.tolist():
                    if row in pending:
                        pool.start_decoding(req_to_token, row)
            pool.map_decode_tokens(req_to_token, forward_batch.req_pool_indices,
                                   forward_batch.seq_lens, forward_batch.out_cache_loc)
            self._tier_steps += 1
            log_now = self._tier_steps % TIER_LOG_EVERY == 0
            metrics_now = self._tier_metrics is not None and \
                self._tier_steps % self._tier_metrics.every == 0
            if log_now or metrics_now:  # reading the counters syncs: rarely
                occupancy = pool.occupancy()
                if self.cooperative is not None:
                    occupancy.update(self.cooperative.read_stats())
                if metrics_now:
                    self._tier_metrics.update(occupancy)
                if log_now:
                    # cumulative: bytes per decode step = transferred_bytes / decode_steps
                    logger.info("sglang_ext tier stats: %s", json.dumps(dict(
                        occupancy, decode_steps=self._tier_steps,
                        transferred_bytes=occupancy["transferred_blocks"] * self._tier_page_bytes)))
            if self._tier_verify:
                pool.verify_mappings(req_to_token, forward_batch.req_pool_indices.tolist(),
                                     forward_batch.seq_lens_cpu.tolist())
        else:
            pool.prepare_extend(
                req_to_token, forward_batch.req_pool_indices.tolist(),
                forward_batch.seq_lens_cpu.tolist(), list(forward_batch.extend_prefix_lens_cpu),
            )

    # ------------------------------------------------------------ CUDA graphs

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.impl != "triton":
            raise RuntimeError("the reference sparse decode cannot run under CUDA graphs")
        self._ensure_workspace(max_bs)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        self.init_forward_metadata(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # padded slots decode densely over position 0 of the padding row

    # ---------------------------------------------------------------- forward

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        if self._has_one_token_extends(layer, forward_batch):
            out = self._forward_extend_one_token_rows(q, k, v, layer, forward_batch, save_kv_cache)
        else:
            out = self._dense_backend().forward_extend(
                q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
            )
        if self.summaries is not None and self._wrote_kv(k, save_kv_cache):
            self._update_summaries(layer, k, v, forward_batch)
        if (self.block_filter is not None or self.impl == "reference") and \
                getattr(forward_batch, "extend_seq_lens", None) is not None:
            self._remember_last_queries(q, layer, forward_batch)
        return out

    def _remember_last_queries(self, q: torch.Tensor, layer: RadixAttention,
                               forward_batch: ForwardBatch) -> None:
        """The asynchronous block filter's first step: each request's first decode step ranks
        its blocks with its last prompt token's query (chosen now in the batched decode,
        kept for the reference one)."""
        from sglang_ext.attention.async_block_filter import last_token_queries

        index = self._layer_index(layer)
        if self.block_filter is not None:
            q_last = last_token_queries(q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                                        forward_batch.extend_seq_lens)
            self.block_filter.choose_after_extend(
                index, q_last, forward_batch.req_pool_indices,
                self._select_blocks(index, forward_batch, q_last.shape[0]))
        elif self.impl == "reference" and self.kv_lora_rank is None:
            rows = forward_batch.req_pool_indices.tolist()
            wanted = [i for i, row in enumerate(rows) if _async_filter(
                request_overrides.lookup(self.req_to_token_pool, row, self.default_params))]
            if not wanted:
                return
            q_last = last_token_queries(q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                                        forward_batch.extend_seq_lens)
            seq_lens = (forward_batch.seq_lens_cpu if forward_batch.seq_lens_cpu is not None
                        else forward_batch.seq_lens).tolist()
            for i in wanted:
                self.previous_queries.put(rows[i], index, seq_lens[i], q_last[i])

    def _has_one_token_extends(self, layer: RadixAttention, forward_batch: ForwardBatch) -> bool:
        """Whether this extend batch holds requests that extend a cached prefix by one token
        (a prompt found in the radix cache but for its last token) on the torch_native delegate,
        for plain causal self-attention."""
        if self.impl != "reference" or forward_batch.encoder_lens is not None:
            return False
        if self.tiered is not None:  # reads the pool by logical slot: not with the tier
            return False
        if layer.is_cross_attention or getattr(layer, "sliding_window_size", -1) > -1:
            return False
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.layers.radix_attention import AttentionType

        if layer.attn_type != AttentionType.DECODER:
            return False
        if not isinstance(self._dense_backend(), TorchNativeAttnBackend):
            return False
        ext, pre = forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu
        return ext is not None and pre is not None and any(
            e == 1 and p > 0 for e, p in zip(ext, pre)
        )

    def _forward_extend_one_token_rows(
        self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
        layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool,
    ) -> torch.Tensor:
        """torch_native's extend, except that a request extending a cached prefix by one token
        attends like a decode step. torch_native runs causal SDPA over the whole sequence (the
        prefix's query rows padded in) and keeps the last row: O(L^2) per request, seconds at 4k
        tokens on a CPU, for one row whose SDPA over all L keys is the same computation (the
        last causal row sees every key: exact attention, rounded differently in the last bits)."""
        dense = self._dense_backend()
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v
            )
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens.tolist()
        computed: list[tuple[int, torch.Tensor]] = []  # (query row, slots) of rows done here
        start = 0
        for i, (ext, pre) in enumerate(
            zip(forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu)
        ):
            if ext == 1 and pre > 0:
                slots = req_to_token[rows[i], : seq_lens[i]]
                twin = _same_last_row(q_, start, slots, computed, k_buf, v_buf)
                if twin is not None:
                    o_[start] = o_[twin]
                else:
                    o_[start] = _last_row_attention_fp32(
                        q_[start], k_buf.index_select(0, slots), v_buf.index_select(0, slots),
                        layer.scaling,
                    )
                    computed.append((start, slots))
            else:
                sl = slice(i, i + 1)
                dense._run_sdpa_forward_extend(
                    q_[start : start + ext], o_[start : start + ext], k_buf, v_buf, req_to_token,
                    forward_batch.req_pool_indices[sl], forward_batch.seq_lens[sl],
                    forward_batch.extend_prefix_lens[sl], forward_batch.extend_seq_lens[sl],
                    None, scaling=layer.scaling,
                    enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=True,
                )
            start += ext
        return o_.view(q_.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        fused = False
        if save_kv_cache and k is not None and v is not None:
            fused = self._write_decode_kv_fused(layer, k, v, forward_batch)
            if not fused:
                # with the layer's KV scales, as SGLang's FlashInfer prefill writes them (an fp8
                # KV cache of a checkpoint that has scales stores k / k_scale)
                self.token_to_kv_pool.set_kv_buffer(
                    layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v,
                    *_kv_write_scales(layer),
                )
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if self.impl == "triton":
            return self._forward_decode_kernels(q, k, v, layer, forward_batch,
                                                save_kv_cache, summarised=fused)
        return self._forward_decode_reference(q, layer)

    def _write_decode_kv_fused(self, layer: RadixAttention, k: torch.Tensor, v: torch.Tensor,
                               forward_batch: ForwardBatch) -> bool:
        """Write this decode step's KV, page summaries and labels of one layer in one launch
        (kernels/decode_write.py) where it writes exactly what set_kv_buffer and
        _update_summaries write: the batched decode on SGLang's plain token-major pool, no tier,
        no locality state; the layer's scales known as floats. False: nothing was written."""
        if self._fused_write_pool is None:
            self._fused_write_pool = fused_write_pool(self)
        if not self._fused_write_pool:
            return False
        from sglang_ext.kernels.decode_write import fused_write_supported, write_decode_kv

        index = self._layer_index(layer)
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        labels = None if self.labels is None else self.labels[index]
        kmin = None if self.summaries is None else self.summaries.kmin[index]
        if not fused_write_supported(k_buffer.dtype, k.dtype, None if kmin is None else kmin.dtype,
                                     None if labels is None else labels.dtype):
            return False
        scales = _kv_write_scales(layer)
        if scales and None in (getattr(layer, "k_scale_float", None),
                               getattr(layer, "v_scale_float", None)):
            return False  # scales only as tensors: set_kv_buffer divides by those
        k_scale, v_scale = _kv_read_scales(layer)
        write_decode_kv(
            k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim),
            v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim),
            forward_batch.out_cache_loc, k_buffer,
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            kmin, None if self.summaries is None else self.summaries.kmax[index],
            self.config.block_size, labels,
            None if labels is None else self.label_channels[layer.layer_id],
            k_scale=k_scale, v_scale=v_scale)
        return True

    def _forward_decode_kernels(
        self, q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
        layer: RadixAttention, forward_batch: ForwardBatch, save_kv_cache: bool,
        summarised: bool = False,
    ) -> torch.Tensor:
        from sglang_ext.kernels.sparse_decode import sparse_decode_batched

        layer_index = self._layer_index(layer)
        if self._wrote_kv(k, save_kv_cache) and not summarised:
            self._update_summaries(layer, k, v, forward_batch)
        channels = None if self.label_channels is None else self.label_channels[layer.layer_id]
        k_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        if self.row_groups is not None:
            k_scale, v_scale = _kv_read_scales(layer)
            out = self._mixed_settings().decode(
                self.row_groups, q, k_buffer, v_buffer, req_to_token,
                forward_batch.req_pool_indices, forward_batch.seq_lens,
                self.summaries.kmin[layer_index], self.summaries.kmax[layer_index],
                layer.scaling, channels=channels,
                labels=None if self.labels is None else self.labels[layer_index],
                k_scale=k_scale, v_scale=v_scale)
            return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        tier_args: dict[str, Any] = {}
        tier = self.tiered.tier if self.tiered is not None else None
        if self.cooperative is not None:  # eager sync tier (patches/server_args.py)
            out = self.cooperative.attend_kernels(
                tier, layer_index, q, k_buffer, v_buffer, req_to_token,
                forward_batch.req_pool_indices, forward_batch.seq_lens,
                self.summaries.kmin[layer_index], self.summaries.kmax[layer_index],
                self.kernel_params, layer.scaling, channels, self._ensure_workspace(q.shape[0]),
                None if self.locality is None else self.locality.layer(layer_index))
            return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim).clone()
        if tier is not None:
            on_blocks, attend = tier.decode_hooks(
                layer_index, forward_batch.req_pool_indices, req_to_token, k_buffer, v_buffer
            )
            tier_args = dict(page_map=tier.page_map(layer_index), on_blocks=on_blocks,
                             attend_blocks=attend)
        guard = self.guard is not None
        k_scale, v_scale = _kv_read_scales(layer)
        if guard and layer_index == 0:
            # This step's per-request top-k sizes, from the budgets the guard left last step.
            budgets = self._guard_budget[forward_batch.req_pool_indices.long()]
            self._guard_row_ks = row_top_k(self.default_params, budgets)
            self._guard_probe.recall_sum.zero_()
        out = sparse_decode_batched(
            q,
            k_buffer,
            v_buffer,
            req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self.summaries.kmin[layer_index],
            self.summaries.kmax[layer_index],
            self.kernel_params,
            layer.scaling,
            channels=channels,
            workspace=self._ensure_workspace(q.shape[0]),
            labels=None if self.labels is None else self.labels[layer_index],
            return_lse=guard,
            row_ks=self._guard_row_ks if guard else None,
            locality=None if self.locality is None else self.locality.layer(layer_index),
            candidates=(None if self.block_filter is None else
                        self.block_filter.candidates(layer_index, forward_batch.req_pool_indices)),
            # a tensor of this layer's own: the workspace's output buffer is shared by all layers
            out=q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim)),
            k_scale=k_scale,
            v_scale=v_scale,
            **tier_args,
        )
        if self.block_filter is not None:
            self.block_filter.choose_next(layer_index, q, forward_batch.req_pool_indices,
                                          self._select_blocks(layer_index, forward_batch,
                                                              q.shape[0]))
            if layer.layer_id == self.token_to_kv_pool.end_layer - 1:
                self.block_filter.finish_step()
        if guard:
            out, lse = out
            # the dense LSE over the keys as the sparse one read them (times the KV scale)
            self._guard_probe.run(self._guard_ctrl, q, k_buffer, req_to_token,
                                  forward_batch.req_pool_indices, forward_batch.seq_lens, lse,
                                  layer.scaling * k_scale)
            if layer.layer_id == self.token_to_kv_pool.end_layer - 1:
                self._guard_finish_kernels(forward_batch)
        if tier is not None:
            tier.after_layer(layer_index, forward_batch.req_pool_indices, req_to_token,
                             k_buffer, v_buffer)
            if layer.layer_id == self.token_to_kv_pool.end_layer - 1:
                tier.finish_step()  # the fence: this step's prefetches land before the next
        return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def _mixed_settings(self) -> MixedSettingsDecode:
        if self._mixed is None:
            pool = self.token_to_kv_pool
            _, num_kv_heads, head_dim_v = pool.get_value_buffer(pool.start_layer).shape
            self._mixed = MixedSettingsDecode(
                self._rank_q_heads(), num_kv_heads, head_dim_v,
                -(-self.req_to_token_pool.req_to_token.shape[1] // self.config.block_size),
                self.device, self.model_runner.dtype, self._topk_radix_bits)
        return self._mixed

    def _ensure_workspace(self, batch: int) -> Any:
        """Scratch that fits `batch`. Workspaces are never freed or replaced: captured CUDA
        graphs keep pointing at the one they were captured with, and eager batches larger than
        the graphs' maximum get a larger one of their own."""
        from sglang_ext.kernels.sparse_decode import SparseDecodeWorkspace

        fitting = [ws for ws in self._workspaces if ws.max_batch >= batch]
        if fitting:
            return min(fitting, key=lambda ws: ws.max_batch)
        pool = self.token_to_kv_pool
        # [.., Hkv, Dv] with this rank's kv heads; MLA pools: one latent head, Dv = R
        _, num_kv_heads, head_dim_v = pool.get_value_buffer(pool.start_layer).shape
        workspace = SparseDecodeWorkspace(
            max_batch=batch,
            num_q_heads=self._rank_q_heads(),
            num_kv_heads=num_kv_heads,
            head_dim_v=head_dim_v,
            params=self.kernel_params,
            max_blocks=-(-self.req_to_token_pool.req_to_token.shape[1] // self.config.block_size),
            device=self.device,
            dtype=self.model_runner.dtype,
            topk_radix_bits=self._topk_radix_bits,
        )
        self._workspaces.append(workspace)
        return workspace

    def _wrote_kv(self, k: Optional[torch.Tensor], save_kv_cache: bool) -> bool:
        """Whether this layer's call wrote KV at out_cache_loc. MLA models write their latent
        rows themselves before an extend without a cached prefix (set_mla_kv_buffer, then
        attention with save_kv_cache=False); every other MLA call stores them itself."""
        return self.kv_lora_rank is not None or (save_kv_cache and k is not None)

    def _update_summaries(self, layer: RadixAttention, k: torch.Tensor, v: Optional[torch.Tensor],
                          forward_batch: ForwardBatch) -> None:
        """Fold the keys just written (prefill or decode) into their pages' min/max, store
        their label channels in the label cache, and (locality constraint) fold their eviction
        scores into their pages' (key norms, or the eviction head of the values)."""
        if self.kv_lora_rank is not None:
            # The rows stored: an MLA extend's k is then the per-head MHA key (qk_nope + rope
            # dims of each query head), not the latent row the pool holds. With the CPU tier
            # they are where the extend's attention reads them (the scratch, or GPU-homed rows).
            rows = forward_batch.out_cache_loc
            if self.tiered is not None:
                rows = self.tiered.written_rows(rows, layer.layer_id)
            keys = self.token_to_kv_pool.get_key_buffer(layer.layer_id).index_select(0, rows)
        else:
            keys = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
            kv_dtype = self.token_to_kv_pool.get_key_buffer(layer.layer_id).dtype
            if kv_dtype.itemsize == 1 and keys.dtype != kv_dtype:
                # an fp8 KV cache: summarise (and label) the keys as stored, not before rounding,
                # so the Quest bound holds for what the attention reads
                keys = keys.to(kv_dtype).to(keys.dtype)
        self.summaries.update(self._layer_index(layer), keys, forward_batch.out_cache_loc)
        if self.locality is not None:
            from sglang_ext.kernels.locality import update_eviction_page_scores

            index = self._layer_index(layer)
            x, head = keys, None
            if self._locality_heads is not None:  # learned: the values' eviction head
                x = v.reshape(-1, layer.tp_k_head_num, layer.v_head_dim)
                head = self._locality_heads[index]
            update_eviction_page_scores(self.locality.page_scores[index], x,
                                        forward_batch.out_cache_loc, self.config.block_size,
                                        self.config.eviction_score, head)
        if self.labels is not None:
            from sglang_ext.kernels.label_cache import update_label_cache

            update_label_cache(self.labels[self._layer_index(layer)], keys,
                               forward_batch.out_cache_loc, self.label_channels[layer.layer_id])

    def _layer_index(self, layer: RadixAttention) -> int:
        return layer.layer_id - self.token_to_kv_pool.start_layer

    def _forward_decode_reference(self, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        meta = self.decode_metadata
        assert meta is not None, "init_forward_metadata was not called for this decode batch"
        out = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        channels = None if self.label_channels is None else self.label_channels[layer.layer_id]

        sparse = []  # sparse requests run together (BatchedSparseDecode) without the tier
        coop: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # cooperative rows
        for i, (row, seq_len, params) in enumerate(
            zip(meta.req_pool_indices, meta.seq_lens, meta.sparsity)
        ):
            local = self._uses_locality(params)
            guard = meta.guards[i] if meta.guards is not None else None
            stale = _async_filter(params)
            if self.tiered is None and params is not None and seq_len > params.budget \
                    and not local and guard is None and params.scoring == "score" \
                    and not params.head_policy and not stale:
                sparse.append(i)
                continue
            slots = req_to_token[row, :seq_len]
            if self.tiered is not None:  # host-homed tokens straight from host memory
                keys, values = self.tiered.gather_tokens(layer.layer_id, slots)
            else:
                # index_select: the same tensor as k_buf[slots], an order of magnitude faster
                keys = k_buf.index_select(0, slots)  # [L, Hkv, D]
                values = v_buf.index_select(0, slots)
            if params is None or seq_len <= params.budget:
                out[i] = self._dense_row(q[i], keys, values, layer.scaling)
            elif local:
                mask = self._select_with_locality(row, layer, q[i], keys, values, params,
                                                  channels)
                if self.cooperative is not None:
                    coop.append((i, mask, keys, values))
                    continue
                out[i] = sparse_attention(q[i], keys, values, mask, layer.scaling)
            else:
                streaming = None if self.streaming_heads is None \
                    else self.streaming_heads[layer.layer_id]
                earlier = self.previous_queries.get(row, self._layer_index(layer)) \
                    if stale else None
                mask = select_token_mask(
                    q[i], keys, params, channels, values, streaming,
                    block_query=None if earlier is None else earlier[1],
                    block_length=None if earlier is None else earlier[0])
                if self.cooperative is not None:  # attended below, the layer's rows together
                    coop.append((i, mask, keys, values))
                    continue
                out[i] = sparse_attention(q[i], keys, values, mask, layer.scaling)
                if guard is not None:
                    guard.add_recall(selection_recall(q[i], keys, mask, layer.scaling,
                                                      guard.probe_head))
        for i, (row, seq_len, params) in enumerate(
            zip(meta.req_pool_indices, meta.seq_lens, meta.sparsity)
        ):
            if _async_filter(params):  # this step's query ranks the next step's blocks
                self.previous_queries.put(row, self._layer_index(layer), seq_len, q[i])
        if coop:
            index = [i for i, _, _, _ in coop]
            layer_index = self._layer_index(layer)
            out[index] = self.cooperative.attend_reference(
                layer_index, q[index], [meta.req_pool_indices[i] for i in index],
                [m for _, m, _, _ in coop], [k for _, _, k, _ in coop],
                [v for _, _, _, v in coop], self.tiered.tier.page_map(layer_index),
                req_to_token, layer.scaling)
        if meta.guards is not None and layer.layer_id == self.token_to_kv_pool.end_layer - 1:
            self._guard_finish_reference(meta)
        if sparse:
            # The same token sets as select_token_mask per request; the key-side work is done
            # once per pool slot that requests share (a prompt decoded under many settings).
            if meta.sparse_plan is None:
                rows = torch.tensor([meta.req_pool_indices[i] for i in sparse], device=q.device)
                meta.sparse_plan = (
                    torch.tensor(sparse, device=q.device),
                    BatchedSparseDecode(
                        req_to_token.index_select(0, rows),
                        [meta.seq_lens[i] for i in sparse],
                        [meta.sparsity[i] for i in sparse],
                    ),
                )
            index, plan = meta.sparse_plan
            out[index] = plan.decode(q[index], k_buf, v_buf, layer.scaling, channels)
        return out.view(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def _dense_row(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   scaling: float) -> torch.Tensor:
        """One request's dense decode (--sparse-dense-decode): SGLang's torch_native call, or
        the same attention in float32 (a CPU runs SDPA with one bf16 query row ~8x slower)."""
        if self.config.dense_decode == "float32":
            return _last_row_attention_fp32(q, keys, values, scaling)
        return _dense_decode_like_sglang(q, keys, values, scaling)

    @staticmethod
    def _uses_locality(params: RequestSparsity) -> bool:
        """The request's k_e (server flag or custom_params.sparse.locality_blocks)."""
        return params is not None and params.method == "two_level" and params.locality_blocks > 0

    def _select_with_locality(self, row: int, layer: RadixAttention, q: torch.Tensor,
                              keys: torch.Tensor, values: torch.Tensor, params: Any,
                              channels: Any) -> torch.Tensor:
        """NOSA's locality-constrained two_level (sglang_ext/selection/locality.py), with its
        per-(request, layer) state kept under the request's row; k_e and the eviction score are
        the request's."""
        from sglang_ext.selection.locality import (
            LocalityState,
            select_token_mask_locality,
            update_eviction_scores,
        )

        states = request_overrides.row_state(self.req_to_token_pool).setdefault(row, {})
        state = states.get(layer.layer_id)
        if state is None:
            state = states[layer.layer_id] = LocalityState(num_kv_heads=keys.shape[1])
        head = None
        if params.eviction_score == "learned":
            # Validated at arrival: learned needs the server's --sparse-eviction-head.
            head = self.eviction_heads.layer(layer.layer_id)
        mask = select_token_mask_locality(q, keys, params, state, params.locality_blocks, channels,
                                          params.eviction_score, values, head)
        if params.eviction_score == "attention":
            update_eviction_scores(state, q, keys, mask, layer.scaling, params.block_size)
        self._locality_steps += 1
        if state.locality and self._locality_metrics is not None:
            self._locality_metrics.observe(state.locality[-1])
        if state.locality and self._locality_steps % LOCALITY_LOG_EVERY == 0:
            recent = state.locality[-LOCALITY_LOG_EVERY:]
            logger.info("sglang_ext locality: layer %d gamma mean %.3f min %.3f (k_e=%d)",
                        layer.layer_id, sum(recent) / len(recent), min(recent),
                        params.locality_blocks)
        return mask

    def support_triton(self) -> bool:
        return self.device != "cpu"


class _WithReqToToken:
    """A model runner whose ``req_to_token_pool.req_to_token`` is another table (the tier's
    device-row translation); everything else is the runner's."""

    def __init__(self, runner: Any, table: torch.Tensor) -> None:
        self._runner = runner
        self.req_to_token_pool = _ReqPoolView(runner.req_to_token_pool, table)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


class _ReqPoolView:
    def __init__(self, pool: Any, table: torch.Tensor) -> None:
        self._pool = pool
        self.req_to_token = table

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)


def _async_filter(params: Optional[SelectionParams]) -> bool:
    return params is not None and params.block_filter == "async"


def resolve_impl(config: SparseConfig, device: Any) -> str:
    if config.impl != "auto":
        return config.impl
    return "reference" if str(device) == "cpu" else "triton"


def _last_row_attention_fp32(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One query row's exact attention over all keys, computed in float32: the last causal row
    of a one-token extend (not bit-identical to torch_native's extend anyway, see
    _forward_extend_one_token_rows) and, with --sparse-dense-decode float32, dense decode rows.
    On a CPU, torch's SDPA with a single bf16 query row is ~8x slower than in float32 (4 ms vs
    0.5 ms per layer at 4k tokens)."""
    out = _dense_decode_like_sglang(q.float(), keys.float(), values.float(), scaling)
    return out.to(q.dtype)


def _same_last_row(q: torch.Tensor, row: int, slots: torch.Tensor,
                   computed: list[tuple[int, torch.Tensor]], k_buf: torch.Tensor,
                   v_buf: torch.Tensor) -> Optional[int]:
    """A query row already computed whose inputs equal ``row``'s exactly (the same query, the
    same prefix slots, an equal last key/value), or None. Requests that extend one cached
    prompt by its last token (one prompt decoded under several settings) compute the same
    attention row: it is done once."""
    for done, done_slots in computed:
        if (done_slots.shape == slots.shape and torch.equal(q[done], q[row])
                and torch.equal(done_slots[:-1], slots[:-1])
                and torch.equal(k_buf[done_slots[-1]], k_buf[slots[-1]])
                and torch.equal(v_buf[done_slots[-1]], v_buf[slots[-1]])):
            return done
    return None


def _dense_decode_like_sglang(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One request's dense decode, the same SDPA call (layout, dtype, GQA) as SGLang's
    torch_native backend, so that dense decode through us is bit-identical to it."""
    q_ = q.unsqueeze(1)  # [Hq, 1, D]
    k_ = keys.movedim(0, 1)  # [Hkv, L, D]
    v_ = values.movedim(0, 1)
    if not (q_.dtype == k_.dtype == v_.dtype):
        k_, v_ = k_.to(q_.dtype), v_.to(q_.dtype)
    o = scaled_dot_product_attention(
        q_.unsqueeze(0), k_.unsqueeze(0), v_.unsqueeze(0),
        enable_gqa=q_.shape[0] != k_.shape[0], scale=scaling, is_causal=False,
    )
    return o.squeeze(0).squeeze(1)  # [Hq, Dv]
