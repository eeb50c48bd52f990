"""NOSA-style locality-constrained selection (sglang_ext/selection/locality.py): the eviction
rule holds over long decode traces (a dropped block never returns to the query-agnostic set),
the measured locality γ(t) is at least |E_t| / blocks attended at every step, |E_t| = k_e once
enough blocks have passed, and with k_e = 0 the selection is two_level's."""

import pytest
import torch

from sglang_ext.kernels.testing import case_generator
from sglang_ext.selection.locality import (
    LocalityState,
    select_token_mask_locality,
    update_eviction_scores,
)
from sglang_ext.selection.reference import SelectionParams, select_token_mask

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
