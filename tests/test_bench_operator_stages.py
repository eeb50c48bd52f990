"""The operator benchmark's per-stage timings (benchmarks/bench_operator.py ``--breakdown``): each
stage it times alone computes, from the intermediates one selection leaves in the workspace,
what that selection computed, with and without the exact rerank (Triton's interpreter here)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_operator import stage_builders
from sglang_ext.kernels.sparse_decode import (
    DecodeRows,
    LayerCache,
    SparseDecodeWorkspace,
    select_slots_batched,
)
from sglang_ext.kernels.testing import case_generator, make_paged_batch, random_values
from sglang_ext.selection.params import SelectionParams


@pytest.mark.parametrize("rerank", [0, 2])
def test_each_stage_alone_recomputes_the_selections_intermediates(rerank: int) -> None:
    gen = case_generator("bench-stages", rerank)
    hkv, group, dim, bs = 2, 2, 16, 4
    lens = [90, 70]
    pb = make_paged_batch(gen, lens, hkv, dim, bs)
    q = random_values(gen, len(lens), hkv * group, dim)
    channels = torch.stack([torch.randperm(dim, generator=gen)[:4] for _ in range(hkv)])
    params = SelectionParams("two_level", 32, bs, 6, 4, 8, block_score="label_max",
                             rerank=rerank)
    max_blocks = pb.req_to_token.shape[1] // bs
    ws = SparseDecodeWorkspace(len(lens), hkv * group, hkv, dim, params, max_blocks, "cpu",
                               q.dtype)
    cache = LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax, channels=channels)
    rows = DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens)
    select = lambda: select_slots_batched(q, cache, rows, params, ws)  # noqa: E731
    selected = select().clone()
    stages = dict(stage_builders(q, pb.k_buffer, pb.req_to_token, pb.req_pool_indices,
                                 pb.seq_lens, pb.kmin, pb.kmax, params, channels, ws, select))
    want = ["block_scores", "block_topk", "token_scores"]
    assert list(stages) == want + (["rerank_scores", "rerank_take_top"] if rerank else [])
    batch = len(lens)
    for name, buffer in [("block_scores", ws.block_scores), ("token_scores", ws.token_scores)]:
        before = buffer[:batch].clone()
        buffer[:batch].fill_(7.0)
        stages[name]()()
        assert torch.equal(buffer[:batch], before), name
    if rerank:
        before = ws.rerank_scores[:batch].clone()
        ws.rerank_scores[:batch].fill_(7.0)
        ws.reranked_slots[:batch].fill_(-5)
        stages["rerank_scores"]()()
        assert torch.equal(ws.rerank_scores[:batch], before)
        stages["rerank_take_top"]()()
        assert torch.equal(ws.reranked_slots[:batch], selected)
        # the rerank cut a longer shortlist to the budget
        assert ws.slots.shape[-1] > selected.shape[-1] == params.budget
