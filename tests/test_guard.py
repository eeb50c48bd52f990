"""The accuracy guard (sglang_ext/selection/guard.py, kernels/guard_probe.py, the backend).

* the rule: doubles below the low recall, halves after PATIENCE high probes, stays in range;
* per-request top-k sizes in the batched kernels select what the widened params select;
* the probe kernel's recall equals exp(lse_selected - lse_dense) from the torch reference, and
  does nothing on non-probe steps;
* through the backend's decode (reference path): a constructed case whose attention mass sits
  on more tokens than the budget holds raises the budget; one whose few heavy tokens are inside
  the selection leaves it alone; a guard that never fires changes no output.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ext.attention import request_overrides
from sglang_ext.attention.sparse_backend import SparseDecodeBackend
from sglang_ext.config import ConfigError, build_config
from sglang_ext.kernels.guard_probe import GuardProbe, probe_recall_ref
from sglang_ext.kernels.sparse_decode import (
    DecodeRows,
    LayerCache,
    SelectionInputs,
    SparseDecodeWorkspace,
    select_slots_batched,
    sparse_decode_batched,
    sparse_decode_batched_ref,
)
from sglang_ext.kernels.testing import case_generator, make_paged_batch, random_values
from sglang_ext.kernels.topk import topk_masked, topk_masked_ref
from sglang_ext.selection.guard import (
    PATIENCE,
    GuardPolicy,
    next_budget,
    row_top_k,
    selection_recall,
    widened,
)
from sglang_ext.selection.reference import SelectionParams, select_token_mask

from fake_backend import DecodeMode, FakePool, FakeReqToTokenPool

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_rule_raises_lowers_and_stays_in_range():
    policy = GuardPolicy(every=4, low=0.9, base_budget=64, max_budget=256)
    b = torch.tensor([64, 128, 256, 64, 128])
    streak = torch.tensor([0, 0, 0, PATIENCE - 1, PATIENCE - 2])
    recall = torch.tensor([0.5, 0.5, 0.5, 0.99, 0.99])
    new, new_streak = next_budget(policy, b, streak, recall)
    assert new.tolist() == [128, 256, 256, 64, 128]  # raise, raise, capped, floor, not yet
    assert new_streak.tolist() == [0, 0, 0, 0, PATIENCE - 1]
    # between the thresholds: nothing moves, the streak restarts
    new, new_streak = next_budget(policy, torch.tensor([128]), torch.tensor([2]),
                                  torch.tensor([0.95]))
    assert (new.item(), new_streak.item()) == (128, 0)
    # PATIENCE high probes in a row halve a raised budget once
    budget, streak = torch.tensor([256]), torch.tensor([0])
    for _ in range(PATIENCE):
        budget, streak = next_budget(policy, budget, streak, torch.tensor([0.999]))
    assert budget.item() == 128
    assert policy.high == pytest.approx(0.975)
    assert [policy.is_probe_step(s) for s in range(6)] == [True, False, False, False, True, False]


@pytest.mark.parametrize("values, flag", [
    ({"guard_every": -1}, "--sparse-guard-every"),
    ({"guard_recall": 1.5}, "--sparse-guard-recall"),
    ({"guard_recall": "high"}, "--sparse-guard-recall"),
    ({"guard_max_budget": 100, "budget": 512}, "--sparse-guard-max-budget"),
    ({"guard_every": 8, "tier": "sync", "method": "quest"}, "--sparse-guard-every"),
    ({"guard_every": 8, "locality_blocks": 2}, "--sparse-guard-every"),
])
def test_bad_guard_flags_name_the_flag(values, flag):
    with pytest.raises(ConfigError) as e:
        build_config(**values)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_topk_per_row_k_matches_reference():
    gen = case_generator("topk-rows")
    scores = torch.randn(3, 2, 70, generator=gen)
    scores[1, 0, 10:] = float("-inf")  # fewer finite entries than k
    k_rows = torch.tensor([7, 20, 1], dtype=torch.int32)
    expect = topk_masked_ref(scores, 20, k_rows)
    for impl in ("triton", "torch"):
        got = topk_masked(scores.to(DEVICE), 20, impl=impl, k_rows=k_rows.to(DEVICE)).cpu()
        for b in range(3):
            for g in range(2):
                assert set(got[b, g].tolist()) == set(expect[b, g].tolist()), (impl, b, g)


def test_topk_streaming_rows_with_length_hints():
    """Rows longer than the resident limit stream from memory; an ``n_rows`` hint (everything
    past it is -inf) lets the passes stop early and changes no result."""
    gen = case_generator("topk-stream")
    n = 8192 + 700
    scores = torch.randn(2, 2, n, generator=gen)
    n_rows = torch.tensor([300, 8500], dtype=torch.int32)
    for b in range(2):
        scores[b, :, int(n_rows[b]):] = float("-inf")
    k_rows = torch.tensor([40, 64], dtype=torch.int32)
    expect = topk_masked_ref(scores, 64, k_rows)
    got = topk_masked(scores.to(DEVICE), 64, k_rows=k_rows.to(DEVICE),
                      n_rows=n_rows.to(DEVICE)).cpu()
    for b in range(2):
        for g in range(2):
            assert set(got[b, g].tolist()) == set(expect[b, g].tolist()), (b, g)


@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
def test_batched_decode_with_per_request_budgets(method):
    """A workspace sized for the guard's largest budget, each request at its own budget, selects
    and attends exactly what the oracle does at that request's widened params."""
    hq, hkv, d, bs = 6, 2, 16, 4
    base = SelectionParams(method, 24, bs, 4, 3, 5)
    top = widened(base, 96)
    lens = [300, 250, 180]
    budgets = torch.tensor([24, 48, 96], dtype=torch.int32)
    gen = case_generator("guard-rows", method)
    pb = make_paged_batch(gen, lens, hkv, d, bs, dtype=torch.float32, device=DEVICE)
    q = random_values(gen, len(lens), hq, d, device=DEVICE)
    ws = SparseDecodeWorkspace(len(lens), hq, hkv, d, top, pb.max_blocks, DEVICE, torch.float32)
    row_ks = tuple(None if k is None else k.to(DEVICE) for k in row_top_k(base, budgets))
    cache = LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax)
    rows = DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens)
    inputs = SelectionInputs(row_ks=row_ks)
    _, pos = select_slots_batched(q, cache, rows, top, ws, inputs, return_positions=True)
    pos = pos.clone()
    out, lse = sparse_decode_batched(q, cache, rows, top, d ** -0.5, ws, inputs,
                                     return_lse=True)
    for b, budget in enumerate(budgets.tolist()):
        params = widened(base, budget)
        sl = slice(b, b + 1)
        ref_out, ref_lse, masks = sparse_decode_batched_ref(
            q[sl], pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices[sl],
            pb.seq_lens[sl], params, d ** -0.5)
        for g in range(hkv):
            got = pos[b, g][pos[b, g] >= 0].long().sort().values
            assert torch.equal(got.cpu(), masks[0][g].nonzero().flatten().cpu()), (b, g)
        torch.testing.assert_close(out[sl].float(), ref_out.float(), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(lse[sl], ref_lse, rtol=1e-4, atol=1e-3)


def _check_probe(kv: str, hq: int, hkv: int, d: int, bs: int, lens: list[int],
                 params: SelectionParams, ctrls: list[list[list[int]]], device: str,
                 num_splits: int) -> None:
    """The probe's recall per request against :func:`probe_recall_ref` for each control
    ``[B, 2]`` in ``ctrls``; requests no longer than the largest budget (``params.budget``)
    are never probed."""
    gen = case_generator("probe", kv, hq, d, *lens)
    fp8 = kv == "fp8"
    pb = make_paged_batch(gen, lens, hkv, d, bs, dtype=torch.float8_e4m3fn if fp8 else
                          torch.bfloat16, device=device,
                          summary_dtype=torch.float32 if fp8 else None)
    q = random_values(gen, len(lens), hq, d, dtype=torch.bfloat16, device=device)
    k_scale = 0.5 if fp8 else 1.0
    _, sparse_lse = sparse_decode_batched(
        q, LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax, k_scale=k_scale),
        DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens), params, d ** -0.5,
        return_lse=True)
    min_len = params.budget
    probe = GuardProbe(len(lens) + 1, hq, hkv, d, min_len=min_len,
                       max_context=pb.req_to_token.shape[1], device=device,
                       num_splits=num_splits)
    batch = len(lens)
    for ctrl in ctrls:
        ctrl = torch.tensor(ctrl, dtype=torch.int32, device=device)
        probe.recall_sum.fill_(0.25)  # accumulates on top of what is there
        probe.run(ctrl, q, pb.k_buffer, pb.req_to_token, pb.req_pool_indices, pb.seq_lens,
                  sparse_lse, d ** -0.5 * k_scale)
        expect = probe_recall_ref(ctrl.cpu(), q.cpu(), pb.k_buffer.cpu(), pb.req_to_token.cpu(),
                                  pb.req_pool_indices.cpu(), pb.seq_lens.cpu(), sparse_lse.cpu(),
                                  d ** -0.5 * k_scale, min_len) + 0.25
        torch.testing.assert_close(probe.recall_sum[:batch].cpu(), expect, rtol=2e-2, atol=2e-2)
        for b, n in enumerate(lens):  # a probed request adds its recall, in (0, 1)
            added = float(expect[b]) - 0.25
            probed = bool(ctrl[b, 0]) and n > min_len
            assert (0 < added < 1) if probed else added == 0, (ctrl.tolist(), b)
    with pytest.raises(ValueError, match=rf"contiguous \[{batch}, 2\]"):
        probe.run(torch.ones(2, dtype=torch.int32, device=device), q, pb.k_buffer,
                  pb.req_to_token, pb.req_pool_indices, pb.seq_lens, sparse_lse, 1.0)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_probe_kernel_matches_reference(kv):
    """The probe's dense LSE against the reference's, each request at its own (probe, kv head);
    on an fp8 cache (``--kv-cache-dtype fp8_e4m3``) with the layer's k_scale folded into the
    scaling, as the backend passes it."""
    # all on one head, another head, none, each its own
    ctrls = [[[1, 1]] * 3, [[1, 0]] * 3, [[0, 1]] * 3, [[1, 0], [1, 1], [0, 1]],
             [[0, 0], [1, 1], [1, 1]]]
    _check_probe(kv, 6, 2, 32, 4, [300, 40, 257], SelectionParams("two_level", 48, 4, 8, 3, 5),
                 ctrls, DEVICE, num_splits=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_probe_real_shapes(kv):
    """Qwen3-8B heads (32 q / 8 kv x 128), block 32, budget 2048: requests of 32k, 8k, one that
    still decodes densely and 4k, each probing its own kv head or not."""
    ctrls = [[[1, 7], [1, 0], [1, 3], [0, 5]], [[0, 0], [1, 2], [0, 0], [1, 6]]]
    _check_probe(kv, 32, 8, 128, 32, [32768, 8192, 1500, 4096],
                 SelectionParams("two_level", 2048, 32, 128, 16, 64), ctrls, "cuda",
                 num_splits=32)


# ---------------------------------------------------------------- through the backend

HQ, HKV, D, LAYERS, SLOTS = 6, 2, 16, 2, 4096


def _needle_case(num_needles: int, strength: float, length: int = 400):
    """Keys of one request where the query's attention mass sits on ``num_needles`` scattered
    positions (keys along the query's direction); the rest is noise."""
    g = torch.Generator().manual_seed(num_needles)
    direction = torch.randn(HKV, D, generator=g)
    direction /= direction.norm(dim=-1, keepdim=True)
    k = torch.randn(SLOTS, HKV, D, generator=g) * 0.5
    v = torch.randn(SLOTS, HKV, D, generator=g)
    needles = (torch.randperm(length - 100, generator=g)[:num_needles] + 50)
    k[needles + 1] = direction * strength  # slot = position + 1 (slot 0 is padding)
    q = (direction * strength).repeat_interleave(HQ // HKV, dim=0)  # [Hq, D]
    return k, v, q


def _run_decode(guard: dict, k, v, q, length: int = 400, steps: int = 6, metrics: bool = False):
    """Decode ``steps`` tokens of one request through the backend (both layers). Returns the
    outputs per step and the guard's row state."""
    cfg = build_config(budget=32, block_size=4, sink=4, window=8, method="two_level", **guard)
    max_context = length + steps + 1
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=FakeReqToTokenPool(
            torch.zeros(4, max_context, dtype=torch.int32)),
        token_to_kv_pool=FakePool([k.clone() for _ in range(LAYERS)],
                                  [v.clone() for _ in range(LAYERS)]),
        server_args=SimpleNamespace(enable_metrics=metrics),
    )
    backend = SparseDecodeBackend(runner, cfg)
    row = 2
    runner.req_to_token_pool.req_to_token[row] = torch.arange(1, max_context + 1).int()
    request_overrides.record(runner.req_to_token_pool, [SimpleNamespace(
        req_pool_idx=row, sampling_params=SimpleNamespace(custom_params=None))], cfg)
    layers = [SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D,
                              v_head_dim=D, scaling=D ** -0.5) for i in range(LAYERS)]
    outputs = []
    for step in range(steps):
        seq_len = length + step
        batch = SimpleNamespace(
            forward_mode=DecodeMode(), req_pool_indices=torch.tensor([row]),
            seq_lens=torch.tensor([seq_len]), seq_lens_cpu=torch.tensor([seq_len]),
            out_cache_loc=torch.tensor([seq_len]),  # slot of position seq_len - 1
        )
        backend.init_forward_metadata(batch)
        outs = [backend.forward_decode(q.reshape(1, -1), k[seq_len:seq_len + 1].reshape(1, -1),
                                       v[seq_len:seq_len + 1].reshape(1, -1), layer, batch)
                for layer in layers]
        outputs.append(torch.stack(outs))
    state = request_overrides.row_state(runner.req_to_token_pool).get(row, {}).get("guard")
    return outputs, state, backend


def test_guard_raises_budget_when_mass_is_outside_the_selection():
    k, v, q = _needle_case(num_needles=60, strength=4.0)
    mask = select_token_mask(q, k[1:401], SelectionParams("two_level", 32, 4, 12, 4, 8))
    assert selection_recall(q, k[1:401], mask, D ** -0.5, 0) < 0.9  # the case is what it says
    _, state, backend = _run_decode({"guard_every": 2, "guard_max_budget": 128}, k, v, q)
    assert state.budget == 128  # 32 -> 64 -> 128 (capped) over the probes at steps 0, 2
    assert backend.decoder.guard.totals.counts[1] >= 2 and backend.decoder.guard.totals.counts[2] == 0


def test_guard_leaves_budget_alone_when_mass_is_inside():
    k, v, q = _needle_case(num_needles=4, strength=6.0)
    mask = select_token_mask(q, k[1:401], SelectionParams("two_level", 32, 4, 12, 4, 8))
    assert selection_recall(q, k[1:401], mask, D ** -0.5, 0) > 0.97
    _, state, backend = _run_decode({"guard_every": 2, "guard_max_budget": 128}, k, v, q)
    assert state.budget == 32 and backend.decoder.guard.totals.counts == [3, 0, 0]


def test_guard_that_never_fires_changes_nothing():
    k, v, q = _needle_case(num_needles=60, strength=4.0)
    off, _, _ = _run_decode({}, k, v, q)
    # recall threshold ~0: never raises; the budget cannot go below its base either
    on, state, backend = _run_decode({"guard_every": 1, "guard_recall": 1e-9,
                                      "guard_max_budget": 128}, k, v, q)
    assert state.budget == 32 and backend.decoder.guard.totals.counts[0] == 6
    for a, b in zip(off, on):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_guard_decisions_reach_prometheus():
    prometheus_client = pytest.importorskip("prometheus_client")
    k, v, q = _needle_case(num_needles=60, strength=4.0)
    _, state, backend = _run_decode({"guard_every": 2, "guard_max_budget": 128}, k, v, q,
                                    metrics=True)
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value("sglang_ext:guard_probes_total") == 3
    assert registry.get_sample_value("sglang_ext:guard_budget_raised_total") == 2
    assert registry.get_sample_value("sglang_ext:guard_budget_lowered_total") == 0


# ------------------------------------------- the batched (Triton) guard keeps each request's cadence

G_HQ, G_HKV, G_D, G_LAYERS, G_PAGE = 4, 2, 16, 2, 4
G_ROWS = {1: 90, 3: 120}  # request row -> prompt length
G_EVERY, G_STEPS, G_LATE = 2, 7, 3


def _guarded_backend(tmp_path):
    from cpu_backend import cpu_mha_pool, cpu_sparse_backend

    pool = cpu_mha_pool(torch.bfloat16, G_HKV, G_D, G_LAYERS, G_PAGE, 128)
    gen = torch.Generator().manual_seed(11)
    for layer in range(G_LAYERS):  # a random context (slot 0 is the padding slot)
        pool.get_key_buffer(layer)[1:] = torch.randn(
            pool.get_key_buffer(layer)[1:].shape, generator=gen).to(torch.bfloat16)
        pool.get_value_buffer(layer)[1:] = torch.randn(
            pool.get_value_buffer(layer)[1:].shape, generator=gen).to(torch.bfloat16)
    table = torch.zeros(4, 256, dtype=torch.int32)
    table[1] = torch.arange(1, 257)
    table[3] = torch.arange(257, 513)
    channels = [[[0, 7, 15], [2, 3, 9]] for _ in range(G_LAYERS)]
    backend = cpu_sparse_backend(tmp_path, pool, table, G_HQ, channels, "auto", budget=16,
                                 guard_every=G_EVERY, guard_max_budget=64)
    return backend, table


def _guarded_decode(tmp_path, schedule: list[list[int]]) -> tuple[dict, dict]:
    """Decode steps whose batches are ``schedule`` (request rows per step); each request's
    q / k / v at its own n-th step are the same whatever else is in the batch. Returns per row
    its outputs and its budget after each of its steps."""
    from cpu_backend import attention_layer, decode_batch

    from sglang_ext.attention.features.guard import KernelGuard

    backend, table = _guarded_backend(tmp_path)
    guard, = (f for f in backend.decoder.features if isinstance(f, KernelGuard))
    done = {row: 0 for row in G_ROWS}
    outs: dict = {row: [] for row in G_ROWS}
    budgets: dict = {row: [] for row in G_ROWS}
    for rows in schedule:
        lens = [G_ROWS[r] + done[r] + 1 for r in rows]
        qkv = []
        for r in rows:
            gen = torch.Generator().manual_seed(1000 * r + done[r])
            qkv.append([tuple(torch.randn(n * G_D, generator=gen).to(torch.bfloat16)
                              for n in (G_HQ, G_HKV, G_HKV)) for _ in range(G_LAYERS)])
        batch = decode_batch(table, rows, lens)
        backend.init_forward_metadata(batch)
        for layer_id in range(G_LAYERS):
            layer = attention_layer(layer_id, G_HQ, G_HKV, G_D)
            q, k, v = (torch.stack([x[layer_id][i] for x in qkv]) for i in range(3))
            out = backend.forward_decode(q, k.view(-1, G_HKV, G_D), v.view(-1, G_HKV, G_D),
                                         layer, batch)
            for i, r in enumerate(rows):
                outs[r].append(out[i])
        for r in rows:
            budgets[r].append(int(guard.budget[r]))
            done[r] += 1
    return outs, budgets


def test_batched_guard_probes_each_request_on_its_own_steps(tmp_path):
    """A request that joins a running batch later decodes exactly what it decodes alone: the
    Triton path's guard probes it on its own steps 0, every, 2 x every ... (RequestGuard's
    rule), not on the server's. Regression: the soak on real weights (guard phase) found a
    request whose output changed under load at token 8 (--sparse-guard-every 8)."""
    alone, alone_budgets = _guarded_decode(tmp_path, [[3]] * G_STEPS)
    # row 1 starts alone; row 3 joins G_LATE steps later, which is not a multiple of G_EVERY
    late = [[1]] * G_LATE + [[1, 3]] * G_STEPS
    joined, joined_budgets = _guarded_decode(tmp_path, late)
    # the case is what it says: random keys, recall far below 0.9, so every probe doubles the
    # budget up to the cap (16 -> 32 -> 64) right after the request's own steps 0 and 2
    assert alone_budgets[3] == [32, 32, 64, 64, 64, 64, 64]
    assert joined_budgets[3] == alone_budgets[3]
    assert joined_budgets[1][:G_LATE] == [32, 32, 64]
    for a, b in zip(alone[3], joined[3]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
