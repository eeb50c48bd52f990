"""The accuracy guard: probe the sparse selection's recall now and then, widen the budget of a
request whose selection misses attention mass, narrow it again when recall stays high.

Recall of a selection is the share of the dense softmax mass it keeps: for query head ``h``,
``sum over selected positions of softmax(q_h . k / sqrt(d))``. It equals
``exp(lse_selected - lse_dense)``, so a probe needs only the dense log-sum-exp of the probed
heads next to the sparse attention's own LSE. A probe step measures it for one kv head per layer
(rotating over the kv heads from one probe to the next) and the request's recall is the mean over
the probed layers and that head's query heads.

The budget moves in powers of two between the configured budget and ``max_budget``:
``recall < low`` doubles it at once; it is halved only after ``PATIENCE`` probes in a row with
``recall >= high`` (``high = 1 - (1 - low) / 4``, e.g. 0.975 for ``low`` = 0.9). The gap and
the patience keep a budget from flapping between two values whose recalls straddle a threshold:
missing mass costs accuracy now, keeping a wider budget only costs time. :func:`next_budget` is
the single rule: the CPU reference decode, the CUDA decode (on device, inside the CUDA graph) and
the long-generation check all call it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from sglang_ext.selection.params import SelectionParams
from sglang_ext.selection.reference import _group_queries

PATIENCE = 4  # probes in a row with high recall before the budget is halved


@dataclass(frozen=True)
class GuardPolicy:
    """``every``: decode steps between two probes of a request (0 = guard off); ``low``: the
    recall under which the budget doubles; ``base_budget`` / ``max_budget``: its range."""

    every: int
    low: float
    base_budget: int
    max_budget: int

    @property
    def enabled(self) -> bool:
        return self.every > 0

    @property
    def high(self) -> float:
        return 1.0 - (1.0 - self.low) / 4.0

    def is_probe_step(self, step):
        """Whether a request's ``step``-th decode step (0-based) probes: the first and then one
        every ``every`` steps (an int, or elementwise on an int tensor of steps)."""
        return self.enabled and step % self.every == 0

    def probe_head(self, step, num_kv_heads: int):
        """The kv head probed at a probe step: rotates from one probe to the next (an int, or
        elementwise on an int tensor)."""
        return (step // max(self.every, 1)) % num_kv_heads


def next_budget(policy: GuardPolicy, budget: Tensor, streak: Tensor,
                recall: Tensor) -> tuple[Tensor, Tensor]:
    """The guard's rule: (new budget, new streak of high-recall probes), elementwise on int
    ``budget`` / ``streak`` and float ``recall`` tensors (any device, fixed shapes: safe inside
    a CUDA graph)."""
    high = recall >= policy.high
    streak = torch.where(high, streak + 1, torch.zeros_like(streak))
    lower = streak >= PATIENCE
    up = torch.clamp(budget * 2, max=policy.max_budget)
    down = torch.clamp(budget // 2, min=policy.base_budget)
    out = torch.where(recall < policy.low, up, torch.where(lower, down, budget))
    return out, torch.where(lower, torch.zeros_like(streak), streak)


def _head_scores(q: Tensor, keys: Tensor, scaling: float, kv_head: int) -> Tensor:
    """float32 ``[G, L]``: scaled logits of kv head ``kv_head``'s query heads over every key.
    ``q`` ``[Hq, D]``, ``keys`` ``[L, Hkv, D]`` (one request, position order)."""
    qg = _group_queries(q, keys.shape[1])[kv_head]  # [G, D]
    return qg @ keys[:, kv_head].float().T * scaling


def dense_lse(q: Tensor, keys: Tensor, scaling: float, kv_head: int) -> Tensor:
    """float32 ``[G]``: log-sum-exp of kv head ``kv_head``'s query heads over every key."""
    return torch.logsumexp(_head_scores(q, keys, scaling, kv_head), dim=-1)


def selection_recall(q: Tensor, keys: Tensor, mask: Tensor, scaling: float, kv_head: int) -> float:
    """Mean over kv head ``kv_head``'s query heads of the dense softmax mass on the positions
    ``mask`` (bool ``[Hkv, L]``) selects, ``exp(lse_selected - lse_dense)``: the reference of
    what a probe measures."""
    scores = _head_scores(q, keys, scaling, kv_head)
    selected = torch.logsumexp(scores[:, mask[kv_head]], dim=-1)
    return float(torch.exp(selected - torch.logsumexp(scores, dim=-1)).mean())


def scaled_candidates(base_candidates, base_budget: int, budget):
    """two_level's candidate blocks at a widened ``budget``: the base count scaled with the
    budget, rounded up (ints or int tensors alike)."""
    return -((-base_candidates * budget) // base_budget)


def widened(params: SelectionParams, budget: int) -> SelectionParams:
    """``params`` (the request's base settings) at the guard's current ``budget``."""
    if budget == params.budget:
        return params
    return dataclasses.replace(
        params, budget=budget,
        candidate_blocks=scaled_candidates(params.candidate_blocks, params.budget, budget),
    )


def row_top_k(base: SelectionParams, budgets: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """Per-request k of the batched decode's block top-k and token top-k (int32 ``[B]``, None
    where the method has no such stage) for requests at ``budgets``: the same selection as
    :func:`widened` params, inside a workspace sized for the guard's largest budget."""
    n_sel = budgets - (base.sink + base.window)
    if base.method == "quest":
        return (n_sel // base.block_size).to(torch.int32), None
    if base.method == "ds":
        return None, n_sel.to(torch.int32)
    cand = scaled_candidates(base.candidate_blocks, base.budget, budgets)
    return cand.to(torch.int32), n_sel.to(torch.int32)


class GuardMetrics:
    """The guard's counters in SGLang's Prometheus endpoint (``--enable-metrics``)."""

    PREFIX = "sglang_ext:guard_"

    def __init__(self) -> None:
        from prometheus_client import Counter

        p = self.PREFIX
        self.probes = Counter(p + "probes", "Requests' recall probes")
        self.raised = Counter(p + "budget_raised", "Probes that doubled a request's budget")
        self.lowered = Counter(p + "budget_lowered", "Probes that halved a request's budget")
        self._last = (0, 0, 0)

    def update(self, probes: int, raised: int, lowered: int) -> None:
        """Cumulative totals in; the counters advance by the difference."""
        now = (probes, raised, lowered)
        for counter, new, old in zip((self.probes, self.raised, self.lowered), now, self._last):
            counter.inc(max(new - old, 0))
        self._last = now


class RequestGuard:
    """One request's guard on the host (the reference decode and the long-generation check):
    its current budget, the streak of high-recall probes and its step count.

    Per decode step: :meth:`begin_step` gives the step's params (None: dense, the context still
    fits the largest budget) and sets :attr:`probe_head`; when it is not None each layer adds
    its :func:`selection_recall` with :meth:`add_recall`; :meth:`finish_step` applies the rule.
    """

    def __init__(self, policy: GuardPolicy, params: SelectionParams, num_kv_heads: int) -> None:
        self.policy = GuardPolicy(policy.every, policy.low, params.budget,
                                  max(policy.max_budget, params.budget))
        self.base = params
        self.num_kv_heads = num_kv_heads
        self.budget = params.budget
        self.streak = 0
        self.step = 0
        self.probe_head: int | None = None
        self._recall_sum = 0.0
        self._recall_count = 0

    def begin_step(self, seq_len: int) -> SelectionParams | None:
        self.probe_head = None
        if seq_len <= self.policy.max_budget:
            return None  # dense until the context exceeds the largest budget
        if self.policy.is_probe_step(self.step):
            self.probe_head = self.policy.probe_head(self.step, self.num_kv_heads)
        self.step += 1
        self._recall_sum, self._recall_count = 0.0, 0
        return widened(self.base, self.budget)

    def add_recall(self, recall: float) -> None:
        self._recall_sum += recall
        self._recall_count += 1

    def finish_step(self) -> tuple[float, int, int] | None:
        """After the last layer of a probe step: (recall, old budget, new budget); else None."""
        if self.probe_head is None or self._recall_count == 0:
            return None
        recall = self._recall_sum / self._recall_count
        old = self.budget
        new, streak = next_budget(self.policy, torch.tensor(old), torch.tensor(self.streak),
                                  torch.tensor(recall))
        self.budget, self.streak = int(new), int(streak)
        self.probe_head = None
        return recall, old, self.budget
