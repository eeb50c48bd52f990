"""benchmarks/soak.py --merge on synthetic phase reports (no server): the merged report of the
two-phase GPU soak (benchmarks/device/soak_real.sh) sums the reliability keys, takes the twins
from the phase that ran them and keeps each phase's report with its server flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks.soak import merge_reports

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _report(requests: int, *, leaks=0, crashes=0, unexpected=(), tracebacks=0, bad_ok=True,
            twins=False, identical=None, launch="--sparse-budget 256", failures=()):
    report = {
        "requests": requests, "crashes": crashes, "leaks": leaks,
        "errors": {"unexpected": list(unexpected), "log_tracebacks": tracebacks,
                   "bad_inputs": [{"case": "not json", "expected": 400,
                                   "observed": 400 if bad_ok else 500, "ok": bad_ok}]},
        "config": {"launch": launch}, "failures": list(failures), "ok": not failures,
        "rows": [{"index": 0}],
    }
    if twins:
        report["dense_twin_agreement"] = {"prompts": 3, "top1_mean": 0.9, "by_length": {}}
        report["identical_when_dense"] = identical
    return report


def test_merge_sums_and_keeps_the_phases():
    load = _report(900, launch="--sparse-tier async --sparse-budget 256")
    twins = _report(150, leaks=0, twins=True, identical=True, launch="--sparse-budget 256")
    merged = merge_reports({"load": load, "twins": twins}, model="smollm2", commit="abc",
                           gpu="H200", note="why")
    assert merged["requests"] == 1050 and merged["crashes"] == 0 and merged["leaks"] == 0
    assert merged["errors"]["count"] == 0 and merged["ok"] and merged["failures"] == []
    assert merged["dense_twin_agreement"]["top1_mean"] == 0.9
    assert merged["identical_when_dense"] is True and merged["dense_twins_phase"] == "twins"
    assert merged["phases"]["load"]["server_flags"].startswith("--sparse-tier async")
    assert merged["phases"]["twins"]["report"] is twins
    assert [b["phase"] for b in merged["errors"]["bad_inputs"]] == ["load", "twins"]
    assert (merged["model"], merged["commit"], merged["gpu"], merged["note"]) == \
        ("smollm2", "abc", "H200", "why")


def test_merge_counts_every_failure_and_a_missing_phase():
    load = _report(500, leaks=2, crashes=1, unexpected=["request 3: HTTP 500"], tracebacks=1,
                   bad_ok=False, failures=["server log: 2 memory_leaks"])
    twins = _report(10, leaks=None, twins=True, identical=False)
    merged = merge_reports({"load": load, "twins": twins, "extra": None})
    assert merged["requests"] == 510 and merged["crashes"] == 1 and merged["leaks"] == 2
    assert merged["errors"]["unexpected"] == ["load: request 3: HTTP 500"]
    assert merged["errors"]["count"] == 3  # one unexpected, one traceback, one bad input
    assert merged["identical_when_dense"] is False and not merged["ok"]
    assert "load: server log: 2 memory_leaks" in merged["failures"]
    assert any(f.startswith("extra: no report") for f in merged["failures"])
    assert merged["phases"]["extra"] == {"server_flags": None, "report": None}


def test_merge_leaks_unknown_without_any_log():
    merged = merge_reports({"a": _report(1, leaks=None)})
    assert merged["leaks"] is None and merged["dense_twin_agreement"] is None
    assert merged["identical_when_dense"] is None


def test_merge_command_line(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report(3)))
    b.write_text(json.dumps(_report(4, twins=True, identical=True)))
    out = tmp_path / "merged.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "soak.py"), "--merge", f"load={a}",
         f"twins={b}", "--out", str(out), "--model", "smollm2", "--note", "n"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "SGLANG_EXT_COMMIT": "c1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    merged = json.loads(out.read_text())
    assert merged["requests"] == 7 and merged["commit"] == "c1" and merged["model"] == "smollm2"
    assert set(merged["phases"]) == {"load", "twins"} and merged["ok"]
