"""kernels/rerank.py against its torch reference (Triton interpreter on the CPU)."""

from __future__ import annotations

import dataclasses

import torch

from sglang_ext.kernels.rerank import (
    KEPT,
    exact_rerank_scores,
    exact_rerank_scores_ref,
    shortlist_selection,
    take_top,
)
from sglang_ext.kernels.testing import case_generator, random_values
from sglang_ext.selection.reference import SelectionParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_shortlist_selection_widens_the_budget_by_the_shortlist() -> None:
    ds = SelectionParams("ds", 100, 4, 0, 4, 16, rerank=3)
    assert shortlist_selection(ds) == SelectionParams("ds", 20 + 3 * 80, 4, 0, 4, 16)
    two = SelectionParams("two_level", 100, 4, 30, 4, 16, rerank=4)  # 120 candidate tokens
    assert shortlist_selection(two).budget == 20 + 120 and shortlist_selection(two).rerank == 0
    # --sparse-rerank-min-tokens: a floor under the factor's shortlist, still capped by two_level's
    # candidates
    floor = dataclasses.replace(ds, rerank_min_tokens=500)
    assert shortlist_selection(floor).budget == 20 + 500
    assert shortlist_selection(dataclasses.replace(ds, rerank_min_tokens=100)).budget == 20 + 240
    assert shortlist_selection(dataclasses.replace(two, rerank_min_tokens=500)).budget == 20 + 120


def test_scores_match_reference_and_keep_what_is_not_ranked() -> None:
    gen = case_generator("rerank-scores")
    batch, hq, hkv, head_dim, num_slots, listed = 3, 6, 2, 24, 200, 70
    params = SelectionParams("ds", 40, 4, 0, 3, 5, rerank=2)
    k_buffer = random_values(gen, num_slots, hkv, head_dim, dtype=torch.float32, device=DEVICE)
    q = random_values(gen, batch, hq, head_dim, dtype=torch.float32, device=DEVICE)
    seq_lens = torch.tensor([30, 90, 150], dtype=torch.int32, device=DEVICE)  # first: dense
    positions = torch.stack([torch.randperm(int(n), generator=gen)[:listed] if n > listed else
                             torch.cat([torch.arange(int(n)), torch.full((listed - int(n),), -1)])
                             for n in seq_lens.tolist() for _ in range(hkv)]).view(batch, hkv, listed)
    slots = torch.where(positions >= 0, torch.randint(0, num_slots, positions.shape, generator=gen),
                        -1)
    positions, slots = positions.int().to(DEVICE), slots.int().to(DEVICE)
    out = torch.full((batch, hkv, listed), float("nan"), device=DEVICE)
    got = exact_rerank_scores(q, k_buffer, slots, positions, seq_lens, params, out)
    want = exact_rerank_scores_ref(q, k_buffer, slots, positions, seq_lens, params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got[0][positions[0] >= 0] == KEPT).all()  # a context within the budget: all kept
    assert (got[slots < 0] == float("-inf")).all()
    ranked = (positions[1] >= params.sink) & (positions[1] < 90 - params.window)
    assert (got[1][ranked] < KEPT).all() and (got[1][~ranked & (slots[1] >= 0)] == KEPT).all()

    top = torch.empty(batch, hkv, params.budget, dtype=torch.int32, device=DEVICE)
    final = torch.empty_like(top)
    final_pos = torch.empty_like(top)
    take_top(slots, positions, got, params.budget, top, final, final_pos)
    for b in range(batch):
        for g in range(hkv):
            order = want[b, g].argsort(descending=True, stable=True)[:params.budget]
            keep = want[b, g][order] > float("-inf")
            assert set(final_pos[b, g][final_pos[b, g] >= 0].tolist()) == \
                set(positions[b, g][order[keep]].tolist())
