"""The backend's decode step on a continuous batch of mixed lengths (no server).

A batch mixes requests below, at and above the budget, with their KV scattered through the
pool, per-request overrides (dense, another method/budget) and a request row reused after
another request freed it. Every request's output must equal the reference decode of that request
alone: dense SDPA within the budget, ``sparse_decode`` beyond it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_ext.attention import reference_decode, request_overrides
from sglang_ext.attention.sparse_backend import SparseDecodeBackend
from sglang_ext.config import build_config
from sglang_ext.selection import sparse_decode

from fake_backend import DecodeMode, FakePool, FakeReqToTokenPool

HQ, HKV, D, LAYERS, SLOTS = 6, 2, 16, 2, 2048


def _backend(generator: torch.Generator, max_context: int, dense_decode: str = "sglang"):
    cfg = build_config(budget=64, block_size=4, sink=4, window=8, method="two_level",
                       dense_decode=dense_decode)
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=FakeReqToTokenPool(torch.zeros(8, max_context, dtype=torch.int32)),
        token_to_kv_pool=FakePool(
            [torch.randn(SLOTS, HKV, D, generator=generator) for _ in range(LAYERS)],
            [torch.randn(SLOTS, HKV, D, generator=generator) for _ in range(LAYERS)]),
        model_runner_dtype=torch.float32,
    )
    return SparseDecodeBackend(runner, cfg), runner, cfg


@pytest.mark.parametrize("seed, dense_decode", [(0, "sglang"), (1, "sglang"), (2, "float32")])
def test_mixed_batch_equals_per_request_reference(seed: int, dense_decode: str):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 40, 64, 65, 300, 129]  # below, at and above the budget of 64
    backend, runner, cfg = _backend(g, max_context=max(lengths), dense_decode=dense_decode)
    rows = [3, 1, 7, 2, 5, 6]  # scattered rows, never 0 (the padding row)
    # Each request's slots: a random, non-contiguous set of pool slots.
    free = torch.randperm(SLOTS - 1, generator=g) + 1
    slots, start = [], 0
    for row, n in zip(rows, lengths):
        slots.append(free[start:start + n])
        runner.req_to_token_pool.req_to_token[row, :n] = free[start:start + n].int()
        start += n
    # Per-request settings, recorded the way the ReqToTokenPool.alloc hook records them.
    overrides = [None, None, None, None, {"method": "quest", "budget": 96}, {"method": "dense"}]
    reqs = [SimpleNamespace(req_pool_idx=row, sampling_params=SimpleNamespace(
        custom_params=None if o is None else {"sparse": o})) for row, o in zip(rows, overrides)]
    request_overrides.record(runner.req_to_token_pool, reqs, cfg)

    batch = SimpleNamespace(
        forward_mode=DecodeMode(), batch_size=len(rows),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lengths),
        seq_lens_cpu=torch.tensor(lengths),
        out_cache_loc=torch.stack([s[-1] for s in slots]),
    )
    backend.init_forward_metadata(batch)
    for layer_id in range(LAYERS):
        layer = SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=HKV,
                                qk_head_dim=D, v_head_dim=D, scaling=D ** -0.5)
        q = torch.randn(len(rows), HQ * D, generator=g)
        k_new = torch.randn(len(rows), HKV * D, generator=g)
        v_new = torch.randn(len(rows), HKV * D, generator=g)
        out = backend.forward_decode(q, k_new, v_new, layer, batch).view(len(rows), HQ, D)

        pool = runner.token_to_kv_pool
        for i, (n, override) in enumerate(zip(lengths, overrides)):
            keys, values = pool.k[layer_id][slots[i]], pool.v[layer_id][slots[i]]
            assert torch.equal(keys[-1], k_new[i].view(HKV, D))  # the new token was written
            qi = q[i].view(HQ, D)
            params = request_overrides.parse_override(
                None if override is None else {"sparse": override}, cfg)
            if params is None or n <= params.budget:
                expected = scaled_dot_product_attention(
                    qi[None, :, None], keys.movedim(0, 1)[None], values.movedim(0, 1)[None],
                    enable_gqa=True, scale=layer.scaling)[0, :, 0]
            else:
                expected = sparse_decode(qi, keys, values, params, layer.scaling)
            torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)


def test_freed_row_forgets_its_override():
    g = torch.Generator().manual_seed(0)
    backend, runner, cfg = _backend(g, max_context=16)
    pool = runner.req_to_token_pool
    req = SimpleNamespace(req_pool_idx=4, sampling_params=SimpleNamespace(
        custom_params={"sparse": {"method": "dense"}}))
    request_overrides.record(pool, [req], cfg)
    assert request_overrides.lookup(pool, 4, backend.default_params) is None
    request_overrides.forget(pool, 4)
    assert request_overrides.lookup(pool, 4, backend.default_params) == backend.default_params


def test_one_token_extends_attend_like_decode_and_share_equal_rows():
    """Requests that extend a cached prompt by its last token (one prompt under several
    settings) attend like a decode step, in float32; rows with equal inputs are computed once
    and rows that differ anywhere are not merged."""
    g = torch.Generator().manual_seed(5)
    backend, runner, cfg = _backend(g, max_context=256)
    backend._dense = SimpleNamespace()  # no multi-token extend here: the delegate is unused
    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    prefix = torch.randperm(SLOTS - 8, generator=g)[:199] + 8  # shared prompt slots
    rows, last = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]  # each request's own slot for the last token
    for row, slot in zip(rows, last):
        table[row, :199] = prefix.int()
        table[row, 199] = slot
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D,
                            v_head_dim=D, scaling=D ** -0.5)
    q_one = torch.randn(HQ * D, generator=g)
    k_one, v_one = torch.randn(HKV * D, generator=g), torch.randn(HKV * D, generator=g)
    q = q_one.repeat(5, 1)
    k, v = k_one.repeat(5, 1), v_one.repeat(5, 1)
    q[3] += 0.5  # request 4: another query
    v[4, 0] += 1.0  # request 5: another last value
    batch = SimpleNamespace(
        req_pool_indices=torch.tensor(rows), seq_lens=torch.full((5,), 200),
        extend_seq_lens_cpu=[1] * 5, extend_prefix_lens_cpu=[199] * 5,
        out_cache_loc=torch.tensor(last),
    )
    calls = []
    real = reference_decode.last_row_attention_fp32
    reference_decode.last_row_attention_fp32 = lambda *a: calls.append(1) or real(*a)
    try:
        out = backend.decoder.one_token_extend_rows(layer, q, k, v, batch, True, backend._dense)
    finally:
        reference_decode.last_row_attention_fp32 = real
    out = out.view(5, HQ, D)
    assert len(calls) == 3  # requests 1-3 share one computation; 4 and 5 differ
    for i, row in enumerate(rows):
        slots = table[row, :200].long()
        keys, values = pool.k[0][slots].double(), pool.v[0][slots].double()
        qi = q[i].view(HKV, HQ // HKV, D).double()
        weights = (torch.einsum("hgd,lhd->hgl", qi, keys) * layer.scaling).softmax(-1)
        expected = torch.einsum("hgl,lhd->hgd", weights, values).reshape(HQ, D)
        torch.testing.assert_close(out[i].double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out[3], out[0]) and not torch.equal(out[4], out[0])
