"""The GPU side of the CPU tier: page maps, working-set slots, and the per-step fetch schedule.

A request row is either **resident** (its whole KV in ordinary device pages; the page map
holds every block, identical for all layers and kv heads) or **tiered** (its KV lives on the
host; the GPU keeps, per layer and kv head, the blocks of the last selection in ``num_slots``
working-set slots, plus the sink and recent-window blocks in ordinary device pages, mapped
like a resident request's). Sparse decode reads keys through the page map
(:func:`kernels.sparse_decode.select_slots_batched` with ``page_map``), so both kinds decode
in one batch.

Per layer, a decode step's block filter picks the blocks ``C_t`` (two_level's candidates or
quest's blocks). Two schedules (``mode``):

* ``sync``: the residency update for ``C_t`` (:func:`kernels.working_set.update_working_set`,
  the set difference) and the host->GPU gather of the misses run on the compute stream before
  the token stage: the step attends over exactly the tokens the untiered path would. Transfers
  are on the critical path.
* ``async`` (AsyncTLS): the step attends with the blocks chosen at the previous step
  (``C_{t-1}``, resident since then), and after the layer's attention the update + gather for
  ``C_t`` runs on a side stream, overlapping the remaining layers; :meth:`finish_step` joins
  the side stream before the step ends (the fence: the next step finds ``C_t`` resident).
  The update runs after the layer's attention, so it may evict ``C_{t-1}``: no double
  buffering is needed and ``num_slots`` equals the block filter's k. A request's first step
  attends the blocks its pool preloaded (:meth:`WorkingSetTier.preload`).
* ``async`` with ``sync_steps = N > 0``: a request's first N decode steps run the ``sync``
  schedule (its ``C_t`` fetched before the token stage and attended), later ones the ``async``
  one. A short answer is decoded in its first steps, where the lagged schedule would attend the
  preloaded blocks and then a one-step-stale selection; those steps' transfers are exposed.
* ``async`` with ``attend_resident``: a step attends the blocks of ``C_t`` that are already
  resident (most of them: the selection turns over slowly) and, in place of each block of
  ``C_t`` still on the host, one block of ``C_{t-1}`` not in ``C_t`` (resident: prefetched at
  the previous step). Nothing more is waited for; only the misses are stale.

Everything a step launches has static shapes and no host sync, so it is captured in the
decode CUDA graph with the rest of the step (the side stream forks and joins inside it).
Counters (wanted blocks, missed = transferred blocks) accumulate on the device; read them with
:meth:`read_stats` outside the step.

With ``timing`` on, a stream clock (:mod:`kernels.stream_clock`) measures the transfer work
(residency update + gather, wherever it runs) and the part of it the step waits for: under
``async`` the compute stream's wait at the fence, under ``sync`` (or without a side stream) all
of it. ``hidden_fraction = 1 - exposed / transfer``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from sglang_ext.kernels.host_gather import DEFAULT_MAX_PROGRAMS
from sglang_ext.kernels.stream_clock import StreamClock
from sglang_ext.kernels.working_set import update_working_set
from sglang_ext.memory_tier.host_store import HostKVStore

MODES = ("sync", "async")
# torch's stream priority (lower = higher; out-of-range values map to the device's highest)
PREFETCH_STREAM_PRIORITY = -1
# StreamClock slots: marks, then nanosecond accumulators.
_FETCH_START, _FENCE, _TRANSFER_NS, _EXPOSED_NS = range(4)


class WorkingSetTier:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        max_rows: int,
        max_blocks: int,
        num_slots: int,
        page_size: int,
        max_batch: int,
        host: HostKVStore,
        device: torch.device | str,
        mode: str = "async",
        gather_programs: Optional[int] = None,
        host_page_offset: int = 0,
        timing: bool = False,
        sync_steps: int = 0,
        attend_resident: bool = False,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} (got {mode!r})")
        if sync_steps < 0 or (sync_steps and mode != "async"):
            raise ValueError(f"sync_steps must be >= 0 and only with mode async (got "
                             f"{sync_steps} with {mode})")
        if attend_resident and mode != "async":
            raise ValueError("attend_resident goes with mode async")
        self.mode = mode
        self.sync_steps = sync_steps
        self.attend_resident = attend_resident
        self.gather_programs = gather_programs  # SMs the async gather may occupy (None: all)
        self.host_page_offset = host_page_offset  # logical page - offset = host page
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_slots = num_slots
        self.page_size = page_size
        self.max_batch = max_batch
        self.host = host
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        # [rows, layers, Hkv, max_blocks]: device page of block j for (layer, head), -1: absent.
        self.page_maps = torch.full((max_rows, num_layers, num_kv_heads, max_blocks), -1, **i32)
        self.slot_block = torch.full((max_rows, num_layers, num_kv_heads, num_slots), -1, **i32)
        self.slot_pages = torch.full((max_rows, num_slots), -1, **i32)
        self.tiered = torch.zeros(max_rows, **i32)
        # async with sync_steps: decode steps each row has run (saturating at sync_steps), and
        # per step the tiered rows still in their first sync_steps steps (fresh: fetched on the
        # critical path) and the others (stale: prefetched after the layer), as 0/1 per row.
        self.decoded_steps = torch.zeros(max_rows, **i32)
        self._fresh_tiered = torch.zeros(max_rows, **i32)
        self._stale_tiered = torch.zeros(max_rows, **i32)
        self._fresh_rows = torch.zeros(max_batch, **i32)
        # async: the blocks each (row, layer, head) attends at its next step (C_{t-1}).
        self.attend_rows = torch.full((max_rows, num_layers, num_kv_heads, num_slots), -1, **i32)
        # per step scratch (static addresses for CUDA graphs)
        self._attend = torch.full((num_layers, max_batch, num_kv_heads, num_slots), -1, **i32)
        self._wanted = torch.full((num_layers, max_batch, num_kv_heads, num_slots), -1, **i32)
        self._src = torch.full((num_layers, max_batch, num_kv_heads, num_slots), -1, **i32)
        self._dst = torch.full((num_layers, max_batch, num_kv_heads, num_slots), -1, **i32)
        self._heads = (
            torch.arange(num_kv_heads, **i32)[None, :, None]
            .expand(max_batch, num_kv_heads, num_slots).contiguous()
        )
        self.stats = torch.zeros(3, dtype=torch.int64, device=self.device)
        # attend_resident: (blocks selected, of them attended at their own step)
        self.attend_stats = torch.zeros(2, dtype=torch.int64, device=self.device)
        # [rows, R] each row's recent-window ring: its device pages and the block each holds
        # (set by the pool). A wanted block in the ring is fetched into a slot before the ring
        # reuses its page (kernels/working_set.py).
        self.ring_pages: Optional[Tensor] = None
        self.ring_blocks: Optional[Tensor] = None
        # The prefetch stream has the highest priority: the compute stream keeps every SM busy,
        # and at the default priority each small kernel of a layer's fetch (the working-set
        # update, the gather) waits for the running kernels' blocks to drain
        # before it gets an SM, which stretches a 0.3 ms copy over most of a layer. Priority
        # only orders the blocks waiting for an SM; it does not preempt running ones.
        self._side = (torch.cuda.Stream(self.device, priority=PREFETCH_STREAM_PRIORITY)
                      if self.device.type == "cuda" else None)
        self._forked = False
        self.clock = StreamClock(4, self.device) if timing else None
        self._clock_started = False

    # ------------------------------------------------------------ host-side bookkeeping
    # (called by the pool manager between steps, in stream order)

    def map_resident(self, row: int, blocks: Tensor, pages: Tensor) -> None:
        """Map blocks of ``row`` to ordinary device pages (all layers and heads)."""
        self.page_maps[row, :, :, blocks.long()] = pages.to(self.page_maps)[None, None, :]

    def unmap(self, row: int, blocks: Tensor) -> None:
        self.page_maps[row, :, :, blocks.long()] = -1

    def attach(self, row: int, slot_pages: Tensor) -> None:
        """Make ``row`` tiered with ``num_slots`` working-set device pages (empty slots)."""
        if slot_pages.numel() != self.num_slots:
            raise ValueError(f"need {self.num_slots} working-set pages, got {slot_pages.numel()}")
        self.slot_pages[row] = slot_pages.to(self.slot_pages)
        self.slot_block[row] = -1
        self.attend_rows[row] = -1
        self.decoded_steps[row] = 0
        self.tiered[row] = 1
        if self.clock is not None and not self._clock_started:
            # The clock counts from the first tiered request: before it, SGLang's CUDA-graph
            # capture and warm-up run the fetch path eagerly, JIT compiles included (seconds on
            # a fresh machine), with nothing to transfer.
            self.clock.buf.zero_()
            self._clock_started = True

    def preload(self, row: int, blocks: Tensor) -> None:
        """Record that the first ``len(blocks)`` working-set slots of ``row`` already hold
        ``blocks`` (every layer and kv head; the caller copied the data) and that the row's
        next step attends them. A request starts decoding with a working set, not an empty one:
        under ``async`` its first step attends these blocks instead of sink + window alone."""
        n = blocks.numel()
        if n > self.num_slots:
            raise ValueError(f"{n} blocks for {self.num_slots} working-set slots")
        if n == 0:
            return
        blocks = blocks.to(device=self.device, dtype=torch.int32)
        self.slot_block[row, :, :, :n] = blocks
        self.page_maps[row, :, :, blocks.long()] = self.slot_pages[row, :n]
        self.attend_rows[row, :, :, :n] = blocks

    def detach(self, row: int) -> None:
        """Forget ``row`` (finished, aborted, retracted): no mappings, no slots."""
        self.tiered[row] = 0
        self.page_maps[row] = -1
        self.slot_block[row] = -1
        self.slot_pages[row] = -1
        self.attend_rows[row] = -1
        self.decoded_steps[row] = 0

    # ------------------------------------------------------------ per step, per layer

    def page_map(self, layer: int) -> Tensor:
        return self.page_maps[:, layer]

    def decode_hooks(
        self, layer: int, req_pool_indices: Tensor, req_to_token: Tensor,
        k_buffer: Tensor, v_buffer: Tensor,
    ) -> tuple[Callable[[Tensor], None], Optional[Tensor]]:
        """``(on_blocks, attend_blocks)`` for :func:`sparse_decode_batched` at this layer."""
        batch = req_pool_indices.shape[0]
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the tier's max_batch {self.max_batch}")

        if self.mode == "sync":
            def fetch_now(blocks: Tensor) -> None:
                self._timed_fetch(layer, blocks, req_pool_indices, req_to_token, k_buffer,
                                  v_buffer, exposed=True)
            return fetch_now, None

        wanted = self._wanted[layer, :batch]
        attend = self._attend[layer, :batch]
        torch.index_select(self.attend_rows[:, layer], 0, req_pool_indices, out=attend)

        def remember(blocks: Tensor) -> None:
            wanted.copy_(blocks)
            if self.attend_resident:
                attend.copy_(resident_first(blocks, attend, self.page_maps[:, layer],
                                            req_pool_indices))

        def count_attended(blocks: Tensor) -> None:
            if self.attend_resident:  # a block attended at its own step keeps its position
                valid = blocks >= 0
                self.attend_stats += torch.stack([valid.sum(), (valid & (attend == blocks)).sum()])
        if not self.sync_steps:
            def on_blocks(blocks: Tensor) -> None:
                remember(blocks)
                count_attended(blocks)
            return on_blocks, attend

        if layer == 0:  # this step's split of the tiered rows, for every layer
            fresh = self.decoded_steps < self.sync_steps
            torch.mul(self.tiered, fresh, out=self._fresh_tiered)
            torch.mul(self.tiered, ~fresh, out=self._stale_tiered)
        fresh_rows = self._fresh_rows[:batch]
        torch.index_select(self._fresh_tiered, 0, req_pool_indices, out=fresh_rows)

        def fetch_fresh_rows_now(blocks: Tensor) -> None:
            remember(blocks)
            self._timed_fetch(layer, blocks, req_pool_indices, req_to_token, k_buffer,
                              v_buffer, exposed=True, tiered=self._fresh_tiered)
            attend.copy_(torch.where(fresh_rows[:, None, None] != 0, blocks, attend))
            count_attended(blocks)
        return fetch_fresh_rows_now, attend

    def after_layer(
        self, layer: int, req_pool_indices: Tensor, req_to_token: Tensor,
        k_buffer: Tensor, v_buffer: Tensor,
    ) -> None:
        """async: after the layer's attention, fetch its ``C_t`` on the side stream."""
        if self.mode != "async":
            return
        batch = req_pool_indices.shape[0]
        wanted = self._wanted[layer, :batch]
        # with sync_steps the fresh rows fetched C_t already: the rest prefetch it
        tiered = self._stale_tiered if self.sync_steps else self.tiered
        if self._side is not None:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
            self._forked = True
            with torch.cuda.stream(self._side):
                self._timed_fetch(layer, wanted, req_pool_indices, req_to_token, k_buffer,
                                  v_buffer, exposed=False, tiered=tiered)
                self.attend_rows[:, layer].index_copy_(0, req_pool_indices, wanted)
        else:  # no side stream (CPU): the fetch runs in line, nothing hides it
            self._timed_fetch(layer, wanted, req_pool_indices, req_to_token, k_buffer, v_buffer,
                              exposed=True, tiered=tiered)
            self.attend_rows[:, layer].index_copy_(0, req_pool_indices, wanted)
        if self.sync_steps and layer == self.num_layers - 1:
            # padded graph rows are row 0 (SGLang zeroes them), which is never a request's
            steps = self.decoded_steps.index_select(0, req_pool_indices)
            self.decoded_steps.index_copy_(0, req_pool_indices,
                                           (steps + 1).clamp_(max=self.sync_steps))

    def finish_step(self) -> None:
        """The fence: the compute stream waits for every prefetch of this step (with timing, the
        wait is what the step could not hide)."""
        if self._forked:
            if self.clock is not None:
                self.clock.mark(_FENCE)
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            if self.clock is not None:
                self.clock.add_since(_FENCE, _EXPOSED_NS)
            self._forked = False

    def _timed_fetch(self, layer: int, blocks: Tensor, req_pool_indices: Tensor,
                     req_to_token: Tensor, k_buffer: Tensor, v_buffer: Tensor,
                     exposed: bool, tiered: Optional[Tensor] = None) -> None:
        """:meth:`_fetch` on the current stream, timed when ``timing`` is on; ``exposed``: it
        runs where the step waits for it (not on the side stream)."""
        if self.clock is None:
            self._fetch(layer, blocks, req_pool_indices, req_to_token, k_buffer, v_buffer,
                        exposed, tiered)
            return
        self.clock.mark(_FETCH_START)
        self._fetch(layer, blocks, req_pool_indices, req_to_token, k_buffer, v_buffer, exposed,
                    tiered)
        self.clock.add_since(_FETCH_START, _TRANSFER_NS)
        if exposed:
            self.clock.add_since(_FETCH_START, _EXPOSED_NS)

    def _fetch(self, layer: int, blocks: Tensor, req_pool_indices: Tensor, req_to_token: Tensor,
               k_buffer: Tensor, v_buffer: Tensor, critical: bool,
               tiered: Optional[Tensor] = None) -> None:
        """Make ``blocks`` resident for the rows marked in ``tiered`` (default: every tiered
        row; the others are left as they are); ``critical``: the step waits for it."""
        batch = blocks.shape[0]
        if blocks.shape[-1] != self.num_slots:
            raise ValueError(f"the block filter keeps {blocks.shape[-1]} blocks per head but the "
                             f"tier has {self.num_slots} working-set slots")
        src, dst = self._src[layer, :batch], self._dst[layer, :batch]
        update_working_set(
            blocks, req_pool_indices, self.tiered if tiered is None else tiered,
            self.page_maps[:, layer],
            self.slot_block[:, layer], self.slot_pages, req_to_token, self.page_size,
            src_pages=src, dst_pages=dst, stats=self.stats, host_page_offset=self.host_page_offset,
            ring_pages=self.ring_pages, ring_blocks=self.ring_blocks,
        )
        # on the critical path the copy gets every SM; on the side stream it runs beside the
        # next layers' kernels, so a few persistent programs (the gather's default) suffice.
        programs = self.gather_programs if self.gather_programs is not None else (
            None if critical else DEFAULT_MAX_PROGRAMS)
        self.host.load(layer, self._heads[:batch].reshape(-1), src.reshape(-1), dst.reshape(-1),
                       k_buffer, v_buffer, max_programs=programs)

    def read_stats(self) -> dict[str, float]:
        wanted, missed, host_wanted = (int(x) for x in self.stats.tolist())
        stats = {
            "wanted_blocks": wanted,
            "transferred_blocks": missed,
            "hit_rate": 1.0 - missed / wanted if wanted else 1.0,
            # GPU-homed blocks always hit: the rate among host-homed ones sizes the transfers
            "host_wanted_blocks": host_wanted,
            "host_hit_rate": 1.0 - missed / host_wanted if host_wanted else 1.0,
        }
        if self.attend_resident:
            selected, current = (int(x) for x in self.attend_stats.tolist())
            # the share of the selection attended at its own step (the rest: stand-ins)
            stats["attended_current"] = current / selected if selected else 1.0
        if self.clock is not None:
            ticks = self.clock.read()
            transfer, exposed = ticks[_TRANSFER_NS], min(ticks[_EXPOSED_NS], ticks[_TRANSFER_NS])
            stats.update(transfer_s=transfer / 1e9, exposed_transfer_s=exposed / 1e9,
                         hidden_fraction=1.0 - exposed / transfer if transfer else None)
        return stats


def resident_first(current: Tensor, previous: Tensor, page_map: Tensor,
                   req_pool_indices: Tensor) -> Tensor:
    """``[B, Hkv, C]`` blocks to attend: each block of ``current`` (this step's selection) that
    ``page_map`` (``[rows, Hkv, max_blocks]``, -1: not resident) maps, and in place of the r-th
    one it does not map the r-th block of ``previous`` not in ``current`` (-1 if none). Static
    shapes, no host sync (CUDA graphs)."""
    heads = torch.arange(current.shape[1], device=current.device)
    pages = page_map[req_pool_indices[:, None, None], heads[None, :, None], current.clamp(min=0)]
    valid = current >= 0
    hit = valid & (pages >= 0)
    miss = valid & ~hit
    in_current = (previous[..., :, None] == current[..., None, :]).any(-1)
    spare = (previous >= 0) & ~in_current
    miss_rank = miss.cumsum(-1) - 1
    spare_rank = spare.cumsum(-1) - 1
    pair = (miss[..., :, None] & spare[..., None, :]
            & (miss_rank[..., :, None] == spare_rank[..., None, :]))
    stand_in = torch.where(pair, previous[..., None, :], -1).amax(-1)
    return torch.where(hit, current, torch.where(miss, stand_in, -1)).to(current.dtype)

