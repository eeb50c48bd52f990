"""NOSA's locality constraint (``--sparse-locality-blocks`` k_e): a query-agnostic set of
k_e blocks per request and kv head that stays from one step to the next, so at least k_e/k of
the attended blocks persist (what bounds the CPU tier's transfers).

* :class:`KernelLocality`: the batched decode's device state by request row and KV page
  (kernels/locality.py), each page's eviction score folded in as its keys are written, and the
  γ(t) counters read every ``LOCALITY_READ_EVERY`` steps.
* :class:`ReferenceLocality`: the reference decode's per-(request, layer) state on the host
  (selection/locality.py), for the server's setting or a request's ``custom_params``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from torch import Tensor

from sglang_ext.attention import request_overrides
from sglang_ext.attention.decode_plan import DecodeContext, DecodeFeature, LayerStep, batch_kind
from sglang_ext.attention.side_buffers import logical_slots

logger = logging.getLogger(__name__)
LOCALITY_LOG_EVERY = 512  # (request, layer) selections between two locality log lines
LOCALITY_READ_EVERY = 64  # decode steps between two reads of the CUDA locality γ counters


def locality_metrics(ctx: DecodeContext) -> Optional[Any]:
    if not ctx.enable_metrics:
        return None
    from sglang_ext.selection.locality import LocalityMetrics

    return LocalityMetrics()


class KernelLocality(DecodeFeature):
    # the fused KV write does not fold the keys' eviction scores
    blocks_fused_write = True

    def __init__(self, ctx: DecodeContext) -> None:
        from sglang_ext.kernels.locality import LocalityKernelState, eviction_head_tensors

        self.ctx = ctx
        config = ctx.config
        pool = ctx.token_to_kv_pool
        bs = config.block_size
        self.state = LocalityKernelState(
            num_layers=pool.layer_num, rows=ctx.req_to_token.shape[0], num_kv_heads=pool.head_num,
            k_e=config.locality_blocks, max_blocks=ctx.max_blocks,
            num_slots=logical_slots(pool, bs), page_size=bs, device=ctx.device,
            limit_new_blocks=config.locality_new_blocks > 0,
        )
        # learned scores: each layer's eviction head of the values
        self.heads: Optional[list[Any]] = None
        if config.eviction_score == "learned":
            self.heads = [eviction_head_tensors(ctx.files.eviction_heads, pool.start_layer + i)
                          for i in range(pool.layer_num)]
        self.metrics = locality_metrics(ctx)
        self.steps = 0
        self.log_totals = [0.0, 0, float("inf")]  # sum, count, min of γ since the last log
        logger.info("sglang_ext locality: k_e=%d blocks, %s score, at most %s new filter blocks "
                    "per step, %.2f GiB of device state", config.locality_blocks,
                    config.eviction_score, config.locality_new_blocks or "any",
                    self.state.nbytes() / 2**30)

    def before_batch(self, forward_batch: Any) -> None:
        kind = batch_kind(forward_batch)
        if kind == "extend":  # a request being prefilled starts with no kept set (rows reused)
            self.state.reset_rows(forward_batch.req_pool_indices)
        elif kind == "decode":
            self._report()

    def kv_written(self, index: int, keys: Tensor, values: Optional[Tensor],
                   loc: Tensor) -> None:
        from sglang_ext.kernels.locality import update_eviction_page_scores

        x, head = keys, None
        if self.heads is not None:  # learned: the values' eviction head
            x, head = values, self.heads[index]
        update_eviction_page_scores(self.state.page_scores[index], x, loc,
                                    self.ctx.config.block_size, self.ctx.config.eviction_score,
                                    head)

    def layer_inputs(self, plan: Any, step: LayerStep) -> dict[str, Any]:
        return {"locality": self.state.layer(step.index)}

    def _report(self) -> None:
        """Now and then read the γ counters (a host sync), export them, log their summary."""
        self.steps += 1
        if self.steps % LOCALITY_READ_EVERY:
            return
        total, count, minimum = self.state.take_gamma_stats()
        if count == 0:
            return
        if self.metrics is not None:
            self.metrics.observe_many(total, count, minimum)
        log = self.log_totals
        log[0] += total
        log[1] += count
        log[2] = min(log[2], minimum)
        if log[1] >= LOCALITY_LOG_EVERY:
            logger.info("sglang_ext locality: %d selections gamma mean %.3f min %.3f (k_e=%d)",
                        log[1], log[0] / log[1], log[2], self.ctx.config.locality_blocks)
            self.log_totals = [0.0, 0, float("inf")]


class ReferenceLocality:
    """The reference decode's locality-constrained two_level, with per-(request, layer) state
    kept under the request's row; k_e and the eviction score are the request's."""

    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        self.metrics = locality_metrics(ctx)
        self.selections = 0

    @staticmethod
    def applies(params: Any) -> bool:
        """Whether the request asks for it (server flag or custom_params.sparse)."""
        return params is not None and params.method == "two_level" and params.locality_blocks > 0

    def select(self, row: int, layer: Any, q: Tensor, keys: Tensor, values: Tensor,
               params: Any, channels: Optional[Tensor]) -> Tensor:
        from sglang_ext.selection.locality import (
            LocalityState,
            select_token_mask_locality,
            update_eviction_scores,
        )

        states = request_overrides.row_state(self.ctx.req_to_token_pool).setdefault(row, {})
        state = states.get(layer.layer_id)
        if state is None:
            state = states[layer.layer_id] = LocalityState(num_kv_heads=keys.shape[1])
        head = None
        if params.eviction_score == "learned":
            # Validated at arrival: learned needs the server's --sparse-eviction-head.
            head = self.ctx.files.eviction_heads.layer(layer.layer_id)
        mask = select_token_mask_locality(q, keys, params, state, params.locality_blocks, channels,
                                          params.eviction_score, values, head)
        if params.eviction_score == "attention":
            update_eviction_scores(state, q, keys, mask, layer.scaling, params.block_size)
        self.selections += 1
        if state.locality and self.metrics is not None:
            self.metrics.observe(state.locality[-1])
        if state.locality and self.selections % LOCALITY_LOG_EVERY == 0:
            recent = state.locality[-LOCALITY_LOG_EVERY:]
            logger.info("sglang_ext locality: layer %d gamma mean %.3f min %.3f (k_e=%d)",
                        layer.layer_id, sum(recent) / len(recent), min(recent),
                        params.locality_blocks)
        return mask
