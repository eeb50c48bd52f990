"""The GPU suite's result tools: implementations compared cell by cell, configurations gathered
into one tagged file, and the block filters' accuracy against operator time."""

import json

import pytest

from benchmarks.accuracy.compare_impls import compare, render
from benchmarks.accuracy.gpu_suite import combine
from benchmarks.accuracy.runner import sparse_settings
from benchmarks.block_filter_pareto import accuracy_drops, operator_times, table
from server_utils import LABELS_BASIS
from sglang_ext.config import build_config


def _row(method, budget, score, lo, hi, dense=80.0, n=30, task="passkey", context=2048):
    return {"task": task, "context": context, "method": method, "budget": budget, "score": score,
            "n": n, "ci_low": lo, "ci_high": hi, "dense_score": dense, "seconds": 1.0}


def test_cells_agree_where_their_intervals_overlap():
    a = {"rows": [_row("dense", 0, 80, 62, 91), _row("ds", 128, 70, 52, 83),
                  _row("two_level", 128, 20, 9, 38)]}
    b = {"rows": [_row("dense", 0, 75, 57, 87), _row("two_level", 128, 60, 42, 75),
                  _row("quest", 128, 10, 3, 26)]}
    rows = compare(a, b)
    assert [(r["method"], r["overlap"]) for r in rows] == [("dense", True), ("two_level", False)]
    assert "1 of 2 cells agree" in render(rows, ["gpu", "cpu"])


def test_configurations_gather_tagged(tmp_path):
    path = tmp_path / "smollm2_b32_fp8.json"
    path.write_text(json.dumps({"commit": "abc", "config": {"server": "x"},
                                "rows": [_row("two_level", 128, 60, 42, 75)]}))
    doc = combine([str(path)], str(tmp_path / "all.json"))
    row = doc["rows"][0]
    assert (row["impl"], row["block_size"], row["storage"]) == ("triton", 32, "fp8")
    assert row["budget_share"] == 128 / 2048 and row["dense_score"] == 80.0
    assert (tmp_path / "all.png").exists()
    assert row["labels"] == "channels"


def test_a_basis_configuration_gathers_tagged_with_its_labels(tmp_path):
    path = tmp_path / "smollm2_b16_bf16_kpca.json"
    path.write_text(json.dumps({"commit": "abc", "config": {"server": "x"},
                                "rows": [_row("two_level", 128, 60, 42, 75)]}))
    row = combine([str(path)], str(tmp_path / "all.json"))["rows"][0]
    assert (row["block_size"], row["storage"], row["labels"]) == (16, "bf16", "kpca")


def test_pareto_rows_pair_each_filter_with_its_time():
    rows = [_row("two_level", 128, 60, 42, 75), _row("two_level", 128, 40, 25, 57, task="x"),
            _row("two_level_bound", 128, 20, 9, 38), _row("dense", 0, 80, 62, 91)]
    drops = accuracy_drops(rows)
    assert drops[("two_level", 16)] == (50.0, -30.0, 2)
    op = {"config": {"block_score": "label_max"},
          "rows": [{"context": 131072, "batch": 32, "ours_ms": 0.5, "ours_bound_ms": 0.25,
                    "flashinfer_ms": 4.0}]}
    times = operator_times(op, 131072, 32)
    assert times == {"label_max": 0.5, "bound": 0.25, "flashinfer": 4.0}
    by_method = {r["method"]: r for r in table(drops, times, "b32_bf16")}
    assert by_method["two_level"]["speedup_vs_flashinfer"] == 8.0
    assert by_method["two_level_bound"]["speedup_vs_flashinfer"] == 16.0


def test_a_server_that_dies_at_start_up_is_reported_with_its_own_error(tmp_path, monkeypatch):
    """A server that exits before it is healthy: the suite reports the end of its log (the
    cause), not the client's view of it or a failed kill of a process already gone."""
    import argparse
    import sys

    import pytest

    from benchmarks.accuracy import gpu_suite

    monkeypatch.setattr(gpu_suite, "launch_args", lambda *a, **k: [
        sys.executable, "-c", "import sys; print('RuntimeError: view size is not compatible'); "
                              "sys.exit(3)"])
    args = argparse.Namespace(out_dir=str(tmp_path), labels=gpu_suite.DEFAULT_LABELS,
                              model_dir=str(tmp_path), context_length=8192, start_timeout=60.0)
    with pytest.raises(RuntimeError) as e:
        gpu_suite.run_config(args, 32, "bf16")
    assert "server exited with 3" in str(e.value) and "view size is not compatible" in str(e.value)


@pytest.mark.parametrize("method", ["two_level", "two_level_rerank4"])
def test_a_tiered_servers_flags_are_the_settings_its_requests_would_carry(method):
    """The tier refuses per-request settings on the Triton path, so the suite starts a tiered
    server per (method, budget) with the settings as flags: they must validate with the tier
    (block 32, a label config) and match what the untiered server's requests carry."""
    from benchmarks.accuracy.gpu_suite import TIER_ARGS, setting_flags

    flags = setting_flags(method, 256, 32) + TIER_ARGS
    values = {flag.removeprefix("--sparse-").replace("-", "_"): value
              for flag, value in zip(flags[::2], flags[1::2])}
    cfg = build_config(**values, tier="async", block_size=32, label_config=LABELS_BASIS)
    sent = sparse_settings([method], [256], 32)[-1].custom_params["sparse"]
    assert (cfg.method, cfg.budget, cfg.sink, cfg.window, cfg.rerank) == (
        sent["method"], 256, sent["sink"], sent["window"], sent.get("rerank", 0))


def test_tiered_rows_pair_with_the_untiered_rows_of_the_same_cells(tmp_path):
    untiered = tmp_path / "smollm2_b32_bf16_kpca.json"
    untiered.write_text(json.dumps({"rows": [
        _row("dense", 0, 80, 62, 91), _row("two_level", 256, 70, 52, 83, n=40),
        _row("two_level", 256, 50, 32, 68, task="niah_number", n=40)]}))
    tiered = tmp_path / "smollm2_b32_bf16_kpca_tierasync.json"
    tiered.write_text(json.dumps({"rows": [
        _row("two_level", 256, 60, 42, 75, dense=None, n=40),
        _row("two_level", 256, 50, 32, 68, dense=None, task="niah_number", n=20)]}))
    doc = combine([str(untiered), str(tiered)], str(tmp_path / "all.json"))
    assert {(r["tier"], r["labels"]) for r in doc["rows"]} == {("off", "kpca"), ("async", "kpca")}
    gaps = doc["tier_gaps"]["async"]
    assert sorted(c["gap"] for c in gaps["cells"]) == [-10.0, 0.0]
    assert gaps["mean_gap"] == round(-10.0 * 40 / 60, 2)  # weighted by the tiered samples


def test_the_async_tiers_in_line_first_steps_are_a_tier_of_their_own(tmp_path):
    from benchmarks.accuracy.gpu_suite import config_tag

    assert config_tag("sparse_labels_kpca.json", "async", 4) == "_kpca_tierasync_sync4"
    assert config_tag("sparse_labels_kpca.json", "sync", 4) == "_kpca_tiersync"
    rows = [_row("two_level", 256, 70, 52, 83, n=40)]
    paths = []
    for tag in ("_kpca", "_kpca_tierasync", "_kpca_tierasync_sync4"):
        path = tmp_path / f"smollm2_b32_bf16{tag}.json"
        path.write_text(json.dumps({"rows": rows}))
        paths.append(str(path))
    doc = combine(paths, str(tmp_path / "all.json"))
    assert {r["tier"] for r in doc["rows"]} == {"off", "async", "async_sync4"}
    assert {r["labels"] for r in doc["rows"]} == {"kpca"}
    assert set(doc["tier_gaps"]) == {"async", "async_sync4"}


def test_the_driver_takes_the_servers_own_setting_only_from_one_named_server():
    from benchmarks.accuracy.driver import parse_args

    args = parse_args(["--server-url", "http://x", "--server-setting", "--methods", "two_level",
                       "--budgets", "256"])
    assert args.server_setting
    for bad in (["--methods", "two_level", "ds", "--budgets", "256"],
                ["--methods", "two_level", "--budgets", "128", "256"]):
        with pytest.raises(SystemExit):
            parse_args(["--server-url", "http://x", "--server-setting", *bad])
    with pytest.raises(SystemExit):
        parse_args(["--server-setting", "--methods", "two_level", "--budgets", "256"])


def test_each_sync_steps_value_is_an_async_configuration_of_its_own(tmp_path, monkeypatch):
    """``--tier-sync-steps 0 8 --tier-async-attend previous resident``: an async server and
    file per combination; untiered and sync configurations run once."""
    from benchmarks.accuracy import gpu_suite

    ran = []
    # main points the driver's tokenizer at --model-dir: restored after the test
    monkeypatch.setenv("SGLANG_EXT_MODEL_DIR", str(tmp_path))
    monkeypatch.setattr(gpu_suite, "run_config",
                        lambda args, bs, storage, tier, steps=0, attend="previous":
                        ran.append((tier, steps, attend)) or str(tmp_path / f"{tier}{steps}.json"))
    code = gpu_suite.main(["--model-dir", str(tmp_path), "--out-dir", str(tmp_path),
                           "--block-sizes", "32", "--tiers", "off", "async", "sync",
                           "--tier-sync-steps", "0", "8", "--tier-async-attend", "previous",
                           "resident"])
    assert code == 0
    assert ran == [("off", 0, "previous"), ("async", 0, "previous"), ("async", 0, "resident"),
                   ("async", 8, "previous"), ("async", 8, "resident"), ("sync", 0, "previous")]


def test_the_async_tier_attending_resident_blocks_is_a_tier_of_its_own(tmp_path):
    from benchmarks.accuracy.gpu_suite import config_tag

    assert config_tag("sparse_labels_kpca.json", "async", 4, "resident") == \
        "_kpca_tierasync_sync4_resident"
    assert config_tag("sparse_labels_kpca.json", "sync", 0, "resident") == "_kpca_tiersync"
    paths = []
    for tag in ("_kpca", "_kpca_tierasync_resident", "_kpca_tierasync_sync4_resident"):
        path = tmp_path / f"smollm2_b32_bf16{tag}.json"
        path.write_text(json.dumps({"rows": [_row("two_level", 256, 70, 52, 83, n=40)]}))
        paths.append(str(path))
    doc = combine(paths, str(tmp_path / "all.json"))
    assert {(r["tier"], r["labels"]) for r in doc["rows"]} == {
        ("off", "kpca"), ("async_resident", "kpca"), ("async_sync4_resident", "kpca")}
