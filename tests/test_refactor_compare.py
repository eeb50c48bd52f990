"""The before/after driver (benchmarks/refactor_compare.py) without a GPU: its command line and
plan, the environment each tree runs in, the rows and verdict it assembles from given numbers
(nothing unmeasured passes), merging two calls' files, run.sh's step and the export script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import refactor_compare as rc
from benchmarks import results_io
from benchmarks.e2e_serving import CONFIGS

ROOT = Path(__file__).resolve().parent.parent


def _args(*argv: str):
    return rc.parse_args(list(argv))


def _reply(ids: list[int], margin: float = 2.0) -> dict:
    tops = [[[-0.1, i], [-0.1 - margin, i + 1]] for i in ids]
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": tops}}


def _before_tree(tmp_path: Path, commit: str = "a" * 40) -> Path:
    tree = tmp_path / "before"
    (tree / "benchmarks").mkdir(parents=True)
    (tree / "COMMIT").write_text(commit + "\n")
    return tree


# ----------------------------------------------------------------------------- command line


def test_help_runs_without_a_gpu() -> None:
    out = subprocess.run([sys.executable, "benchmarks/refactor_compare.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--parts" in out.stdout and "--merge" in out.stdout and "--dry-run" in out.stdout


def test_defaults_are_the_issues_cases() -> None:
    a = _args()
    assert a.parts == ["operator", "serving"]
    assert (a.context, a.batch, a.operator_block_size, a.budget) == (131072, 32, 32, 2048)
    assert (a.input_len, a.block_size, a.config) == (32768, 32, "sglang_ext_fi_fp8s_bound")
    assert (a.operator_bar, a.serving_bar) == (0.02, 0.03)
    assert a.dummy_weights == "scaled" and a.dense_backend == "triton"
    assert a.out == os.path.join(results_io.RESULTS_DIR, "refactor")
    assert results_io.suite_of("refactor_h200.json") == "refactor"
    assert os.path.isabs(a.before) and a.before.endswith(".before")


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--parts", "tier"],
                                  ["--merge", "a.json", "--dry-run"], ["--dense-backend", "x"]])
def test_bad_arguments_stop(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _args(*argv)


def test_operator_runs_alternate() -> None:
    assert rc.operator_order(1) == ["before", "after"]
    assert rc.operator_order(2) == ["before", "after", "after", "before"]
    assert rc.operator_order(3)[4:] == ["before", "after"]


def test_operator_flags_parse_in_bench_operator() -> None:
    from benchmarks.bench_operator import parse_args as bench_args

    a = _args("--operator-extra", "--iters 7")
    got = bench_args(rc.operator_flags(a))
    assert (got.contexts, got.batches, got.block_size, got.fi_page_size) == \
        ("131072", "32", 32, 32)
    assert got.block_score == "label_max" and got.compare_block_score
    assert got.skip_flashinfer and got.skip_triton and not got.fi_sparse
    assert not (got.compare_topk or got.compare_label_cache or got.compare_scatter)
    assert got.iters == 7  # the extra flags come last and win


def test_serving_flags_swap_only_the_prefill_backend() -> None:
    headline = CONFIGS["sglang_ext_fi_fp8s_bound"]
    flags = rc.serving_flags(headline, "triton")
    assert flags[flags.index("--sparse-dense-backend") + 1] == "triton"
    assert [f for f in flags if f != "triton"] == [f for f in headline if f != "flashinfer"]
    assert rc.serving_flags(headline, "config") == headline
    assert rc.serving_flags(CONFIGS["sglang_ext"], "triton")[-2:] == \
        ["--sparse-dense-backend", "triton"]


def test_each_tree_runs_from_its_own_site() -> None:
    current = os.pathsep.join(["/tmp/site", "/repo", "/repo/benchmarks", "/repository", "",
                               "/tmp/site", "/x/.before/sub"])
    got = rc.child_pythonpath("/w/site_before", current, ["/repo", "/x/.before"])
    assert got.split(os.pathsep) == ["/w/site_before", "/tmp/site", "/repository"]


def test_dry_run_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    tree = _before_tree(tmp_path)
    assert rc.main(["--dry-run", "--before", str(tree), "--after-commit", "b" * 40,
                    "--work", str(tmp_path / "work")]) == 0
    out = capsys.readouterr().out
    assert f"before: {tree} ({'a' * 40})" in out
    assert out.count("bench_operator.py") == 4  # two rounds, both trees
    assert str(tree / "benchmarks" / "bench_operator.py") in out
    assert f"--target {tmp_path / 'work' / 'site_before'}" in out
    assert "--sparse-dense-backend triton" in out and "--sparse-block-size 32" in out
    assert "warning" not in out


def test_dry_run_warns_when_both_sides_name_one_commit(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    tree = _before_tree(tmp_path)
    rc.main(["--dry-run", "--before", str(tree), "--after-commit", "a" * 7,
             "--parts", "operator"])
    out = capsys.readouterr().out
    assert "warning: before and after both name" in out and "servers" not in out


def test_a_missing_before_tree_stops_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="export_before.sh"):
        rc.main(["--dry-run", "--before", str(tmp_path)])


def test_without_a_gpu_it_stops_with_one_line(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here")
    tree = _before_tree(tmp_path)
    assert rc.main(["--before", str(tree), "--out", str(tmp_path / "out"),
                    "--work", str(tmp_path / "work")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["refactor_compare: needs a CUDA GPU and none is visible"]
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- provenance


def test_provenance_problems(tmp_path: Path) -> None:
    site, tree = tmp_path / "site", tmp_path / "tree"
    (site / "sglang_ext" / "kernels").mkdir(parents=True)
    (tree / "kernels").mkdir(parents=True)
    kernel = site / "sglang_ext" / "kernels" / "sparse_decode.py"
    kernel.write_text("x = 1\n")
    (tree / "kernels" / "sparse_decode.py").write_text("x = 1\n")
    probe = {"files": {"sglang_ext": str(site / "sglang_ext" / "__init__.py"),
                       "sglang_ext.kernels.sparse_decode": str(kernel)},
             "entry_point_dist": str(site)}
    assert rc.provenance_problems(probe, str(site), str(tree)) == []
    # the checkout's source folder instead of the site (python -m from the repository root)
    wrong = {**probe, "files": {**probe["files"], "sglang_ext": "/repo/sglang_ext/__init__.py"}}
    assert rc.provenance_problems(wrong, str(site), str(tree)) == \
        [f"sglang_ext from /repo/sglang_ext/__init__.py, not {site}"]
    assert "entry point" in rc.provenance_problems({**probe, "entry_point_dist": "/usr/lib"},
                                                   str(site), str(tree))[0]
    (tree / "kernels" / "sparse_decode.py").write_text("x = 2\n")  # another tree's kernel
    assert rc.provenance_problems(probe, str(site), str(tree)) == \
        [f"{kernel} is not {tree / 'kernels' / 'sparse_decode.py'}"]


# ----------------------------------------------------------------------------- rows and verdict


def test_compare_is_two_sided() -> None:
    assert rc.compare(1.0, 1.019, 0.02, True)["passed"] is True
    assert rc.compare(1.0, 1.021, 0.02, True) == {"ratio": 1.021, "change": 0.021,
                                                  "slower": True, "passed": False}
    assert rc.compare(1.0, 0.97, 0.02, True)["passed"] is False  # faster beyond the bar too
    assert rc.compare(100.0, 97.0, 0.03, False)["passed"] is True
    assert rc.compare(100.0, 97.0, 0.03, False)["slower"] is True  # less throughput
    assert rc.compare(100.0, 103.5, 0.03, False)["passed"] is False
    assert rc.compare(None, 1.0, 0.02, True)["passed"] is None
    assert rc.compare(1.0, None, 0.02, True)["ratio"] is None
    assert rc.compare(1.0, 1.5, None, True)["passed"] is None  # informational row


def _op_row(ms: float, bound_ms: float, finite: bool = True) -> dict:
    return {"context": 131072, "batch": 32, "ours_ms": ms, "ours_select_ms": ms / 2,
            "ours_bound_ms": bound_ms, "ours_bound_select_ms": bound_ms / 2,
            "ours_finite": finite}


def test_operator_rows_average_each_trees_runs() -> None:
    args = _args()
    runs = {"before": [_op_row(0.530, 0.260), _op_row(0.540, 0.258)],
            "after": [_op_row(0.536, 0.270), _op_row(0.538, 0.272)]}
    rows = {r["metric"]: r for r in rc.operator_rows(runs, args)}
    assert set(rows) == {"ours_ms", "ours_bound_ms", "ours_select_ms", "ours_bound_select_ms"}
    main = rows["ours_ms"]
    assert main["before"] == pytest.approx(0.535) and main["after"] == pytest.approx(0.537)
    assert main["before_runs"] == [0.530, 0.540] and main["gated"] and main["passed"] is True
    assert main["block_score"] == "label_max" and main["context"] == 131072
    bound = rows["ours_bound_ms"]  # 0.259 -> 0.271: 4.6 % slower
    assert bound["passed"] is False and bound["slower"] is True and bound["bar"] == 0.02
    assert rows["ours_select_ms"]["passed"] is None and not rows["ours_select_ms"]["gated"]


def test_operator_rows_fail_a_non_finite_output_and_leave_a_missing_side_unmeasured() -> None:
    args = _args()
    rows = rc.operator_rows({"before": [_op_row(0.5, 0.25)],
                             "after": [_op_row(0.5, 0.25, finite=False)]}, args)
    assert rows[0]["passed"] is False and "non-finite" in rows[0]["error"]
    rows = rc.operator_rows({"before": [_op_row(0.5, 0.25)], "after": []}, args,
                            {"after": "bench_operator exited 1 (run 1)"})
    assert rows[0]["after"] is None and rows[0]["passed"] is None
    assert "after: bench_operator exited 1" in rows[0]["error"]


def _server(out: float, decode: float, **kw) -> dict:
    return {"completed": 8, "output_tok_s": out, "decode_tok_s": decode, "median_itl_ms": 20.0,
            "median_ttft_ms": 9000.0, "server_errors": 0, "server_retracted_requests": 0, **kw}


def test_serving_rows() -> None:
    args = _args()
    rows = {r["metric"]: r for r in rc.serving_rows(
        {"before": _server(460.0, 2000.0), "after": _server(450.0, 1930.0)}, args, ["--x"])}
    assert rows["output_tok_s"]["passed"] is True  # -2.2 %
    assert rows["decode_tok_s"]["passed"] is False  # -3.5 %
    assert rows["decode_tok_s"]["slower"] is True and rows["decode_tok_s"]["bar"] == 0.03
    assert rows["median_itl_ms"]["passed"] is None and not rows["median_itl_ms"]["gated"]
    assert rows["output_tok_s"]["input_len"] == 32768 and rows["output_tok_s"]["config"] == "--x"


def test_serving_rows_fail_an_unhealthy_run_and_leave_a_dead_server_unmeasured() -> None:
    args = _args()
    rows = rc.serving_rows({"before": _server(460.0, 2000.0),
                            "after": _server(460.0, 2000.0, completed=7, server_errors=2)},
                           args, [])
    assert rows[0]["passed"] is False
    assert rows[0]["problems"] == {"after": "completed 7 of 8, 2 server errors"}
    rows = rc.serving_rows({"before": _server(460.0, 2000.0),
                            "after": {"error": "TimeoutError: server not healthy"}}, args, [])
    assert all(r["passed"] is None for r in rows) and rows[0]["after"] is None
    assert rows[0]["error"] == {"after": "TimeoutError: server not healthy"}


def test_greedy_row() -> None:
    args = _args()
    before = [_reply([1, 2, 3]), _reply([4, 5, 6])]
    same = rc.greedy_row(before, [_reply([1, 2, 3]), _reply([4, 5, 6])], args)
    assert same["passed"] is True and same["identical"] == 2 and same["decisive_tokens"] == 6
    assert same["lengths"] == [1536, 8192] and same["gated"]
    other = rc.greedy_row(before, [_reply([1, 2, 3]), _reply([4, 9, 9])], args)
    assert other["passed"] is False and other["different"] == [1]
    assert other["first_diffs"][0]["token"] == 1
    ties = rc.greedy_row([_reply([1, 2], 0.01)], [_reply([1, 2], 0.01)], args)
    assert ties["passed"] is False and "tested nothing" in ties["why"]  # identical, undecided
    short = rc.greedy_row(before, before[:1], args)
    assert short["passed"] is False
    dead = rc.greedy_row(before, None, args, {"after": "the server failed"})
    assert dead["passed"] is None and dead["error"] == {"after": "the server failed"}


def _all_rows(**passed) -> list[dict]:
    rows = [{"check": c, "metric": m, "gated": True, "passed": passed.get(m, True)}
            for c, m in rc.REQUIRED]
    return rows + [{"check": "operator", "metric": "ours_select_ms", "gated": False,
                    "passed": None}]


def test_verdict_passes_only_what_was_measured() -> None:
    assert rc.verdict(_all_rows()) == {"passed": True, "failed": [], "missing": [],
                                       "unmeasured": []}
    got = rc.verdict(_all_rows(decode_tok_s=False))
    assert got["passed"] is False and got["failed"] == ["serving/decode_tok_s"]
    got = rc.verdict(_all_rows(output_ids=None))
    assert got["passed"] is None and got["unmeasured"] == ["greedy/output_ids"]
    got = rc.verdict([r for r in _all_rows() if r["check"] == "operator"])
    assert got["passed"] is None
    assert got["missing"] == ["serving/output_tok_s", "serving/decode_tok_s", "greedy/output_ids"]
    assert rc.verdict([])["passed"] is None
    # a failure decides even while other rows are missing
    assert rc.verdict([{"check": "operator", "metric": "ours_ms", "gated": True,
                        "passed": False}])["passed"] is False


# ----------------------------------------------------------------------------- two calls


def _doc(part: str, rows: list[dict], before: str = "b" * 40) -> dict:
    return {"commit": "c" * 40, "gpu": "NVIDIA H200", "before_commit": before,
            "after_commit": "c" * 40, "config": {part: {"x": 1}},
            "parts": {part: {"status": "measured"}}, "rows": rows}


def test_merge_joins_two_calls_and_takes_the_verdict_again() -> None:
    rows = _all_rows()
    op = _doc("operator", [r for r in rows if r["check"] == "operator"])
    sv = _doc("serving", [r for r in rows if r["check"] != "operator"])
    merged = rc.merge_docs([op, sv])
    assert merged["passed"] is True and len(merged["rows"]) == len(rows)
    assert set(merged["parts"]) == set(merged["config"]) == {"operator", "serving"}
    again = rc.merge_docs([merged, _doc("operator", [
        {"check": "operator", "metric": "ours_ms", "gated": True, "passed": False}])])
    assert again["passed"] is False and len(again["rows"]) == len(rows)  # replaced, not added
    with pytest.raises(ValueError, match="different things"):
        rc.merge_docs([op, _doc("serving", [], before="d" * 40)])


def test_a_warm_second_call_carries_the_first_calls_part() -> None:
    rows = _all_rows()
    state = {**_doc("operator", rows), "servers": {"before": {"healthy_s": 80}}}
    ident = ("b" * 40, "c" * 40, "NVIDIA H200")
    got = rc.carried_state(state, ident, ["serving"])
    assert {r["check"] for r in got["rows"]} == {"operator"}  # serving and greedy are redone
    assert got["parts"] == {"operator": {"status": "measured"}} and got["servers"] == {}
    assert rc.carried_state(state, ("x" * 40, *ident[1:]), ["serving"]) == {}
    assert rc.carried_state(None, ident, ["serving"]) == {}
    kept = rc.carried_state(state, ident, ["operator"])
    assert {r["check"] for r in kept["rows"]} == {"serving", "greedy"}
    assert kept["servers"] == {"before": {"healthy_s": 80}}


def test_merge_command_writes_the_results_file(tmp_path: Path,
                                               capsys: pytest.CaptureFixture) -> None:
    rows = _all_rows()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc("operator", [r for r in rows if r["check"] == "operator"])))
    b.write_text(json.dumps(_doc("serving", [r for r in rows if r["check"] != "operator"])))
    assert rc.main(["--merge", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "refactor_h200.json").read_text())
    assert doc["passed"] is True and doc["commit"] == "c" * 40 and doc["gpu"] == "NVIDIA H200"
    assert results_io.json_stamp(str(tmp_path / "out" / "refactor_h200.json")) == \
        ("c" * 7, "NVIDIA H200")
    assert "passed: True" in capsys.readouterr().out


def test_table_names_every_row() -> None:
    rows = rc.operator_rows({"before": [_op_row(0.5, 0.25)], "after": [_op_row(0.5, 0.25)]},
                            _args())
    rows.append(rc.greedy_row([_reply([1])], [_reply([1])], _args()))
    table = rc.format_table({"rows": rows, **rc.verdict(rows)})
    assert "ours_bound_ms" in table and "(info)" in table and "1/1" in table
    assert table.splitlines()[-1].startswith("passed: None; missing: serving/output_tok_s")


# ----------------------------------------------------------------------------- run.sh, export


def test_run_sh_has_the_refactor_step() -> None:
    text = (ROOT / "benchmarks/device/run.sh").read_text()
    assert "refactor) echo refactor ;;" in text
    assert "python3 benchmarks/refactor_compare.py --out \"$OUT\"" in text
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks/device/run.sh")]).returncode == 0


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_export_before_writes_only_the_code(tmp_path: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True,
                          text=True, check=True).stdout.strip()
    script = str(ROOT / "benchmarks/device/export_before.sh")
    for _ in range(2):  # again: replaced, the exclude line not doubled
        out = subprocess.run(["bash", script, head[:7]], cwd=clone, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    before = clone / ".before"
    assert (before / "COMMIT").read_text().strip() == head
    for path in ("sglang_ext/plugin.py", "kernels/sparse_decode.py", "patches/__init__.py",
                 "benchmarks/bench_operator.py", "benchmarks/results_io.py", "pyproject.toml"):
        assert (before / path).is_file(), path
    assert not any((before / p).exists() for p in ("tests", "docs", "benchmarks/results",
                                                   "benchmarks/accuracy", "README.md"))
    size = sum(p.stat().st_size for p in before.rglob("*") if p.is_file())
    assert size < 4 << 20, size
    exclude = (clone / ".git" / "info" / "exclude").read_text().splitlines()
    assert exclude.count("/.before/") == 1
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True,
                            text=True).stdout
    assert ".before" not in status
    bad = subprocess.run(["bash", script, "HEAD", "a/b"], cwd=clone, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and "one folder name" in bad.stderr
