"""Scheduler: the CPU tier's prefill admission and queue gauge.

**Admission.** SGLang admits a prefill against free KV slots; with the tier, an extend batch
that touches host-homed pages also attends through the pool's extend scratch, one layer of rows
for the whole batch (prefix and new tokens of every request in it: tiered_pool.py), and each
admitted request takes a working set in the working area. The scratch is sized for one whole
prompt plus one prefill batch (``plan_layout``), but a second request whose prefix is a radix
hit adds that whole prefix to the batch: two 128k prompts sharing host prefixes would overflow
it. So ``PrefillAdder.add_one_req`` refuses (``OTHER``: try again next round, the request keeps
its place in the queue) a request whose scratch rows or working set do not fit in
``TieredPool.admission_room``, which already counts the chunk-prefilled request and the rows not
yet decoding. A lone request always fits (the layout guarantees it), so nothing waits forever.

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
_CLAIMED = "_sglang_ext_tier_claimed"  # (scratch, working-area) pages this adder's requests took


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
    chunked_tokens = 0 if chunked is None or chunked is req else total_tokens(chunked)
    need = pool.admission_need(total_tokens(req))
    claimed = getattr(adder, _CLAIMED, (0, 0))
    room = pool.admission_room(chunked_tokens)
    if any(c + n > r for c, n, r in zip(claimed, need, room)):
        return AddReqResult.OTHER
    result = original(adder, req, *args, **kwargs)
    if any(r is req for r in adder.can_run_list):
        setattr(adder, _CLAIMED, tuple(c + n for c, n in zip(claimed, need)))
    return result


HOOKS = (
    ("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
     _after_get_next_batch_to_run, "AFTER"),
    ("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
     _around_get_new_batch_prefill, "AROUND"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
     _around_add_one_req, "AROUND"),
)
