"""The serving benchmark's result handling (benchmarks/e2e_serving.py): the greedy comparison
between servers, merging runs of other context lengths / TP sizes into one results file, and the
locality run's host->GPU bytes per decode step."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.e2e_serving import (
    CONFIGS,
    compare_greedy,
    finish_rows,
    locality_vs_two_level,
    merge_rows,
    newest_by_series,
    plot,
    series_name,
    server_log_stats,
    synthetic_label_config,
    tier_traffic,
)
from benchmarks.soak import TIE_MARGIN


def _reply(ids: list[int], margins: list[float]) -> dict:
    tops = [[[-0.1, i], [-0.1 - m, i + 1]] for i, m in zip(ids, margins)]
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": tops}}


def test_compare_greedy_tells_near_ties_from_mismatches() -> None:
    ref = [_reply([1, 2, 3], [2.0, 2.0, 2.0]), _reply([4, 5, 6], [2.0, 0.01, 2.0]),
           _reply([7, 8, 9], [2.0, 2.0, 2.0])]
    out = [_reply([1, 2, 3], [0] * 3), _reply([4, 9, 9], [0] * 3), _reply([7, 0, 0], [0] * 3)]
    got = compare_greedy(ref, out, tie_margin=0.25)
    assert got["greedy_equal"] == 1
    assert got["greedy_near_tie"] == 1  # prompt 1 differs where the reference was at a tie
    assert len(got["greedy_mismatches"]) == 1 and got["greedy_mismatches"][0].startswith("prompt 2")
    # decisive tokens: the matched prefix's tokens with a clear reference margin: 3 + 1 + 1
    assert got["greedy_decisive_tokens"] == 5
    assert [(d["prompt"], d["token"], d["reference_margin"]) for d in got["greedy_first_diffs"]] \
        == [(1, 1, 0.01), (2, 1, 2.0)]


def test_a_difference_at_exactly_one_bf16_step_is_a_tie_and_one_above_is_not() -> None:
    """TIE_MARGIN (0.25) is one bf16 step of logits in [32, 64): a first difference at a margin
    of exactly that is a near tie; anything clearly above it is a mismatch."""
    ref = [_reply([1, 2], [2.0, 0.25]), _reply([3, 4], [2.0, 0.26])]
    out = [_reply([1, 5], [0, 0]), _reply([3, 5], [0, 0])]
    got = compare_greedy(ref, out, tie_margin=TIE_MARGIN)
    assert got["greedy_near_tie"] == 1
    assert len(got["greedy_mismatches"]) == 1 and got["greedy_mismatches"][0].startswith("prompt 1")


def test_merge_rows_keeps_other_runs_and_replaces_the_same_one(tmp_path: Path) -> None:
    path = tmp_path / "e2e.json"
    old_rows = [{"backend": "flashinfer", "input_len": 32768, "output_tok_s": 1.0},
                {"backend": "sglang_ext", "input_len": 32768, "output_tok_s": 2.0}]
    path.write_text(json.dumps({"commit": "old", "model": "m8", "rows": old_rows}))
    new = [{"backend": "sglang_ext", "input_len": 32768, "tp": 1, "model": "m8", "output_tok_s": 3.0,
            "commit": "old"},
           {"backend": "sglang_ext", "input_len": 65536, "tp": 2, "model": "m14", "output_tok_s": 4.0,
            "commit": "old"}]
    merged = merge_rows(str(path), new)
    assert [(r["backend"], r["output_tok_s"]) for r in merged] == [
        ("flashinfer", 1.0), ("sglang_ext", 3.0), ("sglang_ext", 4.0)]
    # rows from the old file carry the file's commit and model once merged
    assert merged[0]["commit"] == "old" and merged[0]["model"] == "m8" and merged[0]["tp"] == 1
    assert merge_rows(str(tmp_path / "missing.json"), new) == new
    # another commit's run of the same backend and length is kept beside it, with its baseline
    path.write_text(json.dumps({"commit": "old", "model": "m8", "rows": merged}))
    newer = [{"backend": "flashinfer", "input_len": 32768, "tp": 1, "model": "m8",
              "output_tok_s": 5.0, "commit": "new"}]
    assert [(r["commit"], r["backend"], r["output_tok_s"]) for r in merge_rows(str(path), newer)
            ] == [("old", "flashinfer", 1.0), ("old", "sglang_ext", 3.0),
                  ("old", "sglang_ext", 4.0), ("new", "flashinfer", 5.0)]


def test_merge_puts_device_calls_rows_into_the_results_file(tmp_path: Path, monkeypatch) -> None:
    """--merge: a device call's results file (its own rows, speedups against its own
    flashinfer row) joins the repo's; the repo file's note stays, plots are redrawn."""
    import sys

    import benchmarks.e2e_serving as E

    repo = tmp_path / "e2e_h200.json"
    row = {"input_len": 32768, "tp": 1, "model": "m8", "output_tok_s": 1.0}
    repo.write_text(json.dumps({"commit": "a", "gpu": "H200", "note": "kept", "rows": [
        {**row, "backend": "flashinfer", "commit": "a"}]}))
    call = tmp_path / "call" / "e2e_h200.json"
    call.parent.mkdir()
    call.write_text(json.dumps({"commit": "b", "dummy_weights": "scaled", "rows": [
        {**row, "backend": "flashinfer", "commit": "b"},
        {**row, "backend": "sglang_ext_fi", "commit": "b", "output_tok_s": 3.0,
         "dummy_weights": "sglang"}]}))
    drawn: list[str] = []
    monkeypatch.setattr(E, "plot", lambda rows, path, title: drawn.append(os.path.basename(path)))
    monkeypatch.setattr(sys, "argv", ["e2e_serving.py", "--out", str(tmp_path), "--merge",
                                      str(call)])
    assert E.main() == 0
    merged = json.loads(repo.read_text())
    assert merged["note"] == "kept" and drawn == ["e2e_h200.png"]
    assert [(r["commit"], r["backend"], r.get("dummy_weights")) for r in merged["rows"]] == [
        ("a", "flashinfer", None), ("b", "flashinfer", "scaled"), ("b", "sglang_ext_fi", "sglang")]
    assert E.main() == 0  # merging the same call again replaces its rows
    assert len(json.loads(repo.read_text())["rows"]) == 3
    # a results name not there yet starts a file of its own, headed by the call's fields
    monkeypatch.setattr(sys, "argv", ["e2e_serving.py", "--out", str(tmp_path), "--merge",
                                      str(call), "--results-name", "e2e_h200_decode_only"])
    assert E.main() == 0
    alone = json.loads((tmp_path / "e2e_h200_decode_only.json").read_text())
    assert alone["commit"] == "b" and len(alone["rows"]) == 2
    assert drawn[-1] == "e2e_h200_decode_only.png"


def test_merge_gives_an_fp8_kv_row_its_same_cache_ratio_from_another_call(
        tmp_path: Path, monkeypatch) -> None:
    """Ours on fp8 beside flashinfer on the default cache in one call, flashinfer on fp8 in
    another: after --merge the fp8 row carries the ratio against the other call's fp8 row and
    says where it came from; its bar ratio (same call) is untouched."""
    import sys

    import benchmarks.e2e_serving as E

    def row(backend: str, decode: float, **extra) -> dict:
        return {"backend": backend, "input_len": 131072, "tp": 1, "model": "m8", "commit": "c",
                "config": " ".join(CONFIGS[backend]), "output_tok_s": 1.0,
                "decode_tok_s": decode, **extra}
    repo = tmp_path / "e2e_h200.json"
    repo.write_text(json.dumps({"commit": "a", "gpu": "H200", "rows": []}))
    pair, alone = tmp_path / "pair" / "e2e_h200.json", tmp_path / "alone" / "e2e_h200.json"
    for path, rows in ((pair, [row("flashinfer", 180.0), row(
            "sglang_ext_fi_fp8s_fp8kv", 990.0, kv_cache_dtype="fp8_e4m3",
            decode_speedup_vs_flashinfer=5.5, decode_speedup_vs_flashinfer_same_kv=None)]),
                       (alone, [row("flashinfer_fp8kv", 220.0, kv_cache_dtype="fp8_e4m3")])):
        path.parent.mkdir()
        path.write_text(json.dumps({"commit": "c", "rows": rows}))
    monkeypatch.setattr(E, "plot", lambda rows, path, title: None)
    monkeypatch.setattr(sys, "argv", ["e2e_serving.py", "--out", str(tmp_path), "--merge",
                                      str(pair), str(alone)])
    assert E.main() == 0
    ours = next(r for r in json.loads(repo.read_text())["rows"]
                if r["backend"] == "sglang_ext_fi_fp8s_fp8kv")
    assert ours["decode_speedup_vs_flashinfer_same_kv"] == 4.5
    assert ours["same_kv_from_another_call"] and ours["same_kv_baseline_commit"] == "c"
    assert ours["decode_speedup_vs_flashinfer"] == 5.5


def test_series_names_tell_block_sizes_apart_and_the_plot_shows_the_newest_run(
        tmp_path: Path) -> None:
    ours = {"backend": "sglang_ext_fi", "model": "m8", "tp": 1,
            "config": "--attention-backend sglang_ext --sparse-block-size 32 --x 1"}
    assert series_name(ours) == "sglang_ext_fi bs32 (m8)"
    assert series_name({"backend": "flashinfer", "model": "m8", "tp": 2, "config": "x"}) \
        == "flashinfer (m8, tp 2)"
    rows = [dict(ours, input_len=32768, output_tok_s=1.0, median_itl_ms=9.0, commit="a"),
            dict(ours, input_len=32768, output_tok_s=2.0, median_itl_ms=8.0, commit="b")]
    assert newest_by_series(rows) == {("sglang_ext_fi bs32 (m8)", 32768): rows[1]}
    plot(rows, str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").stat().st_size > 0


FI_LOG = """[2026-11-29 21:23:36 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 1265744, K size: 48.28 GB, V size: 48.28 GB
[2026-11-29 21:25:24 TP0] max_total_num_tokens=1265744, chunked_prefill_size=8192
"""
TIER_LOG = """[2026-11-29 21:39:03 TP0] KV Cache is allocated. dtype: torch.bfloat16, #tokens: 131024, K size: 5.00 GB, V size: 5.00 GB
[2026-11-29 21:39:36 TP0] sglang_ext CPU tier: GPU-homed 16 tokens, host-homed 585936 tokens, working area 131008 tokens (page 16); host store 48.00 GB (async mode)
[2026-11-29 21:40:01 TP0] max_total_num_tokens=585952, chunked_prefill_size=8192
"""


def test_capacity_against_the_physical_limit_comes_from_the_logs() -> None:
    from benchmarks.e2e_serving import capacity_vs_limit, server_log_stats

    fi = {"backend": "flashinfer", **server_log_stats(FI_LOG)}
    tier = {"backend": "sglang_ext_tier", **server_log_stats(TIER_LOG)}
    # SGLang's line counts GiB (2 x 48.28), the tier's host store GB: the limit takes both in GB
    assert fi["device_kv_gb"] == round(96.56 * 2**30 / 1e9, 3) and fi["host_store_gb"] is None
    assert tier["host_store_gb"] == 48.0 and tier["max_total_num_tokens"] == 585952
    fi["server_max_running"], tier["server_max_running"] = 5, 9  # from #running-req lines
    rows = [fi, tier]
    capacity_vs_limit(rows)
    assert "capacity_ratio" not in fi
    assert tier["capacity_ratio"] == round(585952 / 1265744, 3)
    device_gb = 96.56 * 2**30 / 1e9
    assert tier["capacity_limit"] == round((device_gb + 48.0) / device_gb, 3)
    assert tier["capacity_vs_limit"] == round(tier["capacity_ratio"] / tier["capacity_limit"], 3)
    assert tier["running_ratio"] == 1.8
    assert tier["running_vs_limit"] == round(1.8 / ((device_gb + 48.0) / device_gb), 3)


def test_locality_rows_carry_bytes_per_step_and_their_ratio() -> None:
    """The tier's cumulative stats line gives bytes per decode step; a locality row is compared
    with the plain tier row of the same context and budget."""
    log = ('sglang_ext tier stats: {"wanted_blocks": 10, "transferred_blocks": 4, '
           '"decode_steps": 16, "transferred_bytes": 4096}\n'
           'sglang_ext tier stats: {"wanted_blocks": 20, "transferred_blocks": 8, '
           '"decode_steps": 32, "transferred_bytes": 8192}\n')
    stats = server_log_stats(log)["tier_stats"]
    rows = []
    for name, moved in (("sglang_ext_tier", 8192), ("sglang_ext_tier_locality", 2048)):
        rows.append({"context": 65536, **tier_traffic(CONFIGS[name],
                                                       dict(stats, transferred_bytes=moved))})
    assert [(r["locality"], r["budget"], r["bytes_per_step"]) for r in rows] == \
        [("off", 2048, 256.0), ("on", 2048, 64.0)]
    locality_vs_two_level(rows)
    assert rows[1]["bytes_vs_two_level"] == 0.25 and "bytes_vs_two_level" not in rows[0]
    assert tier_traffic(CONFIGS["sglang_ext"], None) == {}


def test_an_fp8_kv_row_is_also_compared_with_full_attention_on_the_same_cache(
        tmp_path: Path) -> None:
    """The bar's ratio stays against the default-cache flashinfer row; a row on an fp8 cache
    also gets the ratio against flashinfer on fp8, and rows on the default cache get none."""
    def row(backend: str, decode: float) -> dict:
        return {"backend": backend, "input_len": 131072, "config": " ".join(CONFIGS[backend]),
                "output_tok_s": decode / 10, "decode_tok_s": decode,
                "server_max_running": 5, "max_total_num_tokens": 10}
    rows = [row("flashinfer", 180.0), row("flashinfer_fp8kv", 360.0),
            row("sglang_ext_fi_fp8s_fp8kv", 1080.0), row("sglang_ext_fi_fp8s", 540.0)]
    finish_rows(rows, str(tmp_path / "e2e.json"), {"gpu": "test"}, append=False)
    by = {r["backend"]: r for r in rows}
    ours = by["sglang_ext_fi_fp8s_fp8kv"]
    assert ours["kv_cache_dtype"] == "fp8_e4m3"
    assert ours["decode_speedup_vs_flashinfer"] == 6.0
    assert ours["decode_speedup_vs_flashinfer_same_kv"] == 3.0
    assert by["flashinfer_fp8kv"]["decode_speedup_vs_flashinfer_same_kv"] == 1.0
    assert "decode_speedup_vs_flashinfer_same_kv" not in by["sglang_ext_fi_fp8s"]
    rows.pop(1)  # no fp8 full-attention row in this run: no same-cache ratio
    for r in rows:
        r.pop("decode_speedup_vs_flashinfer_same_kv", None)
    finish_rows(rows, str(tmp_path / "e2e.json"), {"gpu": "test"}, append=False)
    assert rows[1]["decode_speedup_vs_flashinfer_same_kv"] is None


def test_decode_throughput_and_running_requests_come_from_the_decode_log_lines() -> None:
    """bench_serving's output throughput includes prefill (at 128k most of a run); the rows also
    carry the server's best decode interval and how many requests ran at once."""
    log = "\n".join([
        "[t] Prefill batch, #new-seq: 1, #new-token: 32768, #cached-token: 0, token usage: 0.06, "
        "#running-req: 0, #queue-req: 3, #pending-token: 9, cuda graph: False, "
        "input throughput (token/s): 9045.65",
        "[t] Decode batch, #running-req: 3, #token: 9, token usage: 0.40, cuda graph: True, "
        "gen throughput (token/s): 12.50, #queue-req: 1",
        "[t] Decode batch, #running-req: 5, #token: 9, token usage: 0.98, cuda graph: True, "
        "gen throughput (token/s): 183.25, #queue-req: 0",
        "[t] Decode batch, #running-req: 4, #token: 9, token usage: 0.79, cuda graph: True, "
        "gen throughput (token/s): 150.00, #queue-req: 0",
        "[t] Decode batch, #running-req: 4, #token: 9, token usage: 0.79, cuda graph: True, "
        "gen throughput (token/s): 149.00, #queue-req: 0",
    ])
    stats = server_log_stats(log)
    assert stats["server_max_running"] == 5
    assert stats["decode_tok_s"] == 183.25
    # the best interval at each batch size, in order of size
    assert list(stats["decode_tok_s_by_running"].items()) == [
        ("3", 12.5), ("4", 150.0), ("5", 183.25)]
    assert server_log_stats("no decode yet")["decode_tok_s_by_running"] == {}
    assert stats["server_retracted_requests"] == 0
    assert server_log_stats("no decode yet")["decode_tok_s"] is None
    retracts = ("[t] KV cache pool is full. Retract requests. #retracted_reqs: 2, "
                "#new_tokens_gained: 9, #new_token_ratio: 0.7000 -> 0.9000\n") * 2
    assert server_log_stats(log + "\n" + retracts)["server_retracted_requests"] == 4


def test_collect_builds_a_cut_runs_row_from_its_server_log_alone(tmp_path, monkeypatch) -> None:
    """--collect over a call the time box cut: the config whose bench_serving never finished
    gets a row of its server log's numbers (bench fields empty, bench_cut), and the driver
    says the run is incomplete."""
    import sys

    import benchmarks.e2e_serving as E

    start = _START_LINE.format(cap=16)
    (tmp_path / "server_flashinfer.log").write_text(start + "[t] Prefill batch, #new-seq: 1, "
                                                    "#new-token: 655360, #running-req: 0\n")
    (tmp_path / "bench_flashinfer.jsonl").write_text(json.dumps({
        "completed": 5, "output_throughput": 43.3, "median_tpot_ms": 28.3}) + "\n")
    (tmp_path / "server_sglang_ext_tier_fi.log").write_text(
        start.replace("698122", "1244976") + "[t] Decode batch, #running-req: 8, #token: 9, "
        "token usage: 0.89, cuda graph: True, gen throughput (token/s): 332.44, #queue-req: 1\n")
    monkeypatch.setattr(E, "plot", lambda rows, path, title: open(path, "w").close())
    monkeypatch.setattr(sys, "argv", [
        "e2e_serving.py", "--out", str(tmp_path), "--configs", "flashinfer",
        "sglang_ext_tier_fi", "sglang_ext", "--input-len", "131072", "--output-len", "1024",
        "--num-prompts", "auto", "--concurrency", "auto", "--label-channels", "0",
        "--model", str(tmp_path), "--collect", "--gpu", "NVIDIA H200"])
    assert E.main() == 1  # the cut run is not a complete one
    rows = json.loads((tmp_path / "e2e_h200.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["flashinfer", "sglang_ext_tier_fi"]  # no sglang_ext
    base, cut = rows
    assert "bench_cut" not in base and base["completed"] == 5 and base["num_prompts"] == 5
    assert cut["bench_cut"] and cut["completed"] is None and cut["output_tok_s"] is None
    assert (cut["num_prompts"], cut["decode_tok_s"], cut["server_max_running"]) == (8, 332.44, 8)


def _tier_line(wanted: int, moved: int, steps: int, transfer_s: float, exposed_s: float) -> str:
    return ("[t] sglang_ext tier stats: " + json.dumps({
        "wanted_blocks": wanted, "transferred_blocks": moved, "hit_rate": 1 - moved / wanted,
        "host_wanted_blocks": wanted // 2, "host_hit_rate": 1 - moved / (wanted // 2),
        "transfer_s": transfer_s, "exposed_transfer_s": exposed_s,
        "hidden_fraction": 1 - exposed_s / transfer_s, "work_pages_free": 7,
        "decode_steps": steps, "transferred_bytes": moved * 100}) + "\n")


def test_a_span_of_a_reused_servers_log_gets_its_own_counters() -> None:
    """Several input lengths on one server: each row's tier counters are the difference from
    the last stats line before its span (ratios recomputed), its decode and error counts are
    its span's, and the start-up facts come from the whole log."""
    from benchmarks.e2e_serving import span_log_stats

    startup = "[t] max_total_num_tokens=5000\n[t] host store 48.00 GB (async mode)\n"
    first = (_tier_line(100, 50, 16, 2.0, 1.0)
             + "[t] Decode batch, #running-req: 4, gen throughput (token/s): 90.00\n")
    second = ("[t] Prefill batch, #new-seq: 1, #new-token: 64, #running-req: 0\n"
              + _tier_line(300, 60, 48, 3.0, 1.1)
              + "[t] Decode batch, #running-req: 2, gen throughput (token/s): 70.00\n"
              + "[t] Traceback (most recent call last):\n")
    log = startup + first + second
    a = span_log_stats(log, 0, len(startup + first))
    b = span_log_stats(log, len(startup + first), len(log))
    assert a["tier_stats"]["transferred_bytes"] == 5000 and a["server_errors"] == 0
    assert (a["decode_tok_s"], a["server_max_running"]) == (90.0, 4)
    tb = b["tier_stats"]
    assert (tb["wanted_blocks"], tb["transferred_blocks"], tb["decode_steps"]) == (200, 10, 32)
    assert tb["transferred_bytes"] == 1000 and tb["work_pages_free"] == 7
    assert abs(tb["hit_rate"] - 0.95) < 1e-12 and abs(tb["hidden_fraction"] - 0.9) < 1e-12
    # host-homed: 150 - 50 = 100 wanted in the span, 10 moved
    assert tb["host_wanted_blocks"] == 100 and abs(tb["host_hit_rate"] - 0.9) < 1e-12
    assert (b["decode_tok_s"], b["server_max_running"], b["server_errors"]) == (70.0, 2, 1)
    assert b["server_prefill_tokens"] == 64
    assert (b["max_total_num_tokens"], b["host_store_gb"]) == (5000, 48.0)


def test_several_input_lengths_reuse_one_server_per_config(tmp_path, monkeypatch) -> None:
    """The driver starts each configuration once, runs bench_serving once per length on it,
    and writes one row per (config, length), each with its own span's tier traffic; the
    results file is written after every configuration (a run cut short keeps what it has)."""
    import os
    import sys

    import benchmarks.e2e_serving as E
    import benchmarks.profile_decode as P

    launched, benched = [], []

    class Proc:
        def poll(self):
            return None

    launched_names: list[str] = []

    def launch(model, tokenizer, flags, port, context_len, log_path, extra, env_extra=None):
        launched.append((flags[flags.index("--attention-backend") + 1], context_len))
        launched_names.append(os.path.basename(log_path)[len("server_"):-len(".log")])
        with open(log_path, "w") as f:
            f.write("[t] max_total_num_tokens=5000\n[t] host store 48.00 GB (async mode)\n")
        return Proc()

    moved: dict[str, int] = {}  # cumulative transferred blocks per server, like the tier's

    sizes_at_bench: list[int] = []  # where each benchmark's part of its server's log starts

    def bench(port, tokenizer, n, output_len, prompts, concurrency, out_file, warmup,
              fake_prefill=False):
        benched.append((n, warmup))
        log = tmp_path / f"server_{launched_names[-1]}.log"
        sizes_at_bench.append(log.stat().st_size)
        # the locality server moves a quarter of the plain tier's blocks
        moved[log.name] = moved.get(log.name, 0) + (n // 4 if "locality" in log.name else n)
        runs = len(benched) - 2 * (len(launched) - 1)  # this server's bench runs so far
        with open(log, "a") as f:
            f.write(f"[t] Prefill batch, #new-seq: 1, #new-token: {n * prompts}, #running-req: 0\n")
            f.write(_tier_line(100_000 * runs, moved[log.name], 16 * runs, 1.0 * runs, 0.5 * runs))
        return {"completed": prompts, "output_throughput": 10.0, "median_tpot_ms": 5.0,
                "median_itl_ms": 5.0, "median_ttft_ms": 100.0, "max_concurrent_requests": 2}

    monkeypatch.setattr(E, "launch", launch)
    monkeypatch.setattr(E, "bench", bench)
    monkeypatch.setattr(E, "wait_healthy", lambda *a: None)
    monkeypatch.setattr(E, "stop", lambda proc: None)
    monkeypatch.setattr(E, "plot", lambda rows, path, title: open(path, "w").close())
    monkeypatch.setattr(E, "plot_profiles", lambda rows, path, title: None)
    profile_offsets: list[int] = []

    def profile(port, log_path, running, steps, timeout, cancel=None, log_offset=0):
        profile_offsets.append(log_offset)
        return {"step_ms": 1.0, "categories": {"gemm": 1.0}, "running": running}

    monkeypatch.setattr(P, "profile_running_server", profile)
    monkeypatch.setattr(sys, "argv", [
        "e2e_serving.py", "--out", str(tmp_path), "--configs", "sglang_ext_tier",
        "sglang_ext_tier_locality", "--input-len", "1000", "4000", "--num-prompts", "2",
        "--concurrency", "2", "--warmup-requests", "0", "--label-channels", "0",
        "--profile-steps", "2", "--model", str(tmp_path), "--results-name", "locality_test"])
    assert E.main() == 0
    # each length's profile waits for a full batch in its own part of the reused server's log
    # (the earlier length's full batch would start it during this one's prefill); the first
    # length's part starts at the log's start, so that start-up lines count
    assert sorted(profile_offsets) == sorted([0, sizes_at_bench[1], 0, sizes_at_bench[3]])
    assert sizes_at_bench[1] > sizes_at_bench[0]
    assert launched == [("sglang_ext", int(4000 * 1.25) + 256 + 64)] * 2
    assert benched == [(1000, 0), (4000, 0)] * 2
    rows = json.loads((tmp_path / "locality_test.json").read_text())["rows"]
    assert [(r["backend"], r["input_len"]) for r in rows] == [
        ("sglang_ext_tier", 1000), ("sglang_ext_tier", 4000),
        ("sglang_ext_tier_locality", 1000), ("sglang_ext_tier_locality", 4000)]
    # each span's own traffic: the second length's counters are differences
    assert [r["tier_stats"]["transferred_blocks"] for r in rows] == [1000, 4000, 250, 1000]
    assert all(r["tier_stats"]["decode_steps"] == 16 for r in rows)
    assert [r["locality"] for r in rows] == ["off", "off", "on", "on"]
    assert [r.get("bytes_vs_two_level") for r in rows] == [None, None, 0.25, 0.25]


_START_LINE = ("[t] max_total_num_tokens=698122, chunked_prefill_size=32768, "
               "max_prefill_tokens=16384, max_running_requests={cap}, context_len=163936\n")


def test_auto_concurrency_is_what_the_started_server_holds() -> None:
    import argparse

    import pytest

    from benchmarks.e2e_serving import auto_concurrency, count_or_auto

    # FlashInfer's pool on the H200: it admitted five 128k requests, 19 of 32k + 1k outputs
    assert auto_concurrency(_START_LINE.format(cap=16), 131072, 1024) == 5
    assert auto_concurrency(_START_LINE.format(cap=48), 32768, 1024) == 19
    assert auto_concurrency(_START_LINE.format(cap=48).replace("698122", "620544"),
                            32768, 1024) == 17  # ours without the tier: 17 ran
    assert auto_concurrency(_START_LINE.format(cap=16), 32768, 1024) == 16  # the cap
    # ours on the fp8 cache at 0.91 held 10 of 128k (11 did not fit), with 512 or 1k outputs
    fp8 = _START_LINE.format(cap=16).replace("698122", "1480384")
    assert auto_concurrency(fp8, 131072, 512) == auto_concurrency(fp8, 131072, 1024) == 10
    # a request's tokens round up to whole pages: 31162 re-tokenized + 512 = 33233 tokens,
    # 698122 // 33248 = 20 (// 33233 would be 21)
    assert auto_concurrency(_START_LINE.format(cap=48), 31162, 0) == 20
    assert auto_concurrency(_START_LINE.format(cap=48), 10**6, 0) == 1
    # the CPU tier's homes, each for whole requests: 4 + 4 at 128k + 1k (8 of 9 ran on the H200)
    tier = ("[t] sglang_ext CPU tier: GPU-homed 586688 tokens, host-homed 651040 tokens, working "
            "area 72192 tokens\n") + _START_LINE.format(cap=16).replace("698122", "1237728")
    assert auto_concurrency(tier, 131072, 1024) == 8
    with pytest.raises(RuntimeError, match="max_total_num_tokens"):
        auto_concurrency("[t] not started\n", 1000, 10)
    assert count_or_auto("auto") is None and count_or_auto("12") == 12
    for bad in ("many", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            count_or_auto(bad)


def test_auto_concurrency_drives_bench_serving_and_the_profile_lands_in_the_row(
        tmp_path, monkeypatch) -> None:
    """--concurrency auto: each server's bench gets as many prompts as it holds (from its own
    start-up line), and --profile-steps puts the profile taken beside the bench in the row."""
    import sys

    import benchmarks.e2e_serving as E
    import benchmarks.profile_decode as P

    caps = {"flashinfer": 16, "sglang_ext_tier": 48}
    benched, profiled = [], []

    class Proc:
        def poll(self):
            return None

    def launch(model, tokenizer, flags, port, context_len, log_path, extra, env_extra=None):
        name = os.path.basename(log_path)[len("server_"):-len(".log")]
        tokens = 698122 if name == "flashinfer" else 1244976
        with open(log_path, "w") as f:
            f.write(_START_LINE.format(cap=caps[name]).replace("698122", str(tokens)))
        return Proc()

    def bench(port, tokenizer, n, output_len, prompts, concurrency, out_file, warmup,
              fake_prefill=False):
        benched.append((n, prompts, concurrency))
        name = os.path.basename(out_file)[len("bench_"):-len(".jsonl")]
        with open(tmp_path / f"server_{name}.log", "a") as f:  # the prefill the driver checks
            f.write(f"[t] Prefill batch, #new-seq: 1, #new-token: {n * prompts}\n")
        return {"completed": prompts, "output_throughput": 10.0, "median_tpot_ms": 5.0,
                "median_itl_ms": 5.0, "median_ttft_ms": 100.0}

    def profile(port, log_path, running, steps, timeout, cancel=None, log_offset=0):
        profiled.append((os.path.basename(log_path), running, steps))
        return {"step_ms": 12.5, "idle_ms": 1.0, "categories": {"gemm": 4.0}, "running": running}

    monkeypatch.setattr(E, "launch", launch)
    monkeypatch.setattr(E, "bench", bench)
    monkeypatch.setattr(E, "wait_healthy", lambda *a: None)
    monkeypatch.setattr(E, "stop", lambda proc: None)
    monkeypatch.setattr(E, "plot", lambda rows, path, title: open(path, "w").close())
    monkeypatch.setattr(P, "profile_running_server", profile)
    profile_plots: list[list[str]] = []
    monkeypatch.setattr(E, "plot_profiles", lambda rows, path, title: profile_plots.append(
        [r["backend"] for r in rows]))
    monkeypatch.setattr(sys, "argv", [
        "e2e_serving.py", "--out", str(tmp_path), "--configs", "flashinfer", "sglang_ext_tier",
        "--input-len", "32768", "--output-len", "1024", "--num-prompts", "auto",
        "--concurrency", "auto", "--profile-steps", "4", "--label-channels", "0",
        "--model", str(tmp_path), "--results-name", "auto_test"])
    assert E.main() == 0
    # 698122 // 35840 = 19 capped at 16; 1244976 // 35840 = 34
    assert benched == [(32768, 16, 16), (32768, 34, 34)]
    assert profiled == [("server_flashinfer.log", 16, 4), ("server_sglang_ext_tier.log", 34, 4)]
    rows = json.loads((tmp_path / "auto_test.json").read_text())["rows"]
    assert [(r["num_prompts"], r["concurrency"]) for r in rows] == [(16, 16), (34, 34)]
    assert rows[1]["decode_profile"] == {"step_ms": 12.5, "idle_ms": 1.0,
                                         "categories": {"gemm": 4.0}, "running": 34}
    assert profile_plots == [["flashinfer", "sglang_ext_tier"]]


def _run_sh_call(step: str, env: dict[str, str] | None = None) -> list[str]:
    """The e2e_serving.py arguments of a run.sh step, as bash expands them (defaults of the
    step's environment variables unless ``env`` sets them, OUT=out)."""
    import re
    import subprocess

    text = (Path(__file__).resolve().parent.parent / "benchmarks/device/run.sh").read_text()
    body = re.search(rf"^    {re.escape(step)}\)\n(.*?);;", text, re.S | re.M).group(1)
    call = re.search(r"python3 benchmarks/e2e_serving.py(.*?)\|\| status=1", body, re.S).group(1)
    out = subprocess.run(["bash", "-c", f'OUT=out; eval "set -- $1"; printf "%s\\0" "$@"', "_",
                          call.replace("\\\n", " ")], capture_output=True, text=True, check=True,
                         env={**os.environ, **(env or {})})
    return out.stdout.split("\0")[:-1]


def test_e2e_step_passes_the_documented_knobs() -> None:
    """run.sh e2e as the README's 128k command calls it: auto concurrency, the profile, the
    server flags and a block size reach the driver, and its parser takes them."""
    from benchmarks.e2e_serving import build_parser

    extra = ("--mem-fraction-static 0.8 --max-running-requests 16 --cuda-graph-max-bs 16 "
             "--chunked-prefill-size 32768")
    args = build_parser().parse_args(_run_sh_call("e2e", {
        "E2E_CONFIGS": "flashinfer sglang_ext_tier_locality_fi", "E2E_INPUT": "131072",
        "E2E_OUTPUT": "1024", "E2E_PROMPTS": "auto", "E2E_WARMUP": "0",
        "E2E_PROFILE_STEPS": "8", "E2E_EXTRA": extra, "E2E_BLOCK_SIZE": "32"}))
    assert args.configs == ["flashinfer", "sglang_ext_tier_locality_fi"]
    assert (args.input_len, args.output_len, args.warmup_requests) == ([131072], 1024, 0)
    assert args.num_prompts is None and args.concurrency is None  # auto
    assert (args.profile_steps, args.block_size, args.extra, args.append) == (8, 32, extra, False)
    # the defaults: 16 prompts at once, no profile, the config's block size
    args = build_parser().parse_args(_run_sh_call("e2e"))
    assert (args.num_prompts, args.concurrency, args.profile_steps, args.block_size) == \
        (16, 16, 0, 0)
    assert build_parser().parse_args(_run_sh_call("e2e", {"E2E_APPEND": "1"})).append


def test_decode_only_reaches_every_server_and_bench_serving() -> None:
    """E2E_DECODE_ONLY=1: both servers start in SGLang's decode-only mode with the fake KV
    transfer, after the --extra flags, and bench_serving sends fake-prefilled requests."""
    from benchmarks.e2e_serving import DECODE_ONLY_FLAGS, bench_command, build_parser, server_extra

    args = build_parser().parse_args(_run_sh_call("e2e", {"E2E_DECODE_ONLY": "1",
                                                          "E2E_EXTRA": "--mem-fraction-static 0.9"}))
    assert args.decode_only
    assert server_extra(args) == ["--mem-fraction-static", "0.9", *DECODE_ONLY_FLAGS]
    assert DECODE_ONLY_FLAGS == ["--disaggregation-mode", "decode",
                                 "--disaggregation-transfer-backend", "fake"]
    cmd = bench_command(30000, "tok", 131072, 256, 11, 11, "out.jsonl", 0, fake_prefill=True)
    assert cmd[-1] == "--fake-prefill" and "--fake-prefill" not in bench_command(
        30000, "tok", 131072, 256, 11, 11, "out.jsonl", 0)
    plain = build_parser().parse_args(_run_sh_call("e2e"))
    assert not plain.decode_only and DECODE_ONLY_FLAGS[0] not in server_extra(plain)


def test_decode_only_servers_fill_their_pools_with_random_kv(monkeypatch) -> None:
    """The fake transfer writes no KV: decode-only servers start with SGLANG_EXT_SYNTHETIC_KV
    =random (their pools filled at start-up), unless this process's environment says otherwise;
    other runs leave the environment alone but for a configuration's own (CONFIG_ENV)."""
    from benchmarks.e2e_serving import build_parser, server_env

    decode_only = build_parser().parse_args(_run_sh_call("e2e", {"E2E_DECODE_ONLY": "1"}))
    monkeypatch.delenv("SGLANG_EXT_SYNTHETIC_KV", raising=False)
    assert server_env(decode_only) == {"SGLANG_EXT_SYNTHETIC_KV": "random"}
    assert server_env(build_parser().parse_args(_run_sh_call("e2e"))) == {}
    monkeypatch.setenv("SGLANG_EXT_SYNTHETIC_KV", "off")
    assert server_env(decode_only) == {"SGLANG_EXT_SYNTHETIC_KV": "off"}
    # a configuration's own environment comes with it (the 8-bit top-k control)
    assert server_env(decode_only, "sglang_ext_fi_fp8s_fp8kv_radix8") == {
        "SGLANG_EXT_TOPK_RADIX_BITS": "8,8", "SGLANG_EXT_SYNTHETIC_KV": "off"}
    assert server_env(decode_only, "sglang_ext_fi_fp8s_fp8kv") == {
        "SGLANG_EXT_SYNTHETIC_KV": "off"}


def test_mla_e2e_step_parses_and_its_configs_start_on_the_mla_model() -> None:
    """run.sh mla-e2e (GPU only): its call parses, names the DeepSeek-V2-Lite-shaped config
    (an MLA model, whose rows are then named by that folder), merges into e2e_h200.json, and
    each configuration's flags pass our start-up checks for that model (the CPU tier included)."""
    import argparse
    from types import SimpleNamespace

    from sglang.srt.configs.model_config import ModelConfig

    from benchmarks.e2e_serving import build_parser, ours_flags
    from sglang_ext import config as sparse_config
    from sglang_ext.patches.server_args import check_mla_model
    from sglang_ext.selection.mla import is_mla_model

    args = build_parser().parse_args(_run_sh_call("mla-e2e"))
    repo = Path(__file__).resolve().parent.parent
    assert Path(args.model) == Path("benchmarks/models/deepseek-v2-lite-shape")
    assert os.path.basename(args.model) == "deepseek-v2-lite-shape"  # the rows' "model"
    assert args.results_name == "e2e_h200" and args.append and args.input_len == [32768]
    assert args.label_channels == 0  # no MHA-shaped synthetic labels for the latent row
    assert "sglang_ext_tier" in args.configs and {"flashinfer", "triton"} & set(args.configs)
    mc = ModelConfig(str(repo / args.model), trust_remote_code=False, dtype="bfloat16")
    assert is_mla_model(mc)
    for name in args.configs:
        flags = ours_flags(name, args.block_size, None)
        if "sglang_ext" not in name:
            continue
        if "--sparse-tier-host-gb" in flags:  # run.sh's size is the GPU host's, not this one's
            flags[flags.index("--sparse-tier-host-gb") + 1] = "1"
        parser = argparse.ArgumentParser()
        sparse_config.add_cli_args(parser)
        cfg = sparse_config.from_namespace(parser.parse_known_args(flags)[0])
        assert cfg.tier == "async" or name != "sglang_ext_tier"
        check_mla_model(SimpleNamespace(get_model_config=lambda: mc, device="cuda",
                                        kv_cache_dtype="auto"), cfg)


def test_synthetic_label_basis_loads_as_a_calibrated_one(tmp_path: Path) -> None:
    """--label-basis: the serving rows of the recommended setting time the basis's rotations on
    dummy weights, so the file must pass the server's own basis checks (shape, sha256, leading
    coordinates) and be orthonormal, as a calibrated kpca basis is."""
    import torch

    from sglang_ext.selection.calibrate import load_label_basis, load_label_config

    model = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "models", "qwen3-8b-shape")
    path = synthetic_label_config(model, 16, str(tmp_path), basis=True)
    shape = dict(num_layers=36, num_kv_heads=8, head_dim=128)
    query, key = load_label_basis(path, **shape)
    assert query.shape == (36, 8, 128, 128) and torch.equal(query, key)
    eye = torch.eye(128).expand_as(query)
    assert torch.allclose(query @ query.transpose(-1, -2), eye, atol=1e-5)
    assert load_label_config(path, **shape).shape == (36, 8, 16)
    plain = synthetic_label_config(model, 16, str(tmp_path))
    assert load_label_basis(plain, **shape) is None
