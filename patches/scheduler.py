"""Scheduler: the CPU tier's prefill admission and queue gauge.

**Admission.** SGLang admits a prefill against free KV slots; the tier also needs device pages
in its working area to stage the prompt (tiered_pool.py). Sizing that area for one whole prompt
plus one prefill batch (``plan_layout``) holds while a single long prompt is staged, but a second
request whose prefix is a radix hit on host pages stages that whole prefix at its first chunk:
two 128k prompts sharing host prefixes exhausted the area on the H200 (a scheduler crash). So
``PrefillAdder.add_one_req`` refuses (``OTHER``: try again next round, the request keeps its
place in the queue) a request whose staging plus working set does not fit in
``TieredKVPool.staging_room``, which already reserves what the chunk-prefilled request and the
rows not yet decoding will take. A lone request always fits (the layout guarantees it), so
nothing waits forever.

**Gauge** (``sglang_ext:tier_requests_waiting_for_space``).

With the tier on, a request waits in SGLang's queue when its prompt does not fit in the KV slots
left on the GPU and the host (nothing is dropped). After each ``get_next_batch_to_run`` the gauge
is set to the number of queued requests whose prompt exceeds the free slots (radix-evictable
ones included, as SGLang's admission counts them). Inert unless the tier and
``--enable-metrics`` are on; host-side only.
"""

from __future__ import annotations

from typing import Any, Callable


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


_chunked_req: Any = None  # the scheduler's chunk-prefilled request, during get_new_batch_prefill
_CLAIMED = "_sglang_ext_staging_claimed"  # pages claimed by requests this adder admitted


def _around_get_new_batch_prefill(original: Callable, scheduler: Any, *args: Any,
                                  **kwargs: Any) -> Any:
    global _chunked_req
    _chunked_req = scheduler.chunked_req
    try:
        return original(scheduler, *args, **kwargs)
    finally:
        _chunked_req = None


def total_tokens(req: Any) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)


def _around_add_one_req(original: Callable, adder: Any, req: Any, *args: Any,
                        **kwargs: Any) -> Any:
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sglang_ext.memory_tier.tiered_pool import active_pool

    pool = active_pool()
    if pool is None:
        return original(adder, req, *args, **kwargs)
    chunked = _chunked_req
    remaining = 0 if chunked is None or chunked is req else \
        total_tokens(chunked) - len(chunked.prefix_indices)
    need = pool.staging_need(req.prefix_indices, total_tokens(req) - len(req.prefix_indices))
    claimed = getattr(adder, _CLAIMED, 0)
    if claimed + need > pool.staging_room(remaining):
        return AddReqResult.OTHER
    result = original(adder, req, *args, **kwargs)
    if any(r is req for r in adder.can_run_list):
        setattr(adder, _CLAIMED, claimed + need)
    return result


HOOKS = (
    ("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
     _after_get_next_batch_to_run, "AFTER"),
    ("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
     _around_get_new_batch_prefill, "AROUND"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
     _around_add_one_req, "AROUND"),
)
