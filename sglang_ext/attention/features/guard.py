"""The accuracy guard (``--sparse-guard-every``): probe each request's recall now and then and
move its budget between the configured one and its maximum (selection/guard.py has the rule).

* :class:`KernelGuard`: the batched decode. Budgets, streaks, each request's own step count and
  the counters live on the device; a request's probe step runs the dense LSE of one kv head per
  layer (kernels/guard_probe.py) beside the sparse attention's own LSE, and the new budgets are
  computed after the last layer, all inside the CUDA graph. Each request probes on its own
  steps, as :class:`RequestGuard` does, so what it decodes does not depend on when the other
  requests of its batch arrived. The kernels run in a workspace sized for the largest budget,
  each request at its own top-k sizes (``row_ks``).
* :class:`ReferenceGuard`: the reference decode, one :class:`RequestGuard` per request row on
  the host.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang_ext.attention import request_overrides
from sglang_ext.attention.decode_plan import DecodeContext, DecodeFeature, LayerStep, batch_kind
from sglang_ext.config import SparseConfig
from sglang_ext.selection.guard import (
    GuardMetrics,
    GuardPolicy,
    RequestGuard,
    next_budget,
    row_top_k,
)
from sglang_ext.selection.params import SelectionParams

logger = logging.getLogger(__name__)
GUARD_REPORT_EVERY = 128  # decode steps between two reads of the CUDA guard's counters


def guard_policy(config: SparseConfig) -> Optional[GuardPolicy]:
    """The server's guard, or None when it is off."""
    if config.guard_every <= 0:
        return None
    return GuardPolicy(config.guard_every, config.guard_recall, config.budget,
                       config.effective_guard_max_budget)


class GuardTotals:
    """Probes, raised and lowered budgets so far, exported to ``/metrics`` when enabled."""

    def __init__(self, enable_metrics: bool) -> None:
        self.counts = [0, 0, 0]
        self.metrics = GuardMetrics() if enable_metrics else None

    def publish(self, counts: Optional[list[int]] = None) -> None:
        if counts is not None:
            self.counts = list(counts)
        if self.metrics is not None:
            self.metrics.update(*self.counts)


class KernelGuard(DecodeFeature):
    needs_lse = True

    def __init__(self, ctx: DecodeContext, policy: GuardPolicy) -> None:
        from sglang_ext.kernels.guard_probe import GuardProbe

        self.ctx = ctx
        self.policy = policy
        self.totals = GuardTotals(ctx.enable_metrics)
        req_to_token = ctx.req_to_token
        rows = req_to_token.shape[0]
        pool = ctx.token_to_kv_pool
        dev = ctx.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.budget = torch.full((rows,), policy.base_budget, **i32)  # every row's budget
        self.streak = torch.zeros(rows, **i32)
        # each row's sparse decode steps so far (steps whose context exceeds the largest budget)
        self.row_steps = torch.zeros(rows, **i32)
        # this step's probe control per batch entry (probe?, kv head), set in start_layers
        self.control = torch.zeros(rows, 2, **i32)
        self.counts = torch.zeros(3, dtype=torch.int64, device=dev)  # probes, raised, lowered
        self.row_ks: Any = None
        self.sparse_rows: Any = None  # this step's batch entries past the largest budget
        self.steps = 0  # decode steps of the server (for the periodic report)
        self.probe = GuardProbe(
            max_batch=rows, num_q_heads=ctx.num_q_heads, num_kv_heads=pool.head_num,
            head_dim=pool.get_key_buffer(pool.start_layer).shape[-1],
            min_len=policy.max_budget, max_context=req_to_token.shape[1], device=dev,
        )

    def before_batch(self, forward_batch: Any) -> None:
        kind = batch_kind(forward_batch)
        if kind == "extend":  # a request being prefilled starts at its base budget
            rows = forward_batch.req_pool_indices.long()
            self.budget.index_fill_(0, rows, self.policy.base_budget)
            self.streak.index_fill_(0, rows, 0)
            self.row_steps.index_fill_(0, rows, 0)
        elif kind == "decode":
            self._report()

    def _report(self) -> None:
        """Now and then read and report the counters (a host sync: rarely)."""
        self.steps += 1
        if self.steps % GUARD_REPORT_EVERY == 0:
            counts = self.counts.tolist()
            logger.info("sglang_ext guard: %d probes, %d raised, %d lowered", *counts)
            self.totals.publish(counts)

    def start_layers(self, plan: Any) -> None:
        rows = plan.rows.req_pool_indices.long()
        # This step's per-request top-k sizes, from the budgets the guard left last step.
        self.row_ks = row_top_k(self.ctx.default_params, self.budget[rows])
        # Which requests probe and which kv head, from each one's own step count (GuardPolicy's
        # rule, on device tensors); requests that still decode densely and CUDA-graph padding
        # entries (length 1) neither probe nor count the step.
        steps = self.row_steps[rows]
        self.sparse_rows = plan.rows.seq_lens > self.policy.max_budget
        control = self.control[:rows.shape[0]]
        control[:, 0] = self.sparse_rows & self.policy.is_probe_step(steps)
        control[:, 1] = self.policy.probe_head(steps, self.ctx.token_to_kv_pool.head_num)
        self.probe.recall_sum.zero_()

    def layer_inputs(self, plan: Any, step: LayerStep) -> dict[str, Any]:
        return {"row_ks": self.row_ks}

    def after_layer(self, plan: Any, step: LayerStep, lse: Optional[torch.Tensor]) -> None:
        rows = plan.rows
        # the dense LSE over the keys as the sparse one read them (times the KV scale)
        self.probe.run(self.control[:rows.req_pool_indices.shape[0]], step.q,
                       step.cache.k_buffer, rows.req_to_token, rows.req_pool_indices,
                       rows.seq_lens, lse, step.scaling * step.cache.k_scale)

    def end_layers(self, plan: Any) -> None:
        """The probed requests' new budgets, computed on the device; padding entries (length 1)
        and dense requests change nothing, and duplicate padding rows add zeros."""
        rows = plan.rows.req_pool_indices.long()
        batch = rows.shape[0]
        recall = self.probe.recall_sum[:batch] / self.ctx.num_layers
        old, old_streak = self.budget[rows], self.streak[rows]
        new, streak = next_budget(self.policy, old, old_streak, recall)
        probed = self.control[:batch, 0] != 0
        zero = torch.zeros_like(old)
        # a request's step counts once its context exceeds the largest budget (RequestGuard)
        self.row_steps.index_put_((rows,), self.sparse_rows.to(torch.int32), accumulate=True)
        delta = torch.where(probed, new - old, zero)
        self.budget.index_put_((rows,), delta, accumulate=True)
        self.streak.index_put_((rows,), torch.where(probed, streak - old_streak, zero),
                               accumulate=True)
        self.counts += torch.stack([probed.sum(), (delta > 0).sum(), (delta < 0).sum()])


class ReferenceGuard(DecodeFeature):
    """The reference decode's guard: per request row a :class:`RequestGuard`, kept in the
    rows' side table (dropped when the request leaves)."""

    def __init__(self, ctx: DecodeContext, policy: GuardPolicy) -> None:
        self.ctx = ctx
        self.policy = policy
        self.totals = GuardTotals(ctx.enable_metrics)

    def before_batch(self, forward_batch: Any) -> None:
        if batch_kind(forward_batch) == "extend":  # rows are reused: start afresh
            states = request_overrides.row_state(self.ctx.req_to_token_pool)
            for row in forward_batch.req_pool_indices.tolist():
                states.get(row, {}).pop("guard", None)

    def plan_rows(self, rows: list[int], seq_lens: list[int],
                  sparsity: list[Optional[SelectionParams]]) -> list[Optional[RequestGuard]]:
        """Each sparse request's budget this step (``sparsity`` updated in place), and its
        guard where it probes."""
        states = request_overrides.row_state(self.ctx.req_to_token_pool)
        pool = self.ctx.token_to_kv_pool
        num_kv_heads = pool.get_key_buffer(pool.start_layer).shape[1]
        guards: list[Optional[RequestGuard]] = [None] * len(seq_lens)
        for i, (row, seq_len, params) in enumerate(zip(rows, seq_lens, sparsity)):
            if params is None:
                continue
            row_states = states.setdefault(row, {})
            guard = row_states.get("guard")
            if guard is None:
                guard = row_states["guard"] = RequestGuard(self.policy, params, num_kv_heads)
            sparsity[i] = guard.begin_step(seq_len)
            if guard.probe_head is not None:
                guards[i] = guard
        return guards

    def finish(self, rows: list[int], guards: list[Optional[RequestGuard]]) -> None:
        """After the last layer: move the probed requests' budgets."""
        counts = self.totals.counts
        for row, guard in zip(rows, guards):
            if guard is None:
                continue
            head = guard.probe_head
            recall, old, new = guard.finish_step()
            counts[0] += 1
            if new != old:
                counts[1 if new > old else 2] += 1
                logger.info("sglang_ext guard: request row %d recall %.3f (kv head %d): budget "
                            "%d -> %d", row, recall, head, old, new)
        self.totals.publish()
