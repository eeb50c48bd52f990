"""Our flags: shown in --help, and every invalid value stops start-up with one clear line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_ext.config import ConfigError, build_config
from server_utils import LABELS, LABELS_BASIS, free_port, launch_command, server_env


@pytest.mark.parametrize(
    "values, flag",
    [
        ({"budget": -1}, "--sparse-budget"),
        ({"budget": "many"}, "--sparse-budget"),
        ({"block_size": 12}, "--sparse-block-size"),
        ({"method": "topk"}, "--sparse-method"),
        ({"budget": 64, "sink": 16, "window": 64}, "--sparse-budget"),
        ({"sink": -2}, "--sparse-sink"),
        ({"window": 0}, "--sparse-window"),
        ({"candidate_blocks": -1}, "--sparse-candidate-blocks"),
        ({"label_channels": 0}, "--sparse-label-channels"),
        ({"label_config": "/nonexistent.json"}, "--sparse-label-config"),
        ({"label_dtype": "int4"}, "--sparse-label-dtype"),
        ({"label_dtype": "fp8_e4m3"}, "--sparse-label-dtype"),  # no label config: no cache
        ({"summary_dtype": "fp16"}, "--sparse-summary-dtype"),
        ({"dense_backend": "fa9"}, "--sparse-dense-backend"),
        ({"tier": "on"}, "--sparse-tier"),
        ({"tier": "async", "method": "ds"}, "--sparse-tier"),
        ({"tier_host_gb": "lots"}, "--sparse-tier-host-gb"),
        ({"tier_host_gb": "nan"}, "--sparse-tier-host-gb"),
        ({"tier_host_gb": -1}, "--sparse-tier-host-gb"),
        ({"tier": "sync", "tier_host_gb": 1e9}, "--sparse-tier-host-gb"),
        ({"tier_gpu_tokens": -16}, "--sparse-tier-gpu-tokens"),
        # less than one page of the tier rounds to no GPU-homed page at all
        ({"tier": "async", "block_size": 32, "tier_gpu_tokens": 16}, "--sparse-tier-gpu-tokens"),
        ({"tier": "async", "tier_timing": "yes"}, "--sparse-tier-timing"),
        ({"tier_timing": "on"}, "--sparse-tier-timing"),  # nothing to time without the tier
        ({"tier": "async", "tier_sync_steps": -1}, "--sparse-tier-sync-steps"),
        ({"tier": "sync", "tier_sync_steps": 4}, "--sparse-tier-sync-steps"),  # async only
        ({"tier": "async", "tier_async_attend": "latest"}, "--sparse-tier-async-attend"),
        ({"tier": "sync", "tier_async_attend": "resident"}, "--sparse-tier-async-attend"),
        ({"tier": "async", "candidate_blocks": 64}, "--sparse-candidate-blocks"),
        ({"dense_decode": "fp16"}, "--sparse-dense-decode"),
        ({"scoring": "mass"}, "--sparse-scoring"),
        ({"scoring": "output_aware", "method": "quest"}, "--sparse-scoring"),
        ({"head_policy": "/nonexistent.json"}, "--sparse-head-policy"),
        ({"eviction_score": "oracle"}, "--sparse-eviction-score"),
        ({"eviction_score": "learned"}, "--sparse-eviction-score"),  # needs the heads
        ({"eviction_head": "/nonexistent.safetensors"}, "--sparse-eviction-head"),
        ({"locality_blocks": 2, "method": "quest"}, "--sparse-locality-blocks"),
        ({"budget": 128, "locality_blocks": 13}, "--sparse-locality-blocks"),
        ({"locality_new_blocks": 4}, "--sparse-locality-new-blocks"),  # needs the constraint
        ({"locality_blocks": 2, "locality_new_blocks": -1}, "--sparse-locality-new-blocks"),
        ({"cooperative": "yes"}, "--sparse-cooperative"),
        ({"cooperative": "on"}, "--sparse-cooperative"),  # no tier: no misses to share
        ({"cooperative": "on", "tier": "async"}, "--sparse-cooperative"),  # all resident
        ({"cooperative_threads": -1}, "--sparse-cooperative-threads"),
        ({"cooperative_threads": "many"}, "--sparse-cooperative-threads"),
        ({"rerank": 1}, "--sparse-rerank"),  # a shortlist of the budget's size reranks nothing
        ({"rerank": -2}, "--sparse-rerank"),
        ({"rerank": 4, "method": "quest"}, "--sparse-rerank"),  # quest scores no tokens
        ({"rerank": 4, "scoring": "output_aware"}, "--sparse-rerank"),
        ({"rerank": 4, "guard_every": 8}, "--sparse-rerank"),
        ({"rerank": 4, "tier": "sync", "cooperative": "on"}, "--sparse-rerank"),
    ],
)
def test_invalid_values_name_the_flag(values, flag):
    with pytest.raises(ConfigError) as e:
        build_config(**values)
    message = str(e.value)
    assert flag in message and "\n" not in message


def test_fp8_labels_need_the_label_cache():
    labels = dict(label_config=__file__)  # any readable file: only its presence matters here
    assert build_config(label_dtype="fp8_e4m3", **labels).label_dtype == "fp8_e4m3"
    # under the tier the label cache covers the host-homed pages too
    assert build_config(label_dtype="fp8_e4m3", tier="sync", **labels).keeps_label_cache
    with pytest.raises(ConfigError, match="--sparse-label-dtype needs the label cache"):
        build_config(label_dtype="fp8_e4m3", method="quest", **labels)


def test_fp8_summaries_reach_every_request():
    from sglang_ext.attention.request_overrides import parse_override

    base = build_config(summary_dtype="fp8_e4m3")
    assert parse_override(None, base).summary_dtype == "fp8_e4m3"
    assert parse_override({"sparse": {"method": "quest"}}, base).summary_dtype == "fp8_e4m3"


def test_fp8_label_servers_take_label_free_request_overrides():
    from sglang_ext.attention.request_overrides import parse_override

    base = build_config(label_dtype="fp8_e4m3", label_config=__file__)
    assert parse_override(None, base).label_dtype == "fp8_e4m3"
    assert parse_override({"sparse": {"method": "ds"}}, base).label_dtype == "fp8_e4m3"
    assert parse_override({"sparse": {"method": "quest"}}, base).label_dtype == "auto"


def test_valid_values_and_auto_candidates():
    cfg = build_config(budget="512", block_size="32", sink="0", window="32", method="quest")
    assert (cfg.budget, cfg.block_size, cfg.method) == (512, 32, "quest")
    assert cfg.effective_candidate_blocks == 2 * (480 // 32)


def test_the_tiers_working_set_check_counts_the_locality_slots():
    """With the tier, the working set (candidate blocks plus E_t's, per kv head) must hold a
    budget-sized context's middle blocks (123 here: the last one shares its page with the
    window's first tokens and still needs a slot); the locality benchmarks' block filter,
    sized for the query-aware rest, passes beside its k_e."""
    from sglang_ext.config import locality_candidate_blocks

    plain = dict(budget=2048, block_size=16, sink=16, window=64)
    assert build_config(**plain).effective_candidate_blocks == 2 * 123  # auto: the whole middle
    assert locality_candidate_blocks(61, **plain) == 2 * 62
    assert locality_candidate_blocks(76, **plain) == 2 * 47
    build_config(**plain, locality_blocks=76, candidate_blocks=94, tier="async")  # 170 slots
    build_config(**plain, locality_blocks=76, candidate_blocks=47, tier="async")  # 123: enough
    with pytest.raises(ConfigError) as e:
        build_config(**plain, locality_blocks=76, candidate_blocks=46, tier="async")
    assert "--sparse-locality-blocks must be >= 123" in str(e.value)


def test_the_locality_runs_limit_share_of_the_automatic_filter():
    """The GPU locality run's and the accuracy suite's locality_limited limit: a quarter of
    the automatic filter (246 blocks at budget 2048, block 16; 20 / 40 at the CPU budgets)."""
    from sglang_ext.config import LOCALITY_NEW_SHARE, locality_new_blocks_for_share

    assert locality_new_blocks_for_share(LOCALITY_NEW_SHARE, 2048, 16, 64, 16) == 246 // 4
    assert locality_new_blocks_for_share(LOCALITY_NEW_SHARE, 64, 8, 16, 4) == 5
    assert locality_new_blocks_for_share(LOCALITY_NEW_SHARE, 128, 16, 32, 4) == 10
    assert locality_new_blocks_for_share(0.01, 64, 8, 16, 4) == 1  # never 0 (= no limit)
    from sglang_ext.config import locality_limited_candidate_blocks
    assert locality_limited_candidate_blocks(1, 2048, 16, 64, 16) == 246  # the automatic filter
    assert locality_limited_candidate_blocks(2, 64, 8, 16, 4) == 40
    cfg = build_config(budget=2048, block_size=16, locality_blocks=61, locality_new_blocks=30)
    assert cfg.locality_new_blocks == 30


def test_the_tier_refuses_quest_whose_kept_blocks_miss_a_dense_contexts_middle():
    """quest keeps (budget - sink - window) // block_size blocks; with a window that is not a
    multiple of the block size a budget-sized context's middle touches one block more (the
    sync tier would then drop a middle block that the untiered dense decode attends)."""
    build_config(budget=96, block_size=4, sink=4, window=8, method="quest", tier="sync")
    with pytest.raises(ConfigError) as e:
        build_config(budget=96, block_size=4, sink=4, window=10, method="quest", tier="sync")
    assert "must be multiples of --sparse-block-size" in str(e.value)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "fp4_e2m1"])
def test_the_tier_refuses_an_unchecked_kv_cache_in_one_line(kv_cache_dtype):
    """These caches decode without the tier; with it, start-up stops in one line (the pool's
    construction in the scheduler would otherwise fail with a traceback). fp8_e4m3 is accepted:
    tests/test_tier_fp8_e2e.py serves it."""
    from types import SimpleNamespace

    from sglang_ext.patches.server_args import check_tier_kv_dtype

    check_tier_kv_dtype(SimpleNamespace(kv_cache_dtype="fp8_e4m3"), build_config(tier="sync"))
    args = SimpleNamespace(kv_cache_dtype=kv_cache_dtype)
    check_tier_kv_dtype(args, build_config())
    check_tier_kv_dtype(SimpleNamespace(kv_cache_dtype="auto"), build_config(tier="async"))
    with pytest.raises(SystemExit) as e:
        check_tier_kv_dtype(args, build_config(tier="async"))
    message = str(e.value)
    assert message.startswith(f"sglang_ext: --sparse-tier does not support --kv-cache-dtype "
                              f"{kv_cache_dtype}") and "\n" not in message


def _run_server(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        launch_command(args, free_port()), capture_output=True, text=True, timeout=timeout,
        env=server_env(),
    )


def test_help_lists_our_flags():
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True,
        text=True, timeout=240, env=server_env(),
    )
    assert out.returncode == 0
    for flag in ("--sparse-budget", "--sparse-block-size", "--sparse-candidate-blocks",
                 "--sparse-sink", "--sparse-window", "--sparse-label-channels",
                 "--sparse-method", "--sparse-label-config", "--sparse-label-dtype",
                 "--sparse-tier",
                 "--sparse-tier-host-gb", "--sparse-tier-gpu-tokens", "--sparse-tier-timing",
                 "--sparse-tier-sync-steps", "--sparse-tier-async-attend",
                 "--sparse-guard-every",
                 "--sparse-guard-recall", "--sparse-guard-max-budget",
                 "--sparse-locality-blocks", "--sparse-locality-new-blocks",
                 "--sparse-eviction-score", "--sparse-eviction-head", "--sparse-cooperative", "--sparse-cooperative-threads"):
        assert flag in out.stdout
    assert "sglang_ext" in out.stdout  # the backend name is an allowed --attention-backend


BAD_LAUNCHES = [
    (["--sparse-budget", "-5"], "--sparse-budget"),
    (["--sparse-block-size", "24"], "--sparse-block-size"),
    (["--sparse-method", "random"], "--sparse-method"),
    (["--sparse-budget", "64", "--sparse-sink", "32", "--sparse-window", "64"], "--sparse-budget"),
    (["--sparse-tier", "async", "--sparse-method", "ds"], "--sparse-tier"),
    (["--sparse-tier", "sync", "--sparse-tier-host-gb", "100000"], "--sparse-tier-host-gb"),
    (["--sparse-guard-every", "8", "--sparse-guard-recall", "1.2"], "--sparse-guard-recall"),
    # prefill around our backend would read host-homed prompt pages from nowhere (no scratch)
    (["--decode-attention-backend", "sglang_ext", "--prefill-attention-backend", "torch_native",
      "--sparse-tier", "sync"], "--prefill-attention-backend"),
    (["--prefill-attention-backend", "sglang_ext", "--decode-attention-backend", "torch_native",
      "--sparse-tier", "sync"], "--decode-attention-backend"),
    (["--sparse-cooperative", "on", "--sparse-tier", "async"], "--sparse-cooperative"),
    # keys stored in a label basis: prefill and decode must both change basis, and eviction
    # heads score keys in the model's own basis (any readable file reaches that check)
    (["--decode-attention-backend", "sglang_ext", "--prefill-attention-backend", "torch_native",
      "--sparse-label-config", LABELS_BASIS], "--prefill-attention-backend"),
    (["--prefill-attention-backend", "sglang_ext", "--decode-attention-backend", "torch_native",
      "--sparse-label-config", LABELS_BASIS], "--decode-attention-backend"),
    (["--sparse-label-config", LABELS_BASIS, "--sparse-eviction-head", LABELS_BASIS],
     "--sparse-eviction-head"),
]


@pytest.mark.server
def test_bad_flags_stop_startup_with_one_line():
    """A real launch with each bad value exits before loading the model, saying which flag."""
    procs = [
        subprocess.Popen(
            launch_command(["--attention-backend", "sglang_ext", *args], free_port()),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=server_env(),
        )
        for args, _ in BAD_LAUNCHES
    ]
    for proc, (args, flag) in zip(procs, BAD_LAUNCHES):
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode != 0, args
        last = stderr.strip().splitlines()[-1]
        assert last.startswith("sglang_ext: ") and flag in last, (args, stderr[-2000:])
        assert "Traceback" not in stderr


@pytest.mark.server
def test_label_config_for_another_model_is_rejected(tmp_path):
    import json

    with open(LABELS) as f:
        labels = json.load(f)
    labels["model"]["num_layers"] -= 1
    labels["channels"] = labels["channels"][:-1]
    bad = tmp_path / "labels.json"
    bad.write_text(json.dumps(labels))
    out = _run_server(["--attention-backend", "sglang_ext", "--sparse-label-config", str(bad)])
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang_ext: --sparse-label-config") and "layers" in last, out.stderr[-2000:]


@pytest.mark.server
def test_head_policy_for_another_model_is_rejected(tmp_path):
    import json

    from sglang_ext.selection.head_policy import FORMAT

    bad = tmp_path / "policy.json"  # SmolLM2 has 30 layers of 3 kv heads
    bad.write_text(json.dumps({"format": FORMAT, "model": {"num_layers": 30, "num_kv_heads": 8},
                               "streaming": [[False] * 8] * 30}))
    out = _run_server(["--attention-backend", "sglang_ext", "--sparse-head-policy", str(bad)])
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang_ext: --sparse-head-policy") and "kv heads" in last, \
        out.stderr[-2000:]


@pytest.mark.server
def test_eviction_head_for_another_model_is_rejected(tmp_path):
    from sglang_ext.selection.eviction_head import EvictionHeads, save_eviction_heads

    bad = tmp_path / "heads.safetensors"  # SmolLM2 has 30 layers of 3 kv heads, head dim 64
    save_eviction_heads(EvictionHeads(30, 8, 64), bad, model="other")
    out = _run_server(["--attention-backend", "sglang_ext", "--sparse-eviction-head", str(bad),
                       "--sparse-eviction-score", "learned", "--sparse-locality-blocks", "8"])
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("sglang_ext: --sparse-eviction-head") and "kv heads" in last, \
        out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def _cuda_server_args():
    """The server arguments _force_compatible_settings reads, for a CUDA launch."""
    from types import SimpleNamespace

    args = SimpleNamespace(speculative_algorithm=None, enable_mixed_chunk=False, device="cuda",
                           disable_cuda_graph=False, page_size=None, max_running_requests=None)
    args.override = lambda who, **changes: vars(args).update(changes)
    return args


@pytest.mark.parametrize("score", ["key_norm", "learned"])
def test_locality_runs_in_the_kernel_decode(score, tmp_path):
    """--sparse-impl triton takes the locality constraint with the key_norm and learned
    scores (the batched decode, kernels/locality.py): no refusal at start-up."""
    from sglang_ext.patches.server_args import _force_compatible_settings
    from sglang_ext.selection.eviction_head import EvictionHeads, save_eviction_heads

    head = None
    if score == "learned":
        head = str(tmp_path / "heads.safetensors")
        save_eviction_heads(EvictionHeads(2, 2, 8), head, model="tiny")
    cfg = build_config(impl="triton", budget=256, block_size=16, locality_blocks=8,
                       eviction_score=score, eviction_head=head)
    args = _cuda_server_args()
    _force_compatible_settings(args, cfg)
    assert args.page_size == 16  # the kernel path's settings still apply


@pytest.mark.parametrize("values, words", [
    ({"eviction_score": "attention"}, "--sparse-eviction-score attention"),
    ({"eviction_score": "key_norm", "window": 6}, "--sparse-window"),
    ({"eviction_score": "key_norm", "scoring": "output_aware"}, "--sparse-scoring"),
])
def test_what_the_kernel_decode_cannot_do_stops_startup_with_one_line(values, words):
    """The attention eviction score needs each step's attention probabilities (reference
    decode only); a block must be complete when it enters the middle (window >= block - 1);
    Fluxion's scoring is still reference-only."""
    from sglang_ext.patches.server_args import _force_compatible_settings

    cfg = build_config(impl="triton", budget=256, block_size=16, locality_blocks=8, **values)
    with pytest.raises(SystemExit) as e:
        _force_compatible_settings(_cuda_server_args(), cfg)
    message = str(e.value)
    assert message.startswith("sglang_ext: ") and words in message and "\n" not in message


def test_the_tier_turns_the_prefill_cuda_graph_off():
    """SGLang captures prefill graphs (breakable, CUDA's default) with dummy requests, which the
    tier would keep as requests (the soak on an H100: the first request waited for ever): with
    --sparse-tier the prefill runs eagerly, decode graphs stay; a prefill graph backend the user
    asked for is refused in one line; without the tier nothing changes."""
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig

    from sglang_ext.patches.server_args import _force_compatible_settings

    def args(backend_flag=None):
        a = _cuda_server_args()
        a.cuda_graph_config = CudaGraphConfig(decode=PhaseConfig(backend="full"),
                                              prefill=PhaseConfig(backend="breakable"))
        a.cuda_graph_backend_prefill = backend_flag
        return a

    tier = build_config(impl="triton", tier="async", budget=256, block_size=16)
    a = args()
    _force_compatible_settings(a, tier)
    assert a.cuda_graph_config.prefill.backend == "disabled"
    assert a.cuda_graph_config.decode.backend == "full" and not a.disable_cuda_graph
    untiered = args()
    _force_compatible_settings(untiered, build_config(impl="triton", budget=256, block_size=16))
    assert untiered.cuda_graph_config.prefill.backend == "breakable"
    with pytest.raises(SystemExit) as e:
        _force_compatible_settings(args("breakable"), tier)
    message = str(e.value)
    assert message.startswith("sglang_ext: --sparse-tier needs --cuda-graph-backend-prefill "
                              "disabled") and "\n" not in message


def test_cooperative_needs_eager_decode_on_cuda():
    """--sparse-cooperative waits for the CPU inside each layer: refused under the decode CUDA
    graph in one line, accepted with --disable-cuda-graph and by the reference decode (which
    turns the graphs off itself)."""
    from sglang_ext.patches.server_args import _force_compatible_settings

    cfg = build_config(impl="triton", tier="sync", cooperative="on", budget=256, block_size=16)
    with pytest.raises(SystemExit) as e:
        _force_compatible_settings(_cuda_server_args(), cfg)
    message = str(e.value)
    assert message.startswith("sglang_ext: --sparse-cooperative") and "--disable-cuda-graph" \
        in message and "\n" not in message
    eager = _cuda_server_args()
    eager.disable_cuda_graph = True
    _force_compatible_settings(eager, cfg)
    reference = _cuda_server_args()
    _force_compatible_settings(reference, build_config(impl="reference", tier="sync",
                                                       cooperative="on", budget=256))
    assert reference.disable_cuda_graph


def test_the_reference_decode_turns_sglangs_graphs_off():
    """SGLang 0.5.16 folds its graph flags into cuda_graph_config at parse time and captures by
    that config: the reference decode (a host loop, not capturable) on a CUDA device turns both
    phases off there, not only the legacy flag."""
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig

    from sglang_ext.patches.server_args import _force_compatible_settings

    args = _cuda_server_args()
    args.cuda_graph_config = CudaGraphConfig(decode=PhaseConfig(backend="full"),
                                             prefill=PhaseConfig(backend="breakable"))
    args.cuda_graph_backend_prefill = None
    _force_compatible_settings(args, build_config(impl="reference", budget=256))
    assert args.disable_cuda_graph
    assert args.cuda_graph_config.decode.backend == args.cuda_graph_config.prefill.backend \
        == "disabled"


def test_cooperative_is_refused_for_mla_models():
    from sglang_ext.selection.mla import mla_unsupported

    cfg = build_config(tier="sync", cooperative="on")
    assert ("cooperative", "--sparse-cooperative") in mla_unsupported(cfg)
    assert not mla_unsupported(build_config())


def test_cooperative_worker_threads():
    from sglang_ext.config import cooperative_worker_threads

    assert cooperative_worker_threads(build_config(cooperative_threads=3)) == 3
    assert 1 <= cooperative_worker_threads(build_config()) <= 8


def test_block_score_auto_resolves_and_label_max_is_checked():
    """auto: label_max for two_level without the locality constraint or the async filter
    (which rank by the bound), under the tier only with the label cache (a label config); an
    explicit label_max elsewhere stops start-up."""
    from sglang_ext.attention.request_overrides import parse_override

    assert build_config().effective_block_score == "label_max"
    assert parse_override(None, build_config()).block_score == "label_max"
    for values in ({"method": "quest"}, {"tier": "sync"}, {"block_filter": "async"},
                   {"locality_blocks": 2}):
        assert build_config(**values).effective_block_score == "bound"
        with pytest.raises(ConfigError, match="--sparse-block-score label_max needs"):
            build_config(block_score="label_max", **values)
    tier_with_labels = build_config(tier="sync", label_config=__file__)
    assert tier_with_labels.keeps_label_cache
    assert tier_with_labels.effective_block_score == "label_max"
    with pytest.raises(ConfigError,
                       match="--sparse-block-prefilter does not combine with --sparse-tier"):
        build_config(tier="sync", label_config=__file__, prefilter=2)
    assert build_config(block_score="bound").effective_block_score == "bound"
    with pytest.raises(ConfigError, match="--sparse-block-score must be one of"):
        build_config(block_score="minmax")
    # a request that changes the method falls back to what applies to it
    base = build_config(block_score="label_max")
    assert parse_override({"sparse": {"method": "quest"}}, base).block_score == "bound"
    assert parse_override({"sparse": {"block_score": "bound"}}, base).block_score == "bound"


def test_mla_models_rank_blocks_by_the_bound():
    """The label maximum has no MLA version yet: auto resolves to the bound for an MLA model,
    and an explicit label_max is refused like the other MLA-less settings."""
    from sglang_ext.selection.mla import mla_config, mla_unsupported

    assert mla_config(build_config()).block_score == "bound"
    assert mla_config(build_config(block_score="bound")).block_score == "bound"
    assert mla_unsupported(build_config()) == []
    assert [flag for _, flag in mla_unsupported(build_config(block_score="label_max"))] == [
        "--sparse-block-score label_max"]


def test_rerank_reaches_every_request_and_both_decodes():
    """--sparse-rerank: accepted for ds and two_level by both decodes, reaches every request's
    selection, and a request may set its own (or lose it by switching to quest)."""
    from sglang_ext.attention.request_overrides import parse_override
    from sglang_ext.patches.server_args import _force_compatible_settings

    cfg = build_config(rerank=4)
    assert parse_override(None, cfg).rerank == 4
    assert parse_override({"sparse": {"method": "quest"}}, cfg).rerank == 0
    assert parse_override({"sparse": {"rerank": 2}}, build_config()).rerank == 2
    with pytest.raises(ValueError, match="rerank"):
        parse_override({"sparse": {"rerank": "4"}}, build_config())
    args = _cuda_server_args()
    _force_compatible_settings(args, build_config(impl="triton", rerank=4, block_size=16))
    # the automatic block filter keeps room for the whole shortlist, twice over
    assert build_config(rerank=4).effective_candidate_blocks == \
        4 * build_config().effective_candidate_blocks
    assert parse_override({"sparse": {"rerank": 4}}, build_config()).candidate_blocks == \
        build_config(rerank=4).effective_candidate_blocks
    for values in ({"guard_every": 8}, {"block_filter": "async"}):
        with pytest.raises(ConfigError, match="--sparse-rerank"):
            build_config(rerank=4, **values)


def test_rerank_min_tokens_is_a_floor_under_small_budgets_only():
    """--sparse-rerank-min-tokens: at budget 1/64 of 2k (20 selected tokens, block 32) the
    shortlist and the automatic block filter grow to the floor; at the default budget the
    factor dominates and nothing changes; a request may set its own; negative is refused."""
    from sglang_ext.attention.request_overrides import parse_override
    from sglang_ext.selection.params import shortlist_tokens

    small = dict(rerank=4, budget=32, sink=4, window=8, block_size=32)
    assert build_config(**small, rerank_min_tokens=0).effective_candidate_blocks == 2 * 4
    assert build_config(**small).effective_candidate_blocks == 2 * 1024 // 32  # the default 1024
    assert shortlist_tokens(parse_override(None, build_config(**small))) == 1024
    assert shortlist_tokens(parse_override(None, build_config(**small, rerank_min_tokens=0))) == 80
    big = build_config(rerank=4)
    assert big.effective_candidate_blocks == build_config(rerank=4, rerank_min_tokens=0) \
        .effective_candidate_blocks
    assert shortlist_tokens(parse_override(None, big)) == 4 * (2048 - 16 - 64)
    request = parse_override({"sparse": {"rerank_min_tokens": 0}}, build_config(**small))
    assert shortlist_tokens(request) == 80 and request.candidate_blocks == 8
    with pytest.raises(ConfigError, match="--sparse-rerank-min-tokens"):
        build_config(rerank_min_tokens=-1)
