"""The tier projection's arithmetic (benchmarks/tier_projection.py, docs/tier-projection.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks import tier_projection as tp
from benchmarks.tier_projection import GIB, Model, parse_size, project, untiered

# Round numbers: 1,000 bytes of KV per token, 1,000-token requests (1 MB each), a GPU holding
# 10 of them, no working sets, 4 ms of GEMMs and 1 ms of attention per request, and no HBM
# floor.
TOY = Model(layers=1, kv_heads=1, head_dim=500, kv_bytes=1.0, context=1000,
            gpu_gib=10e6 / GIB, mem_fraction=1.0, weights_gb=0.0, gpu_overhead_gb=0.0,
            host_pin_fraction=1.0, working_set_tokens=0, gemm_ms=4.0, attn_ms_per_request=1.0,
            pcie_bytes_per_request=1e6, pcie_gbps=0.5, budget=0, summary_bytes=0.0,
            allreduce_ms=0.5)


def test_the_defaults_reproduce_the_measured_untiered_fp8_server():
    m = Model()
    assert m.kv_bytes_per_token == 36 * 8 * 128 * 2  # fp8: one byte per value
    assert m.request_kv_bytes == pytest.approx(9.66e9, rel=1e-3)
    assert m.gpu_kv_bytes(1) / 1e9 == pytest.approx(105.0, abs=0.1)  # e2e_h200.json's row
    base = untiered(m, 1)
    assert base["requests"] == 10 and base["step_ms"] == pytest.approx(9.34, abs=0.01)
    # the admission's bound: 62 blocks x 8 kv heads x 4 KiB (fp8 K+V of 16 tokens) x 36 layers
    assert m.pcie_bound_bytes_per_request == 73_138_176
    assert m.pcie_bytes_per_request <= m.pcie_bound_bytes_per_request  # measured within it
    # TP=2: twice the GPUs, half the weights each
    assert m.gpu_kv_bytes(2) == pytest.approx(2 * (m.gpu_kv_bytes(1) + 8.2e9))


def test_sizes_parse():
    assert parse_size("128GiB") == 128 * GIB
    assert parse_size("1TB") == 1e12 and parse_size("2 tb") == 2e12
    with pytest.raises(ValueError):
        parse_size("lots")


def test_the_pcie_term_admits_host_homed_requests_while_their_transfers_fit_the_step():
    # 2 ms of transfers per host-homed request against 1 ms more compute: h <= 14, all 5 fit
    row = project(TOY, 5e6, 1)
    assert (row["gpu_homed"], row["host_homed"], row["requests_decoding"]) == (10, 5, 15)
    assert row["step_ms"] == 19.0 and row["transfer_ms"] == 10.0
    assert row["bytes_per_step"] == 5e6 and row["tok_s"] == pytest.approx(15 / 19e-3, abs=0.1)
    assert row["bound"] == "attention"  # 15 ms of attention beside 4 ms of GEMMs
    assert row["physical_limit"] == 15.0 and row["decoding_vs_limit"] == 1.0
    assert untiered(TOY, 1) == {"tp": 1, "requests": 10, "step_ms": 14.0, "tok_s": 714.3}
    assert row["tok_s_vs_untiered"] == pytest.approx(789.5 / 714.3, abs=0.01)
    # a slow link, 10 ms per request: 10 h <= 14 + h holds for one; the other four wait
    slow = Model(**{**TOY.__dict__, "pcie_gbps": 0.1})
    row = project(slow, 5e6, 1)
    assert (row["host_homed"], row["host_homed_waiting"], row["step_ms"]) == (1, 4, 15.0)
    assert row["bound"] == "pcie"
    # without the term all five decode and the step is the transfers'
    row = project(slow, 5e6, 1, term=False)
    assert (row["host_homed"], row["step_ms"], row["tok_s"]) == (5, 50.0, 300.0)
    assert row["bound"] == "pcie"
    # slower still: a lone host-homed request runs anyway
    assert project(Model(**{**TOY.__dict__, "pcie_gbps": 0.01}), 5e6, 1)["host_homed"] == 1


def test_gemm_and_hbm_bounds():
    few = Model(**{**TOY.__dict__, "gemm_ms": 40.0})
    assert project(few, 1e6, 1)["bound"] == "gemm"
    # an HBM floor above the measured attention: 1 MB per request at 0.1 GB/s = 10 ms each
    floor = Model(**{**TOY.__dict__, "budget": 1000, "hbm_tbps": 1e-4})
    row = project(floor, 0.0, 1)
    assert row["hbm_ms"] == 100.0 and row["bound"] == "hbm" and row["step_ms"] == 104.0


def test_tensor_parallel_splits_gemms_attention_and_transfers():
    assert tp.gemm_ms(TOY, 2) == 4.0 / 2 + 0.5
    assert tp.attention_ms(TOY, 10, 2) == (5.0, 0.0)
    assert tp.transfer_ms(TOY, 4, 2) == 4.0  # each rank moves half over its own link
    row = project(TOY, 5e6, 2)
    assert row["gpu_homed"] == 20 and row["host_homed"] == 5
    assert row["step_ms"] == 2.5 + 25 / 2


def test_working_sets_take_gpu_memory_from_every_request():
    m = Model(**{**TOY.__dict__, "working_set_tokens": 100})  # 0.1 MB each
    assert tp.split(m, 10e6, 0) == 9  # 10 MB / 1.1 MB
    assert tp.split(m, 10e6, 5) == 8  # five host-homed working sets take 0.5 MB


def test_from_results_reads_the_measured_costs(tmp_path):
    rows = [
        {"backend": "sglang_ext_tier_locality", "input_len": 131072, "concurrency": 2,
         "config": "--sparse-tier async --sparse-tier-gpu-tokens 16 "
                   "--sparse-locality-new-blocks 61",
         "tier_stats": {"decode_steps": 100, "transferred_bytes": 100 * 200e6,
                        "requests_tiered": 2}},
        {"backend": "sglang_ext_fi_fp8s_fp8kv", "input_len": 131072, "device_kv_gb": 100.0,
         "config": "--kv-cache-dtype fp8_e4m3",
         "decode_profile": {"step_ms": 10.0, "running": 8, "categories": {"gemm": 4.0}}},
    ]
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"rows": rows}))
    m = tp.from_results(Model(), [str(path)])
    assert m.pcie_bytes_per_request == 50e6  # 200 MB over 2 requests, halved for fp8
    assert m.gemm_ms == 4.0 and m.attn_ms_per_request == 0.75
    assert m.gpu_kv_bytes(1) / 1e9 == pytest.approx(100.0)
    assert "halved for fp8" in m.provenance["pcie_bytes_per_request"]


def test_the_cli_writes_a_json(tmp_path):
    out = tmp_path / "p.json"
    assert tp.main(["--out", str(out), "--no-plot", "--hosts", "128GiB,1TB", "--tp", "1",
                    "--pcie-gbps", "60"]) == 0
    result = json.loads(out.read_text())
    assert [r["host_gb"] for r in result["rows"]] == [137.4, 1000.0, 137.4, 1000.0]
    assert result["model"]["pcie_gbps"] == 60.0
    assert result["provenance"]["pcie_gbps"] == "command line"
    assert tp.main(["--out", str(out), "--no-plot", "--tp", "1", "--use-bound"]) == 0
    result = json.loads(out.read_text())
    assert result["model"]["pcie_bytes_per_request"] == 73_138_176
    help_text = subprocess.run([sys.executable, tp.__file__, "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert "--from-results FILE" in help_text and "--pcie-gbps" in help_text
