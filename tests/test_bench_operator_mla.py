"""The MLA operator benchmark's CPU-testable parts (benchmarks/bench_operator_mla.py): its
correctness check at tiny shapes in Triton's interpreter (ours and SGLang's own Triton MLA
decode against the MLA torch reference), that the check catches wrong wiring, and that its
rows merge into operator_h200.json without touching the MHA benchmark's rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import bench_operator
from benchmarks import bench_operator_mla as mla

cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="the interpreter check; the GPU runs --check at full shapes")
RESULTS = (Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "operator"
           / "operator_h200.json")


@cpu_only
def test_tiny_check_passes_with_ours_and_sglang_triton_mla():
    report = mla.run_check(**mla.tiny_check_setup())
    assert report.ok, report.lines
    # SGLang's kernel really ran (in the interpreter), not just ours
    assert report.covered == ["ours two_level", "ours quest", "triton"]
    assert report.notes == ["flashinfer_mla: not checked (CUDA only)"]


@cpu_only
def test_check_fails_on_wrong_rows_for_the_baseline(monkeypatch):
    """Every request's indices shifted by one slot (the wiring bug the check exists for)."""
    right = mla.flat_kv_indices

    def shifted(torch_, req_to_token, lens):
        indptr, indices = right(torch_, req_to_token, lens)
        return indptr, indices.roll(1)

    monkeypatch.setattr(mla, "flat_kv_indices", shifted)
    report = mla.run_check(**{**mla.tiny_check_setup(), "methods": ()})
    assert not report.ok and report.covered == ["triton"]


@cpu_only
def test_check_fails_when_ours_uses_another_scaling(monkeypatch):
    """Ours run with the layer's scaling doubled (e.g. (R + P)^-0.5 instead of
    layer.scaling) must not pass against the reference's."""
    right = mla.ours_decode

    def rescaled(torch_, q, k_buffer, shape, *args, **kw):
        wrong = mla.MLAShape(**{**mla.asdict(shape), "scaling": 2 * shape.scaling})
        return right(torch_, q, k_buffer, wrong, *args, **kw)

    monkeypatch.setattr(mla, "ours_decode", rescaled)
    report = mla.run_check(**{**mla.tiny_check_setup(), "methods": ("two_level",),
                              "baselines": ()})
    assert not report.ok and report.covered == ["ours two_level"]


@cpu_only
def test_sglang_kv_splits_heuristic_runs_as_on_the_gpu():
    """With a core count SGLang's get_num_kv_splits_triton runs (ragged requests get ragged
    splits); without one every request gets the maximum, as TritonAttnBackend does."""
    lens = torch.tensor([3000, 1500, 33], dtype=torch.int32)
    with mla.interpreter_runtime_loop_bounds():
        splits = mla.sglang_num_kv_splits(torch, lens, 16, 16, 256, 132).tolist()
    assert splits[0] > splits[1] > splits[2] >= 1 and splits[0] <= 256
    assert mla.sglang_num_kv_splits(torch, lens, 16, 16, 256, 0).tolist() == [256] * 3
    # SGLang's MLA cap: the next power of two of the SM count, at least the flag's value
    assert mla.sglang_mla_max_kv_splits(8, 132, 163840) == 256
    assert mla.sglang_mla_max_kv_splits(8, 0, 163840) == 8


def test_model_shape_is_deepseek_v2_lite_with_sglang_scaling():
    shape = mla.model_shape()
    assert (shape.num_q_heads, shape.kv_lora_rank, shape.rope_dim, shape.row_dim) == \
        (16, 512, 64, 576)
    # (qk_nope 128 + qk_rope 64)^-0.5 times YaRN's mscale^2 (factor 40, mscale_all_dim 0.707)
    mscale = 0.1 * 0.707 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert shape.scaling == pytest.approx(192 ** -0.5 * mscale ** 2, rel=1e-6)
    assert shape.context_len == 163840 and shape.config_kv_heads == 16


def _mla_result(ms: dict[str, float], contexts: list[int], commit: str) -> dict[str, Any]:
    rows = []
    for context in contexts:
        timed = {name: (value, "graph") for name, value in ms.items()}
        rows += mla.case_rows(context, 8, 2048, timed, {}, {}, commit, "NVIDIA H200",
                              floor_bytes_=123)
    return {"commit": commit, "gpu": "NVIDIA H200", "mla_config": {"budget": 2048}, "rows": rows}


def test_rows_merge_keeps_the_mha_rows(tmp_path: Path):
    path = tmp_path / "operator_h200.json"
    # the MHA benchmark's file as it is before any MLA run (the repo's also holds MLA rows)
    original = json.loads(Path(RESULTS).read_text())
    original["rows"] = [r for r in original["rows"] if "model" not in r]
    path.write_text(json.dumps(original))

    first = _mla_result({"ours": 0.5, "triton": 2.0, "flashinfer_mla": 1.0}, [32768, 65536], "c1")
    mla.write_rows(str(path), first)
    second = _mla_result({"ours": 0.25, "triton": 2.0}, [65536, 131072], "c2")
    mla.write_rows(str(path), second)
    merged = json.loads(path.read_text())

    mha = [r for r in merged["rows"] if "model" not in r]
    assert len(mha) == len(original["rows"])
    for got, old in zip(mha, original["rows"]):
        # unchanged, and still saying which commit and GPU measured them
        assert got == {"commit": original["commit"], "gpu": original["gpu"], **old}
    assert merged["config"] == original["config"]  # the MHA run's settings stay
    assert merged["commit"] == "c2" and merged["mla_config"] == {"budget": 2048}

    ours = {(r["context"], r["commit"]): r for r in merged["rows"]
            if r.get("model") == mla.MODEL and r["operator"] == "ours"}
    # 65k replaced by the second run, 32k kept from the first, 128k added
    assert sorted(ours) == [(32768, "c1"), (65536, "c2"), (131072, "c2")]
    assert ours[(65536, "c2")]["speedup_vs_triton"] == 8.0
    assert ours[(65536, "c2")]["speedup_vs_flashinfer_mla"] is None
    assert ours[(32768, "c1")]["speedup_vs_flashinfer_mla"] == 2.0
    # a case is replaced whole: the first run's flashinfer_mla row of 65k is gone too
    cases = sorted((r["context"], r["operator"], r["commit"]) for r in merged["rows"]
                   if r.get("model"))
    assert cases == [(32768, "flashinfer_mla", "c1"), (32768, "ours", "c1"),
                     (32768, "triton", "c1"), (65536, "ours", "c2"), (65536, "triton", "c2"),
                     (131072, "ours", "c2"), (131072, "triton", "c2")]

    # and the MHA benchmark writing afterwards keeps the MLA rows
    mha_result = {"commit": "c3", "gpu": "NVIDIA H200", "config": {"x": 1},
                  "rows": [{"context": 32768, "batch": 1, "ours_ms": 1.0}]}
    bench_operator.write_result(str(path), mha_result)
    after = json.loads(path.read_text())
    assert [r for r in after["rows"] if "model" not in r] == mha_result["rows"]
    assert [r for r in after["rows"] if r.get("model")] == \
        [r for r in merged["rows"] if r.get("model")]
    assert after["mla_config"] == {"budget": 2048} and after["config"] == {"x": 1}


def test_plot_of_mla_rows(tmp_path: Path):
    result = _mla_result({"ours": 0.5, "triton": 2.0, "floor": 0.1}, [32768, 65536], "c1")
    result["mla_config"] = {"budget": 2048, "method": "two_level",
                            "shape": mla.asdict(mla.model_shape())}
    mla.plot(result, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000
