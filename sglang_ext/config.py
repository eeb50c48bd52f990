"""The sparse decode settings: CLI flags, validation and the config object the backend reads.

Flags are parsed as strings and validated here (not by argparse ``type=``) so that every bad
value stops start-up with one line that names the flag, instead of argparse's usage dump of
SGLang's several hundred flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from sglang_ext.selection.params import (
    BLOCK_SCORES,
    LABEL_DTYPES,
    METHODS,
    SCORINGS,
    SUMMARY_DTYPE_NAMES,
)

BACKEND_NAME = "sglang_ext"  # --attention-backend / --decode-attention-backend value
DENSE_BACKENDS = ("auto", "torch_native", "triton", "flashinfer")
IMPLS = ("auto", "reference", "triton")
TIER_MODES = ("off", "sync", "async")
TIER_METHODS = ("quest", "two_level")  # the tier fetches what a block filter chose
DENSE_DECODE_MODES = ("sglang", "float32")  # the reference decode's dense rows
ON_OFF = ("off", "on")
# async tier: attend the previous step's blocks, or this step's resident blocks and the previous
# step's in place of this step's misses (memory_tier/working_set.py)
TIER_ASYNC_ATTEND = ("previous", "resident")
BLOCK_FILTER_MODES = ("sync", "async")
BLOCK_SCORE_MODES = ("auto", *BLOCK_SCORES)
# The locality constraint's query-agnostic scores (selection/locality.py: SCORE_KINDS).
EVICTION_SCORES = ("attention", "key_norm", "learned")
ENV_CONFIG = "SGLANG_EXT_CONFIG"  # JSON fallback for sgl.Engine(...), which rejects unknown kwargs


class ConfigError(ValueError):
    """A bad sparse setting; its message is one line that names the flag."""


@dataclass(frozen=True)
class SparseConfig:
    method: str = "two_level"
    budget: int = 2048
    block_size: int = 16
    candidate_blocks: int = 0  # 0 = auto: twice the blocks the token budget (or shortlist) needs
    sink: int = 16
    window: int = 64
    label_channels: int = 16
    label_config: Optional[str] = None
    label_dtype: str = "auto"  # the label cache's storage: see LABEL_DTYPES
    summary_dtype: str = "auto"  # the page summaries' storage: see SUMMARY_DTYPE_NAMES
    dense_backend: str = "auto"
    impl: str = "auto"
    tier: str = "off"
    tier_host_gb: float = 0.0  # 0 = auto: half of the host memory available at start-up
    tier_gpu_tokens: int = 0  # 0 = auto: what the GPU holds after the working area
    tier_timing: str = "off"  # stream-clock timing of the tier's transfers: see ON_OFF
    tier_sync_steps: int = 0  # async tier: a request's first steps fetched on the critical path
    tier_async_attend: str = "previous"  # async tier: what a step attends, see TIER_ASYNC_ATTEND
    # The tier admission's PCIe term (memory_tier/transfer_budget.py): a step may move
    # tier_pcie_gbps x tier_step_ms. On the H200 (PCIe 5 x16) the tier's gather moved 55.6 GB/s
    # contiguous and ~51 GB/s of random 4 KiB blocks beside a decode attention
    # (kernels/host_gather.py): 45 leaves a margin. The tier's decode steps at 128k took 18 ms
    # (2 requests) to 24 ms (8 requests) there. Off by default until measured on the GPU: without
    # the locality limit a 128k request is predicted at its whole block budget per step.
    tier_pcie_gbps: float = 0.0  # 0 = no PCIe term; 45 on an H200
    tier_step_ms: float = 20.0
    locality_blocks: int = 0  # NOSA k_e: query-agnostic blocks per kv head (0 = off)
    locality_new_blocks: int = 0  # query-aware blocks admitted per step from outside the last filter
    eviction_score: str = "attention"  # see EVICTION_SCORES
    eviction_head: Optional[str] = None  # trained eviction heads (selection/eviction_head.py)
    dense_decode: str = "sglang"  # reference decode's dense rows: see DENSE_DECODE_MODES
    guard_every: int = 0  # accuracy guard: decode steps between two recall probes (0 = off)
    guard_recall: float = 0.9  # the guard doubles a request's budget below this recall
    guard_max_budget: int = 0  # 0 = auto: 4x --sparse-budget
    scoring: str = "score"  # two_level's token ranking: see SCORINGS
    head_policy: Optional[str] = None  # per-head policy file (selection/head_policy.py)
    cooperative: str = "off"  # Fluxion CPU-GPU cooperative attention of the sync tier: ON_OFF
    cooperative_threads: int = 0  # its CPU worker threads (0 = auto: cooperative_worker_threads)
    block_filter: str = "sync"  # AsyncTLS's one-step-ahead block filter: see BLOCK_FILTER_MODES
    block_score: str = "auto"  # how the block filter ranks blocks: see BLOCK_SCORE_MODES
    rerank: int = 0  # exact q.k reranks rerank x the label-picked tokens (0 = off)
    rerank_min_tokens: int = 1024  # ... but at least this many (a small budget's floor)
    prefilter: int = 0  # the bound keeps prefilter x the candidate blocks for label_max (0 = off)

    @property
    def keeps_label_cache(self) -> bool:
        """Whether the batched (CUDA) decode keeps a label cache (kernels/label_cache.py): a
        label config and a method that scores tokens by label channels. Under the CPU tier it
        covers the host-homed pages too (r/D of their keys stays on the GPU), so blocks and
        tokens are scored without their keys being resident."""
        return self.label_config is not None and self.method in ("two_level", "ds")

    @property
    def label_max_applies(self) -> bool:
        """Whether the label-max block filter can serve this configuration: two_level, under
        the CPU tier only with the label cache (host-homed keys are not resident), and without
        the locality constraint (whose query-aware part is ranked by the bound) or the
        asynchronous block filter."""
        return (self.method == "two_level" and (self.tier == "off" or self.keeps_label_cache)
                and self.locality_blocks == 0 and self.block_filter == "sync")

    @property
    def effective_block_score(self) -> str:
        """``block_score`` with "auto" resolved: label_max where it applies, else bound."""
        if self.block_score != "auto":
            return self.block_score
        return "label_max" if self.label_max_applies else "bound"

    @property
    def effective_guard_max_budget(self) -> int:
        return self.guard_max_budget if self.guard_max_budget > 0 else 4 * self.budget

    @property
    def effective_candidate_blocks(self) -> int:
        if self.candidate_blocks > 0:
            return self.candidate_blocks
        middle = max(self.budget - self.sink - self.window, 0)
        # with the exact rerank the filter keeps room for its whole shortlist, twice over
        blocks = 2 * max(1, self.rerank) * -(-middle // self.block_size)
        if self.rerank:  # ... and for the shortlist's floor
            blocks = max(blocks, 2 * -(-self.rerank_min_tokens // self.block_size))
        return max(1, blocks)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


# (field, flag, metavar, help). Defaults come from SparseConfig.
_FLAGS: tuple[tuple[str, str, str, str], ...] = (
    ("method", "--sparse-method", "{" + ",".join(METHODS) + "}",
     "Sparse decode method: quest (top blocks by key min/max bound), ds (top tokens by "
     "label channels), two_level (blocks filtered by the bound, then tokens by labels)."),
    ("budget", "--sparse-budget", "TOKENS",
     "Tokens attended per kv head at each decode step, sink and window included; contexts "
     "within the budget decode densely."),
    ("block_size", "--sparse-block-size", "TOKENS",
     "Tokens per block summarised by key min/max (a power of two)."),
    ("candidate_blocks", "--sparse-candidate-blocks", "BLOCKS",
     "two_level: blocks kept by the block filter before token selection (0 = twice what the "
     "budget needs, times --sparse-rerank's factor when it is on)."),
    ("sink", "--sparse-sink", "TOKENS", "First tokens of the context that are always attended."),
    ("window", "--sparse-window", "TOKENS",
     "Most recent tokens (the current one included) that are always attended."),
    ("scoring", "--sparse-scoring", "{" + ",".join(SCORINGS) + "}",
     "two_level's token ranking: score (label scores, the same k per kv head) or output_aware "
     "(Fluxion: estimated attention weight x value norm, the layer's budget shared among its kv "
     "heads by that mass; reference decode)."),
    ("head_policy", "--sparse-head-policy", "PATH",
     "Per-head policy (python -m sglang_ext.selection.head_policy): streaming kv heads attend "
     "sink + window only and retrieval heads share the budget they leave (reference decode; a "
     "request opts out with custom_params.sparse.head_policy=false)."),
    ("label_channels", "--sparse-label-channels", "CHANNELS",
     "Channels per kv head used for token scores (taken from --sparse-label-config)."),
    ("label_config", "--sparse-label-config", "PATH",
     "Calibrated heavy channels (python -m sglang_ext.selection.calibrate); without it token "
     "scores use every channel."),
    ("label_dtype", "--sparse-label-dtype", "{" + ",".join(LABEL_DTYPES) + "}",
     "How the label cache stores the label channels: auto (the KV cache's dtype) or fp8_e4m3 "
     "(one byte per channel, rounded to nearest, saturating at +-448: half the label cache's "
     "memory, so more KV tokens fit, and half the token scoring's reads). The reference "
     "decode rounds the same way. Needs --sparse-label-config, --sparse-method two_level or "
     "ds, and no --sparse-tier."),
    ("summary_dtype", "--sparse-summary-dtype", "{" + ",".join(SUMMARY_DTYPE_NAMES) + "}",
     "How the page summaries (the block filter's per-block key min/max) are stored: auto (the "
     "KV cache's dtype, exact) or fp8_e4m3 (one byte per value, each min rounded down and "
     "each max up, so the Quest bound stays an upper bound; keys beyond +-448 saturate): half "
     "the summaries' memory, so more KV tokens fit, and half the block scoring's reads; the "
     "looser bound may rank blocks otherwise. The reference decode rounds the same way."),
    ("dense_backend", "--sparse-dense-backend", "{" + ",".join(DENSE_BACKENDS) + "}",
     "SGLang backend used for prefill/extend (auto: torch_native on CPU, triton on CUDA)."),
    ("impl", "--sparse-impl", "{" + ",".join(IMPLS) + "}",
     "Decode implementation: reference (plain torch, per request; CPU default) or triton "
     "(batched kernels, CUDA graphs; CUDA default)."),
    ("tier", "--sparse-tier", "{" + ",".join(TIER_MODES) + "}",
     "CPU KV tier: off; async (AsyncTLS: each step attends the blocks chosen at the previous "
     "step while this step's choice is fetched from host memory on a side stream); sync "
     "(fetch inside the step: exactly the untiered selection). KV beyond the GPU's share "
     "lives in pinned host memory; the GPU keeps sink/window pages and a working set per "
     "request."),
    ("tier_host_gb", "--sparse-tier-host-gb", "GB",
     "Pinned host memory for the CPU tier's KV, the whole server's (with --tp N each rank "
     "pins 1/N of it; 0 = half of the memory available at start-up)."),
    ("locality_blocks", "--sparse-locality-blocks", "BLOCKS",
     "two_level with NOSA's locality constraint: this many blocks per kv head are kept by a "
     "query-agnostic eviction score, and a block once dropped never returns, so at least "
     "that share of the attended blocks persists between steps (0 = off; both decode "
     "implementations, triton with the key_norm and learned scores)."),
    ("locality_new_blocks", "--sparse-locality-new-blocks", "BLOCKS",
     "With --sparse-locality-blocks: per step and kv head, at most this many of the "
     "query-aware block filter's blocks may lie outside the previous step's filter (the best "
     "of them by Quest bound; the rest wait a step), which bounds the CPU tier's transfers "
     "per step while the filter still spans the whole middle (0 = no limit)."),
    ("eviction_score", "--sparse-eviction-score", "{" + ",".join(EVICTION_SCORES) + "}",
     "Score of the query-agnostic part: attention (decayed attention mass; reference decode "
     "only), key_norm (pooled key norms) or learned (NOSA's trained eviction head, "
     "--sparse-eviction-head)."),
    ("eviction_head", "--sparse-eviction-head", "PATH",
     "Trained eviction heads (python -m sglang_ext.selection.train_eviction), checked against "
     "the model at start-up; needed by --sparse-eviction-score learned and by requests that "
     "ask for it (custom_params.sparse.eviction_score)."),
    ("dense_decode", "--sparse-dense-decode", "{sglang,float32}",
     "Dense decode rows of the reference (CPU) decode: sglang = the same SDPA call as SGLang's "
     "torch_native backend (bit-identical outputs); float32 = the same attention in float32 "
     "(~8x faster per bf16 row on a CPU, rounded differently)."),
    ("guard_every", "--sparse-guard-every", "STEPS",
     "Accuracy guard: every this many decode steps, measure for one kv head per layer the share "
     "of the dense attention mass the sparse selection keeps (recall), and double a request's "
     "budget when it is below --sparse-guard-recall (halve it again, down to --sparse-budget, "
     "when it is high). Requests decode densely until their context exceeds the guard's largest "
     "budget. 0 = off."),
    ("guard_recall", "--sparse-guard-recall", "FRACTION",
     "Recall under which the guard doubles a request's budget (it halves it at or above "
     "1 - (1 - FRACTION) / 4)."),
    ("guard_max_budget", "--sparse-guard-max-budget", "TOKENS",
     "Largest budget the guard may raise a request to (0 = 4x --sparse-budget)."),
    ("tier_gpu_tokens", "--sparse-tier-gpu-tokens", "TOKENS",
     "KV slots homed on the GPU with the tier on (0 = all the GPU holds beside the tier's "
     "working area); a small value forces requests onto the host (tests)."),
    ("tier_pcie_gbps", "--sparse-tier-pcie-gbps", "GBPS",
     "The CPU tier admission's PCIe term: host->GPU rate (GB/s, 1e9 bytes) the tier's transfers "
     "may use. A request whose KV lives on the host is admitted into decode only while the "
     "transfers predicted per step for the running host-homed requests (per request: "
     "--sparse-locality-new-blocks + 1 blocks per layer and kv head, or its whole block budget "
     "without that limit) fit in GBPS x --sparse-tier-step-ms; otherwise it waits in the queue "
     "(a lone request always runs). 0 (the default) = no PCIe term; ~45 suits an H200's PCIe 5 "
     "x16."),
    ("tier_step_ms", "--sparse-tier-step-ms", "MS",
     "The decode step time (milliseconds) the tier's per-step transfers must fit in, for the "
     "PCIe term of --sparse-tier-pcie-gbps."),
    ("tier_sync_steps", "--sparse-tier-sync-steps", "STEPS",
     "With --sparse-tier async: a request's first STEPS decode steps fetch the blocks their own "
     "query selects before attending them (the sync schedule), later steps attend the previous "
     "step's blocks while the next ones are prefetched. A short answer is decoded in its first "
     "steps, where the lagged schedule attends the preloaded blocks and then a stale selection. "
     "0 = every step async."),
    ("tier_async_attend", "--sparse-tier-async-attend", "{previous,resident}",
     "With --sparse-tier async, what a step attends while its own blocks are fetched: "
     "'previous' (the blocks the previous step selected, AsyncTLS) or 'resident' (the blocks "
     "this step selects that are already on the GPU, and previous-step blocks in place of the "
     "ones still on the host: no transfer waited for, fewer stale blocks)."),
    ("tier_timing", "--sparse-tier-timing", "{off,on}",
     "Time the tier's transfers on the GPU's own clock, inside the decode CUDA graph (a few "
     "tiny kernels per layer): transfer seconds, the part the step waited for, and the hidden "
     "fraction, in the tier stats log line and /metrics."),
    ("cooperative", "--sparse-cooperative", "{off,on}",
     "Fluxion's CPU-GPU cooperative attention (needs --sparse-tier sync and eager decode, e.g. "
     "--disable-cuda-graph): per layer, CPU threads attend some of the step's selected blocks "
     "that are still only in host memory, chosen by a cost model calibrated at the first "
     "tiered decode, instead of fetching them; the partial results are merged exactly by "
     "log-sum-exp. CPU-attended blocks and planned/skipped layers go to the tier stats log "
     "line and /metrics."),
    ("block_filter", "--sparse-block-filter", "{" + ",".join(BLOCK_FILTER_MODES) + "}",
     "When the block filter (Quest bounds over every block summary + block top-k) runs: sync "
     "(in each layer, with this step's query) or async (AsyncTLS: with this step's query for "
     "the next step, on a side stream beside the following layers' GEMMs; each step picks its "
     "tokens, with its own query, inside the blocks chosen at the previous step, a request's "
     "first step inside those its last prompt token chose). The reference decode ranks the "
     "blocks with each request's previous query instead (the same selection; a request may ask "
     "for it: custom_params.sparse.block_filter). async needs --sparse-method quest or "
     "two_level, and no tier, locality constraint or guard."),
    ("block_score", "--sparse-block-score", "{" + ",".join(BLOCK_SCORE_MODES) + "}",
     "How two_level's block filter ranks blocks: bound (Quest's upper bound of q.k from each "
     "page's key min/max), label_max (each block's largest label score: every middle token is "
     "scored by its label channels, which keeps the block holding a needle about as often as "
     "token-level selection does; bound loses it about half the time at 16- and 32-token "
     "blocks on real weights), or auto (label_max for two_level, under --sparse-tier only with "
     "a --sparse-label-config; the bound with --sparse-locality-blocks or --sparse-block-filter "
     "async)."),
    ("rerank", "--sparse-rerank", "FACTOR",
     "Token level, exact rerank: the label channels shortlist FACTOR times the tokens the "
     "budget selects, and the exact q.k over all channels (max over the kv head's query "
     "heads) picks the budget's tokens among them. Label scores are an approximation; top-k "
     "by the exact q.k kept dense attention's score on the needle tasks at budget 1/16 (2k "
     "context, SmolLM2). Costs reading FACTOR x the selected tokens' keys once more. 0 = off; "
     "else >= 2; ds and two_level (with or without the tier), not with the locality "
     "constraint, the guard, the async block filter or cooperative attention."),
    ("rerank_min_tokens", "--sparse-rerank-min-tokens", "TOKENS",
     "With --sparse-rerank: the shortlist holds at least TOKENS tokens (and the automatic "
     "--sparse-candidate-blocks room for twice that). The label scores' rank error grows with "
     "the context, not the budget: at budget 1/64 of 2k (20 selected tokens) a shortlist of "
     "4 x 20 missed needles that 256 kept, and four-value retrieval kept more with 1024 than "
     "with 256 at 2k and 4k. Large budgets (2048: 4 x 1968) are unaffected."),
    ("prefilter", "--sparse-block-prefilter", "FACTOR",
     "The block filter's cascade: Quest's bound (cheap) keeps FACTOR times "
     "--sparse-candidate-blocks pages, and the label maximum ranks only those to keep the "
     "candidates (it kept the label maximum's needle recall at FACTOR 2 to 8 on real weights). "
     "0 = off; else >= 2; needs the label_max block filter (--sparse-block-score label_max, or "
     "auto where it resolves to label_max)."),
    ("cooperative_threads", "--sparse-cooperative-threads", "THREADS",
     "CPU worker threads of --sparse-cooperative (0 = half of the cores this process may use, "
     "at least 1, at most 8)."),
)
_FIELD_BY_FLAG = {flag: field for field, flag, _, _ in _FLAGS}
_FLAG_BY_FIELD = {field: flag for field, flag, _, _ in _FLAGS}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add our flags to SGLang's server parser (shown in ``--help``)."""
    defaults = SparseConfig()
    group = parser.add_argument_group(
        "sglang_ext sparse decode (used with --attention-backend sglang_ext)"
    )
    for field, flag, metavar, help_text in _FLAGS:
        default = getattr(defaults, field)
        group.add_argument(
            flag, dest=_dest(field), metavar=metavar, default=None,
            help=f"{help_text} Default: {default}.",
        )


def _dest(field: str) -> str:
    return f"sglang_ext_{field}"


def from_namespace(args: argparse.Namespace) -> SparseConfig:
    """Build and validate the config from parsed flags, falling back to $SGLANG_EXT_CONFIG."""
    raw: dict[str, Any] = {}
    env = os.environ.get(ENV_CONFIG)
    if env:
        try:
            raw.update(json.loads(env))
        except json.JSONDecodeError as e:
            raise ConfigError(f"${ENV_CONFIG} is not valid JSON: {e}") from None
        unknown = set(raw) - {f.name for f in dataclasses.fields(SparseConfig)}
        if unknown:
            raise ConfigError(f"${ENV_CONFIG} has unknown keys: {sorted(unknown)}")
    for field, _flag, _, _ in _FLAGS:
        value = getattr(args, _dest(field), None)
        if value is not None:
            raw[field] = value
    return build_config(**raw)


def build_config(**values: Any) -> SparseConfig:
    """Validate raw values (strings from the CLI, or typed values) into a SparseConfig."""
    defaults = SparseConfig()
    typed: dict[str, Any] = {}
    for f in dataclasses.fields(SparseConfig):
        value = values.get(f.name, getattr(defaults, f.name))
        typed[f.name] = _coerce(f.name, value, getattr(defaults, f.name))
    cfg = SparseConfig(**typed)
    _validate(cfg)
    return cfg


def _coerce(field: str, value: Any, default: Any) -> Any:
    flag = _FLAG_BY_FIELD[field]
    if isinstance(default, float):
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag} must be a number (got {value!r})") from None
        if out != out or out in (float("inf"), float("-inf")):
            raise ConfigError(f"{flag} must be a finite number (got {value!r})")
        return out
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool):
            raise ConfigError(f"{flag} must be an integer (got {value!r})")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag} must be an integer (got {value!r})") from None
    if value is None:
        return None
    return str(value)


def _validate_rerank(cfg: SparseConfig, fail: Callable[[str, str], None]) -> None:
    if cfg.rerank < 0 or cfg.rerank == 1:
        fail("rerank", "must be 0 (off) or >= 2 (the shortlist's size over the budget's)")
    if cfg.rerank_min_tokens < 0:
        fail("rerank_min_tokens", "must be >= 0 (0 = no floor)")
    if cfg.rerank and (cfg.method not in ("ds", "two_level") or cfg.scoring != "score"):
        fail("rerank", "reranks label scores: it needs --sparse-method ds or two_level with "
             "--sparse-scoring score")
    if cfg.rerank and (cfg.locality_blocks or cfg.guard_every or cfg.block_filter != "sync"
                       or cfg.cooperative == "on"):
        fail("rerank", "does not combine with --sparse-locality-blocks, --sparse-guard-every, "
             "--sparse-block-filter async or --sparse-cooperative yet")


def _validate_prefilter(cfg: SparseConfig, fail: Callable[[str, str], None]) -> None:
    if cfg.prefilter < 0 or cfg.prefilter == 1:
        fail("prefilter", "must be 0 (off) or >= 2 (the bound keeps FACTOR x the candidate "
             "blocks)")
    if cfg.prefilter and cfg.effective_block_score != "label_max":
        fail("prefilter", "narrows the label_max block filter: it needs --sparse-method "
             "two_level with --sparse-block-score label_max or auto, and no "
             "--sparse-locality-blocks or --sparse-block-filter async")
    if cfg.prefilter and cfg.tier != "off":
        fail("prefilter", "does not combine with --sparse-tier (the cascade's kernel path "
             "has no page map)")


def _validate(cfg: SparseConfig) -> None:
    def fail(field: str, why: str) -> None:
        raise ConfigError(f"{_FLAG_BY_FIELD[field]} {why} (got {getattr(cfg, field)!r})")

    if cfg.method not in METHODS:
        fail("method", f"must be one of {', '.join(METHODS)}")
    if cfg.dense_backend not in DENSE_BACKENDS:
        fail("dense_backend", f"must be one of {', '.join(DENSE_BACKENDS)}")
    if cfg.impl not in IMPLS:
        fail("impl", f"must be one of {', '.join(IMPLS)}")
    if cfg.budget < 1:
        fail("budget", "must be a positive number of tokens")
    if cfg.block_size < 1 or cfg.block_size & (cfg.block_size - 1):
        fail("block_size", "must be a power of two")
    if cfg.candidate_blocks < 0:
        fail("candidate_blocks", "must be >= 0 (0 = auto)")
    if cfg.sink < 0:
        fail("sink", "must be >= 0")
    if cfg.window < 1:
        fail("window", "must be >= 1 (the current token is always attended)")
    if cfg.budget < cfg.sink + cfg.window:
        raise ConfigError(
            f"--sparse-budget must be >= --sparse-sink + --sparse-window "
            f"(got {cfg.budget} < {cfg.sink} + {cfg.window})"
        )
    if cfg.label_channels < 1:
        fail("label_channels", "must be >= 1")
    if cfg.label_config is not None and not os.path.isfile(cfg.label_config):
        fail("label_config", "is not a readable file")
    if cfg.label_dtype not in LABEL_DTYPES:
        fail("label_dtype", f"must be one of {', '.join(LABEL_DTYPES)}")
    if cfg.label_dtype != "auto" and not cfg.keeps_label_cache:
        fail("label_dtype", "needs the label cache: --sparse-label-config and --sparse-method "
             "two_level or ds")
    if cfg.summary_dtype not in SUMMARY_DTYPE_NAMES:
        fail("summary_dtype", f"must be one of {', '.join(SUMMARY_DTYPE_NAMES)}")
    if cfg.tier not in TIER_MODES:
        fail("tier", f"must be one of {', '.join(TIER_MODES)}")
    if cfg.tier_host_gb < 0:
        fail("tier_host_gb", "must be >= 0 (0 = auto)")
    if cfg.locality_blocks < 0:
        fail("locality_blocks", "must be >= 0 (0 = off)")
    if cfg.locality_new_blocks < 0:
        fail("locality_new_blocks", "must be >= 0 (0 = no limit)")
    if cfg.locality_new_blocks > 0 and cfg.locality_blocks == 0:
        fail("locality_new_blocks", "needs --sparse-locality-blocks > 0")
    if cfg.eviction_score not in EVICTION_SCORES:
        fail("eviction_score", f"must be one of {', '.join(EVICTION_SCORES)}")
    if cfg.eviction_head is not None and not os.path.isfile(cfg.eviction_head):
        fail("eviction_head", "is not a readable file")
    if cfg.eviction_score == "learned" and cfg.eviction_head is None:
        fail("eviction_score", "learned needs --sparse-eviction-head")
    if cfg.scoring not in SCORINGS:
        fail("scoring", f"must be one of {', '.join(SCORINGS)}")
    if cfg.scoring != "score" and cfg.method != "two_level":
        fail("scoring", "needs --sparse-method two_level")
    if cfg.head_policy is not None and not os.path.isfile(cfg.head_policy):
        fail("head_policy", "is not a readable file")
    if cfg.dense_decode not in DENSE_DECODE_MODES:
        fail("dense_decode", f"must be one of {', '.join(DENSE_DECODE_MODES)}")
    if cfg.locality_blocks > 0:
        if cfg.method != "two_level":
            fail("locality_blocks", "needs --sparse-method two_level")
        if cfg.locality_blocks * cfg.block_size > cfg.budget - cfg.sink - cfg.window:
            raise ConfigError(
                f"--sparse-locality-blocks x --sparse-block-size must fit in the selected part of "
                f"the budget ({cfg.budget - cfg.sink - cfg.window} tokens) "
                f"(got {cfg.locality_blocks} x {cfg.block_size})"
            )
    if cfg.tier_gpu_tokens < 0:
        fail("tier_gpu_tokens", "must be >= 0 (0 = auto)")
    if cfg.tier != "off" and 0 < cfg.tier_gpu_tokens < cfg.block_size:
        # the tier homes whole pages (one page = one block): less than one rounds to none
        fail("tier_gpu_tokens", f"must be 0 (auto) or at least one page of "
                                f"--sparse-block-size {cfg.block_size} tokens")
    if cfg.tier_pcie_gbps < 0:
        fail("tier_pcie_gbps", "must be >= 0 (0 = no PCIe term)")
    if cfg.tier_step_ms <= 0:
        fail("tier_step_ms", "must be > 0")
    if cfg.tier_sync_steps < 0:
        fail("tier_sync_steps", "must be >= 0 (0 = every step async)")
    if cfg.tier_sync_steps and cfg.tier != "async":
        fail("tier_sync_steps", "needs --sparse-tier async (sync fetches every step already)")
    if cfg.tier_async_attend not in TIER_ASYNC_ATTEND:
        fail("tier_async_attend", f"must be one of {', '.join(TIER_ASYNC_ATTEND)}")
    if cfg.tier_async_attend != "previous" and cfg.tier != "async":
        fail("tier_async_attend", "needs --sparse-tier async (sync attends its own blocks)")
    if cfg.tier_timing not in ON_OFF:
        fail("tier_timing", f"must be one of {', '.join(ON_OFF)}")
    if cfg.tier_timing == "on" and cfg.tier == "off":
        fail("tier_timing", "needs --sparse-tier sync or async (it times the tier's transfers)")
    _validate_cooperative(cfg, fail)
    _validate_block_filter(cfg, fail)
    if cfg.block_score not in BLOCK_SCORE_MODES:
        fail("block_score", f"must be one of {', '.join(BLOCK_SCORE_MODES)}")
    if cfg.block_score == "label_max" and not cfg.label_max_applies:
        fail("block_score", "label_max needs --sparse-method two_level (under --sparse-tier "
             "with a --sparse-label-config), and no --sparse-locality-blocks or "
             "--sparse-block-filter async")
    _validate_rerank(cfg, fail)
    _validate_prefilter(cfg, fail)
    if cfg.guard_every < 0:
        fail("guard_every", "must be >= 0 (0 = off)")
    if not 0.0 < cfg.guard_recall < 1.0:
        fail("guard_recall", "must be in (0, 1)")
    if cfg.guard_max_budget < 0:
        fail("guard_max_budget", "must be >= 0 (0 = 4x --sparse-budget)")
    if cfg.guard_max_budget and cfg.guard_max_budget < cfg.budget:
        raise ConfigError(
            f"--sparse-guard-max-budget must be >= --sparse-budget "
            f"(got {cfg.guard_max_budget} < {cfg.budget})"
        )
    if cfg.guard_every > 0:
        if cfg.tier != "off":
            fail("guard_every", "needs --sparse-tier off (the tier's working sets are sized for "
                 "--sparse-budget)")
        if cfg.locality_blocks > 0:
            fail("guard_every", "cannot be combined with --sparse-locality-blocks")
    if cfg.tier != "off":
        if cfg.method not in TIER_METHODS:
            raise ConfigError(
                f"--sparse-tier needs a block-filtering --sparse-method ({', '.join(TIER_METHODS)}); "
                f"{cfg.method} scores every token, which the host tier cannot serve (got {cfg.method!r})"
            )
        # A context within the budget decodes densely: the working set (the block filter's
        # blocks per kv head: two_level's candidates plus E_t's, quest's kept blocks) must hold
        # all its middle blocks at once.
        dense_middle = dense_middle_blocks(cfg.budget, cfg.sink, cfg.window, cfg.block_size)
        if cfg.method == "two_level":
            slots = cfg.effective_candidate_blocks + cfg.locality_blocks
            if slots < dense_middle:
                raise ConfigError(
                    f"--sparse-candidate-blocks + --sparse-locality-blocks must be >= "
                    f"{dense_middle} with --sparse-tier (the middle blocks of a {cfg.budget}-token "
                    f"context, which decodes densely) (got {cfg.effective_candidate_blocks} + "
                    f"{cfg.locality_blocks})"
                )
        elif cfg.method == "quest":
            kept = (cfg.budget - cfg.sink - cfg.window) // cfg.block_size
            if kept < dense_middle:
                raise ConfigError(
                    f"--sparse-budget, --sparse-sink and --sparse-window must be multiples of "
                    f"--sparse-block-size with --sparse-tier and quest: its {kept} kept blocks "
                    f"cannot hold the {dense_middle} middle blocks of a {cfg.budget}-token "
                    f"context, which decodes densely (got budget {cfg.budget}, sink {cfg.sink}, "
                    f"window {cfg.window}, block size {cfg.block_size})"
                )
        available = _available_host_gb()
        if available is not None and cfg.tier_host_gb > available:
            raise ConfigError(
                f"--sparse-tier-host-gb {cfg.tier_host_gb:g} exceeds the {available:.1f} GB of "
                f"host memory available"
            )


# The benchmarks' operating point of NOSA's constraint: this share of the budget's middle blocks
# is query-agnostic, in the accuracy suite (benchmarks/accuracy/runner.py) and the GPU locality
# run (benchmarks/e2e_serving.py), so both describe one setting. (The earlier setting also sized
# the block filter for the query-aware rest, locality_candidate_blocks: the accuracy suite's
# "locality" rows; it lost points. The GPU run now limits the filter's new blocks instead.)
LOCALITY_SHARE = 1 / 4


# The operating point of the limit on new filter blocks (--sparse-locality-new-blocks): this
# share of the automatic block filter (sized for the whole middle) may enter per step, into a
# filter LOCALITY_FILTER_SCALE times the automatic one (locality_limited_candidate_blocks); the
# accuracy suite's locality_limited rows and the GPU locality run use it.
LOCALITY_NEW_SHARE = 1 / 4
LOCALITY_FILTER_SCALE = 1


def _share_of_automatic_filter(share: float, budget: int, sink: int, window: int,
                               block_size: int) -> int:
    """``share`` of the automatic block filter (``SparseConfig.effective_candidate_blocks``),
    at least 1 block."""
    auto = SparseConfig(budget=budget, sink=sink, window=window,
                        block_size=block_size).effective_candidate_blocks
    return max(1, int(auto * share))


def locality_new_blocks_for_share(share: float, budget: int, sink: int, window: int,
                                  block_size: int) -> int:
    """``--sparse-locality-new-blocks`` that lets ``share`` of the automatic block filter
    enter per step (at least 1: 0 would mean no limit)."""
    return _share_of_automatic_filter(share, budget, sink, window, block_size)


def locality_limited_candidate_blocks(scale: float, budget: int, sink: int, window: int,
                                      block_size: int) -> int:
    """The block filter of the limited setting: ``scale`` times the automatic one. A wider
    filter keeps more of the recent blocks resident (the limit only bounds what enters), so a
    block that leaves the query's favour for a few steps is still there when it returns."""
    return _share_of_automatic_filter(scale, budget, sink, window, block_size)


def locality_blocks_for_share(share: float, budget: int, sink: int, window: int,
                              block_size: int) -> int:
    """NOSA's ``k_e`` that gives the query-agnostic part ``share`` of the budget's middle
    blocks (what the benchmarks set --sparse-locality-blocks to)."""
    return int((budget - sink - window) // block_size * share)


def locality_candidate_blocks(locality_blocks: int, budget: int, sink: int, window: int,
                              block_size: int) -> int:
    """A block filter sized for the query-aware part alone: twice the blocks its tokens need
    (the automatic filter is sized for the whole middle, which scatters the query-aware tokens
    over twice as many blocks, all of which a tier then fetches). Fewer transfers; on the
    accuracy suite it costs points at small budgets (README, NOSA locality)."""
    query_aware = max(budget - sink - window - locality_blocks * block_size, 0)
    return max(1, 2 * -(-query_aware // block_size))


def _validate_block_filter(cfg: SparseConfig, fail: Any) -> None:
    if cfg.block_filter not in BLOCK_FILTER_MODES:
        fail("block_filter", f"must be one of {', '.join(BLOCK_FILTER_MODES)}")
    if cfg.block_filter != "async":
        return
    if cfg.method not in TIER_METHODS:
        fail("block_filter", "async needs a block filter (--sparse-method quest or two_level)")
    if cfg.tier != "off":
        fail("block_filter", "async does not combine with --sparse-tier (its async mode "
                             "already attends the previous step's blocks)")
    if cfg.locality_blocks > 0:
        fail("block_filter", "async does not combine with --sparse-locality-blocks")
    if cfg.guard_every > 0:
        fail("block_filter", "async does not combine with --sparse-guard-every")


def _validate_cooperative(cfg: SparseConfig, fail: Any) -> None:
    """--sparse-cooperative: only the sync tier has misses the CPU can take instead of a fetch
    (under async every attended block is resident by construction)."""
    if cfg.cooperative not in ON_OFF:
        fail("cooperative", f"must be one of {', '.join(ON_OFF)}")
    if cfg.cooperative == "on" and cfg.tier != "sync":
        fail("cooperative", "needs --sparse-tier sync (the step's misses are what the CPU attends "
             "instead of fetching)")
    if cfg.cooperative == "on" and cfg.label_dtype != "auto":
        fail("cooperative", "does not combine with --sparse-label-dtype fp8_e4m3 (its CPU "
             "scores the host keys' channels unrounded, the device the fp8 labels)")
    if cfg.cooperative_threads < 0:
        fail("cooperative_threads", "must be >= 0 (0 = auto)")


def cooperative_worker_threads(cfg: SparseConfig) -> int:
    """The CPU worker threads of --sparse-cooperative: the flag, or half of the cores this
    process may run on (the other half stays with the scheduler and the launch path), 1 to 8
    (the per-task fixed cost grows with the thread count on large hosts: see README)."""
    if cfg.cooperative_threads > 0:
        return cfg.cooperative_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


def tier_ring_pages(window: int, block_size: int) -> int:
    """Recent-window pages a tiered request keeps on the GPU (one more than the window spans:
    the page being written)."""
    return -(-window // block_size) + 1


def dense_middle_blocks(budget: int, sink: int, window: int, block_size: int) -> int:
    """Blocks holding a middle token (between the sink and the recent window) of the longest
    context that still decodes densely (``budget`` tokens): with the tier they must all be in
    the working set, which holds a two_level request's candidate blocks. The last of them may
    share its page with the window's first tokens and sit in the recent-window ring; it still
    needs a slot of its own (a wanted ring block is fetched into one before the ring reuses its
    page, kernels/working_set.py), so it counts."""
    return max(0, -(-(budget - window) // block_size) - sink // block_size)


def _available_host_gb() -> Optional[float]:
    try:
        import psutil

        return psutil.virtual_memory().available / 1e9
    except Exception:  # psutil missing: SGLang depends on it, but stay usable without
        return None


def tier_host_bytes(cfg: SparseConfig) -> int:
    """Bytes of pinned host memory the tier may use (the auto default resolved)."""
    if cfg.tier_host_gb > 0:
        return int(cfg.tier_host_gb * 1e9)
    available = _available_host_gb()
    return int((available or 8.0) * 0.5 * 1e9)
