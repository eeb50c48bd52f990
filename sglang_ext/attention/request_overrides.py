"""Per-request sparse settings, carried with the request in ``sampling_params.custom_params``.

A request may ask for its own method and budget, e.g.
``{"custom_params": {"sparse": {"method": "quest", "budget": 512}}}``, or
``{"sparse": {"method": "dense"}}`` for exact attention. The KV itself does not depend on these
settings, so requests with different settings still share prefixes through the radix cache
(the accuracy suite prefills each sample once and decodes it under every method).

Overrides are validated when the request arrives (a bad one is a 400, like a bad temperature)
and recorded per ``req_pool_idx`` when the scheduler gives the request its row.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from sglang_ext import runtime
from sglang_ext.config import ConfigError, SparseConfig, build_config
from sglang_ext.selection import SelectionParams

OVERRIDE_KEY = "sparse"
DENSE = "dense"
OVERRIDABLE = ("method", "budget", "block_size", "candidate_blocks", "sink", "window", "scoring",
               "head_policy", "locality_blocks", "eviction_score", "locality_new_blocks",
               "block_filter", "block_score", "rerank", "prefilter", "rerank_min_tokens")

# What a request decodes with: SelectionParams, or None for dense attention.
RequestSparsity = Optional[SelectionParams]


def selection_params(cfg: SparseConfig, use_head_policy: Optional[bool] = None) -> SelectionParams:
    """The selection ``cfg`` describes; the server's head policy applies unless
    ``use_head_policy`` is False."""
    return SelectionParams(
        method=cfg.method,
        budget=cfg.budget,
        block_size=cfg.block_size,
        candidate_blocks=cfg.effective_candidate_blocks,
        sink=cfg.sink,
        window=cfg.window,
        scoring=cfg.scoring,
        head_policy=cfg.head_policy is not None and use_head_policy is not False,
        locality_blocks=cfg.locality_blocks,
        eviction_score=cfg.eviction_score,
        locality_new_blocks=cfg.locality_new_blocks,
        block_filter=cfg.block_filter,
        label_dtype=cfg.label_dtype,
        summary_dtype=cfg.summary_dtype,
        block_score=cfg.effective_block_score,
        rerank=cfg.rerank,
        prefilter=cfg.prefilter,
        rerank_min_tokens=cfg.rerank_min_tokens,
    )


def parse_override(custom_params: Optional[Mapping[str, Any]], base: SparseConfig) -> RequestSparsity:
    """The request's sparsity; raises ValueError (one line) for a bad override."""
    raw = (custom_params or {}).get(OVERRIDE_KEY)
    if raw is None:
        return selection_params(base)
    if not isinstance(raw, Mapping):
        raise ValueError(f"custom_params.{OVERRIDE_KEY} must be an object, got {raw!r}")
    unknown = set(raw) - set(OVERRIDABLE)
    if unknown:
        raise ValueError(
            f"custom_params.{OVERRIDE_KEY} has unknown keys {sorted(unknown)}; "
            f"allowed: {', '.join(OVERRIDABLE)}"
        )
    if raw.get("method") == DENSE:
        return None
    raw = dict(raw)
    use_policy = raw.pop("head_policy", None)
    if use_policy is not None and not isinstance(use_policy, bool):
        raise ValueError(f"custom_params.{OVERRIDE_KEY}.head_policy must be true or false, "
                         f"got {use_policy!r}")
    if use_policy and base.head_policy is None:
        raise ValueError(f"custom_params.{OVERRIDE_KEY}.head_policy needs a server started with "
                         f"--sparse-head-policy")
    values = dataclasses.asdict(base)
    if {"budget", "rerank", "rerank_min_tokens"} & set(raw) and "candidate_blocks" not in raw:
        values["candidate_blocks"] = 0  # re-derive the automatic value from the new budget
    if "method" in raw and raw["method"] != "two_level":
        # The server's output-aware scoring and locality constraint are two_level's (its fp8
        # labels two_level's and ds's).
        if "scoring" not in raw:
            values["scoring"] = "score"
        if "locality_blocks" not in raw:
            values["locality_blocks"] = 0
        if raw["method"] != "ds":
            values["label_dtype"] = "auto"  # quest scores no tokens: the labels go unread
            if "rerank" not in raw:
                values["rerank"] = 0  # nor reranks them
    if raw.get("locality_blocks", values["locality_blocks"]) == 0 and \
            "locality_new_blocks" not in raw:
        values["locality_new_blocks"] = 0  # the limit belongs to the constraint: off with it
    if "block_score" not in raw and {"method", "locality_blocks", "block_filter"} & set(raw):
        values["block_score"] = "auto"  # the server's label_max may not apply to the request's
    for key in ("locality_blocks", "locality_new_blocks", "rerank", "prefilter",
                "rerank_min_tokens"):
        if key in raw and (isinstance(raw[key], bool) or not isinstance(raw[key], int)):
            raise ValueError(f"custom_params.{OVERRIDE_KEY}.{key} must be an integer, "
                             f"got {raw[key]!r}")
    values.update(raw)
    if "prefilter" not in raw and SparseConfig(**values).effective_block_score != "label_max":
        values["prefilter"] = 0  # the server's cascade narrows label_max: off where it is off
    try:
        return selection_params(build_config(**values), use_policy)
    except ConfigError as e:
        raise ValueError(f"custom_params.{OVERRIDE_KEY}: {e}") from None


@dataclasses.dataclass
class RowTables:
    """Per request row of one request-to-token pool: its settings, whether they differ from the
    server's, and the decode's per-row state (e.g. the locality constraint's)."""

    sparsity: dict[int, RequestSparsity] = dataclasses.field(default_factory=dict)
    overriding: set[int] = dataclasses.field(default_factory=set)
    state: dict[int, Any] = dataclasses.field(default_factory=dict)


def _tables(req_to_token_pool: Any) -> RowTables:
    # keyed by the pool itself (weakly): the tables go with it, nothing is set on it
    return runtime.state().side_table(req_to_token_pool, RowTables)


def record(req_to_token_pool: Any, reqs: list, base: SparseConfig) -> None:
    """Remember each request's sparsity under its row (called when rows are handed out)."""
    tables = _tables(req_to_token_pool)
    server_default = selection_params(base)
    for req in reqs:
        if req.req_pool_idx is not None:
            sparsity = parse_override(req.sampling_params.custom_params, base)
            tables.sparsity[req.req_pool_idx] = sparsity
            if sparsity != server_default:
                tables.overriding.add(req.req_pool_idx)
            else:
                tables.overriding.discard(req.req_pool_idx)


def forget(req_to_token_pool: Any, row: Optional[int]) -> None:
    if row is not None:
        tables = _tables(req_to_token_pool)
        tables.sparsity.pop(row, None)
        tables.overriding.discard(row)
        tables.state.pop(row, None)


def has_overriding_rows(req_to_token_pool: Any) -> bool:
    """Whether a request that decodes with other settings than the server's holds a row (the
    batched decode then runs eagerly, in groups: attention/mixed_settings.py)."""
    return bool(_tables(req_to_token_pool).overriding)


def row_state(req_to_token_pool: Any) -> dict[int, Any]:
    """Per-row decode state of the backend (e.g. the locality constraint's), dropped with the
    row's sparse settings when the request leaves."""
    return _tables(req_to_token_pool).state


def lookup(req_to_token_pool: Any, row: int, default: SelectionParams) -> RequestSparsity:
    return _tables(req_to_token_pool).sparsity.get(row, default)
