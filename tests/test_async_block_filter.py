"""--sparse-block-filter async (sglang_ext/attention/async_block_filter.py) through the backend:
a prefill, then decode steps of a batch of mixed lengths. Each step's output must be the
reference decode whose block filter ran one step earlier (the previous step's query and length;
a request's first step: its last prompt token's), with the tokens picked by this step's query.
On the CPU the batched decode's filter runs in line and the reference decode ranks the blocks
with each row's previous query (server-wide or asked for by a request); the GPU tests run the
batched one on its side stream, eagerly and inside a CUDA graph."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from sglang_ext.attention import request_overrides
from sglang_ext.attention.async_block_filter import last_token_queries
from sglang_ext.attention.features.async_filter import KernelAsyncFilter
from sglang_ext.attention.sparse_backend import SparseDecodeBackend
from sglang_ext.config import ConfigError, build_config
from sglang_ext.kernels.sparse_decode import sparse_decode_batched_ref

from fake_backend import DecodeMode, ExtendMode, FakePool, FakeReqToTokenPool

HQ, HKV, D, LAYERS, BS = 4, 2, 16, 2, 4
STEPS = 3
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class KvWritingDelegate:
    """SGLang's dense extend, as far as this test needs it: store the extend's K/V, return
    zeros (the prefill's output is not what is checked here)."""

    def __init__(self, pool: FakePool) -> None:
        self.pool = pool

    def init_forward_metadata(self, forward_batch) -> None:
        """Nothing to plan: forward_extend below neither reads metadata nor attends."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        self.pool.set_kv_buffer(layer, SimpleNamespace(loc=forward_batch.out_cache_loc), k, v)
        return q.new_zeros(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)


def _setup(device: str, block_filter: str = "async", method: str = "two_level",
           impl: str = "triton", request_filter: str | None = None):
    lens = [9, 28, 45, 70]  # one within the budget, the others sparse
    rows = [3, 1, 6, 2]  # scattered rows, never 0 (the padding row)
    max_context = max(lens) + STEPS + BS
    cfg = build_config(method=method, budget=24, block_size=BS, sink=4, window=8,
                       candidate_blocks=4, impl=impl, block_filter=block_filter)
    gen = torch.Generator().manual_seed(7)
    slots_total = BS * (2 + len(rows) * -(-max_context // BS))
    pool = FakePool([torch.zeros(slots_total, HKV, D, device=device) for _ in range(LAYERS)],
                    [torch.zeros(slots_total, HKV, D, device=device) for _ in range(LAYERS)])
    table = torch.zeros(8, max_context, dtype=torch.int32, device=device)
    pages = (torch.randperm(slots_total // BS - 1, generator=gen) + 1).tolist()
    per_req = -(-max_context // BS)
    for i, row in enumerate(rows):
        own = torch.tensor(pages[i * per_req:(i + 1) * per_req])
        table[row] = (own[:, None] * BS + torch.arange(BS)).flatten()[:max_context].int()
    runner = SimpleNamespace(
        device=device, req_to_token_pool=FakeReqToTokenPool(table),
        token_to_kv_pool=pool, model_config=SimpleNamespace(num_attention_heads=HQ),
        server_args=SimpleNamespace(page_size=BS, enable_metrics=False), dtype=torch.float32)
    backend = SparseDecodeBackend(runner, cfg)
    backend._dense = KvWritingDelegate(pool)
    if request_filter is not None:  # every request asks for it (custom_params)
        reqs = [SimpleNamespace(req_pool_idx=row, sampling_params=SimpleNamespace(
            custom_params={"sparse": {"block_filter": request_filter}})) for row in rows]
        request_overrides.record(runner.req_to_token_pool, reqs, cfg)
    return backend, pool, table, rows, lens, gen


def _layer(layer_id: int):
    from sglang.srt.layers.radix_attention import AttentionType

    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D,
                           v_head_dim=D, scaling=D ** -0.5, is_cross_attention=False,
                           attn_type=AttentionType.DECODER, sliding_window_size=-1)


def _prefill(backend, table, rows, lens, gen, device):
    """One extend of every prompt; returns each layer's last-token queries [B, Hq, D]."""
    idx = torch.tensor(rows, device=device)
    seq = torch.tensor(lens, device=device)
    loc = torch.cat([table[row, :n] for row, n in zip(rows, lens)]).long()
    batch = SimpleNamespace(
        forward_mode=ExtendMode(), req_pool_indices=idx, seq_lens=seq, seq_lens_cpu=seq.cpu(),
        extend_seq_lens=seq, extend_seq_lens_cpu=list(lens), extend_prefix_lens=seq * 0,
        extend_prefix_lens_cpu=[0] * len(lens), out_cache_loc=loc, encoder_lens=None)
    backend.init_forward_metadata(batch)
    last = []
    for layer_id in range(LAYERS):
        q, k, v = (torch.randn(loc.shape[0], HQ * D, generator=gen).to(device) for _ in range(3))
        backend.forward_extend(q, k[:, :HKV * D], v[:, :HKV * D], _layer(layer_id), batch)
        last.append(last_token_queries(q.view(-1, HQ, D), seq))
    return last


def _decode_inputs(table, rows, lens, gen, device):
    seq = torch.tensor(lens, device=device)
    batch = SimpleNamespace(
        forward_mode=DecodeMode(), batch_size=len(rows),
        req_pool_indices=torch.tensor(rows, device=device), seq_lens=seq, seq_lens_cpu=seq.cpu(),
        out_cache_loc=torch.stack([table[r, n - 1] for r, n in zip(rows, lens)]).long())
    per_layer = [tuple(torch.randn(len(rows), n, generator=gen).to(device)
                       for n in (HQ * D, HKV * D, HKV * D)) for _ in range(LAYERS)]
    return batch, per_layer


def _check_step(backend, pool, table, batch, per_layer, outs, block_q, block_lens):
    # the asynchronous filter ranks blocks by the bound (server-wide or asked for by a request)
    params = dataclasses.replace(backend.default_params, block_filter="sync", block_score="bound")
    for layer_id, ((q, _, _), out) in enumerate(zip(per_layer, outs)):
        want, _, _ = sparse_decode_batched_ref(
            q.view(-1, HQ, D), pool.k[layer_id], pool.v[layer_id], table,
            batch.req_pool_indices, batch.seq_lens, params, D ** -0.5,
            block_queries=block_q[layer_id], block_lens=block_lens)
        torch.testing.assert_close(out.view(-1, HQ, D), want, rtol=1e-4, atol=1e-5)


def _run(device: str, method: str = "two_level", graph: bool = False, impl: str = "triton",
         block_filter: str = "async", request_filter: str | None = None) -> None:
    backend, pool, table, rows, lens, gen = _setup(device, block_filter, method, impl,
                                                   request_filter)
    block_q = _prefill(backend, table, rows, lens, gen, device)
    block_lens = torch.tensor(lens, device=device)
    for step in range(STEPS):
        lens = [n + 1 for n in lens]
        batch, per_layer = _decode_inputs(table, rows, lens, gen, device)
        backend.init_forward_metadata(batch)

        def forward():
            return [backend.forward_decode(q, k, v, _layer(i), batch).clone()
                    for i, (q, k, v) in enumerate(per_layer)]

        if graph and step == STEPS - 1:
            # the last step replays a captured graph (the side stream's fork and join inside)
            next_blocks = backend.decoder.feature(KernelAsyncFilter).filter.next_blocks
            saved = [t.clone() for t in (*pool.k, *pool.v, next_blocks)]
            # SGLang's capture: warm-up runs, then the capture, all from one plan (each run
            # must start and end the step, or the graph misses the side stream's join)
            forward()
            for t, s in zip((*pool.k, *pool.v, next_blocks), saved):
                t.copy_(s)
            torch.cuda.synchronize()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                outs = forward()
            for t, s in zip((*pool.k, *pool.v, next_blocks), saved):
                t.copy_(s)  # capturing ran nothing: the replay is the step
            captured.replay()
            torch.cuda.synchronize()
        else:
            outs = forward()
        _check_step(backend, pool, table, batch, per_layer, outs, block_q, block_lens)
        block_q = [q.view(-1, HQ, D) for q, _, _ in per_layer]
        block_lens = batch.seq_lens


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("method", ["two_level", "quest"])
def test_decode_attends_the_blocks_chosen_a_step_earlier(method, impl):
    _run("cpu", method, impl=impl)


def test_a_request_asks_for_it_on_the_reference_decode():
    _run("cpu", impl="reference", block_filter="sync", request_filter="async")


def test_the_check_tells_the_async_filter_from_the_inline_one():
    """The same inputs through --sparse-block-filter sync differ from the one-step-late
    reference: the async test above could not pass with the filter run in line."""
    backend, pool, table, rows, lens, gen = _setup("cpu", block_filter="sync")
    block_q = _prefill(backend, table, rows, lens, gen, "cpu")
    lens = [n + 1 for n in lens]
    batch, per_layer = _decode_inputs(table, rows, lens, gen, "cpu")
    backend.init_forward_metadata(batch)
    outs = [backend.forward_decode(q, k, v, _layer(i), batch).clone()
            for i, (q, k, v) in enumerate(per_layer)]
    with pytest.raises(AssertionError):
        _check_step(backend, pool, table, batch, per_layer, outs, block_q,
                    torch.tensor(lens) - 1)


def test_last_token_queries_pick_each_requests_last_row():
    q = torch.arange(10.0).view(10, 1, 1)
    got = last_token_queries(q, torch.tensor([3, 1, 6]))
    assert got.flatten().tolist() == [2.0, 3.0, 9.0]


@pytest.mark.parametrize("flags, words", [
    (dict(method="ds"), "--sparse-method quest or two_level"),
    (dict(tier="async"), "--sparse-tier"),
    (dict(locality_blocks=2), "--sparse-locality-blocks"),
    (dict(guard_every=4), "--sparse-guard-every"),
    (dict(block_filter="later"), "must be one of sync, async"),
])
def test_flag_combinations_fail_at_start_up_in_one_line(flags, words):
    values = {"block_filter": "async", "budget": 256, "block_size": 16, **flags}
    with pytest.raises(ConfigError) as err:
        build_config(**values)
    assert "--sparse-block-filter" in str(err.value) and words in str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_request_value_is_refused_in_one_line():
    cfg = build_config(budget=24, block_size=BS, sink=4, window=8)
    with pytest.raises(ValueError, match="--sparse-block-filter must be one of sync, async"):
        request_overrides.parse_override({"sparse": {"block_filter": "later"}}, cfg)
    with pytest.raises(ValueError, match="async needs a block filter"):
        request_overrides.parse_override({"sparse": {"block_filter": "async", "method": "ds"}},
                                         cfg)


def test_mla_models_refuse_it_server_wide_and_per_request():
    from sglang_ext.attention.request_overrides import selection_params
    from sglang_ext.selection.mla import mla_unsupported

    cfg = build_config(block_filter="async")
    assert ("block_filter", "--sparse-block-filter async") in mla_unsupported(cfg)
    # a request's settings (SelectionParams) too: patches/sampling_params.py answers a 400
    assert mla_unsupported(selection_params(cfg)) == [("block_filter",
                                                       "--sparse-block-filter async")]
    assert not mla_unsupported(build_config())


@gpu
@needs_cuda
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gpu_side_stream_decode_matches_reference(graph):
    _run("cuda", graph=graph)
