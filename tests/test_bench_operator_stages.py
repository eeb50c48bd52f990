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


@pytest.mark.parametrize("rerank,prefilter", [(0, 0), (2, 0), (2, 2)])
def test_each_stage_alone_recomputes_the_selections_intermediates(rerank: int,
                                                                  prefilter: int) -> None:
    gen = case_generator("bench-stages", rerank, prefilter)
    hkv, group, dim, bs = 2, 2, 16, 4
    lens = [90, 70]
    pb = make_paged_batch(gen, lens, hkv, dim, bs)
    q = random_values(gen, len(lens), hkv * group, dim)
    channels = torch.stack([torch.randperm(dim, generator=gen)[:4] for _ in range(hkv)])
    params = SelectionParams("two_level", 32, bs, 6, 4, 8, block_score="label_max",
                             rerank=rerank, prefilter=prefilter)
    max_blocks = pb.req_to_token.shape[1] // bs
    ws = SparseDecodeWorkspace(len(lens), hkv * group, hkv, dim, params, max_blocks, "cpu",
                               q.dtype)
    cache = LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax, channels=channels)
    rows = DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens)
    select = lambda: select_slots_batched(q, cache, rows, params, ws)  # noqa: E731
    selected = select().clone()
    stages = dict(stage_builders(q, pb.k_buffer, pb.req_to_token, pb.req_pool_indices,
                                 pb.seq_lens, pb.kmin, pb.kmax, params, channels, ws, select))
    block_stages = (["block_bound", "block_prefilter_topk", "block_scores", "block_topk"]
                    if prefilter else ["block_scores", "block_topk"])
    assert list(stages) == block_stages + ["token_scores"] + (
        ["rerank_scores", "rerank_take_top"] if rerank else [])
    batch = len(lens)
    # what each stage writes: the cascade's label maximum and top-k have their own buffers
    written = {"token_scores": ws.token_scores, "block_scores": ws.block_scores}
    if prefilter:
        written |= {"block_bound": ws.block_scores, "block_prefilter_topk": ws.prefilter_top,
                    "block_scores": ws.prefilter_scores, "block_topk": ws.prefilter_pick}
    for name, buffer in written.items():
        before = buffer[:batch].clone()
        buffer[:batch].fill_(7)
        assert isinstance(stages[name]()(), torch.Tensor), name  # the timer clones one output
        assert torch.equal(buffer[:batch], before), name
    if rerank:
        before = ws.rerank_scores[:batch].clone()
        ws.rerank_scores[:batch].fill_(7.0)
        ws.reranked_slots[:batch].fill_(-5)
        stages["rerank_scores"]()()
        assert torch.equal(ws.rerank_scores[:batch], before)
        assert isinstance(stages["rerank_take_top"]()(), torch.Tensor)
        assert torch.equal(ws.reranked_slots[:batch], selected)
        # the rerank cut a longer shortlist to the budget
        assert ws.slots.shape[-1] > selected.shape[-1] == params.budget
