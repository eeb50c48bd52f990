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

**The PCIe term** (``--sparse-tier-pcie-gbps`` x ``--sparse-tier-step-ms``, memory_tier/
transfer_budget.py). A request whose KV will live on the host fetches up to a bound of blocks
per decode step (``--sparse-locality-new-blocks`` + 1 per layer and kv head, or its block
budget). It is admitted only while the bounds of the admitted host-homed requests, its own
included, fit in the step's budget; otherwise ``add_one_req`` refuses it (``OTHER``) and it
keeps its place in the queue until running requests finish. Whether a request will be
host-homed is predicted without a device read where possible: its pages go to the GPU when the
GPU-homed pages surely free (the allocator's free pages, less the tokens SGLang reserves for
running requests and this round's admissions, less every host page) cover its prompt and
``max_new_tokens`` and it has no radix prefix; only when the budget would turn it away is its
prefix read (a device read) to find out. A request predicted GPU-homed is never held back;
nothing predicted moving, a lone host-homed request runs whatever the budget (nothing waits
forever). The prediction is recorded per request row once SGLang hands rows out (after
``get_new_batch_prefill``) and replaced by what the row's pages are once its prompt is written
(``TieredPool.predicted_row_bytes``); ``TieredPool.occupancy`` reports predicted and measured
bytes per step.

**Gauge** (``sglang_ext:tier_requests_waiting_for_space``).

With the tier on, a request waits in SGLang's queue when its prompt does not fit in the KV slots
left on the GPU and the host (nothing is dropped). After each ``get_next_batch_to_run`` the gauge
is set to the number of queued requests whose prompt exceeds the free slots (radix-evictable
ones included, as SGLang's admission counts them). Inert unless the tier and
``--enable-metrics`` are on; host-side only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang_ext import runtime


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


@dataclass
class AdderClaims:
    """What one PrefillAdder's admitted requests take this round (a side table of the adder)."""

    pages: tuple[int, int] = (0, 0)  # (scratch, working-area) pages
    transfer: int = 0  # bytes per step they are predicted to move


@dataclass
class RequestAdmission:
    """The tier admission's notes on one request (a side table of the request)."""

    predicted: Optional[tuple[int, int]] = None  # (predicted, bound) bytes per step
    held: bool = False  # the PCIe term kept it in the queue at least once
    new_blocks: Optional[int] = None  # its limit on new filter blocks, once parsed


def claims_of(adder: Any) -> AdderClaims:
    return runtime.state().side_table(adder, AdderClaims)


def admission_of(req: Any) -> RequestAdmission:
    return runtime.state().side_table(req, RequestAdmission)


def _around_get_new_batch_prefill(original: Callable, scheduler: Any, *args: Any,
                                  **kwargs: Any) -> Any:
    process = runtime.state()
    process.chunked_req = scheduler.chunked_req
    try:
        result = original(scheduler, *args, **kwargs)
    finally:
        process.chunked_req = None
    note_admitted_rows(result)
    return result


def note_admitted_rows(result: Any) -> None:
    """The new prefill batch's requests have rows now: record each one's prediction."""
    from sglang_ext.memory_tier.tiered_pool import active_pool

    pool = active_pool()
    batch = getattr(result, "batch_to_run", result)
    if pool is None or batch is None:
        return
    for req in getattr(batch, "reqs", None) or ():
        predicted = admission_of(req).predicted
        if predicted is not None and getattr(req, "req_pool_idx", None) is not None:
            pool.note_admitted(req.req_pool_idx, *predicted)


def total_tokens(req: Any) -> int:
    return len(req.origin_input_ids) + len(req.output_ids)


def max_new_tokens(req: Any) -> int:
    sampling = getattr(req, "sampling_params", None)
    value = getattr(sampling, "max_new_tokens", None)
    return max(int(value or 0) - len(req.output_ids), 0)


def request_new_blocks_limit(req: Any, server_limit: int) -> int:
    """The limit on new filter blocks the request decodes with (0: none): the server's, or its
    own ``custom_params.sparse`` (parsed once, as the backend will)."""
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if not custom or "sparse" not in custom:
        return server_limit
    notes = admission_of(req)
    if notes.new_blocks is None:
        from sglang_ext.attention.request_overrides import parse_override
        from sglang_ext.patches.server_args import active_config

        try:
            params = parse_override(custom, active_config())
        except ValueError:  # refused on arrival already; count it without a limit
            params = None
        notes.new_blocks = 0 if params is None else params.locality_new_blocks
    return notes.new_blocks


def free_tokens_left(adder: Any) -> int:
    """Free KV slots once the running requests' reserved decode tokens and this round's
    admissions are taken (SGLang's own estimate, ``PrefillAdder.rem_total_token_offset``);
    radix-evictable slots not counted: the allocator hands out free pages before evicting."""
    allocator = getattr(adder, "token_to_kv_pool_allocator", None)
    if allocator is None:
        return 0
    return int(allocator.available_size() - getattr(adder, "rem_total_token_offset", 0))


def predict_transfer(pool: Any, adder: Any, req: Any, claimed: int) -> tuple[bool, int, int]:
    """The PCIe term for ``req`` (module doc): ``(admit, predicted bytes per step, its bound if
    host-homed)``; ``claimed``: bytes this round's admitted requests are predicted to move."""
    budget = pool.transfer_budget()
    bound = pool.request_step_bytes(request_new_blocks_limit(req, pool.transfer_new_blocks))
    ps = pool.layout.page_size
    prefix = getattr(req, "prefix_indices", None)
    prefix_len = 0 if prefix is None else len(prefix)
    new_pages = -(-(total_tokens(req) + max_new_tokens(req)) // ps) - prefix_len // ps
    fits_gpu = new_pages <= pool.gpu_pages_free_at_least(free_tokens_left(adder))
    if fits_gpu and prefix_len == 0:
        return True, 0, bound
    if budget.fits(pool.predicted_load() + claimed, bound):
        return True, bound, bound
    if fits_gpu and not pool.prefix_on_host(prefix):  # the budget hinges on it: look
        return True, 0, bound
    return False, bound, bound


def _around_add_one_req(original: Callable, adder: Any, req: Any, *args: Any,
                        **kwargs: Any) -> Any:
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sglang_ext.memory_tier.tiered_pool import active_pool

    pool = active_pool()
    if pool is None:
        return original(adder, req, *args, **kwargs)
    chunked = runtime.state().chunked_req
    chunked_tokens = 0 if chunked is None or chunked is req else total_tokens(chunked)
    need = pool.admission_need(total_tokens(req))
    claims = claims_of(adder)
    room = pool.admission_room(chunked_tokens)
    if any(c + n > r for c, n, r in zip(claims.pages, need, room)):
        return AddReqResult.OTHER
    admit, predicted, bound = predict_transfer(pool, adder, req, claims.transfer)
    if not admit:
        notes = admission_of(req)
        if not notes.held:  # count requests, not attempts
            notes.held = True
            pool.pcie_holds += 1
        return AddReqResult.OTHER
    result = original(adder, req, *args, **kwargs)
    if any(r is req for r in adder.can_run_list):
        claims.pages = tuple(c + n for c, n in zip(claims.pages, need))
        claims.transfer += predicted
        admission_of(req).predicted = (predicted, bound)
    return result


HOOKS = (
    ("sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
     _after_get_next_batch_to_run, "AFTER"),
    ("sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
     _around_get_new_batch_prefill, "AROUND"),
    ("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
     _around_add_one_req, "AROUND"),
)
