"""NOSA-style locality-constrained selection (sglang_ext/selection/locality.py): the eviction
rule holds over long decode traces (a dropped block never returns to the query-agnostic set),
the measured locality γ(t) is at least |E_t| / blocks attended at every step, |E_t| = k_e once
enough blocks have passed, and with k_e = 0 the selection is two_level's."""

import dataclasses

import pytest
import torch

from sglang_ext.kernels.testing import case_generator
from sglang_ext.selection.locality import (
    LocalityState,
    select_token_mask_locality,
    update_eviction_scores,
)
from sglang_ext.selection.reference import SelectionParams, select_token_mask
from fake_backend import FakeReqToTokenPool

PARAMS = SelectionParams("two_level", 64, 4, 10, 8, 16)  # 40 tokens = 10 blocks selected


def _trace(gen, steps, start, hkv=2, hq=4, d=16):
    keys = torch.randn(start + steps, hkv, d, generator=gen)
    qs = torch.randn(steps, hq, d, generator=gen)
    return keys, qs


@pytest.mark.parametrize("score_kind", ["attention", "key_norm"])
def test_eviction_rule_and_locality_floor_over_a_long_trace(score_kind):
    gen = case_generator("locality", score_kind)
    k_e = 6
    keys, qs = _trace(gen, steps=120, start=100)
    state = LocalityState(num_kv_heads=2)
    evicted_before = None
    for t in range(qs.shape[0]):
        length = 100 + t + 1
        mask = select_token_mask_locality(qs[t], keys[:length], PARAMS, state, k_e,
                                          score_kind=score_kind)
        if score_kind == "attention":
            update_eviction_scores(state, qs[t], keys[:length], mask, 0.25, PARAMS.block_size)
        assert int(mask.sum(dim=1).max()) <= PARAMS.budget
        evicted = state.evicted.clone()
        if evicted_before is not None:
            n = evicted_before.shape[1]
            # once evicted, always evicted: never back in the query-agnostic set
            assert not bool((evicted_before & state.keep[:, :n]).any())
            assert bool((evicted[:, :n] >= evicted_before).all())
        evicted_before = evicted
        assert int(state.keep.sum(dim=1).min()) == k_e  # enough blocks have passed
    assert len(state.locality) == qs.shape[0] - 1
    for gamma, floor in zip(state.locality, state.floor):
        assert gamma >= floor - 1e-6
    # NOSA's bound γ(t) >= k_e / k, k = most blocks one step can attend: sink and window blocks,
    # the k_e blocks, and one block per query-aware token.
    p = PARAMS
    n_q = p.budget - p.sink - p.window - k_e * p.block_size
    k = -(-p.sink // p.block_size) + -(-p.window // p.block_size) + 1 + k_e + n_q
    assert min(state.locality) >= k_e / k


def test_ke_zero_is_two_level():
    gen = case_generator("locality-ke0")
    keys, qs = _trace(gen, steps=20, start=150)
    state = LocalityState(num_kv_heads=2)
    for t in range(qs.shape[0]):
        length = 150 + t + 1
        got = select_token_mask_locality(qs[t], keys[:length], PARAMS, state, 0)
        want = select_token_mask(qs[t], keys[:length], PARAMS)
        assert torch.equal(got, want)


def _filter_blocks(mask: torch.Tensor, bs: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask, (0, (-mask.shape[1]) % bs)).reshape(
        mask.shape[0], -1, bs).any(dim=2)


@pytest.mark.parametrize("limit", [1, 3])
def test_new_block_limit_holds_over_a_long_trace(limit):
    """At most ``limit`` query-aware filter blocks per step and kv head come from outside the
    previous step's filter; without the limit far more do on this (random, low-locality)
    trace; the budget and the eviction rule are unaffected."""
    gen = case_generator("locality-new-blocks", limit)
    keys, qs = _trace(gen, steps=80, start=100)
    params = dataclasses.replace(PARAMS, locality_blocks=4, locality_new_blocks=limit)
    limited, unlimited = LocalityState(num_kv_heads=2), LocalityState(num_kv_heads=2)
    evicted_before = None
    for t in range(qs.shape[0]):
        length = 100 + t + 1
        mask = select_token_mask_locality(qs[t], keys[:length], params, limited, 4,
                                          score_kind="key_norm")
        select_token_mask_locality(qs[t], keys[:length], dataclasses.replace(
            params, locality_new_blocks=0), unlimited, 4, score_kind="key_norm")
        assert int(mask.sum(dim=1).max()) <= params.budget
        evicted = limited.evicted.clone()
        if evicted_before is not None:
            n = evicted_before.shape[1]
            assert not bool((evicted_before & limited.keep[:, :n]).any())
        evicted_before = evicted
    assert len(limited.new_blocks) == qs.shape[0] - 1
    assert max(limited.new_blocks) == limit
    assert max(unlimited.new_blocks) > 2 * limit
    # the blocks a step attends lie in its filter, sink and window (tokens within those only)
    bs = params.block_size
    attended = _filter_blocks(mask, bs)
    allowed = limited.prev_filter[:, :attended.shape[1]].clone()
    allowed[:, : -(-params.sink // bs)] = True
    allowed[:, (length - params.window) // bs:] = True
    assert not bool((attended & ~allowed).any())


def test_a_limit_above_the_filter_changes_nothing():
    """With room for the whole filter the limit never binds: the unlimited selection."""
    gen = case_generator("locality-new-blocks-wide")
    keys, qs = _trace(gen, steps=30, start=120)
    params = dataclasses.replace(PARAMS, locality_blocks=4)
    wide = dataclasses.replace(params, locality_new_blocks=params.candidate_blocks)
    a, b = LocalityState(num_kv_heads=2), LocalityState(num_kv_heads=2)
    for t in range(qs.shape[0]):
        length = 120 + t + 1
        got = select_token_mask_locality(qs[t], keys[:length], wide, a, 4, score_kind="key_norm")
        want = select_token_mask_locality(qs[t], keys[:length], params, b, 4,
                                          score_kind="key_norm")
        assert torch.equal(got, want)


def test_short_context_is_dense():
    gen = case_generator("locality-short")
    keys, qs = _trace(gen, steps=1, start=30)
    state = LocalityState(num_kv_heads=2)
    assert bool(select_token_mask_locality(qs[0], keys[:31], PARAMS, state, 4).all())


@pytest.mark.server
def test_server_with_locality_finds_the_passkey():
    """A CPU server with k_e = 16 blocks of the 256-token budget query-agnostic: the passkey is
    still found and the measured locality is logged and exported to Prometheus."""
    import requests
    from server_utils import LABELS, Server

    server = Server([
        "--attention-backend", "sglang_ext", "--sparse-budget", "256", "--sparse-block-size", "4",
        "--sparse-label-config", LABELS, "--sparse-locality-blocks", "16", "--enable-metrics",
    ]).start()
    try:
        filler = "The grass is green. The sky is blue. The sun is yellow. " * 120
        prompt = (filler[:len(filler) // 2] + "The pass key is 48213. Remember it. " +
                  filler[len(filler) // 2:] + "What is the pass key? The pass key is")
        out = server.generate(prompt, max_new_tokens=24)
        assert "48213" in out["text"], out["text"]
        log = server.log_text()
        assert "sglang_ext locality: layer" in log, server.log_tail()
        gammas = [float(line.split("gamma mean ")[1].split()[0])
                  for line in log.splitlines() if "sglang_ext locality: layer" in line]
        floor = 16 / (4 + 17 + 16 + 176 - 64)  # NOSA's floor k_e / k
        assert min(gammas) >= floor
        metrics = {}
        for line in requests.get(server.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("sglang_ext:locality_"):
                name, _, value = line.rpartition(" ")
                metrics[name.split("{")[0]] = float(value)
        assert metrics.get("sglang_ext:locality_selections_total", 0) > 0, metrics
        assert floor <= metrics["sglang_ext:locality_gamma_min"] <= metrics["sglang_ext:locality_gamma"] <= 1
    finally:
        server.stop()


# ---------------------------------------------------------------- trained eviction heads (NOSA)


def _heads(seed: int, layers: int = 1, hkv: int = 2, d: int = 16):
    from sglang_ext.selection.eviction_head import EvictionHeads

    return EvictionHeads(layers, hkv, d, generator=torch.Generator().manual_seed(seed))


def test_learned_scores_drive_the_query_agnostic_set_and_the_rule_holds():
    """With the trained head's scores, E_t is the top k_e of the pooled scores of every block
    that has entered the middle (the closed form of NOSA's rule for fixed scores), evicted
    blocks never return, and γ(t) stays above the floor."""
    from sglang_ext.selection.locality import two_stage_pool

    gen = case_generator("locality", "learned")
    k_e = 6
    keys, qs = _trace(gen, steps=120, start=100)
    values = torch.randn(keys.shape, generator=gen)
    head = _heads(1).layer(0)
    pooled_all = two_stage_pool(head.token_scores(values[: values.shape[0] // 4 * 4]), 4)
    state = LocalityState(num_kv_heads=2)
    evicted_before = None
    for t in range(qs.shape[0]):
        length = 100 + t + 1
        mask = select_token_mask_locality(qs[t], keys[:length], PARAMS, state, k_e,
                                          score_kind="learned", values=values[:length],
                                          eviction_head=head)
        assert int(mask.sum(dim=1).max()) <= PARAMS.budget
        lo, hi = PARAMS.sink, length - PARAMS.window
        first, last = lo // 4, (hi - 1) // 4
        pooled = pooled_all[:, first:last + 1]
        want = torch.zeros_like(pooled, dtype=torch.bool)
        want.scatter_(1, pooled.topk(k_e, dim=1).indices, True)
        assert torch.equal(state.keep[:, first:last + 1], want)
        # every token of E_t is attended
        pos = torch.arange(lo, hi)
        assert bool(mask[:, lo:hi][want[:, pos // 4 - first]].all())
        evicted = state.evicted.clone()
        if evicted_before is not None:
            n = evicted_before.shape[1]
            assert not bool((evicted_before & state.keep[:, :n]).any())
        evicted_before = evicted
    for gamma, floor in zip(state.locality, state.floor):
        assert gamma >= floor - 1e-6
    p = PARAMS  # NOSA's bound, k as in the trace test above
    n_q = p.budget - p.sink - p.window - k_e * p.block_size
    k = -(-p.sink // p.block_size) + -(-p.window // p.block_size) + 1 + k_e + n_q
    assert min(state.locality) >= k_e / k


def test_a_head_that_likes_one_value_direction_keeps_those_blocks():
    """A head whose weight points along a planted value direction keeps the blocks holding it,
    whatever the query."""
    from sglang_ext.selection.eviction_head import EvictionHeads

    gen = case_generator("locality", "planted")
    keys, qs = _trace(gen, steps=1, start=200)
    values = torch.randn(keys.shape, generator=gen) * 0.1
    planted = [10, 17, 30, 41]  # blocks of 4 tokens in the middle
    direction = torch.zeros(16)
    direction[3] = 1.0
    for b in planted:
        values[b * 4 + 1, :, :] += 5 * direction
    heads = EvictionHeads(1, 2, 16)
    with torch.no_grad():
        heads.weight.zero_()
        heads.weight[0, :, 3] = 1.0
    state = LocalityState(num_kv_heads=2)
    mask = select_token_mask_locality(qs[0], keys, PARAMS, state, len(planted),
                                      score_kind="learned", values=values,
                                      eviction_head=heads.layer(0))
    kept = state.keep.nonzero()[:, 1].view(2, -1)
    assert kept.tolist() == [planted, planted]
    assert bool(mask[:, [b * 4 + j for b in planted for j in range(4)]].all())


def test_eviction_head_files_are_checked_against_the_model(tmp_path):
    from sglang_ext.selection.eviction_head import load_eviction_heads, save_eviction_heads

    heads = _heads(3, layers=4, hkv=3, d=8)
    path = tmp_path / "heads.safetensors"
    save_eviction_heads(heads, path, model="tiny")
    got = load_eviction_heads(path, num_layers=4, num_kv_heads=3, head_dim=8)
    assert torch.equal(got.weight, heads.weight.detach())
    values = torch.randn(5, 3, 8)
    torch.testing.assert_close(got.token_scores(2, values), heads.token_scores(2, values).detach())
    # one rank's slice (--tp): its kv heads' scores
    torch.testing.assert_close(got.kv_heads(1, 3).token_scores(2, values[:, 1:3]),
                               got.token_scores(2, values)[1:3])
    for shape, what in (((30, 3, 8), "layers"), ((4, 2, 8), "kv heads"), ((4, 3, 64), "head dim")):
        with pytest.raises(ValueError) as e:
            load_eviction_heads(path, num_layers=shape[0], num_kv_heads=shape[1], head_dim=shape[2])
        assert what in str(e.value) and "\n" not in str(e.value) and str(path) in str(e.value)
    junk = tmp_path / "junk.safetensors"
    junk.write_text("not a tensor file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_eviction_heads(junk, num_layers=4, num_kv_heads=3, head_dim=8)


def test_requests_choose_their_locality_and_bad_ones_are_one_line_errors(tmp_path):
    from sglang_ext.attention.request_overrides import parse_override
    from sglang_ext.config import build_config
    from sglang_ext.selection.eviction_head import save_eviction_heads

    base = build_config(budget=128, block_size=4, sink=16, window=32)
    assert parse_override(None, base).locality_blocks == 0  # the server's default: off
    got = parse_override({"sparse": {"locality_blocks": 10, "eviction_score": "key_norm"}}, base)
    assert (got.locality_blocks, got.eviction_score) == (10, "key_norm")
    # another budget with its own k_e; a method other than two_level drops the server's k_e
    local = build_config(budget=128, block_size=4, sink=16, window=32, locality_blocks=10)
    assert parse_override({"sparse": {"method": "quest"}}, local).locality_blocks == 0
    assert parse_override({"sparse": {"locality_blocks": 0}}, local).locality_blocks == 0
    # the limit on new filter blocks: per request, and off with the constraint
    limited = build_config(budget=128, block_size=4, sink=16, window=32, locality_blocks=10,
                           locality_new_blocks=5)
    assert parse_override(None, limited).locality_new_blocks == 5
    assert parse_override({"sparse": {"locality_new_blocks": 2}}, limited).locality_new_blocks == 2
    got = parse_override({"sparse": {"locality_blocks": 0}}, limited)
    assert (got.locality_blocks, got.locality_new_blocks) == (0, 0)
    got = parse_override({"sparse": {"locality_blocks": 4, "locality_new_blocks": 1}}, base)
    assert (got.locality_blocks, got.locality_new_blocks) == (4, 1)
    path = tmp_path / "h.safetensors"
    save_eviction_heads(_heads(0), path, model="tiny")
    with_head = build_config(budget=128, block_size=4, sink=16, window=32,
                             eviction_head=str(path))
    assert parse_override({"sparse": {"locality_blocks": 4, "eviction_score": "learned"}},
                          with_head).eviction_score == "learned"
    for bad, words in (
        ({"locality_blocks": 21}, "must fit"),  # 80 selected tokens = 20 blocks of 4
        ({"locality_blocks": -1}, ">= 0"),
        ({"locality_blocks": True}, "integer"),
        ({"locality_blocks": 2.5}, "integer"),
        ({"locality_blocks": 2, "method": "ds"}, "two_level"),
        ({"locality_blocks": 2, "eviction_score": "learned"}, "--sparse-eviction-head"),
        ({"eviction_score": "oracle"}, "must be one of"),
        ({"budget": 64, "sink": 8, "window": 16, "locality_blocks": 11}, "must fit"),
        ({"locality_new_blocks": 2}, "--sparse-locality-blocks"),  # the constraint is off
        ({"locality_blocks": 2, "locality_new_blocks": 1.5}, "integer"),
    ):
        with pytest.raises(ValueError) as e:
            parse_override({"sparse": bad}, base)
        assert words in str(e.value) and "\n" not in str(e.value), (bad, str(e.value))


def test_backend_decodes_per_request_locality_with_its_own_score(tmp_path):
    """One backend decodes two_level, locality (attention score) and locality with the trained
    heads side by side (per-request settings); each request's output over several steps equals
    its selection replayed alone with its own state."""
    from types import SimpleNamespace

    from fake_backend import DecodeMode, FakePool
    from sglang_ext.attention import request_overrides
    from sglang_ext.attention.sparse_backend import SparseDecodeBackend
    from sglang_ext.config import build_config
    from sglang_ext.selection.eviction_head import save_eviction_heads
    from sglang_ext.selection.reference import sparse_attention

    hq, hkv, d, layers, slots = 4, 2, 16, 2, 1024
    gen = case_generator("locality", "backend")
    heads = _heads(5, layers=layers, hkv=hkv, d=d)
    path = tmp_path / "heads.safetensors"
    save_eviction_heads(heads, path, model="tiny")
    cfg = build_config(budget=64, block_size=4, sink=8, window=16, eviction_head=str(path))
    pool = FakePool([torch.randn(slots, hkv, d, generator=gen) for _ in range(layers)],
                    [torch.randn(slots, hkv, d, generator=gen) for _ in range(layers)])
    runner = SimpleNamespace(
        device="cpu", token_to_kv_pool=pool, model_runner_dtype=torch.float32,
        req_to_token_pool=FakeReqToTokenPool(torch.zeros(4, 400, dtype=torch.int32)),
        model_config=SimpleNamespace(num_hidden_layers=layers, head_dim=d,
                                     get_total_num_kv_heads=lambda: hkv))
    backend = SparseDecodeBackend(runner, cfg)
    overrides = [None, {"locality_blocks": 5}, {"locality_blocks": 5, "eviction_score": "learned"}]
    rows, start = [1, 2, 3], 150
    for i, row in enumerate(rows):
        runner.req_to_token_pool.req_to_token[row] = torch.arange(i * 330, i * 330 + 400)
    reqs = [SimpleNamespace(req_pool_idx=row, sampling_params=SimpleNamespace(
        custom_params=None if o is None else {"sparse": o})) for row, o in zip(rows, overrides)]
    request_overrides.record(runner.req_to_token_pool, reqs, cfg)
    params = [request_overrides.parse_override(None if o is None else {"sparse": o}, cfg)
              for o in overrides]
    states = {(i, l): LocalityState(num_kv_heads=hkv) for i in range(3) for l in range(layers)}
    for step in range(6):
        length = start + step
        lens = torch.tensor([length] * 3)
        batch = SimpleNamespace(
            forward_mode=DecodeMode(), batch_size=3, req_pool_indices=torch.tensor(rows),
            seq_lens=lens, seq_lens_cpu=lens,
            out_cache_loc=torch.tensor([i * 330 + length - 1 for i in range(3)]))
        backend.init_forward_metadata(batch)
        for l in range(layers):
            layer = SimpleNamespace(layer_id=l, tp_q_head_num=hq, tp_k_head_num=hkv,
                                    qk_head_dim=d, v_head_dim=d, scaling=d ** -0.5)
            q = torch.randn(3, hq * d, generator=gen)
            k_new = torch.randn(3, hkv * d, generator=gen)
            v_new = torch.randn(3, hkv * d, generator=gen)
            out = backend.forward_decode(q, k_new, v_new, layer, batch).view(3, hq, d)
            for i in range(3):
                idx = torch.arange(i * 330, i * 330 + length)
                keys, values = pool.k[l][idx], pool.v[l][idx]
                qi = q[i].view(hq, d)
                p = params[i]
                if p.locality_blocks:
                    mask = select_token_mask_locality(
                        qi, keys, p, states[i, l], p.locality_blocks, None, p.eviction_score,
                        values, heads.layer(l))
                    if p.eviction_score == "attention":
                        update_eviction_scores(states[i, l], qi, keys, mask, layer.scaling, 4)
                else:
                    mask = select_token_mask(qi, keys, p)
                torch.testing.assert_close(out[i], sparse_attention(qi, keys, values, mask,
                                                                    layer.scaling))
    # the learned request's query-agnostic sets came from the heads: not the attention request's
    assert not torch.equal(states[1, 0].keep, states[2, 0].keep)
