"""AsyncTLS's block filter one step ahead (``--sparse-block-filter async``) in the batched
decode: each layer attends the blocks chosen with the previous step's query, and chooses the
next step's on a side stream right after its token stage (attention/async_block_filter.py has
the state and the streams; the reference decode keeps previous queries instead)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from torch import Tensor

from sglang_ext.attention.async_block_filter import AsyncBlockFilter, last_token_queries
from sglang_ext.attention.decode_plan import DecodeFeature, LayerStep, decode_rows
from sglang_ext.kernels.sparse_decode import DecodeRows, LayerCache, select_blocks_batched

logger = logging.getLogger(__name__)


class KernelAsyncFilter(DecodeFeature):
    def __init__(self, decoder: Any) -> None:
        ctx = decoder.ctx
        self.decoder = decoder
        pool = ctx.token_to_kv_pool
        _, num_kv_heads, head_dim = pool.get_key_buffer(pool.start_layer).shape
        rows = ctx.req_to_token.shape[0]
        # Sized for every request row: a decode batch never holds more requests than rows.
        self.filter = AsyncBlockFilter(
            num_layers=ctx.num_layers, rows=rows, num_kv_heads=num_kv_heads,
            k_blocks=decoder.workspace(1).k_blocks, max_batch=rows,
            num_q_heads=ctx.num_q_heads, head_dim=head_dim, device=ctx.device, dtype=ctx.dtype)
        logger.info("sglang_ext: asynchronous block filter on (%d blocks per kv head chosen a "
                    "step ahead on a side stream), %.1f MiB of device state",
                    self.filter.k_blocks, self.filter.nbytes() / 2**20)

    def _chooser(self, cache: LayerCache, rows: DecodeRows,
                 batch: int) -> Callable[[Tensor, Tensor], Any]:
        """``(q, table)`` -> each request's blocks written into its row of the table."""
        params, ws = self.decoder.kernel_params, self.decoder.workspace(batch)
        return lambda q, table: select_blocks_batched(q, cache, rows, params, ws, out_table=table)

    def after_extend_layer(self, step: LayerStep, forward_batch: Any) -> None:
        """A request's first decode step ranks its blocks with its last prompt token's query."""
        if getattr(forward_batch, "extend_seq_lens", None) is None:
            return
        q_last = last_token_queries(step.q, forward_batch.extend_seq_lens)
        rows = decode_rows(self.decoder.ctx.req_to_token, forward_batch)
        self.filter.choose_after_extend(step.index, q_last, rows.req_pool_indices,
                                        self._chooser(step.cache, rows, q_last.shape[0]))

    def layer_inputs(self, plan: Any, step: LayerStep) -> dict[str, Any]:
        return {"candidates": self.filter.candidates(step.index, plan.rows.req_pool_indices)}

    def after_layer(self, plan: Any, step: LayerStep, lse: Optional[Tensor]) -> None:
        self.filter.choose_next(step.index, step.q, plan.rows.req_pool_indices,
                                self._chooser(step.cache, plan.rows, step.q.shape[0]))

    def end_layers(self, plan: Any) -> None:
        self.filter.finish_step()
