"""The long-generation check (benchmarks/accuracy/longgen.py): its helpers, and ``--quick`` end
to end on the real model (SmolLM2-135M on the CPU).

The quick run decodes 96 tokens teacher-forced and free-running under two_level@32 with and
without the guard, plus a budget above the whole context, which must reproduce dense exactly:
that is the check that the harness compares like with like.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_utils import MODEL_DIR, REPO

sys.path.insert(0, REPO)

from benchmarks.accuracy import longgen as LG  # noqa: E402


def test_helpers():
    assert LG.repetition_rate([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4]) == pytest.approx(1 - 4 / 9)
    assert LG.repetition_rate([1, 2, 3]) == 0.0
    assert LG.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert LG.first_divergence([1, 2], [1, 2]) is None
    rows = [{"position": 0, "nll_gap": 0.01, "top1_agree": 1.0},
            {"position": 64, "nll_gap": 0.2, "top1_agree": 0.95},
            {"position": 128, "nll_gap": 0.0, "top1_agree": 0.5}]
    assert LG.drift_onset(rows, 0.1, 0.9) == 64
    assert LG.drift_onset(rows[:1], 0.1, 0.9) is None
    p = LG.selection_params(LG.Setting("two_level", 64, False), 4, 16, 64)
    assert (p.sink, p.window, p.budget) == (8, 16, 64)  # shrunk like the accuracy suite's


def test_quick_run(tmp_path):
    if not os.path.exists(os.path.join(MODEL_DIR, "model.safetensors")):
        pytest.skip(f"no model at {MODEL_DIR} (make model)")
    out = tmp_path / "longgen.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.accuracy.longgen", "--quick", "--model-path",
         MODEL_DIR, "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (tmp_path / "longgen.png").stat().st_size > 0
    assert doc["config"]["tokens"] == 96 and doc["commit"]
    rows = doc["rows"]
    for r in rows:
        assert set(r) == {"method", "budget", "guard", "position", "nll_gap", "top1_agree"}
        assert 0.0 <= r["top1_agree"] <= 1.0
    by = {(s["method"], s["budget"], s["guard"]): s for s in doc["summary"]}
    assert set(by) == {("two_level", 32, "off"), ("two_level", 32, "on"),
                       ("two_level", 4096, "off")}
    # a budget above the context is dense: no gap, full agreement, the same free-running text
    same = by[("two_level", 4096, "off")]
    assert abs(same["mean_nll_gap"]) < 1e-4 and same["mean_top1_agree"] == 1.0
    assert same["first_divergence"] is None and same["drift_onset"] is None
    # at budget 32 over a ~250-token context the selection leaves out real mass: a real gap
    sparse = by[("two_level", 32, "off")]
    assert sparse["mean_nll_gap"] > 1e-3 and sparse["guard_probes"] == 0
    guarded = by[("two_level", 32, "on")]
    assert guarded["guard_probes"] > 0
    assert 32 <= guarded["guard_final_budget"] <= 128
