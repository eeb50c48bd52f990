"""Decode CUDA graphs: a batch holding a request with its own sparse settings runs eagerly.

The captured decode runs the server's one setting with static top-k sizes; a request that asked
for another (``custom_params.sparse`` on ``--sparse-impl triton``) decodes in groups outside the
graph (sglang_ext/attention/mixed_settings.py). Batches of default requests replay as before."""

from __future__ import annotations

from typing import Any

from sglang_ext.attention import request_overrides


def _after_can_run_graph(result: Any, runner: Any, forward_batch: Any, *args: Any,
                         **kwargs: Any) -> Any:
    if result and request_overrides.has_overriding_rows(runner.model_runner.req_to_token_pool):
        return False
    return None


HOOKS = (
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
     ".can_run_graph", _after_can_run_graph, "AFTER"),
)
