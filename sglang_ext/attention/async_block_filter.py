"""AsyncTLS's asynchronous block filter for the batched decode (``--sparse-block-filter async``).

The two-level selection's first level (Quest block scores over every block summary, then the
block top-k) is about half of a layer's selection time and depends only on the query and the
summaries. Here it runs one step ahead, off the critical path: at step ``t`` layer ``l``
attends over tokens picked (with step ``t``'s query, on the compute stream) inside the blocks
chosen with step ``t - 1``'s query, and right after that token stage the block filter for step
``t + 1`` runs with step ``t``'s query on a side stream, beside the compute stream's attention
and the next layers' GEMMs. The sink and the recent window are always this step's.

State per request row and layer: the blocks chosen for the row's next step (``-1`` = none).
A request's first decode step uses blocks chosen at the end of its prefill, with the query of
its last prompt token (:meth:`AsyncBlockFilter.choose_after_extend`), so every step of every
request attends a real selection. The side stream joins the compute stream once per step
(:meth:`finish_step`, after the last layer), which also orders the next step's reads after
this step's writes. Under CUDA graphs the fork and join are captured as graph edges.

Without a side stream (CPU) the filter runs in line: the same results, nothing hidden. The
reference decode (``--sparse-impl reference``, per request on the host) keeps each row's previous
query instead (:class:`PreviousQueries`) and ranks the blocks with it: the same selection, for the
CPU accuracy suite (a request may ask for it: ``custom_params.sparse.block_filter``).

Measured: ≈ 7% off a 128k decode step on an H200, and 15 points off the CPU accuracy suite
(SmolLM2, budgets 64 / 128: benchmarks/results/accuracy/accuracy_async_filter_smollm2.md), so it is
off by default.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

# The side stream's kernels are short; at the highest priority each gets SMs as soon as the
# compute stream's running blocks drain, instead of queueing behind a whole GEMM.
SIDE_STREAM_PRIORITY = -1


class AsyncBlockFilter:
    """The blocks each request row attends at its next decode step, per layer, and the side
    stream that chooses them."""

    def __init__(self, num_layers: int, rows: int, num_kv_heads: int, k_blocks: int,
                 max_batch: int, num_q_heads: int, head_dim: int, device: Any,
                 dtype: torch.dtype) -> None:
        self.device = torch.device(device)
        self.k_blocks = k_blocks
        # [layers, rows, Hkv, k] int32: what each row attends at its next step
        self.next_blocks = torch.full((num_layers, rows, num_kv_heads, k_blocks), -1,
                                      dtype=torch.int32, device=self.device)
        # The side stream reads the query after the layer returns, when the compute stream may
        # already reuse the query's memory: it reads a copy kept per layer instead.
        self._queries = torch.empty(num_layers, max_batch, num_q_heads, head_dim, dtype=dtype,
                                    device=self.device)
        self._side = (torch.cuda.Stream(self.device, priority=SIDE_STREAM_PRIORITY)
                      if self.device.type == "cuda" else None)
        self._forked = False

    def nbytes(self) -> int:
        return (self.next_blocks.numel() * self.next_blocks.element_size()
                + self._queries.numel() * self._queries.element_size())

    def candidates(self, layer: int, req_pool_indices: Tensor) -> Tensor:
        """``[B, Hkv, k]``: the blocks chosen for this step of each request of the batch."""
        return self.next_blocks[layer].index_select(0, req_pool_indices.long())

    def choose_next(self, layer: int, q: Tensor, req_pool_indices: Tensor,
                    select_blocks: Any) -> None:
        """After the layer's token stage: choose the rows' blocks for their next step with this
        step's query ``q`` ``[B, Hq, D]``. ``select_blocks(q, table)`` runs the block filter
        (:func:`~sglang_ext.kernels.sparse_decode.select_blocks_batched` bound to the layer's
        summaries and the batch), writing each request's blocks into its row of ``table``
        ``[rows, Hkv, k]`` (its top-k scatters them: no copy after it)."""
        batch = q.shape[0]
        if batch > self._queries.shape[1]:
            raise ValueError(f"batch {batch} exceeds the filter's max_batch "
                             f"{self._queries.shape[1]}")
        query = self._queries[layer, :batch]
        query.copy_(q)
        if self._side is None:
            select_blocks(query, self.next_blocks[layer])
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        self._forked = True
        with torch.cuda.stream(self._side):
            select_blocks(query, self.next_blocks[layer])

    def choose_after_extend(self, layer: int, q_last: Tensor, req_pool_indices: Tensor,
                            select_blocks: Any) -> None:
        """At the end of an extend (in line): each request's first decode step attends the
        blocks its last prompt token's query ``q_last`` ``[B, Hq, D]`` chooses."""
        select_blocks(q_last, self.next_blocks[layer])

    def finish_step(self) -> None:
        """The join, after the last layer: the step ends when its block filters have."""
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._forked = False


def last_token_queries(q: Tensor, extend_seq_lens: Tensor) -> Tensor:
    """``[B, Hq, D]``: the query of each request's last extended token, from an extend's
    ``q`` ``[tokens, Hq, D]`` and its per-request token counts ``[B]``."""
    ends = torch.cumsum(extend_seq_lens.to(device=q.device, dtype=torch.long), 0) - 1
    return q.index_select(0, ends)


class PreviousQueries:
    """The reference (per-request) decode's asynchronous filter: per request row, the length
    and each layer's query of its previous step (of its last prompt token after a prefill), which
    rank its blocks at the next step (``select_token_mask``'s ``block_query``). Host-side: the
    reference decode loops over requests anyway. One entry per row, replaced when the row is
    prefilled again: bounded by the rows, nothing to free on abort."""

    def __init__(self) -> None:
        self._rows: dict[int, dict[int, tuple[int, Tensor]]] = {}

    def get(self, row: int, layer: int) -> Optional[tuple[int, Tensor]]:
        """(length, query [Hq, D]) of the row's previous step at ``layer``, or None (then the
        block filter runs with this step's query)."""
        return self._rows.get(row, {}).get(layer)

    def put(self, row: int, layer: int, length: int, q: Tensor) -> None:
        self._rows.setdefault(row, {})[layer] = (length, q.detach().clone())
