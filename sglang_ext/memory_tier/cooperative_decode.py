"""Fluxion's cooperative attention in the serving path: the sync tier's decode step, per layer.

``--sparse-cooperative on`` (with ``--sparse-tier sync`` and eager decode). A step's selection is
split per (request, kv head) into the blocks resident on the device (GPU-homed, sink and window
pages, working-set slots: ``WorkingSetTier.page_maps``) and the misses, which are only in host
memory. :func:`cooperative.plan_split` lets the :class:`PriorityScheduler` pick the misses the CPU
workers attend straight from the host store (:class:`HostAttentionWorkers`); the device attends
the rest, and the two partial attentions are merged exactly by log-sum-exp. The CPU is handed the
exact tokens of its blocks that the step selected (two_level keeps part of a block; a block may
reach into the recent window), so the merged output is attention over exactly the selection.

The cost model is calibrated once, at the first tiered decode (``calibrate_cpu_cost`` on the
host store, a few small rounds): the CPU side is measured, the device side keeps
``CostModel``'s defaults (the benchmark, ``benchmarks/bench_fluxion.py``, measures those on a
GPU). ``SGLANG_EXT_TEST_COOP_ALL_CPU=1`` is a **test-only** override: a free CPU in the cost
model, so the scheduler hands the CPU every miss (the end-to-end tests use it to make the CPU
path run on a 2-core machine whose calibrated CPU would get nothing).

Counters (cumulative): CPU-attended (request, kv head, block) triples and their tokens, misses
left to the device, planned and skipped layers; :meth:`CooperativeTier.read_stats` merges them
into the tier stats log line and ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import Tensor

from sglang_ext.memory_tier.cooperative import (
    CostModel,
    HostAttentionWorkers,
    PriorityScheduler,
    calibrate_cpu_cost,
    plan_split,
)
from sglang_ext.memory_tier.host_store import HostKVStore
from sglang_ext.selection.reference import (
    _mask_to_indices,
    merge_attention_states,
    sparse_attention,
    sparse_attention_with_lse,
)

if TYPE_CHECKING:
    from sglang_ext.kernels.sparse_decode import DecodeRows, LayerCache

logger = logging.getLogger(__name__)

TEST_ALL_CPU_ENV = "SGLANG_EXT_TEST_COOP_ALL_CPU"  # test-only: see the module doc
STAT_KEYS = ("coop_cpu_blocks", "coop_cpu_tokens", "coop_device_miss_blocks",
             "coop_planned_layers", "coop_skipped_layers")


def test_cost_override() -> Optional[CostModel]:
    """The test-only cost model (``SGLANG_EXT_TEST_COOP_ALL_CPU=1``): the CPU costs nothing, so
    every miss set finishes "before" the device and goes to the CPU."""
    if os.environ.get(TEST_ALL_CPU_ENV, "0") != "1":
        return None
    return CostModel(cpu_s_per_token=0.0, cpu_fixed_s=0.0)


class CooperativeTier:
    """The scheduler, the CPU workers and the counters of one tiered pool's cooperation."""

    def __init__(self, host: HostKVStore, gpu_tokens: int, page_size: int, threads: int) -> None:
        self.host = host
        self.gpu_tokens = gpu_tokens  # logical slot - gpu_tokens = host slot
        self.page_size = page_size
        self.workers = HostAttentionWorkers(threads)
        self.scheduler: Optional[PriorityScheduler] = None  # built at the first use
        self.stats = dict.fromkeys(STAT_KEYS, 0)

    def close(self) -> None:
        self.workers.close()

    def _ensure_scheduler(self, group: int, scaling: float) -> PriorityScheduler:
        if self.scheduler is None:
            cost = test_cost_override()
            if cost is None:
                t0 = time.perf_counter()
                fixed, per_token = calibrate_cpu_cost(
                    self.workers, self.host.k[0], self.host.v[0], group, self.page_size,
                    scaling, repeats=3)
                cost = CostModel(cpu_fixed_s=fixed, cpu_s_per_token=per_token)
                logger.info("sglang_ext cooperative: %d CPU threads calibrated in %.2f s: %.3g s "
                            "per task + %.3g s per token", self.workers.threads,
                            time.perf_counter() - t0, fixed, per_token)
            else:
                logger.info("sglang_ext cooperative: test cost model (%s=1): every miss goes to "
                            "the CPU", TEST_ALL_CPU_ENV)
            self.scheduler = PriorityScheduler(cost, self.workers.threads)
        return self.scheduler

    def read_stats(self) -> dict[str, int]:
        return dict(self.stats)

    def attend_reference(self, layer: int, q: Tensor, rows: list[int], masks: list[Tensor],
                         keys: list[Tensor], values: list[Tensor], page_map: Tensor,
                         req_to_token: Tensor, scaling: float) -> Tensor:
        """The reference decode's sparse rows of one layer: ``q`` ``[B, Hq, D]``; per request its
        row, token mask ``[Hkv, L]`` and K/V ``[L, Hkv, D]`` read from their homes;
        ``page_map`` ``[rows, Hkv, max_blocks]`` (the layer's residency). Returns ``[B, Hq, Dv]``
        in q's dtype: attention over exactly each mask."""
        num_kv_heads = masks[0].shape[0]
        scheduler = self._ensure_scheduler(q.shape[1] // num_kv_heads, scaling)
        if not scheduler.worth_planning():
            # Every miss stays on the device: the step is the non-cooperative one.
            self.stats["coop_skipped_layers"] += 1
            return torch.stack([sparse_attention(q[i], keys[i], values[i], masks[i], scaling)
                                for i in range(len(rows))])
        ps = self.page_size
        selected, resident = self._selected_blocks(rows, masks, page_map)
        plan, _, cpu_blocks, device_misses = plan_split(selected, resident, scheduler, ps)
        # Per request, the selected tokens of its CPU blocks, and their host slots.
        num_blocks = resident.shape[2]  # padding (-1) lands in an extra column, dropped after
        on_cpu = torch.zeros(*resident.shape[:2], num_blocks + 1, dtype=torch.bool,
                             device=resident.device)
        on_cpu.scatter_(2, torch.where(cpu_blocks >= 0, cpu_blocks, num_blocks).long(), True)
        on_cpu = on_cpu[..., :num_blocks]
        cpu_masks, dev_masks, tokens = [], [], []
        for i, (row, mask) in enumerate(zip(rows, masks)):
            length = mask.shape[1]
            cpu_tok = mask & on_cpu[i][:, torch.arange(length, device=mask.device) // ps]
            pos, valid = _mask_to_indices(cpu_tok)
            slots = req_to_token[row, :length].long()[pos] - self.gpu_tokens
            tokens.append(torch.where(valid, slots, -1))
            cpu_masks.append(cpu_tok)
            dev_masks.append(mask & ~cpu_tok)
        width = max(t.shape[1] for t in tokens)
        host_tokens = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=-1)
                                   for t in tokens]).cpu()
        future = self.workers.submit_tokens(q.cpu(), self.host.k[layer], self.host.v[layer],
                                            host_tokens, plan, scaling)
        # The device part meanwhile, in float32 so that the merge rounds once, like the
        # non-cooperative path.
        parts = [sparse_attention_with_lse(q[i].float(), keys[i], values[i], dev_masks[i],
                                           scaling) for i in range(len(rows))]
        dev_out = torch.stack([o for o, _ in parts])
        dev_lse = torch.stack([s for _, s in parts])
        cpu_out, cpu_lse = future.result()
        scheduler.observe(plan, future.cpu_seconds)
        out, _ = merge_attention_states(dev_out, dev_lse, cpu_out.to(dev_out.device),
                                        cpu_lse.to(dev_lse.device))
        self.stats["coop_planned_layers"] += 1
        self.stats["coop_cpu_blocks"] += int((cpu_blocks >= 0).sum())
        self.stats["coop_cpu_tokens"] += int(sum(int(m.sum()) for m in cpu_masks))
        self.stats["coop_device_miss_blocks"] += int((device_misses >= 0).sum())
        return out.to(q.dtype)

    def attend_kernels(self, tier: Any, layer: int, q: Tensor, cache: LayerCache,
                       rows: DecodeRows, params: Any, scaling: float, workspace: Any,
                       locality: Optional[Any] = None) -> Tensor:
        """The batched decode's layer (``--sparse-impl triton``, sync tier, eager): the block
        filter's choice is split when it is made; the misses the scheduler leaves to the device
        are fetched, the CPU's are not (two_level: the CPU scores their tokens for the token
        stage); the device attends the slots it holds, the CPU the selected tokens of its
        blocks (``positions`` whose block is not resident), and the two merge. ``tier`` is the
        pool's :class:`WorkingSetTier`; ``cache`` (:class:`LayerCache`: the layer's keys,
        values, summaries and channels; its labels are not read with the tier's page map) and
        ``rows`` (:class:`DecodeRows`) and the rest as :func:`sparse_decode_batched`. Returns
        ``[B, Hq, Dv]`` in q's dtype."""
        from sglang_ext.kernels.sparse_attention import sparse_attention_batched
        from sglang_ext.kernels.sparse_decode import SelectionInputs, select_slots_batched

        k_buffer, v_buffer, channels = cache.k_buffer, cache.v_buffer, cache.channels
        req_to_token, req_pool_indices, seq_lens = (rows.req_to_token, rows.req_pool_indices,
                                                    rows.seq_lens)
        batch = q.shape[0]
        num_kv_heads = k_buffer.shape[1]
        scheduler = self._ensure_scheduler(q.shape[1] // num_kv_heads, scaling)
        fetch, _ = tier.decode_hooks(layer, req_pool_indices, req_to_token, k_buffer, v_buffer)
        page_map = tier.page_map(layer)
        step: dict[str, Any] = {}

        def on_blocks(top: Tensor) -> None:
            if not scheduler.worth_planning():
                fetch(top)  # the non-cooperative step
                return
            resident = page_map.index_select(0, req_pool_indices.long()) >= 0
            plan, _, cpu_blocks, device_misses = plan_split(top, resident, scheduler,
                                                            self.page_size)
            fetch(torch.where(cpu_blocks >= 0, torch.full_like(top, -1), top))
            step.update(plan=plan, cpu_blocks=cpu_blocks, device_misses=device_misses)

        def on_token_scores(scores: Tensor, cand: Tensor) -> None:
            if "plan" in step:
                self._score_cpu_tokens(layer, scores, step["cpu_blocks"], q, req_to_token,
                                       req_pool_indices, seq_lens, params, channels,
                                       None if locality is None
                                       else workspace.block_scores[:batch])

        slots, positions = select_slots_batched(
            q, cache, rows, params, workspace,
            SelectionInputs(page_map=page_map, on_blocks=on_blocks, locality=locality,
                            on_token_scores=on_token_scores),
            return_positions=True)
        attend = dict(num_splits=workspace._splits_for(batch), lse=workspace.lse[:batch],
                      partial_o=workspace.partial_o[:batch],
                      partial_lse=workspace.partial_lse[:batch])
        if "plan" not in step:
            self.stats["coop_skipped_layers"] += 1
            out, _ = sparse_attention_batched(q, k_buffer, v_buffer, slots, scaling,
                                              out=workspace.out[:batch], **attend)
            return out
        plan = step["plan"]
        # The CPU's tokens: selected positions the device does not hold (its blocks only:
        # every other miss was fetched above).
        cpu_tok = (positions >= 0) & (slots < 0)
        row_index = req_pool_indices.long()[:, None, None]
        host_slots = (req_to_token[row_index, positions.long().clamp(min=0)].long()
                      - self.gpu_tokens)
        tokens = torch.where(cpu_tok, host_slots, torch.full_like(host_slots, -1)).cpu()
        future = self.workers.submit_tokens(q.cpu(), self.host.k[layer], self.host.v[layer],
                                            tokens, plan, scaling)
        # The device part meanwhile, in float32 so that the merge rounds once.
        dev_out = torch.empty(q.shape[0], q.shape[1], v_buffer.shape[2], dtype=torch.float32,
                              device=q.device)
        dev_out, dev_lse = sparse_attention_batched(q, k_buffer, v_buffer, slots, scaling,
                                                    out=dev_out, **attend)
        cpu_out, cpu_lse = future.result()
        scheduler.observe(plan, future.cpu_seconds)
        out, _ = merge_attention_states(dev_out, dev_lse, cpu_out.to(q.device),
                                        cpu_lse.to(q.device))
        self.stats["coop_planned_layers"] += 1
        self.stats["coop_cpu_blocks"] += int((step["cpu_blocks"] >= 0).sum())
        self.stats["coop_cpu_tokens"] += int((tokens >= 0).sum())
        self.stats["coop_device_miss_blocks"] += int((step["device_misses"] >= 0).sum())
        return out.to(q.dtype)

    def _score_cpu_tokens(self, layer: int, scores: Tensor, cpu_blocks: Tensor, q: Tensor,
                          req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor,
                          params: Any, channels: Optional[Tensor],
                          forced: Optional[Tensor]) -> None:
        """two_level's token scores (label channels, max over the kv head's query heads) of the
        CPU's candidate blocks, from host memory, into ``scores`` ``[B, Hkv, C*bs]`` (the
        device scored them ``-inf``: not resident); ``forced`` (locality: block scores, ``+inf``
        for kept blocks) keeps the kept blocks' middle tokens first, as the device does."""
        ps = self.page_size
        lengths = seq_lens.long()[:, None, None, None]
        offs = torch.arange(ps, device=cpu_blocks.device)
        pos = cpu_blocks.long()[..., None] * ps + offs  # [B, Hkv, C, bs]
        middle = (cpu_blocks[..., None] >= 0) & (pos >= params.sink) & \
            (pos < lengths - params.window)
        b, h, c, o = middle.nonzero(as_tuple=True)
        if b.numel() == 0:
            return
        rows = req_pool_indices.long()[b]
        host_slot = (req_to_token[rows, pos[b, h, c, o]].long() - self.gpu_tokens).cpu()
        hc = h.cpu()
        keys = self.host.k[layer][hc, host_slot].float()  # [n, D]
        group = q.shape[1] // cpu_blocks.shape[1]
        qg = q.float().view(q.shape[0], cpu_blocks.shape[1], group, -1)[b, h].cpu()  # [n, G, D]
        if channels is not None:
            ch = channels.long()[h].cpu()  # [n, r]
            qg = qg.gather(2, ch[:, None, :].expand(-1, group, -1))
            keys = keys.gather(1, ch)
        value = (qg * keys[:, None, :]).sum(-1).amax(-1).to(scores.device)
        if forced is not None:
            kept = torch.isinf(forced[b, h, cpu_blocks.long()[b, h, c]]) & \
                (forced[b, h, cpu_blocks.long()[b, h, c]] > 0)
            value = torch.where(kept, torch.full_like(value, float("inf")), value)
        scores[b, h, c * ps + o] = value

    def _selected_blocks(self, rows: list[int], masks: list[Tensor],
                         page_map: Tensor) -> tuple[Tensor, Tensor]:
        """``(selected [B, Hkv, K] block ids, -1 padded; resident [B, Hkv, N] bool)`` of the
        requests' token masks, for :func:`plan_split`."""
        ps = self.page_size
        num_blocks = max(-(-m.shape[1] // ps) for m in masks)
        per_request = []
        for mask in masks:
            padded = torch.nn.functional.pad(mask, (0, num_blocks * ps - mask.shape[1]))
            ids, valid = _mask_to_indices(padded.view(mask.shape[0], num_blocks, ps).any(-1))
            per_request.append(torch.where(valid, ids, -1))
        width = max(max(s.shape[1] for s in per_request), 1)
        selected = torch.stack([torch.nn.functional.pad(s, (0, width - s.shape[1]), value=-1)
                                for s in per_request])
        index = torch.tensor(rows, device=page_map.device, dtype=torch.long)
        resident = page_map.index_select(0, index)[..., :num_blocks] >= 0
        return selected.to(resident.device), resident
