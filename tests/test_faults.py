"""The fault table (benchmarks/faults.py) on the CPU: the real SmolLM2 server with our backend
and the CPU tier (sync, 1024 KV slots on the device, a 0.1 GB host tier, so a few prompts fill
the pool), the tier's idle page check on (SGLANG_EXT_TIER_VERIFY=1). Every fault must get its
expected outcome: malformed custom_params.sparse, out-of-vocabulary ids and a prompt past the
context are 400s with the server alive; prompts beyond the pool wait and complete; aborts during
the tier's transfers leave no leak; SIGTERM during decode drains and exits without a leak or
crash line; a host tier larger than the machine and a label file of another model stop the
start-up in one line. The GPU runs the same script (benchmarks/device/soak_real.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_utils import LABELS, MODEL_DIR, REPO, free_port, server_env

pytestmark = pytest.mark.server

SERVER = (
    f"--model-path {MODEL_DIR} --device cpu --max-total-tokens 16384 --sleep-on-idle "
    f"--attention-backend sglang_ext --sparse-budget 256 --sparse-block-size 4 "
    f"--sparse-label-config {LABELS} --page-size 4 --max-running-requests 4 "
    f"--sparse-tier sync --sparse-tier-gpu-tokens 1024 --sparse-tier-host-gb 0.1"
)


def test_fault_table_on_cpu(tmp_path):
    out = tmp_path / "faults_cpu.json"
    port = free_port()
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "faults.py"), "--launch", SERVER,
         "--port", str(port), "--out", str(out), "--abort-prompt-tokens", "2048",
         "--sigterm-decode-tokens", "96", "--exit-timeout", "90", "--refusal-timeout", "240"],
        capture_output=True, text=True, timeout=600, env=server_env(),
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    rows = {r["fault"]: r for r in report.get("rows", [])}
    assert set(rows) == {
        "malformed_sparse", "input_ids_outside_vocabulary", "longer_than_context",
        "host_tier_full", "abort_during_prefetch", "sigterm_during_decode",
        "host_memory_too_big", "label_file_for_another_model"}, (proc.stdout, proc.stderr[-3000:])
    failed = {k: r["observed"] for k, r in rows.items() if not r["passed"]}
    assert not failed and proc.returncode == 0 and report["passed"], failed
    for r in rows.values():
        assert set(r) >= {"fault", "expected", "observed", "passed", "test"}
        assert r["test"].startswith("tests/test_")
    assert "outside the vocabulary" in rows["input_ids_outside_vocabulary"]["observed"]
    assert "longer than the model's context length" in rows["longer_than_context"]["observed"]
    assert "sglang_ext: --sparse-tier-host-gb" in rows["host_memory_too_big"]["observed"]
    assert "sglang_ext: --sparse-label-config" in rows["label_file_for_another_model"]["observed"]
