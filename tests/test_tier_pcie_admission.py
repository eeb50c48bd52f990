"""The CPU tier admission's PCIe term (patches/scheduler.py, memory_tier/transfer_budget.py).

A request whose KV lives on the host fetches up to a bound of blocks per decode step; it is
admitted into decode only while the bounds of the host-homed requests, its own included, fit in
``--sparse-tier-pcie-gbps`` x ``--sparse-tier-step-ms``. Otherwise it waits in SGLang's queue
(``add_one_req`` answers ``OTHER``, nothing is dropped) and is admitted once running requests
finish. These tests replay that on a small pool with SGLang's admission stood in for, as
tests/test_tier_admission.py does; the last one runs real decode steps (Triton's interpreter)
and checks that the measured transfers stay within the prediction.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_policy import AddReqResult

from fake_backend import FakePrefillAdder, FakeReq
from sglang_ext import runtime
from sglang_ext.config import ConfigError, add_cli_args, build_config
from sglang_ext.memory_tier.tiered_pool import TieredKVPool, plan_layout
from sglang_ext.memory_tier.transfer_budget import (
    TransferBudget,
    blocks_per_step,
    request_bytes_per_step,
    step_budget_bytes,
)
from sglang_ext.patches import scheduler as sched

PS = 4
PROMPT = 64
SLOTS = 6
HEADS, DIM, LAYERS = 2, 8, 3


def _pool(gpu_tokens: int = PS, rows: int = 3) -> tuple[TieredKVPool, torch.Tensor]:
    """All KV on the host by default (page 0 alone is GPU-homed); room for three working sets."""
    layout = plan_layout(device_tokens=0, host_tokens=1024, page_size=PS, max_running_requests=3,
                         max_prefill_tokens=PROMPT + PS, num_slots=SLOTS, sink=PS, window=2 * PS,
                         side_tokens_per_token=1 / PS, gpu_tokens=gpu_tokens)
    pool = TieredKVPool(PS, torch.bfloat16, HEADS, DIM, LAYERS, "cpu", False, layout=layout,
                        mode="sync")
    req_to_token = torch.zeros((rows + 1, 2 * PROMPT), dtype=torch.int32)
    for row in range(1, rows + 1):  # each row its own pages, after the GPU-homed ones
        first = gpu_tokens + (row - 1) * 2 * PROMPT
        req_to_token[row] = torch.arange(first, first + 2 * PROMPT, dtype=torch.int32)
    pool.bind(req_to_token)
    return pool, req_to_token


def _req(row: int, prefix: torch.Tensor | None = None, **custom) -> SimpleNamespace:
    return FakeReq(prefix_indices=torch.zeros(0) if prefix is None else prefix,
                           origin_input_ids=list(range(PROMPT)), output_ids=[],
                           sampling_params=SimpleNamespace(max_new_tokens=8,
                                                           custom_params=custom or None),
                           req_pool_idx=row)


_Adder = FakePrefillAdder


def _admit(adder: FakePrefillAdder, req: FakeReq) -> AddReqResult:
    return adder.admit(req)


def _rows_handed_out(*reqs: SimpleNamespace) -> None:
    """What happens after get_new_batch_prefill: SGLang gave the batch's requests their rows."""
    sched.note_admitted_rows(SimpleNamespace(batch_to_run=SimpleNamespace(reqs=list(reqs))))


def _prefill_and_decode(pool: TieredKVPool, r2t: torch.Tensor, row: int) -> None:
    pool.prepare_extend(r2t, [row], [PROMPT], [0])
    pool.start_decoding(r2t, row)


def _start(pool: TieredKVPool, r2t: torch.Tensor, req: SimpleNamespace) -> AddReqResult:
    """One admission round for ``req``; admitted, it gets its row and decodes."""
    result = _admit(_Adder(), req)
    if result == AddReqResult.CONTINUE:
        _rows_handed_out(req)
        _prefill_and_decode(pool, r2t, req.req_pool_idx)
    return result


def _budget_of(pool: TieredKVPool, requests: float, locality_new_blocks: int = 0) -> None:
    """A PCIe term worth ``requests`` host-homed requests' transfers per 1 ms step."""
    bound = pool.request_step_bytes(locality_new_blocks)
    pool.configure_transfers(pcie_gbps=requests * bound / 1e6, step_ms=1.0,
                             locality_new_blocks=locality_new_blocks)


def test_the_arithmetic():
    assert step_budget_bytes(45.0, 20.0) == 900_000_000
    assert step_budget_bytes(0.0, 20.0) == 0  # no PCIe term
    assert blocks_per_step(246, 0) == 246  # no limit: the whole working set may turn over
    assert blocks_per_step(246, 61) == 62  # F new filter blocks + the one leaving the window
    assert blocks_per_step(4, 61) == 4
    # Qwen3-8B shape at block 16: 36 layers, 8 kv heads, K+V of 16 x 128 dims
    assert request_bytes_per_step(62, 8, 16 * 256 * 2, 36) == 146_276_352  # bf16
    assert request_bytes_per_step(62, 8, 16 * 256 * 1, 36) == 73_138_176  # fp8: half
    term = TransferBudget(step_bytes=100, request_bytes=60)
    assert term.fits(0, 60) and term.fits(40, 60) and not term.fits(41, 60)
    assert term.fits(0, 1000)  # a lone request always runs
    assert term.fits(1000, 0)  # a request that moves nothing is never held back
    assert TransferBudget(step_bytes=0, request_bytes=60).fits(10**12, 60)  # term off


def test_the_pool_predicts_a_host_homed_requests_transfers():
    pool, r2t = _pool()
    page_bytes = PS * 2 * DIM * 2  # K and V rows of a page, bf16
    assert pool.tier_page_bytes == page_bytes
    assert pool.request_step_bytes(0) == SLOTS * HEADS * page_bytes * LAYERS
    assert pool.request_step_bytes(2) == 3 * HEADS * page_bytes * LAYERS
    pool.configure_transfers(45.0, 20.0)
    assert pool.transfer_budget().step_bytes == 900_000_000
    pool.configure_transfers(0.0, 20.0)
    assert not pool.transfer_budget().enabled


def test_the_pcie_term_holds_a_host_homed_request_and_admits_it_later(monkeypatch):
    pool, r2t = _pool()
    monkeypatch.setattr(runtime.state(), "tier_pool", pool)
    _budget_of(pool, 1.5)  # one host-homed request's transfers fit, two do not
    bound = pool.request_step_bytes(0)
    a, b = _req(1), _req(2)
    adder = _Adder()
    assert _admit(adder, a) == AddReqResult.CONTINUE  # the idle pool: A is admitted
    assert sched.claims_of(adder).transfer == bound
    assert sched.admission_of(a).predicted == (bound, bound)
    _rows_handed_out(a)
    assert pool.predicted_load() == bound  # admitted, still to prefill: its prediction counts
    _prefill_and_decode(pool, r2t, 1)
    assert pool.predicted_load(decoding_only=True) == bound
    # while A decodes, B waits in the queue: the scratch and the working area would take it,
    # the PCIe term does not; refusing touches nothing, and B is counted once
    need, room = pool.admission_need(PROMPT), pool.admission_room()
    assert all(n <= r for n, r in zip(need, room))
    free_before = pool.work.available
    for _ in range(3):
        adder = _Adder()
        assert _admit(adder, b) == AddReqResult.OTHER and adder.can_run_list == []
    assert pool.pcie_holds == 1 and pool.work.available == free_before
    # A finishes: B is admitted
    pool.release_row(1, r2t)
    assert pool.predicted_load() == 0
    adder = _Adder()
    assert _admit(adder, b) == AddReqResult.CONTINUE and adder.can_run_list == [b]
    _rows_handed_out(b)
    _prefill_and_decode(pool, r2t, 2)
    pool.release_row(2, r2t)
    pool.check_idle()


def test_the_locality_limit_lets_more_requests_decode_within_the_same_budget(monkeypatch):
    pool, r2t = _pool()
    monkeypatch.setattr(runtime.state(), "tier_pool", pool)
    bound_unlimited = pool.request_step_bytes(0)
    limited = pool.request_step_bytes(1)  # 2 blocks per (layer, kv head) instead of SLOTS
    assert limited * 3 <= 1.5 * bound_unlimited
    pool.configure_transfers(pcie_gbps=1.5 * bound_unlimited / 1e6, step_ms=1.0,
                             locality_new_blocks=1)
    assert _start(pool, r2t, _req(1)) == AddReqResult.CONTINUE
    assert _start(pool, r2t, _req(2)) == AddReqResult.CONTINUE
    assert pool.predicted_load(decoding_only=True) == 2 * limited
    # a request that asks for no limit (custom_params.sparse) is predicted at its whole budget
    unlimited = _req(3, sparse={"method": "quest"})
    assert sched.request_new_blocks_limit(unlimited, 1) == 0
    assert _start(pool, r2t, unlimited) == AddReqResult.OTHER
    for row in (1, 2):
        pool.release_row(row, r2t)


def test_a_lone_request_runs_whatever_the_budget_and_no_term_holds_nothing(monkeypatch):
    pool, r2t = _pool()
    monkeypatch.setattr(runtime.state(), "tier_pool", pool)
    _budget_of(pool, 0.25)  # below one request's transfers
    assert _start(pool, r2t, _req(1)) == AddReqResult.CONTINUE  # nothing moving: it runs
    assert _start(pool, r2t, _req(2)) == AddReqResult.OTHER
    pool.configure_transfers(0.0, 20.0)  # --sparse-tier-pcie-gbps 0
    assert _start(pool, r2t, _req(2)) == AddReqResult.CONTINUE
    assert _start(pool, r2t, _req(3)) == AddReqResult.CONTINUE
    for row in (1, 2, 3):
        pool.release_row(row, r2t)
    pool.check_idle()


def test_requests_whose_pages_go_to_the_gpu_are_never_held_back(monkeypatch):
    """GPU-homed requests transfer nothing. Predicted without a device read when the GPU pages
    surely free cover the request and it has no prefix; with a radix prefix, by reading where
    the prefix lives, only when the budget would turn the request away."""
    gpu = 1024
    pool, r2t = _pool(gpu_tokens=gpu)
    monkeypatch.setattr(runtime.state(), "tier_pool", pool)
    _budget_of(pool, 1.0)
    busy = pool.request_step_bytes(0)
    pool.note_admitted(3, busy, busy)  # a host-homed request is running: the budget is full
    host = pool.layout.host_tokens
    plenty = gpu + host - PS  # every slot free (page 0 is reserved)
    assert _admit(_Adder(free_tokens=plenty), _req(1)) == AddReqResult.CONTINUE
    # no allocator to ask, or the GPU pages may be gone: host-homed, held
    assert _admit(_Adder(), _req(1)) == AddReqResult.OTHER
    assert _admit(_Adder(free_tokens=host + 4 * PS), _req(1)) == AddReqResult.OTHER
    # a radix prefix on the GPU (slots < G): GPU-homed; on the host: held
    on_gpu = torch.arange(PS, PS + 16, dtype=torch.int64)
    on_host = torch.arange(gpu, gpu + 16, dtype=torch.int64)
    assert _admit(_Adder(free_tokens=plenty), _req(1, on_gpu)) == AddReqResult.CONTINUE
    assert _admit(_Adder(free_tokens=plenty), _req(2, on_host)) == AddReqResult.OTHER
    # the row's prediction is replaced by what its pages are once its prompt is written
    req = _req(1)
    adder = _Adder(free_tokens=plenty)
    assert _admit(adder, req) == AddReqResult.CONTINUE
    assert sched.admission_of(req).predicted == (0, busy)
    _rows_handed_out(req)
    assert pool.predicted_row_bytes(1) == 0
    r2t[1] = torch.arange(PS, PS + 2 * PROMPT, dtype=torch.int32)  # GPU-homed pages
    _prefill_and_decode(pool, r2t, 1)
    assert pool.predicted_row_bytes(1) == 0
    pool.release_row(1, r2t)
    # mispredicted: its pages went to the host after all
    pool.note_admitted(1, 0, busy)
    r2t[1] = torch.arange(gpu, gpu + 2 * PROMPT, dtype=torch.int32)
    _prefill_and_decode(pool, r2t, 1)
    assert pool.predicted_row_bytes(1) == busy
    pool.release_row(1, r2t)


def test_the_stats_report_predicted_and_measured_bytes_per_step(monkeypatch):
    pool, r2t = _pool()
    monkeypatch.setattr(runtime.state(), "tier_pool", pool)
    _budget_of(pool, 2.0)
    _prefill_and_decode(pool, r2t, 1)
    for step in range(3):
        pos = PROMPT + step
        pool.map_decode_tokens(r2t, torch.tensor([1]), torch.tensor([pos + 1]),
                               r2t[1, pos:pos + 1].long())
    stats = pool.occupancy()
    bound = pool.request_step_bytes(0)
    assert stats["decode_steps"] == 3
    assert stats["predicted_bytes"] == 3 * bound
    assert stats["predicted_bytes_per_step"] == bound
    assert stats["predicted_bytes_per_step_now"] == bound
    assert stats["step_budget_bytes"] == pool.transfers.step_bytes
    assert stats["bytes_per_step"] == 0.0  # nothing was fetched (no block filter ran)
    assert stats["pcie_holds"] == 0
    pool.release_row(1, r2t)


def test_request_limits_follow_custom_params(monkeypatch):
    # requests are parsed against the server's config: a default one, whatever ran before
    monkeypatch.setattr(runtime.state(), "config", build_config())
    req = _req(1, sparse={"locality_blocks": 30, "eviction_score": "key_norm",
                          "locality_new_blocks": 4})
    assert sched.request_new_blocks_limit(req, 0) == 4
    assert sched.request_new_blocks_limit(_req(1, sparse={"method": "dense"}), 7) == 0
    assert sched.request_new_blocks_limit(_req(1), 7) == 7


@pytest.mark.parametrize("values, flag", [
    ({"tier_pcie_gbps": -1}, "--sparse-tier-pcie-gbps"),
    ({"tier_pcie_gbps": "fast"}, "--sparse-tier-pcie-gbps"),
    ({"tier_pcie_gbps": "inf"}, "--sparse-tier-pcie-gbps"),
    ({"tier_step_ms": 0}, "--sparse-tier-step-ms"),
    ({"tier_step_ms": "nan"}, "--sparse-tier-step-ms"),
])
def test_bad_values_name_the_flag_in_one_line(values, flag):
    with pytest.raises(ConfigError) as e:
        build_config(**values)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_the_flags_are_in_help_with_their_defaults():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    text = " ".join(parser.format_help().split())
    assert "--sparse-tier-pcie-gbps GBPS" in text and "Default: 0.0." in text
    assert "--sparse-tier-step-ms MS" in text and "Default: 20.0." in text
    cfg = build_config(tier_pcie_gbps="0", tier_step_ms="12.5")
    assert cfg.tier_pcie_gbps == 0.0 and cfg.tier_step_ms == 12.5


def test_measured_transfers_stay_within_the_prediction():
    """Real decode steps of the tier (the batched kernels, sync schedule) with the locality
    limit: after a request's first sparse step, which fills its working set, every step moves
    at most the predicted ``locality_new_blocks + 1`` blocks per (request, layer, kv head)."""
    from test_tier_decode_steps import SMALL, Run

    from sglang_ext.selection.reference import SelectionParams

    ps = SMALL.page_size
    params = SelectionParams("two_level", 24, ps, 3, SMALL.sink, SMALL.window, locality_blocks=1,
                             eviction_score="key_norm", locality_new_blocks=1)
    run = Run(params, "sync", prompt_lens=[45, 30], steps=10)
    pool = run.pool
    pool.configure_transfers(45.0, 20.0, locality_new_blocks=1)
    run.prefill()
    run.decode_step()  # the first sparse step fills the working sets
    first = pool.occupancy()
    per_step = []
    for _ in range(run.steps - 1):
        before = pool.tier.read_stats()["transferred_blocks"]
        run.decode_step()
        per_step.append(pool.tier.read_stats()["transferred_blocks"] - before)
    entries = len(run.rows) * SMALL.layers * SMALL.kv_heads
    assert max(per_step) <= blocks_per_step(pool.layout.num_slots, 1) * entries, per_step
    assert sum(per_step) > 0
    stats = pool.occupancy()
    assert stats["predicted_bytes_per_step_now"] == 2 * pool.request_step_bytes(1)
    moved = (stats["transferred_bytes"] - first["transferred_bytes"]) / (run.steps - 1)
    assert moved <= stats["predicted_bytes_per_step_now"]
    run.finish()


def test_metrics_export_predicted_and_measured_bytes_per_step():
    from prometheus_client import REGISTRY

    from sglang_ext.memory_tier.metrics import TierMetrics

    metrics = TierMetrics(page_bytes=1024)
    collectors = [c for c in vars(metrics).values() if hasattr(c, "_name")]
    collectors += list(metrics.coop.values())
    try:
        occupancy = dict(wanted_blocks=10, transferred_blocks=4, hit_rate=0.6, host_hit_rate=0.5,
                         work_pages_free=3, work_pages=8, requests_tiered=2, bytes_per_step=2048.0,
                         predicted_bytes_per_step=6144.0, predicted_bytes_per_step_now=8192,
                         step_budget_bytes=10_000, pcie_holds=2)
        metrics.update(occupancy)
        metrics.update(dict(occupancy, pcie_holds=3))
        value = lambda name: REGISTRY.get_sample_value("sglang_ext:tier_" + name)  # noqa: E731
        assert value("bytes_per_step") == 2048.0
        assert value("predicted_bytes_per_step") == 6144.0
        assert value("predicted_bytes_per_step_now") == 8192
        assert value("step_budget_bytes") == 10_000
        assert value("pcie_held_requests_total") == 3
    finally:
        for collector in collectors:
            REGISTRY.unregister(collector)
