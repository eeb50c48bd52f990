"""The soak driver (benchmarks/soak.py) on the CPU: a real SGLang server with the real model,
our backend and the CPU tier (sync, 1024 KV slots on the device, per-step verification), under
concurrent streaming requests of mixed lengths, aborts (client disconnect and /abort_request),
shared prefixes, a reference subset checked against the idle server's outputs, a subset checked
against a dense-attention server's (SGLang's torch_native), dense twins (the same prompt again
with ``custom_params.sparse.method = dense`` on the same server) and the sweep of bad inputs. It
must report no failure: no errors, no mismatches, the expected 400 for every bad input, within-
budget prompts identical to their dense twins, no traceback, leak or scheduler crash in the
server's log, healthy afterwards. The twins' agreement beyond the budget is measured, not
asserted."""

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
    f"--sparse-tier sync --sparse-tier-gpu-tokens 1024 --sparse-tier-host-gb 0.5 --enable-metrics "
    f"--sparse-tier-timing on"
)


# The dense reference: SGLang's own torch_native attention, same model and paging.
DENSE_SERVER = (
    f"--model-path {MODEL_DIR} --device cpu --max-total-tokens 16384 --sleep-on-idle "
    f"--attention-backend torch_native --page-size 4 --max-running-requests 4"
)


def test_soak_on_cpu(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "soak.py"), "--launch", SERVER,
         "--port", str(free_port()), "--out", str(out), "--requests", "16", "--concurrency", "4",
         "--lengths", "64", "300", "900", "1800", "--max-new-tokens", "16", "--reference", "3",
         "--abort-frac", "0.2", "--time-limit", "600",
         # prompts + 16 new tokens within the 256-token budget: our decode attends every token
         "--dense-launch", DENSE_SERVER, "--dense-reference", "2", "--dense-lengths", "100", "160",
         # after the load: 2 prompts beyond the 256-token budget and 2 within it, each run alone
         # sparse and dense on the same server, 8 greedy tokens compared
         "--dense-twins", "2", "--dense-twins-within", "2", "--twin-tokens", "8"],
        capture_output=True, text=True, timeout=1200,
        env=server_env({"SGLANG_EXT_TIER_VERIFY": "2"}),
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0 and report.get("ok"), (report.get("failures"), proc.stderr[-3000:])
    assert report["completed"] + report["aborted"] == 16
    # 20 % of the 11 requests that are not references, exactly (rounded)
    assert report["aborted"] == 2 and report["kinds"]["abort-client"] == 1
    assert report["reference_checked"] == 3 and report["dense_reference_checked"] == 2
    assert report["server_log"]["retractions"] == 0
    assert report["max_prompt_tokens"] > 1024  # some requests live mostly on the host
    assert all(m["ok"] for m in report["malformed"])
    # the reliability issue's top-level keys
    assert report["crashes"] == 0 and report["leaks"] == 0
    assert report["errors"]["unexpected"] == [] and report["errors"]["log_tracebacks"] == 0
    bad = report["errors"]["bad_inputs"]
    assert len(bad) == len(report["malformed"]) and all(b["ok"] for b in bad)
    assert all(b["observed"] == b["expected"] == 400 for b in bad if not b.get("skipped"))
    phases = report["requests_by_phase"]
    assert report["requests"] == sum(phases.values())
    assert phases["load"] == 16 and phases["idle_references"] == 3 and phases["dense_twins"] == 8
    # dense twins: agreement measured beyond the budget, identity within it
    agreement = report["dense_twin_agreement"]
    assert agreement["prompts"] == 2 and 0.0 <= agreement["top1_mean"] <= 1.0
    assert 0.0 <= agreement["sequence_match_rate"] <= 1.0
    assert sum(b["prompts"] for b in agreement["by_length"].values()) == 2
    assert all(r["prompt_tokens"] > 256 and r["tokens"] == 8 for r in agreement["rows"])
    assert report["dense_twins"]["within_budget"]["prompts"] == 2
    assert report["identical_when_dense"] is True
    assert report["healthy_after"]
    assert report["server_log"]["memory_leaks"] == 0
    assert report["metrics_during"].get("sglang_ext:tier_working_area_pages", 0) > 0
    # --sparse-tier-timing exports its counters (the CPU's reference decode reads the host
    # store directly, so they stay at 0 here; tests/test_memory_tier.py -k timing covers them)
    assert "sglang_ext:tier_transfer_seconds_total" in report["metrics_after"]
