"""The CPU tier's counters in SGLang's Prometheus endpoint (``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode, so metrics created in the scheduler process
show up on the HTTP server's ``/metrics``. The tier's transfer counters live on the device;
reading them is a host sync, so they are refreshed every ``every`` decode steps only. The
occupancy gauges are host-side values and are also refreshed whenever a request starts decoding
or leaves (so they do not stay stale once the server is idle), and the queue gauge on every
scheduler iteration (patches/scheduler.py).
"""

from __future__ import annotations

from typing import Any


class TierMetrics:
    PREFIX = "sglang_ext:tier_"

    def __init__(self, page_bytes: int, every: int = 32) -> None:
        from prometheus_client import Counter, Gauge

        p = self.PREFIX
        self.every = every
        self.page_bytes = page_bytes  # bytes one (block, kv head) transfer moves, K and V
        self._last = {"wanted_blocks": 0, "transferred_blocks": 0}
        self.wanted = Counter(p + "wanted_blocks", "Blocks the block filter chose (per layer and kv head)")
        self.transferred = Counter(p + "transferred_blocks", "Blocks fetched from host memory")
        self.transferred_bytes = Counter(p + "transferred_bytes", "Bytes fetched from host memory")
        self.hit_rate = Gauge(p + "hit_rate", "Share of chosen blocks already on the GPU (cumulative)",
                              multiprocess_mode="mostrecent")
        self.host_hit_rate = Gauge(p + "host_hit_rate",
                                   "Share of chosen host-homed blocks already on the GPU "
                                   "(cumulative; what sizes the transfers)",
                                   multiprocess_mode="mostrecent")
        self.work_free = Gauge(p + "working_area_free_pages", "Free pages of the GPU working area",
                               multiprocess_mode="mostrecent")
        self.work_total = Gauge(p + "working_area_pages", "Pages of the GPU working area",
                                multiprocess_mode="mostrecent")
        self.requests = Gauge(p + "requests", "Requests holding working-area pages",
                              multiprocess_mode="mostrecent")
        # --sparse-tier-timing: the GPU clock's account of the transfers (cumulative)
        self.transfer_seconds = Counter(p + "transfer_seconds",
                                        "GPU time of the tier's transfers (residency update + gather)")
        self.exposed_seconds = Counter(p + "exposed_transfer_seconds",
                                       "Part of the transfer time the decode steps waited for")
        self.hidden_fraction = Gauge(p + "hidden_transfer_fraction",
                                     "1 - exposed / transfer time (cumulative)",
                                     multiprocess_mode="mostrecent")
        self._last_times = (0.0, 0.0)
        # --sparse-cooperative (memory_tier/cooperative_decode.py; cumulative counts)
        self.coop = {
            "coop_cpu_blocks": Counter(p + "cooperative_cpu_blocks",
                                       "Selected (request, kv head, block)s handed to the CPU "
                                       "workers (attended from host memory, not fetched)"),
            "coop_cpu_tokens": Counter(p + "cooperative_cpu_tokens",
                                       "Selected tokens attended by the CPU workers"),
            "coop_planned_layers": Counter(p + "cooperative_planned_layers",
                                           "Layer steps the cooperative scheduler planned"),
            "coop_skipped_layers": Counter(p + "cooperative_skipped_layers",
                                           "Layer steps it skipped (no CPU task could finish "
                                           "before the device)"),
        }
        self._last_coop = dict.fromkeys(self.coop, 0)
        # the admission's PCIe term (memory_tier/transfer_budget.py, patches/scheduler.py)
        self.bytes_per_step = Gauge(p + "bytes_per_step",
                                    "Measured bytes fetched per decode step (cumulative mean)",
                                    multiprocess_mode="mostrecent")
        self.predicted_bytes_per_step = Gauge(
            p + "predicted_bytes_per_step",
            "The PCIe term's predicted bytes per decode step over the same steps (a bound)",
            multiprocess_mode="mostrecent")
        self.predicted_bytes_now = Gauge(
            p + "predicted_bytes_per_step_now",
            "Predicted bytes per step of the requests decoding now", multiprocess_mode="mostrecent")
        self.step_budget = Gauge(p + "step_budget_bytes",
                                 "Bytes a decode step may move (PCIe rate x step time; 0 = no "
                                 "PCIe term)", multiprocess_mode="mostrecent")
        self.pcie_holds = Counter(p + "pcie_held_requests",
                                  "Requests the PCIe term kept in the queue for a while")
        self._last_holds = 0
        self.waiting = Gauge(p + "requests_waiting_for_space",
                             "Queued requests whose prompt does not fit in the free KV slots "
                             "(GPU + host tier, radix-evictable included)",
                             multiprocess_mode="mostrecent")

    def update(self, occupancy: dict[str, Any]) -> None:
        wanted = occupancy["wanted_blocks"] - self._last["wanted_blocks"]
        moved = occupancy["transferred_blocks"] - self._last["transferred_blocks"]
        self._last = {k: occupancy[k] for k in self._last}
        self.wanted.inc(max(wanted, 0))
        self.transferred.inc(max(moved, 0))
        self.transferred_bytes.inc(max(moved, 0) * self.page_bytes)
        self.hit_rate.set(occupancy["hit_rate"])
        self.host_hit_rate.set(occupancy["host_hit_rate"])
        if occupancy.get("transfer_s") is not None:
            transfer, exposed = occupancy["transfer_s"], occupancy["exposed_transfer_s"]
            self.transfer_seconds.inc(max(transfer - self._last_times[0], 0.0))
            self.exposed_seconds.inc(max(exposed - self._last_times[1], 0.0))
            self._last_times = (transfer, exposed)
            if occupancy["hidden_fraction"] is not None:
                self.hidden_fraction.set(occupancy["hidden_fraction"])
        if "predicted_bytes_per_step" in occupancy:
            self.bytes_per_step.set(occupancy["bytes_per_step"])
            self.predicted_bytes_per_step.set(occupancy["predicted_bytes_per_step"])
            self.predicted_bytes_now.set(occupancy["predicted_bytes_per_step_now"])
            self.step_budget.set(occupancy["step_budget_bytes"])
            self.pcie_holds.inc(max(occupancy["pcie_holds"] - self._last_holds, 0))
            self._last_holds = occupancy["pcie_holds"]
        for key, counter in self.coop.items():
            if key in occupancy:
                counter.inc(max(occupancy[key] - self._last_coop[key], 0))
                self._last_coop[key] = occupancy[key]
        self.update_occupancy(occupancy["work_pages_free"], occupancy["work_pages"],
                              occupancy["requests_tiered"])

    def update_occupancy(self, work_pages_free: int, work_pages: int, requests: int) -> None:
        self.work_free.set(work_pages_free)
        self.work_total.set(work_pages)
        self.requests.set(requests)

    def update_waiting(self, waiting: int) -> None:
        self.waiting.set(waiting)
