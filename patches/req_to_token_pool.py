"""ReqToTokenPool: record each request's sparse settings under its row; forget them (and release
the CPU tier's device pages of the row) on free.

``free`` is the single point every exit (finish, abort, retract) goes through.
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
        # The CPU tier's staging, window and working-set pages of this request.
        tiered.release_row(req.req_pool_idx, pool.req_to_token)


HOOKS = (
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc", _after_alloc, "AFTER"),
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free", _before_free, "BEFORE"),
)
