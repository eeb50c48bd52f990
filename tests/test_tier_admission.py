"""The CPU tier's prefill admission (patches/scheduler.py, ``TieredPool.admission_room``).

An extend batch that touches host-homed pages attends through the pool's extend scratch, sized
for one whole prompt plus one prefill batch; a second request whose prefix is a radix hit on
host pages brings that whole prefix into the batch. Admitted beside a long prompt still being
prefilled, it would overflow the scratch (on the H200 the same sequence, when prompts were
staged in the working area, crashed the scheduler at 128k). These tests replay that sequence on
a small pool: without the admission check the batch does not fit, with it the second request
waits until the first one's prompt is done, then fits; a working set per running request is
the other bound.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.managers.schedule_policy import AddReqResult

from fake_backend import FakePrefillAdder, FakeReq
from sglang_ext import runtime
from sglang_ext.memory_tier.tiered_pool import TieredKVPool, plan_layout
from sglang_ext.patches import scheduler as sched

PS = 4
PROMPT = 64  # tokens of each long prompt (16 pages)
SLOTS = 6  # working-set slots per request


def _pool() -> tuple[TieredKVPool, torch.Tensor]:
    layout = plan_layout(device_tokens=0, host_tokens=1024, page_size=PS, max_running_requests=2,
                         max_prefill_tokens=PROMPT + PS, num_slots=SLOTS, sink=PS, window=2 * PS,
                         side_tokens_per_token=1 / PS, gpu_tokens=PS)  # all KV on the host
    pool = TieredKVPool(PS, torch.bfloat16, 1, 8, 1, "cpu", False, layout=layout, mode="sync")
    req_to_token = torch.zeros((3, 2 * PROMPT), dtype=torch.int32)
    # row 1: request A's pages; row 2: request B's, whose first 48 tokens are a radix hit on
    # pages an earlier request left on the host
    req_to_token[1] = torch.arange(PS, PS + 2 * PROMPT, dtype=torch.int32)
    req_to_token[2] = torch.arange(PS + 2 * PROMPT, PS + 4 * PROMPT, dtype=torch.int32)
    pool.bind(req_to_token)
    return pool, req_to_token


def _req(r2t: torch.Tensor, row: int, prefix: int) -> SimpleNamespace:
    return FakeReq(prefix_indices=r2t[row, :prefix].long(),
                           origin_input_ids=list(range(PROMPT)), output_ids=[])


_Adder = FakePrefillAdder


def _admit(adder: FakePrefillAdder, req: FakeReq) -> AddReqResult:
    return adder.admit(req)


def test_without_admission_a_host_prefix_beside_a_long_prompt_overflows_the_scratch():
    """The H200 sequence: A's whole prompt and B's (its 48-token host prefix and the rest) in
    one prefill batch."""
    pool, r2t = _pool()
    with pytest.raises(RuntimeError, match="does not fit in the extend scratch"):
        pool.prepare_extend(r2t, [1, 2], [PROMPT, PROMPT], [0, 48])


def test_admission_holds_the_second_prompt_until_the_first_ones_is_done(monkeypatch):
    pool, r2t = _pool()
    monkeypatch.setattr(runtime.state(), "tier_pool", pool)
    a, b = _req(r2t, 1, 0), _req(r2t, 2, 48)
    # in one round, A is admitted on the idle pool and B is not: the adder counts A's claim
    adder = _Adder()
    assert _admit(adder, a) == AddReqResult.CONTINUE
    assert sched.claims_of(adder).pages == pool.admission_need(PROMPT)
    assert _admit(adder, b) == AddReqResult.OTHER and adder.can_run_list == [a]
    # while A is chunk-prefilled (16 of its tokens done), B still waits; refusing touches nothing
    pool.prepare_extend(r2t, [1], [16], [0])
    monkeypatch.setattr(runtime.state(), "chunked_req", a)
    free_before = pool.work.available
    assert _admit(_Adder(), b) == AddReqResult.OTHER
    assert pool.work.available == free_before
    # A's prompt is done (it has not decoded yet): B fits, and everything it takes is there
    monkeypatch.setattr(runtime.state(), "chunked_req", None)
    pool.prepare_extend(r2t, [1], [PROMPT], [16])
    assert _admit(_Adder(), b) == AddReqResult.CONTINUE
    pool.prepare_extend(r2t, [2], [PROMPT], [48])
    pool.start_decoding(r2t, 2)
    # two requests hold or will hold a working set: a third waits for the working area
    short = FakeReq(prefix_indices=r2t[2, :0].long(), origin_input_ids=[0] * 4,
                            output_ids=[])
    assert pool.admission_room()[1] < pool.admission_need(4)[1]
    assert _admit(_Adder(), short) == AddReqResult.OTHER
    for row in (1, 2):
        pool.release_row(row, r2t)
    pool.check_idle()
    assert _admit(_Adder(), short) == AddReqResult.CONTINUE


def test_the_chunk_prefilled_requests_prompt_is_reserved(monkeypatch):
    """A request mid-way through a chunked prefill brings its prefix and next chunk into every
    batch until its prompt is done: its whole prompt is reserved in the scratch, so a short
    request fits beside it and a long one does not."""
    pool, r2t = _pool()
    monkeypatch.setattr(runtime.state(), "tier_pool", pool)
    chunked = _req(r2t, 1, 16)  # 16 of its 64 tokens prefilled
    pool.prepare_extend(r2t, [1], [16], [0])
    room = pool.admission_room()
    assert pool.admission_room(PROMPT)[0] == room[0] - PROMPT // PS - 1
    monkeypatch.setattr(runtime.state(), "chunked_req", chunked)
    short = FakeReq(prefix_indices=r2t[2, :0].long(), origin_input_ids=[0] * 4,
                            output_ids=[])
    assert pool.admission_need(4)[0] <= pool.admission_room(PROMPT)[0]
    assert _admit(_Adder(), short) == AddReqResult.CONTINUE
    long = _req(r2t, 2, 0)
    assert pool.admission_need(PROMPT)[0] > pool.admission_room(PROMPT)[0]
    assert _admit(_Adder(), long) == AddReqResult.OTHER


def test_the_hook_is_inert_without_a_tier(monkeypatch):
    monkeypatch.setattr(runtime.state(), "tier_pool", None)
    adder = _Adder()
    req = FakeReq(prefix_indices=torch.zeros(0), origin_input_ids=[1], output_ids=[])
    assert _admit(adder, req) == AddReqResult.CONTINUE and adder not in runtime.state().side_tables
