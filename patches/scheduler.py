"""Scheduler: the CPU tier's queue gauge (``sglang_ext:tier_requests_waiting_for_space``).

With the tier on, a request waits in SGLang's queue when its prompt does not fit in the KV slots
left on the GPU and the host (nothing is dropped). After each ``get_next_batch_to_run`` the gauge
is set to the number of queued requests whose prompt exceeds the free slots (radix-evictable
ones included, as SGLang's admission counts them). Inert unless the tier and
``--enable-metrics`` are on; host-side only.
"""

from __future__ import annotations

from typing import Any


def waiting_for_space(waiting_queue: list, free_tokens: int) -> int:
    """Queued requests whose prompt does not fit in ``free_tokens`` KV slots."""
    return sum(1 for req in waiting_queue if len(req.origin_input_ids) > free_tokens)


def _after_get_next_batch_to_run(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    from sglang_ext.memory_tier.tiered_pool import active_pool

    pool = active_pool()
    if pool is None or pool.metrics is None:
        return
    queue = scheduler.waiting_queue
    waiting = 0
    if queue:
        evictable = getattr(scheduler.tree_cache, "evictable_size", lambda: 0)()
        free = scheduler.token_to_kv_pool_allocator.available_size() + evictable
        waiting = waiting_for_space(queue, free)
    pool.metrics.update_waiting(waiting)


HOOKS = (
    ("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
     _after_get_next_batch_to_run, "AFTER"),
)
