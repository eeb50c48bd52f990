"""The CPU tier (``--sparse-tier``): KV pages homed in pinned host memory, each decoding
request's working set on the device (memory_tier/). This feature drives the pool around each
batch (extend scratch, the first decode step of a request, the decode tokens' page map, the
counters) and, in the batched decode, hands each layer's block filter result to the tier to
fetch now (sync) or after the layer on a side stream (async), fenced after the last layer."""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Optional

from torch import Tensor

from sglang_ext.attention.decode_plan import DecodeContext, DecodeFeature, LayerStep, batch_kind

logger = logging.getLogger(__name__)
# decode steps between two log lines of the CPU tier's counters (benchmarks log more often)
TIER_LOG_EVERY = int(os.environ.get("SGLANG_EXT_TIER_LOG_EVERY", "256"))
# decode steps between two refreshes of the tier's /metrics counters (each reads the device)
TIER_METRICS_EVERY = int(os.environ.get("SGLANG_EXT_TIER_METRICS_EVERY", "32"))


class TierDriver(DecodeFeature):
    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        self.pool = pool = ctx.tiered
        self.verify = pool.verify >= 2  # check every mapping at every step (tests)
        self.steps = 0
        self.page_bytes = pool.tier_page_bytes  # K + V bytes of one (layer, kv head) block
        self.metrics = None
        if ctx.enable_metrics:
            from sglang_ext.memory_tier.metrics import TierMetrics

            self.metrics = pool.metrics = TierMetrics(page_bytes=self.page_bytes,
                                                      every=TIER_METRICS_EVERY)
        # more counters for the log and /metrics (cooperative attention's)
        self.stats_sources: list[Callable[[], dict]] = []
        pool.bind(ctx.req_to_token)

    def before_batch(self, forward_batch: Any) -> None:
        self.pool.note_forward_stream()
        kind = batch_kind(forward_batch)
        req_to_token = self.ctx.req_to_token
        if kind == "idle":
            self.pool.end_extend()
        elif kind == "extend":
            self.pool.prepare_extend(
                req_to_token, forward_batch.req_pool_indices.tolist(),
                forward_batch.seq_lens_cpu.tolist(), list(forward_batch.extend_prefix_lens_cpu))
        else:
            self._prepare_decode(forward_batch)

    def _prepare_decode(self, forward_batch: Any) -> None:
        """Start requests decoding for the first time and map each decode token's block."""
        pool = self.pool
        req_to_token = self.ctx.req_to_token
        pending = pool.pending_rows()
        if pending:  # requests decoding for the first time (one host sync, then none)
            for row in forward_batch.req_pool_indices.tolist():
                if row in pending:
                    pool.start_decoding(req_to_token, row)
        pool.map_decode_tokens(req_to_token, forward_batch.req_pool_indices,
                               forward_batch.seq_lens, forward_batch.out_cache_loc)
        self.steps += 1
        self._report()
        if self.verify:
            pool.verify_mappings(req_to_token, forward_batch.req_pool_indices.tolist(),
                                 forward_batch.seq_lens_cpu.tolist())

    def _report(self) -> None:
        log_now = self.steps % TIER_LOG_EVERY == 0
        metrics_now = self.metrics is not None and self.steps % self.metrics.every == 0
        if not (log_now or metrics_now):  # reading the counters syncs: rarely
            return
        occupancy = self.pool.occupancy()
        for source in self.stats_sources:
            occupancy.update(source())
        if metrics_now:
            self.metrics.update(occupancy)
        if log_now:
            # cumulative: bytes per decode step = transferred_bytes / decode_steps
            logger.info("sglang_ext tier stats: %s", json.dumps(dict(
                occupancy, decode_steps=self.steps,
                transferred_bytes=occupancy["transferred_blocks"] * self.page_bytes)))

    def layer_inputs(self, plan: Any, step: LayerStep) -> dict[str, Any]:
        tier = self.pool.tier
        on_blocks, attend = tier.decode_hooks(step.index, plan.rows.req_pool_indices,
                                              plan.rows.req_to_token, step.cache.k_buffer,
                                              step.cache.v_buffer)
        return {"page_map": tier.page_map(step.index), "on_blocks": on_blocks,
                "attend_blocks": attend}

    def after_layer(self, plan: Any, step: LayerStep, lse: Optional[Tensor]) -> None:
        self.pool.tier.after_layer(step.index, plan.rows.req_pool_indices, plan.rows.req_to_token,
                                   step.cache.k_buffer, step.cache.v_buffer)

    def end_layers(self, plan: Any) -> None:
        self.pool.tier.finish_step()  # the fence: this step's prefetches land before the next
