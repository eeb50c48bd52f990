"""The CPU tier's PCIe term: what a decode step may move from host memory, and what a
host-homed request is predicted to move.

**Budget.** ``--sparse-tier-pcie-gbps`` (the host->GPU rate the tier's gather reaches) times
``--sparse-tier-step-ms`` (the decode step the transfers must fit in) is the most a step may
move: :func:`step_budget_bytes`. A PCIe rate of 0 turns the term off.

**Prediction.** Per (layer, kv head) a decoding request fetches, per step, the blocks its
block filter chose that are not resident yet (kernels/working_set.py). Their number is bounded
by construction:

* with NOSA's limit on new filter blocks (``--sparse-locality-new-blocks F``) at most ``F`` of
  the query-aware blocks lie outside the previous step's filter, plus the one block that leaves
  the recent window (a wanted block still in the window's ring page gets a slot of its own,
  and the query-agnostic set takes in the blocks that enter the middle: one per ``block_size``
  steps): ``F + 1``;
* without it, every working-set slot may turn over: the request's block budget (``num_slots``:
  two_level's candidate blocks plus the locality blocks, quest's kept blocks).

Bytes per step = blocks x ``tier_page_bytes`` (K and V rows of one page of one kv head, in the
KV cache's dtype: an fp8 cache moves half of bf16's) x kv heads x layers
(:func:`request_bytes_per_step`). A request whose pages all live on the GPU transfers nothing
and is never held back by the term.

Pure arithmetic, shared by the admission (TieredPool, patches/scheduler.py) and the projection
(benchmarks/tier_projection.py).
"""

from __future__ import annotations

from dataclasses import dataclass


def step_budget_bytes(pcie_gbps: float, step_ms: float) -> int:
    """Bytes one decode step may move at ``pcie_gbps`` GB/s (1e9 bytes) within ``step_ms``
    milliseconds; 0 = no PCIe term."""
    if pcie_gbps <= 0 or step_ms <= 0:
        return 0
    return int(pcie_gbps * 1e9 * step_ms / 1e3)


def blocks_per_step(num_slots: int, locality_new_blocks: int = 0) -> int:
    """Most blocks one (layer, kv head) of a request fetches in a step (module doc)."""
    if locality_new_blocks > 0:
        return min(num_slots, locality_new_blocks + 1)
    return num_slots


def request_bytes_per_step(blocks: int, kv_heads: int, page_bytes: int, layers: int) -> int:
    """Bytes a host-homed request moves per step when each (layer, kv head) fetches
    ``blocks`` blocks of ``page_bytes`` (K and V of one page of one kv head)."""
    return blocks * kv_heads * page_bytes * layers


@dataclass(frozen=True)
class TransferBudget:
    """The PCIe term of one tiered pool: the step's budget and the per-request bound."""

    step_bytes: int  # what a step may move (0: no PCIe term)
    request_bytes: int  # what one host-homed request moves per step at most (server settings)
    pcie_gbps: float = 0.0
    step_ms: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.step_bytes > 0

    def fits(self, load: int, need: int) -> bool:
        """Whether a request predicted to move ``need`` bytes per step may join requests
        predicted to move ``load``: always when it moves nothing, when the term is off, or
        when nothing is moving (a lone host-homed request always runs: nothing waits forever,
        even with a budget below one request's transfers)."""
        return need <= 0 or not self.enabled or load <= 0 or load + need <= self.step_bytes
