"""ServerArgs: our CLI flags, their validation at start-up, and the settings our backend needs."""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

from sglang_ext import config as sparse_config
from sglang_ext import runtime
from sglang_ext.config import BACKEND_NAME
from sglang_ext.selection.mla import is_mla_model, kv_layout, mla_config, mla_unsupported

logger = logging.getLogger(__name__)

_CONFIG_ATTR = "_sglang_ext_config"
TIER_DEFAULT_MAX_RUNNING = 32  # --max-running-requests with the CPU tier unless given
# --kv-cache-dtype values whose rows the CPU tier moves (16-bit rows of the KV dtype; 8-bit ones
# are stored as bytes)
# KV dtypes the tier's host copy holds: 16-bit rows, or fp8_e4m3 bytes (the fp8 pool's stored
# rows: host and PCIe bytes per token halve; its batched decode was checked on the GPU against an
# untiered fp8 pool, tests/test_tier_decode_steps.py). MLA's latent rows: 16-bit only.
TIER_KV_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3")
MLA_TIER_KV_DTYPES = ("auto", "bf16", "bfloat16")


def _after_add_cli_args(result: Any, parser: argparse.ArgumentParser) -> None:
    sparse_config.add_cli_args(parser)


def _around_from_cli_args(original: Callable, cls: type, args: argparse.Namespace) -> Any:
    try:
        cfg = sparse_config.from_namespace(args)
    except sparse_config.ConfigError as e:
        raise SystemExit(f"sglang_ext: {e}") from None
    server_args = original(cls, args)
    attach_config(server_args, cfg)
    if uses_sparse_backend(server_args):
        check_mla_model(server_args, cfg)
        if is_mla_model(server_args.get_model_config()):
            cfg = mla_config(cfg)  # what requests are parsed against, too
            attach_config(server_args, cfg)
        check_tier_kv_dtype(server_args, cfg)
        _check_label_config(server_args, cfg)
        _check_head_policy(server_args, cfg)
        _check_eviction_head(server_args, cfg)
        _force_compatible_settings(server_args, cfg)
        from sglang_ext.attention.sparse_backend import resolve_impl

        process = runtime.state()
        process.impl = resolve_impl(cfg, server_args.device)
        process.mla = is_mla_model(server_args.get_model_config())
    return server_args


def active_impl() -> str | None:
    """The decode implementation of the server this (main) process launched, if ours."""
    return runtime.state().impl


def active_is_mla() -> bool:
    """Whether the server this (main) process launched serves an MLA model with our backend."""
    return runtime.state().mla


def attach_config(server_args: Any, cfg: sparse_config.SparseConfig) -> None:
    # ServerArgs rejects bare attribute assignment after resolution; underscore names are
    # exempt and survive pickling into the scheduler processes.
    object.__setattr__(server_args, _CONFIG_ATTR, cfg)
    runtime.state().config = cfg


def config_of(server_args: Any) -> sparse_config.SparseConfig:
    """The config attached at start-up, or (sgl.Engine path, no CLI) $SGLANG_EXT_CONFIG."""
    cfg = getattr(server_args, _CONFIG_ATTR, None)
    if cfg is None:
        cfg = sparse_config.from_namespace(argparse.Namespace())
        attach_config(server_args, cfg)
    return cfg


def active_config() -> sparse_config.SparseConfig:
    """This process's config (main process: from the CLI; scheduler: from its ServerArgs)."""
    if runtime.state().config is not None:
        return runtime.state().config
    try:
        from sglang.srt.server_args import get_global_server_args

        return config_of(get_global_server_args())
    except Exception:  # no server args in this process (e.g. a bare tokenizer-side check)
        return sparse_config.from_namespace(argparse.Namespace())


def uses_sparse_backend(server_args: Any) -> bool:
    names = (
        server_args.attention_backend,
        server_args.decode_attention_backend,
        server_args.prefill_attention_backend,
    )
    return BACKEND_NAME in names


def check_mla_model(server_args: Any, cfg: sparse_config.SparseConfig) -> None:
    """MLA models (DeepSeek-V2/V3 and kin: one latent KV row per token) decode through the
    backend on CUDA; what has no MLA version yet stops start-up in one line, not the first
    decode deep inside the scheduler."""
    if not is_mla_model(server_args.get_model_config()):
        return
    if server_args.device == "cpu":
        # Their prefill takes SGLang's MHA path (per-head keys, latent rows written aside), which
        # torch_native, our dense backend on a CPU, cannot run: it reads the keys from the pool.
        raise SystemExit("sglang_ext: MLA models (latent KV pool) need a CUDA device with "
                         "--attention-backend sglang_ext (torch_native cannot run their prefill)")
    unsupported = mla_unsupported(cfg)
    if unsupported:
        raise SystemExit(f"sglang_ext: {unsupported[0][1]} does not support MLA models (latent "
                         "KV pool) yet")
    kv_dtype = getattr(server_args, "kv_cache_dtype", "auto")
    if cfg.tier != "off" and kv_dtype not in MLA_TIER_KV_DTYPES:
        # 8-bit latent rows are stored as bytes (and FP4 ones by another pool factory, which
        # the tier does not hook): the host copy holds rows of the KV dtype.
        raise SystemExit(f"sglang_ext: --sparse-tier does not support MLA models with "
                         f"--kv-cache-dtype {kv_dtype} yet (use auto or bf16)")


def check_tier_kv_dtype(server_args: Any, cfg: sparse_config.SparseConfig) -> None:
    """The tier's host copy and scratch hold rows of the KV dtype: a cache the tier has not been
    checked with (fp8_e5m2, FP4) stops start-up in one line instead of the pool's construction in
    the scheduler."""
    kv_dtype = getattr(server_args, "kv_cache_dtype", "auto")
    if cfg.tier != "off" and kv_dtype not in TIER_KV_DTYPES:
        raise SystemExit(f"sglang_ext: --sparse-tier does not support --kv-cache-dtype "
                         f"{kv_dtype} yet (use auto, bf16 or fp8_e4m3)")


def _check_label_config(server_args: Any, cfg: sparse_config.SparseConfig) -> None:
    """A label file calibrated for another model must stop start-up, not the first decode."""
    if cfg.label_config is None:
        return
    from sglang_ext.selection.calibrate import load_label_basis, load_label_config
    from sglang_ext.selection.label_basis import EVICTION_HEAD_CONFLICT

    mc = server_args.get_model_config()
    layout = kv_layout(mc)
    try:
        channels = load_label_config(
            cfg.label_config,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
        )
        basis = load_label_basis(cfg.label_config, num_layers=mc.num_hidden_layers,
                                 num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim)
    except ValueError as e:
        raise SystemExit(f"sglang_ext: --sparse-label-config: {e}") from None
    if basis is not None and cfg.eviction_head is not None:
        raise SystemExit(f"sglang_ext: {EVICTION_HEAD_CONFLICT}")
    if cfg.label_channels > channels.shape[-1]:
        raise SystemExit(
            f"sglang_ext: --sparse-label-channels must be <= {channels.shape[-1]}, the channels "
            f"calibrated in {cfg.label_config} (got {cfg.label_channels})"
        )


def _check_model_file(flag: str, path: str, load: Callable[..., Any], **shape: int) -> None:
    """A file calibrated or trained for another model must stop start-up, not the first
    decode: ``load(path, **shape)`` raises ValueError (one line) on a mismatch."""
    try:
        load(path, **shape)
    except ValueError as e:
        raise SystemExit(f"sglang_ext: {flag}: {e}") from None


def _check_head_policy(server_args: Any, cfg: sparse_config.SparseConfig) -> None:
    if cfg.head_policy is None:
        return
    from sglang_ext.selection.head_policy import load_head_policy

    mc = server_args.get_model_config()
    _check_model_file("--sparse-head-policy", cfg.head_policy, load_head_policy,
                      num_layers=mc.num_hidden_layers, num_kv_heads=mc.get_total_num_kv_heads())


def _check_eviction_head(server_args: Any, cfg: sparse_config.SparseConfig) -> None:
    if cfg.eviction_head is None:
        return
    from sglang_ext.selection.eviction_head import load_eviction_heads

    mc = server_args.get_model_config()
    _check_model_file("--sparse-eviction-head", cfg.eviction_head, load_eviction_heads,
                      num_layers=mc.num_hidden_layers, num_kv_heads=mc.get_total_num_kv_heads(),
                      head_dim=mc.head_dim)


def _check_kernel_locality(cfg: sparse_config.SparseConfig) -> None:
    """What the batched decode's locality constraint (kernels/locality.py) cannot do."""
    from sglang_ext.kernels.locality import KERNEL_SCORE_KINDS

    if cfg.eviction_score not in KERNEL_SCORE_KINDS:
        # The attention score accumulates each step's attention probabilities per block.
        raise SystemExit(f"sglang_ext: --sparse-eviction-score {cfg.eviction_score} runs in the "
                         f"reference decode for now (use key_norm or learned, or add "
                         f"--sparse-impl reference)")
    if cfg.window < cfg.block_size - 1:
        # A block's fixed score is taken when it enters the middle: it must be complete then.
        raise SystemExit(f"sglang_ext: --sparse-locality-blocks with --sparse-impl triton needs "
                         f"--sparse-window >= --sparse-block-size - 1 (got {cfg.window} and "
                         f"{cfg.block_size})")


def _check_prefill_elsewhere(server_args: Any, cfg: sparse_config.SparseConfig, impl: str) -> None:
    """``--decode-attention-backend sglang_ext`` with another prefill backend (SGLang's hybrid
    backend) never shows us the prompt's keys: the batched decode's page summaries (updated as
    our backend writes KV) would stay stale and the CPU tier would not stage the prompt's pages,
    so its KV would land in the wrong device rows. Only the reference decode, which recomputes
    summaries from the keys each step and keeps no tier, works that way. The other way round,
    another decode backend cannot read the tier's host-homed KV."""
    # (getattr: sgl.Engine-style and test stand-ins may set attention_backend alone)
    default = getattr(server_args, "attention_backend", None)
    decode = getattr(server_args, "decode_attention_backend", None) or default
    prefill = getattr(server_args, "prefill_attention_backend", None) or default
    basis = has_label_basis(cfg)
    if prefill == BACKEND_NAME and decode != BACKEND_NAME and (cfg.tier != "off" or basis):
        # ...and another decode backend would read logical slots the device does not have, or
        # keys in the label basis with queries that are not.
        what = "the CPU tier's KV" if cfg.tier != "off" else "keys stored in the label basis"
        raise SystemExit(f"sglang_ext: --decode-attention-backend {decode} cannot read {what}; "
                         f"decode with --attention-backend {BACKEND_NAME}")
    if decode != BACKEND_NAME or prefill == BACKEND_NAME:
        return
    needs = [what for what, applies in (("the batched decode's block summaries", impl == "triton"),
                                        ("the CPU tier", cfg.tier != "off"),
                                        ("the label basis", basis)) if applies]
    if needs:
        raise SystemExit(
            f"sglang_ext: --prefill-attention-backend {prefill} sends prefill around our backend, "
            f"but {' and '.join(needs)} must see the prompt's keys; use --attention-backend "
            f"{BACKEND_NAME} with --sparse-dense-backend to choose the prefill kernels")


def has_label_basis(cfg: sparse_config.SparseConfig) -> bool:
    """Whether ``--sparse-label-config`` names a label basis (queries and keys change basis at
    the backend's entry, attention/qk_basis.py)."""
    if cfg.label_config is None:
        return False
    from sglang_ext.selection.calibrate import label_config_has_basis

    return label_config_has_basis(cfg.label_config)


def _check_cooperative(server_args: Any, cfg: sparse_config.SparseConfig, impl: str) -> None:
    """--sparse-cooperative hands the host a layer's misses and waits for the CPU's partial
    attention inside the layer: a per-layer host round trip, which a captured decode CUDA graph
    cannot hold (the reference decode turns the graphs off itself)."""
    if cfg.cooperative != "on" or server_args.device == "cpu" or impl == "reference":
        return
    if not server_args.disable_cuda_graph:
        raise SystemExit("sglang_ext: --sparse-cooperative on needs eager decode: add "
                         "--disable-cuda-graph (a per-layer host round trip cannot be captured)")


def _force_compatible_settings(server_args: Any, cfg: sparse_config.SparseConfig) -> None:
    """Settings that would route decode tokens around our backend, and the paging and CUDA
    graph settings each decode implementation needs."""
    from sglang_ext.attention.sparse_backend import resolve_impl

    if server_args.speculative_algorithm is not None:
        raise SystemExit(
            "sglang_ext: --speculative-algorithm cannot be combined with "
            f"--attention-backend {BACKEND_NAME} (draft verification bypasses sparse decode)"
        )
    changes: dict[str, Any] = {}
    if server_args.enable_mixed_chunk:
        changes["enable_mixed_chunk"] = False  # mixed batches decode through forward_extend
    impl = resolve_impl(cfg, server_args.device)
    if impl == "triton" and server_args.device == "cpu":
        raise SystemExit("sglang_ext: --sparse-impl triton needs a CUDA device (use reference on CPU)")
    _check_prefill_elsewhere(server_args, cfg, impl)
    for field, flag in (("scoring", "--sparse-scoring output_aware"),
                        ("head_policy", "--sparse-head-policy")):
        if impl == "triton" and getattr(cfg, field) not in ("score", None):
            raise SystemExit(f"sglang_ext: {flag} runs in the reference decode for now "
                             f"(add --sparse-impl reference)")
    if impl == "triton" and cfg.locality_blocks > 0:
        _check_kernel_locality(cfg)
    _check_cooperative(server_args, cfg, impl)
    if impl == "reference" and not server_args.disable_cuda_graph and server_args.device != "cpu":
        # The reference decode loops over requests on the host: not capturable.
        changes["disable_cuda_graph"] = True
        changes.update(_graphs_off(server_args, ("decode", "prefill")))
    if impl == "triton" and server_args.page_size != cfg.block_size:
        # Block summaries are kept per KV page, so a block must be exactly one page.
        if server_args.page_size not in (None, 1):
            raise SystemExit(
                f"sglang_ext: --page-size {server_args.page_size} differs from "
                f"--sparse-block-size {cfg.block_size}; blocks are KV pages on CUDA"
            )
        changes["page_size"] = cfg.block_size
    if cfg.tier != "off":
        if getattr(server_args, "enable_hierarchical_cache", False):
            raise SystemExit("sglang_ext: --sparse-tier cannot be combined with "
                             "--enable-hierarchical-cache (two host tiers would fight over KV ids)")
        if server_args.page_size != cfg.block_size:
            if server_args.page_size not in (None, 1):
                raise SystemExit(
                    f"sglang_ext: --page-size {server_args.page_size} differs from "
                    f"--sparse-block-size {cfg.block_size}; the CPU tier moves whole pages"
                )
            changes["page_size"] = cfg.block_size
        _no_prefill_graph_with_tier(server_args, changes)
        if server_args.max_running_requests is None:
            # The tier reserves a working set per running request and keeps per-row page maps:
            # SGLang's default (thousands of rows) would spend the GPU on them.
            changes["max_running_requests"] = TIER_DEFAULT_MAX_RUNNING
    if changes:
        logger.info("sglang_ext: overriding %s for sparse decode", changes)
        server_args.override("sglang_ext", **changes)


def _graphs_off(server_args: Any, phases: tuple[str, ...]) -> dict[str, Any]:
    """The overrides that turn SGLang's CUDA graphs off for ``phases`` (decode, prefill): its
    ``cuda_graph_config``, into which the flags were folded at parse time (a flag set afterwards
    changes nothing), and the per-phase flags, for the log."""
    from dataclasses import replace

    graphs = getattr(server_args, "cuda_graph_config", None)
    if graphs is None:
        return {}
    for phase in phases:
        graphs = replace(graphs, **{phase: replace(getattr(graphs, phase), backend="disabled")})
    return {"cuda_graph_config": graphs, **{f"cuda_graph_backend_{p}": "disabled" for p in phases}}


def _no_prefill_graph_with_tier(server_args: Any, changes: dict[str, Any]) -> None:
    """SGLang captures prefill CUDA graphs (breakable, the CUDA default) by running extend
    batches of dummy requests through the backend; the tier would take them for real requests
    (rows with working sets that no request ever frees) and the first real request would wait
    for space for ever. So with the tier the prefill runs without graphs (decode graphs stay)."""
    graphs = changes.get("cuda_graph_config", getattr(server_args, "cuda_graph_config", None))
    if server_args.device == "cpu" or graphs is None or graphs.prefill.backend == "disabled":
        return
    if server_args.cuda_graph_backend_prefill not in (None, "disabled"):
        raise SystemExit(f"sglang_ext: --sparse-tier needs --cuda-graph-backend-prefill disabled "
                         f"(got {server_args.cuda_graph_backend_prefill})")
    changes.update(_graphs_off(server_args, ("prefill",)))


HOOKS = (
    ("sglang.srt.server_args.ServerArgs.add_cli_args", _after_add_cli_args, "AFTER"),
    ("sglang.srt.server_args.ServerArgs.from_cli_args", _around_from_cli_args, "AROUND"),
)
