"""The selection's types and settings: what the server, the kernels and the reference decode
share (the per-request torch oracle is :mod:`sglang_ext.selection.reference`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

METHODS = ("quest", "ds", "two_level")
# How two_level ranks the tokens of its kept blocks: by label score (Double Sparsity), or by
# estimated contribution to the output with the budget shared among the kv heads (Fluxion).
SCORINGS = ("score", "output_aware")
# How two_level's block filter ranks blocks: "bound" by Quest's upper bound of q·k from the key
# min/max summaries, or "label_max" by the largest label score (Double Sparsity's token score)
# of the block's middle positions. On real weights at 16- and 32-token blocks the bound keeps
# the needle's block about half the time, the label maximum about as often as token-level
# selection over the whole context (benchmarks/block_filter_study.py).
BLOCK_SCORES = ("bound", "label_max")
# How the label cache stores the label channels: "auto" in the KV cache's dtype (exact), or
# "fp8_e4m3" (one byte each: half the memory and token-scoring reads of bf16 labels).
LABEL_DTYPES = ("auto", "fp8_e4m3")
FP8_LABELS = torch.float8_e4m3fn
# How the page summaries (Quest's per-block key min / max) are stored: "auto" in the KV dtype
# (exact), or "fp8_e4m3" (one byte per value: half the memory and the block scoring's reads of
# bf16), each min rounded down and each max rounded up to the fp8 grid, so that the bound stays
# an upper bound of every q·k in the block (up to keys beyond ±448, where fp8 saturates).
SUMMARY_DTYPE_NAMES = ("auto", "fp8_e4m3")
FP8_SUMMARIES = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn



def label_storage_dtype(label_dtype: str, kv_dtype: torch.dtype) -> torch.dtype:
    """The label cache's torch dtype for ``label_dtype`` (one of :data:`LABEL_DTYPES`)."""
    if label_dtype not in LABEL_DTYPES:
        raise ValueError(f"label_dtype must be one of {LABEL_DTYPES}, got {label_dtype!r}")
    return FP8_LABELS if label_dtype == "fp8_e4m3" else kv_dtype


def summary_storage_dtype(summary_dtype: str, kv_dtype: torch.dtype) -> torch.dtype:
    """The page summaries' torch dtype for ``summary_dtype`` (one of
    :data:`SUMMARY_DTYPE_NAMES`): "auto" keeps a 16-bit or float32 KV dtype (exact) and takes
    float32 for anything else."""
    if summary_dtype not in SUMMARY_DTYPE_NAMES:
        raise ValueError(f"summary_dtype must be one of {SUMMARY_DTYPE_NAMES}, got "
                         f"{summary_dtype!r}")
    if summary_dtype == "fp8_e4m3":
        return FP8_SUMMARIES
    if kv_dtype in (torch.bfloat16, torch.float16, torch.float32):
        return kv_dtype
    return torch.float32


@dataclass(frozen=True)
class SelectionParams:
    """Token-selection configuration of one layer.

    ``budget`` counts every attended position, sink and window included. ``window`` includes
    the current token, so it is at least 1. ``candidate_blocks`` is only used by two_level.
    ``scoring`` (two_level): see :data:`SCORINGS` and :func:`output_aware_token_mask`.
    ``head_policy``: apply the server's per-head policy (streaming kv heads attend their sink and
    window only; see :mod:`sglang_ext.selection.head_policy`).
    ``locality_blocks`` / ``eviction_score`` (two_level): NOSA's locality constraint, ``k_e``
    query-agnostic blocks per kv head kept by that score (0 = off; see
    :mod:`sglang_ext.selection.locality`). ``locality_new_blocks`` (with ``locality_blocks``):
    at most this many of the query-aware part's blocks per step and kv head may lie outside
    the previous step's block filter (0 = no limit), which bounds a host tier's transfers.
    ``block_filter`` (quest, two_level): "async" ranks the blocks with the previous step's query
    and length (AsyncTLS's asynchronous filter; ``select_token_mask``'s ``block_query``).
    ``block_score`` (two_level): how the block filter ranks blocks, see :data:`BLOCK_SCORES`.
    ``label_dtype`` / ``summary_dtype``: how the server stores the label channels and the page
    summaries (:data:`LABEL_DTYPES`, :data:`SUMMARY_DTYPE_NAMES`); the reference scores the
    values as stored, so that it selects what the kernels select.
    ``rerank`` (ds, two_level with label scores): 0, or the label scores shortlist ``rerank``
    times the selected tokens and the exact q·k picks among them (:func:`rerank_top_k_mask`).
    ``rerank_min_tokens`` (with ``rerank``): the shortlist holds at least this many tokens
    (:func:`shortlist_tokens`).
    ``prefilter`` (two_level with block_score label_max): 0, or the cascade: the bound keeps
    ``prefilter`` times ``candidate_blocks`` blocks and the label maximum ranks only those
    (on the GPU the label maximum would then score those blocks only).
    """

    method: str
    budget: int
    block_size: int
    candidate_blocks: int
    sink: int
    window: int
    scoring: str = "score"
    head_policy: bool = False
    locality_blocks: int = 0
    eviction_score: str = "attention"
    locality_new_blocks: int = 0
    block_filter: str = "sync"
    label_dtype: str = "auto"
    summary_dtype: str = "auto"
    block_score: str = "bound"
    rerank: int = 0
    prefilter: int = 0
    rerank_min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if self.scoring != "score" and self.method != "two_level":
            raise ValueError(f"scoring {self.scoring!r} needs method two_level, got {self.method!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.sink < 0 or self.window < 1:
            raise ValueError(f"need sink >= 0 and window >= 1, got {self.sink}, {self.window}")
        if self.sink + self.window > self.budget:
            raise ValueError(
                f"sink + window ({self.sink} + {self.window}) exceeds budget {self.budget}"
            )
        if self.locality_blocks < 0 or (self.locality_blocks and self.method != "two_level"):
            raise ValueError(f"locality_blocks needs two_level and >= 0, got "
                             f"{self.locality_blocks} with {self.method!r}")
        if self.locality_new_blocks < 0 or (self.locality_new_blocks and not self.locality_blocks):
            raise ValueError(f"locality_new_blocks needs locality_blocks > 0 and >= 0, got "
                             f"{self.locality_new_blocks}")
        if self.block_filter not in ("sync", "async") or (
                self.block_filter == "async" and self.method not in ("quest", "two_level")):
            raise ValueError(f"block_filter must be sync or async (async: quest, two_level), "
                             f"got {self.block_filter!r} with {self.method!r}")
        if self.label_dtype not in LABEL_DTYPES:
            raise ValueError(f"label_dtype must be one of {LABEL_DTYPES}, got {self.label_dtype!r}")
        if self.summary_dtype not in SUMMARY_DTYPE_NAMES:
            raise ValueError(f"summary_dtype must be one of {SUMMARY_DTYPE_NAMES}, got "
                             f"{self.summary_dtype!r}")
        if self.block_score not in BLOCK_SCORES or (
                self.block_score != "bound" and self.method != "two_level"):
            raise ValueError(f"block_score must be one of {BLOCK_SCORES} (label_max: two_level), "
                             f"got {self.block_score!r} with {self.method!r}")
        if self.rerank < 0 or self.rerank == 1 or (
                self.rerank and (self.method not in ("ds", "two_level") or self.scoring != "score")):
            raise ValueError(f"rerank must be 0 or >= 2 (ds, two_level with label scores), got "
                             f"{self.rerank} with {self.method!r}, {self.scoring!r}")
        if self.rerank_min_tokens < 0:
            raise ValueError(f"rerank_min_tokens must be >= 0, got {self.rerank_min_tokens}")
        if self.prefilter < 0 or self.prefilter == 1 or (
                self.prefilter and (self.method != "two_level" or self.block_score != "label_max")):
            raise ValueError(f"prefilter must be 0 or >= 2 (two_level with block_score label_max), "
                             f"got {self.prefilter} with {self.method!r}, {self.block_score!r}")
        if self.method == "two_level" and self.candidate_blocks < 1:
            raise ValueError(
                f"two_level needs candidate_blocks >= 1, got {self.candidate_blocks}"
            )


def shortlist_tokens(params: SelectionParams) -> int:
    """How many tokens the label scores shortlist for the exact rerank: ``rerank`` times the
    selected ones but at least ``rerank_min_tokens``, and at most what two_level's candidate
    blocks hold. A middle this short (or shorter) is ranked by the exact q·k whole, as a
    context within the budget is attended whole.

    Why a floor: what the shortlist must absorb is the label scores' rank error, which grows
    with the context rather than with the budget. A small budget's shortlist (1/64 of 2k: 20
    tokens x 4) missed needles that a few hundred tokens keep; at large budgets the factor
    dominates and the floor costs nothing."""
    n_sel = params.budget - params.sink - params.window
    wanted = max(params.rerank * n_sel, params.rerank_min_tokens)
    if params.method == "two_level":
        return min(wanted, params.candidate_blocks * params.block_size)
    return wanted
