"""Fluxion's cooperative attention (sglang_ext/memory_tier/cooperative.py): the log-sum-exp merge
is exact, the priority scheduler keeps the CPU off the critical path, and a layer attended by
GPU + CPU threads equals attention over the whole selection."""

from __future__ import annotations

import pytest
import torch

from sglang_ext.memory_tier.cooperative import (
    AttendScratch,
    CostModel,
    HostAttentionWorkers,
    PriorityScheduler,
    attend_blocks,
    attend_items,
    calibrate_cpu_cost,
    cooperative_attention,
    split_selection,
)
from sglang_ext.selection.reference import merge_attention_states

B, HKV, G, D, PS, BLOCKS = 3, 2, 3, 16, 4, 24
SCALING = D ** -0.5


def naive_attention(q, k, v, blocks):
    """Per (request, q head): softmax over the listed blocks' tokens, float64."""
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for b in range(q.shape[0]):
        for hq in range(q.shape[1]):
            h = hq // G
            ids = [int(x) for x in blocks[b, h] if x >= 0]
            tok = torch.tensor([p * PS + o for p in ids for o in range(PS)], dtype=torch.long)
            s = (k[h, tok].double() @ q[b, hq].double()) * SCALING
            out[b, hq] = torch.softmax(s, 0) @ v[h, tok].double()
    return out


@pytest.fixture
def kv():
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(HKV, BLOCKS * PS, D, generator=gen)
    v = torch.randn(HKV, BLOCKS * PS, D, generator=gen)
    q = torch.randn(B, HKV * G, D, generator=gen) * 2
    return q, k, v, gen


def random_selection(gen, k=8):
    return torch.stack([torch.stack([torch.randperm(BLOCKS, generator=gen)[:k]
                                     for _ in range(HKV)]) for _ in range(B)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_items_into_reused_buffers_gives_the_same_bits(kv, dtype):
    """The CPU workers' path (AttendScratch: gathers and scores in reused buffers) computes
    exactly what the fresh-tensor path does, across calls that grow and shrink the buffers and
    with padded (-1) blocks and an item that attends nothing."""
    q, k, v, gen = kv
    k, v = k.to(dtype), v.to(dtype)
    scratch = AttendScratch()
    for m in (5, 12, 3):
        n = 4
        q_items = q.reshape(-1, G, D)[:n].to(dtype)
        heads = torch.randint(0, HKV, (n,), generator=gen)
        blocks = torch.randint(0, BLOCKS, (n, m), generator=gen)
        blocks[0, -1] = -1
        blocks[1] = -1
        want = attend_items(q_items, k, v, heads, blocks, PS, SCALING)
        got = attend_items(q_items, k, v, heads, blocks, PS, SCALING, scratch=scratch)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.isneginf(got[1][1]).all() and (got[0][1] == 0).all()


def test_merge_of_disjoint_parts_equals_attention_over_the_union(kv):
    q, k, v, gen = kv
    selected = random_selection(gen)
    resident = torch.rand(B, HKV, BLOCKS, generator=gen) < 0.5
    part_a, part_b = split_selection(selected, resident)
    assert bool(((part_a >= 0) ^ (part_b >= 0)).all())  # every selected block in one part
    out_a, lse_a = attend_blocks(q, k, v, part_a, PS, SCALING)
    out_b, lse_b = attend_blocks(q, k, v, part_b, PS, SCALING)
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    whole, whole_lse = attend_blocks(q, k, v, selected, PS, SCALING)
    torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), naive_attention(q, k, v, selected), rtol=1e-4, atol=1e-5)


def test_merge_with_an_empty_side(kv):
    q, k, v, gen = kv
    selected = random_selection(gen)
    out, lse = attend_blocks(q, k, v, selected, PS, SCALING)
    empty_out, empty_lse = attend_blocks(q, k, v, torch.full_like(selected, -1), PS, SCALING)
    assert bool(torch.isneginf(empty_lse).all()) and bool((empty_out == 0).all())
    m_out, m_lse = merge_attention_states(out, lse, empty_out, empty_lse)
    assert torch.equal(m_out, out) and torch.equal(m_lse, lse)
    m_out, m_lse = merge_attention_states(empty_out, empty_lse, out, lse)
    assert torch.equal(m_out, out) and torch.equal(m_lse, lse)
    z_out, z_lse = merge_attention_states(empty_out, empty_lse, empty_out, empty_lse)
    assert bool((z_out == 0).all()) and bool(torch.isneginf(z_lse).all())


def check_plan(plan, resident, missing, cost, page_size):
    n = len(resident)
    on_cpu = [i for items in plan.cpu_items for i in items]
    assert len(on_cpu) == len(set(on_cpu))
    assert sorted(on_cpu + plan.fetched) == [i for i in range(n) if missing[i] > 0]
    assert sorted(plan.gpu_order) == list(range(n))
    gpu_work = [resident[i] + (0 if i in on_cpu else missing[i]) for i in range(n)]
    ordered = [gpu_work[i] for i in plan.gpu_order]
    assert ordered == sorted(ordered, reverse=True)  # the largest GPU work first
    assert plan.est_cpu_s <= plan.est_gpu_s + 1e-12  # the CPU is off the critical path
    for items in plan.cpu_items:  # one task per thread: one fixed cost, then its tokens
        busy = (cost.cpu_fixed_s if items else 0.0) + sum(missing[i] for i in items) * cost.cpu_s_per_token
        assert busy <= plan.est_gpu_s + 1e-12
    return on_cpu


def test_scheduler_keeps_cpu_work_off_the_critical_path():
    gen = torch.Generator().manual_seed(3)
    resident = torch.randint(0, 4096, (64,), generator=gen)
    missing = torch.randint(0, 512, (64,), generator=gen) * (torch.rand(64, generator=gen) < 0.7)
    cost = CostModel(gpu_s_per_token=1e-8, cpu_s_per_token=1e-6, fetch_s_per_block=2e-7,
                     cpu_fixed_s=1e-6)
    plan = PriorityScheduler(cost, cpu_threads=4).plan(resident, missing, 16)
    on_cpu = check_plan(plan, resident.tolist(), missing.tolist(), cost, 16)
    assert on_cpu and plan.fetched  # this load splits: the CPU takes some, not all
    # smallest miss sets first: everything on the CPU is no larger than anything fetched
    assert max(int(missing[i]) for i in on_cpu) <= min(int(missing[i]) for i in plan.fetched)


def test_scheduler_without_cpu_threads_or_with_a_slow_cpu_fetches_everything():
    resident = torch.tensor([100, 2000, 0, 50])
    missing = torch.tensor([64, 0, 128, 16])
    for threads, cost in ((0, CostModel()), (4, CostModel(cpu_s_per_token=1.0))):
        plan = PriorityScheduler(cost, threads).plan(resident, missing, 16)
        check_plan(plan, resident.tolist(), missing.tolist(), cost, 16)
        assert plan.fetched == [0, 2, 3] and not any(plan.cpu_items)
    with pytest.raises(ValueError):
        PriorityScheduler(CostModel(), -1)


def test_scheduler_gives_a_cpu_slower_than_modelled_less_work_then_none():
    """observe(): when the workers take longer than the plan's estimate, the scheduler scales
    its CPU costs up, so the CPU gets fewer miss sets; a much slower CPU soon gets none."""
    gen = torch.Generator().manual_seed(5)
    resident = torch.randint(1000, 4096, (64,), generator=gen)
    missing = torch.randint(16, 512, (64,), generator=gen)
    cost = CostModel(gpu_s_per_token=1e-8, cpu_s_per_token=1e-7, fetch_s_per_block=2e-7,
                     cpu_fixed_s=1e-6)
    sched = PriorityScheduler(cost, cpu_threads=4)
    counts = []
    for _ in range(8):
        plan = sched.plan(resident, missing, 16)
        counts.append(sum(len(items) for items in plan.cpu_items))
        sched.observe(plan, plan.est_cpu_s * 10)  # the CPU really took 10x the estimate
    assert counts[0] > 0 and counts[-1] == 0
    assert all(a >= b for a, b in zip(counts, counts[1:]))
    # an accurate estimate leaves the correction where it is
    steady = PriorityScheduler(cost, cpu_threads=4)
    plan = steady.plan(resident, missing, 16)
    steady.observe(plan, plan.est_cpu_s)
    assert steady.cpu_scale == pytest.approx(1.0)
    with pytest.raises(ValueError):
        PriorityScheduler(cost, 4, adapt=1.5)


def test_workers_report_their_time_and_calibration_is_positive(kv):
    q, host_k, host_v, gen = kv
    workers = HostAttentionWorkers(2)
    try:
        fixed, per_token = calibrate_cpu_cost(workers, host_k, host_v, G, PS, SCALING,
                                              items_per_thread=2, blocks_per_item=(2, 12),
                                              repeats=3)
        selected = random_selection(gen)
        plan = PriorityScheduler(CostModel(cpu_s_per_token=1e-12, cpu_fixed_s=0.0), 2).plan(
            torch.full((B * HKV,), 10_000), torch.full((B * HKV,), 8 * PS), PS)
        fut = workers.submit(q, host_k, host_v, selected, plan, PS, SCALING)
        out, lse = fut.result()
    finally:
        workers.close()
    assert fixed >= 0 and per_token >= 0 and fixed + per_token > 0
    assert fut.cpu_seconds > 0
    want, want_lse = attend_blocks(q, host_k, host_v, selected, PS, SCALING)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)  # every item went to the CPU
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cpu_cost", [1e-9, 2e-7, 1.0])  # CPU takes all, some, none
def test_cooperative_layer_equals_attention_over_the_selection(kv, cpu_cost):
    q, host_k, host_v, gen = kv
    selected = random_selection(gen, k=10)
    resident = torch.rand(B, HKV, BLOCKS, generator=gen) < 0.5
    dev_k, dev_v, dev_pages, fetch, fetched_blocks = _device_pool(gen, host_k, host_v, resident)
    cost = CostModel(gpu_s_per_token=1e-8, cpu_s_per_token=cpu_cost, fetch_s_per_block=1e-7,
                     cpu_fixed_s=0.0)
    workers = HostAttentionWorkers(2)
    try:
        out, lse, plan = cooperative_attention(
            q, dev_k, dev_v, dev_pages, host_k, host_v, selected, resident, PS, SCALING,
            PriorityScheduler(cost, 2), workers, fetch=fetch)
    finally:
        workers.close()
    want, want_lse = attend_blocks(q, host_k, host_v, selected, PS, SCALING)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    _, misses = split_selection(selected, resident)
    n_miss = int((misses >= 0).sum())
    on_cpu = sum(1 for items in plan.cpu_items for _ in items)
    if cpu_cost == 1.0:
        assert on_cpu == 0 and len(fetched_blocks) == n_miss
    elif cpu_cost == 1e-9:
        assert not fetched_blocks and on_cpu == int(((misses >= 0).sum(-1) > 0).sum())
    else:
        assert 0 < len(fetched_blocks) < n_miss


def test_scheduler_skips_planning_while_the_cpu_cannot_finish_inside_the_gpu(kv):
    """A plan costs a device sync per layer; while one CPU task's fixed cost exceeds the GPU's
    whole estimate it could only say "fetch everything", so the layer skips it (plan None), is
    still exact, fetches every miss, and plans again every reprobe_every-th call."""
    q, host_k, host_v, gen = kv
    slow_cpu = CostModel(gpu_s_per_token=1e-8, cpu_s_per_token=1e-7, fetch_s_per_block=1e-7,
                         cpu_fixed_s=1.0)
    sched = PriorityScheduler(slow_cpu, 2, reprobe_every=3)
    workers = HostAttentionWorkers(2)
    planned = []
    try:
        for _ in range(5):
            selected = random_selection(gen, k=10)
            resident = torch.rand(B, HKV, BLOCKS, generator=gen) < 0.5
            dev_k, dev_v, dev_pages, fetch, fetched = _device_pool(gen, host_k, host_v, resident)
            out, lse, plan = cooperative_attention(
                q, dev_k, dev_v, dev_pages, host_k, host_v, selected, resident, PS, SCALING,
                sched, workers, fetch=fetch)
            want, want_lse = attend_blocks(q, host_k, host_v, selected, PS, SCALING)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
            _, misses = split_selection(selected, resident)
            assert len(fetched) == int((misses >= 0).sum())
            if plan is not None:
                assert not any(plan.cpu_items)
            planned.append(plan is not None)
    finally:
        workers.close()
    assert planned == [True, False, False, True, False]  # the first call, then every 3rd skip
    # a CPU fast enough for the GPU's estimate is always planned; no threads, never
    fast = PriorityScheduler(CostModel(cpu_fixed_s=0.0), 2)
    fast.last_gpu_s = 1e-6
    assert all(fast.worth_planning() for _ in range(5))
    assert not PriorityScheduler(CostModel(), 0).worth_planning()
    with pytest.raises(ValueError):
        PriorityScheduler(CostModel(), 2, reprobe_every=0)


def _device_pool(gen, host_k, host_v, resident):
    """The device pool: resident blocks at scattered device pages; misses get pages when
    fetched (``fetch`` records them)."""
    pages = B * HKV * BLOCKS
    dev_k = torch.zeros(HKV, pages * PS, D)
    dev_v = torch.zeros(HKV, pages * PS, D)
    dev_pages = torch.full((B, HKV, BLOCKS), -1, dtype=torch.long)
    free = iter(torch.randperm(pages, generator=gen).tolist())

    def place(b, h, blk):
        p = next(free)
        dev_pages[b, h, blk] = p
        dev_k[h, p * PS:(p + 1) * PS] = host_k[h, blk * PS:(blk + 1) * PS]
        dev_v[h, p * PS:(p + 1) * PS] = host_v[h, blk * PS:(blk + 1) * PS]

    for b, h, blk in resident.nonzero().tolist():
        place(b, h, blk)
    fetched_blocks = []

    def fetch(misses):
        for b, h, j in (misses >= 0).nonzero().tolist():
            fetched_blocks.append(int(misses[b, h, j]))
            place(b, h, int(misses[b, h, j]))

    return dev_k, dev_v, dev_pages, fetch, fetched_blocks


def test_fluxion_benchmark_smoke_run(tmp_path):
    """benchmarks/bench_fluxion.py end to end at toy sizes on the CPU: its --check (cooperative
    output == plain output) passes and both configurations are written (times mean nothing)."""
    import json

    from benchmarks import bench_fluxion

    threads = torch.get_num_threads()  # the benchmark sets it to 1 for its worker threads
    try:
        rc = bench_fluxion.main(["--device", "cpu", "--contexts", "1024", "--batch", "2",
                                 "--layers", "2", "--budget", "256", "--steps", "2",
                                 "--cpu-threads", "2", "--check", "--out", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    data = json.loads((tmp_path / "fluxion_h200.json").read_text())
    assert [r["cooperative"] for r in data["rows"]] == ["off", "on"]
    on = data["rows"][1]
    assert on["cpu_blocks_per_step"] + on["fetched_blocks_per_step"] == \
        data["rows"][0]["fetched_blocks_per_step"]  # the same misses, split between CPU and fetch
    assert (tmp_path / "fluxion_h200.png").exists()
