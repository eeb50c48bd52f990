"""The exact rerank stage of ``--sparse-rerank`` (:func:`sglang_ext.selection.reference.
rerank_top_k_mask` is its oracle, per request).

The selection before it runs with a budget widened to ``sink + window + shortlist`` (the
shortlist: :func:`~sglang_ext.selection.reference.shortlist_tokens`), so its slot list holds the
sink, the window and the label scores' best ``shortlist`` tokens, or a whole context when that
is within the widened budget. Here each listed middle token is scored by the exact q·k over all
channels (max over the kv head's query heads), the sink and window and every token of a
context within the real budget are kept whatever they score, and the top ``budget`` entries
become the slot list the attention reads. Label scores read r of D channels; this stage reads
the whole key of ``shortlist`` tokens once more, which is what makes it faithful and what it
costs.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.kernels.topk import topk_masked
from sglang_ext.selection.params import SelectionParams, shortlist_tokens

RERANK_TILE = 64  # listed tokens per program
# The score of an entry kept whatever it scores: finite (the top-k takes finite entries only)
# and above any q·k.
KEPT = 3.0e38


def shortlist_selection(params: SelectionParams) -> SelectionParams:
    """The selection whose slot list the rerank reads: the budget widened by the shortlist,
    without the rerank itself."""
    n_sel = params.budget - params.sink - params.window
    return dataclasses.replace(
        params, rerank=0,
        budget=params.budget + (shortlist_tokens(params) - n_sel if n_sel > 0 else 0))


@triton.jit
def _exact_rerank_scores_kernel(
    Q,
    K_BUFFER,
    SLOTS,
    POSITIONS,
    SEQ_LENS,
    SCORES,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_sb,
    stride_sg,
    stride_pb,
    stride_pg,
    stride_ob,
    stride_og,
    LISTED: tl.constexpr,
    BUDGET: tl.constexpr,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILE: tl.constexpr,
    KEPT_SCORE: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    j = tl.program_id(2) * TILE + tl.arange(0, TILE)
    listed = j < LISTED
    slot = tl.load(SLOTS + b * stride_sb + g * stride_sg + j, mask=listed, other=-1).to(tl.int64)
    pos = tl.load(POSITIONS + b * stride_pb + g * stride_pg + j, mask=listed, other=-1)
    seq_len = tl.load(SEQ_LENS + b)
    valid = listed & (slot >= 0)
    # a middle token of a context longer than the budget competes; the rest is kept
    ranked = valid & (seq_len > BUDGET) & (pos >= SINK) & (pos < seq_len - WINDOW)
    d = tl.arange(0, BLOCK_D)
    keys = tl.load(K_BUFFER + slot[:, None] * stride_kt + g * stride_kh + d[None, :],
                   mask=ranked[:, None] & (d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
    best = tl.full([TILE], float("-inf"), tl.float32)
    for h in tl.static_range(GROUP):
        query = tl.load(Q + b * stride_qb + (g * GROUP + h) * stride_qh + d,
                        mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.sum(keys * query[None, :], axis=1))
    score = tl.where(ranked, best, tl.where(valid, KEPT_SCORE, float("-inf")))
    tl.store(SCORES + b * stride_ob + g * stride_og + j, score, mask=listed)


def exact_rerank_scores(q: Tensor, k_buffer: Tensor, slots: Tensor, positions: Tensor,
                        seq_lens: Tensor, params: SelectionParams, out: Tensor) -> Tensor:
    """float32 ``[B, Hkv, W]`` over the shortlist's slot list ``slots``/``positions``
    (int32 ``[B, Hkv, W]``, ``-1`` padded): a ranked token's exact q·k, :data:`KEPT` for what is
    kept anyway (sink, window, a context within ``params.budget``), ``-inf`` for padding."""
    batch, num_kv_heads, listed = slots.shape
    if batch == 0:
        return out
    head_dim = k_buffer.shape[2]
    grid = (batch, num_kv_heads, triton.cdiv(listed, RERANK_TILE))
    _exact_rerank_scores_kernel[grid](
        q, k_buffer, slots, positions, seq_lens, out,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        slots.stride(0), slots.stride(1), positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1),
        LISTED=listed, BUDGET=params.budget, SINK=params.sink, WINDOW=params.window,
        GROUP=q.shape[1] // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), TILE=RERANK_TILE, KEPT_SCORE=KEPT,
        num_warps=4,
    )
    return out


def exact_rerank_scores_ref(q: Tensor, k_buffer: Tensor, slots: Tensor, positions: Tensor,
                            seq_lens: Tensor, params: SelectionParams) -> Tensor:
    """Torch reference of :func:`exact_rerank_scores`."""
    batch, num_kv_heads, listed = slots.shape
    group = q.shape[1] // num_kv_heads
    lengths = seq_lens.long()[:, None, None]
    valid = slots >= 0
    pos = positions.long()
    ranked = (valid & (lengths > params.budget) & (pos >= params.sink)
              & (pos < lengths - params.window))
    keys = k_buffer[slots.long().clamp(min=0), torch.arange(num_kv_heads)[None, :, None]]
    qg = q.float().reshape(batch, num_kv_heads, group, -1)
    exact = torch.einsum("bgtd,bghd->bgth", keys.float(), qg).amax(-1)
    return torch.where(ranked, exact, torch.where(valid, KEPT, -torch.inf))


def take_top(slots: Tensor, positions: Tensor | None, scores: Tensor, budget: int,
             top: Tensor, out_slots: Tensor, out_positions: Tensor | None,
             impl: str = "triton") -> None:
    """The ``budget`` best-scored entries of each row of the slot list into ``out_slots``
    (and ``out_positions``), ``-1`` where a row lists fewer."""
    topk_masked(scores, budget, out=top, impl=impl)
    picked = top.long()
    missing = picked < 0
    index = picked.clamp(min=0)
    out_slots.copy_(slots.gather(2, index).masked_fill(missing, -1))
    if out_positions is not None and positions is not None:
        out_positions.copy_(positions.gather(2, index).masked_fill(missing, -1))
