"""ReqToTokenPool: record each request's sparse settings under its row; forget them on free.

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


HOOKS = (
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc", _after_alloc, "AFTER"),
    ("sglang.srt.mem_cache.memory_pool.ReqToTokenPool.free", _before_free, "BEFORE"),
)
