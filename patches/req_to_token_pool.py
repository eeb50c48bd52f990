"""ReqToTokenPool: record each request's sparse settings under its row; forget them (and release
the CPU tier's device pages of the row) on free.

``free`` is the single point every exit (finish, abort, retract) goes through. ``write`` is
watched for the radix cache's dedup, which re-points a prefilled row at pages it already holds.
"""

from __future__ import annotations

from typing import Any

from sglang_ext.attention import request_overrides


def _after_alloc(result: Any, pool: Any, reqs: list, *args: Any, **kwargs: Any) -> None:
    if result is None:  # no rows were free: nothing was handed out
        return
    from sglang_ext.patches.server_args import active_config

    request_overrides.record(pool, reqs, active_config())


def _before_free(pool: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    request_overrides.forget(pool, req.req_pool_idx)
    from sglang_ext.memory_tier.tiered_pool import active_pool

    tiered = active_pool()
    if tiered is not None and req.req_pool_idx is not None:
        # The CPU tier's sink, window and working-set pages of this request (and its row state).
        tiered.release_row(req.req_pool_idx, pool.req_to_token)


def _before_write(pool: Any, indices: Any, values: Any, *args: Any, **kwargs: Any) -> None:
    from sglang_ext.memory_tier.tiered_pool import active_pool

    tiered = active_pool()
    if tiered is None or not isinstance(indices, tuple) or len(indices) != 2:
        return
    row, cols = indices
    # SGLang's rewrites of a row's prompt slots come as (req_pool_idx, slice); other forms (the
    # decode path's per-token writes) place nothing the tier has copied yet.
    if (not isinstance(row, int) or not isinstance(cols, slice) or cols.step not in (None, 1)
            or not hasattr(values, "numel")):
        return
    # The radix cache's dedup re-points a prompt's pages at equal ones it already holds: the
    # tier's copies of those blocks must follow (TieredPool.repoint_pages; it reads the old
    # slots, this hook runs before the write).
    tiered.repoint_pages(row, cols.start or 0, pool.req_to_token, values)


HOOKS = (
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc", _after_alloc, "AFTER"),
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free", _before_free, "BEFORE"),
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.write", _before_write, "BEFORE"),
)
