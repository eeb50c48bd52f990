"""Quest block scores for a whole decode batch, from the per-page key summaries.

For request ``b`` and kv head ``g``, block ``j`` (positions ``[j*bs, (j+1)*bs)``) lives in page
``req_to_token[row_b, j*bs] // bs``; its score is the Quest bound
``max_{h in group g} (q_h⁺ · kmax[page, g] + q_h⁻ · kmin[page, g])`` (the reference's
``quest_block_scores``). One program handles a tile of blocks of one (request, kv head): it
gathers the tile's summary rows and computes the bound as two small GEMMs
``[G, D] x [D, BLOCK_NB]`` over the group's query heads, then reduces over the group.

Blocks that are not candidates get ``-inf``: blocks at/after ``ceil(L / bs)`` and blocks with no
middle position (all positions inside the sink ``[0, sink)`` or the window ``[L - window, L)``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.selection.reference import quest_block_scores


@triton.jit
def _quest_block_scores_kernel(
    Q,
    KMIN,
    KMAX,
    REQ_TO_TOKEN,
    REQ_POOL_INDICES,
    SEQ_LENS,
    OUT,
    max_blocks,
    sink,
    window,
    stride_qb,
    stride_qh,
    stride_sp,
    stride_sh,
    stride_r2t,
    stride_ob,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    tile = tl.program_id(2)

    row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int64)
    hi = seq_len - window  # the middle is [sink, hi)

    j = tile * BLOCK_NB + tl.arange(0, BLOCK_NB)
    # block j overlaps the (non-empty) middle
    valid = (j < max_blocks) & (j * BLOCK_SIZE < hi) & ((j + 1) * BLOCK_SIZE > sink) & (hi > sink)
    first_slot = tl.load(
        REQ_TO_TOKEN + row * stride_r2t + j.to(tl.int64) * BLOCK_SIZE, mask=valid, other=0
    )
    page = first_slot.to(tl.int64) // BLOCK_SIZE

    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    summary = page[:, None] * stride_sp + g * stride_sh + d[None, :]
    smask = valid[:, None] & dmask[None, :]
    kmax = tl.load(KMAX + summary, mask=smask, other=0.0)  # [NB, D], shared by the group
    kmin = tl.load(KMIN + summary, mask=smask, other=0.0)
    q_base = Q + b.to(tl.int64) * stride_qb + (g * GROUP) * stride_qh

    if PRECISION == "fma":
        # small groups: one multiply-add pass per query head (no padding of the group to 16)
        score = tl.full([BLOCK_NB], float("-inf"), tl.float32)
        for hh in tl.static_range(GROUP):
            qh = tl.load(q_base + hh * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
            bound_h = tl.sum(
                kmax * tl.maximum(qh, 0.0)[None, :] + kmin * tl.minimum(qh, 0.0)[None, :], axis=1
            )
            score = tl.maximum(score, bound_h)
    else:
        # two GEMMs [G, D] x [D, NB] (G padded to the 16 rows tl.dot needs)
        hh = tl.arange(0, GROUP_PAD)
        hmask = hh < GROUP
        q = tl.load(
            q_base + hh[:, None] * stride_qh + d[None, :],
            mask=hmask[:, None] & dmask[None, :],
            other=0.0,
        ).to(tl.float32)
        bound = tl.dot(tl.maximum(q, 0.0), tl.trans(kmax), input_precision=PRECISION)
        bound = tl.dot(tl.minimum(q, 0.0), tl.trans(kmin), acc=bound, input_precision=PRECISION)
        bound = tl.where(hmask[:, None], bound, float("-inf"))  # [GP, NB]
        score = tl.max(bound, axis=0)
    score = tl.where(valid, score, float("-inf"))
    tl.store(OUT + b * stride_ob + g * stride_oh + j, score, mask=j < max_blocks)


def quest_block_scores_batched(
    q: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    block_size: int,
    sink: int,
    window: int,
    max_blocks: int,
    out: Tensor | None = None,
    precision: str | None = None,
) -> Tensor:
    """Quest block scores of every request of a decode batch: float32 ``[B, Hkv, max_blocks]``.

    ``q`` ``[B, Hq, D]``; ``kmin``/``kmax`` float32 ``[num_pages, Hkv, D]`` (page = slot //
    block_size); ``req_to_token`` int32 ``[rows, max_context]``; ``req_pool_indices`` ``[B]``;
    ``seq_lens`` ``[B]`` (the current token included). ``precision`` picks how the bound is
    computed: "ieee" (fp32 GEMMs on FMA units: exact fp32 products, so the top-k agrees with
    the fp32 reference), "tf32x3" (GEMMs on tensor cores, near-fp32), or "fma" (one
    multiply-add pass per query head, no padding of the group to tl.dot's 16 rows); None =
    "fma" for groups smaller than 8 query heads, "ieee" otherwise.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if kmin.stride(2) != 1 or kmax.stride() != kmin.stride():
        raise ValueError("kmin/kmax must share a layout with contiguous rows")
    if q.stride(2) != 1:
        q = q.contiguous()
    group = num_q_heads // num_kv_heads
    if precision is None:
        precision = "fma" if group < 8 else "ieee"
    if precision not in ("ieee", "tf32x3", "fma"):
        raise ValueError(f"precision must be ieee, tf32x3 or fma, got {precision!r}")
    if out is None:
        out = torch.empty(batch, num_kv_heads, max_blocks, dtype=torch.float32, device=q.device)
    if batch == 0 or max_blocks == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_nb = min(32, max(16, triton.next_power_of_2(max_blocks)))
    grid = (batch, num_kv_heads, triton.cdiv(max_blocks, block_nb))
    _quest_block_scores_kernel[grid](
        q,
        kmin,
        kmax,
        req_to_token,
        req_pool_indices,
        seq_lens,
        out,
        max_blocks,
        sink,
        window,
        q.stride(0),
        q.stride(1),
        kmin.stride(0),
        kmin.stride(1),
        req_to_token.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_NB=block_nb,
        PRECISION=precision,
        num_warps=8 if block_nb * block_d >= 4096 else 4,
    )
    return out


def quest_block_scores_batched_ref(
    q: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    block_size: int,
    sink: int,
    window: int,
    max_blocks: int,
) -> Tensor:
    """Plain-torch reference of :func:`quest_block_scores_batched` (loops over requests)."""
    batch = q.shape[0]
    num_kv_heads = kmin.shape[1]
    out = torch.full(
        (batch, num_kv_heads, max_blocks), float("-inf"), dtype=torch.float32, device=q.device
    )
    for b in range(batch):
        row, length = int(req_pool_indices[b]), int(seq_lens[b])
        num_blocks = min(-(-length // block_size), max_blocks)
        if num_blocks == 0:
            continue
        starts = torch.arange(num_blocks, device=q.device) * block_size
        pages = req_to_token[row, starts].long() // block_size
        scores = quest_block_scores(q[b], kmin[pages], kmax[pages])  # [Hkv, nb]
        lo, hi = sink, length - window
        has_middle = (starts < hi) & (starts + block_size > lo) & (hi > lo)
        out[b, :, :num_blocks] = scores.masked_fill(~has_middle, float("-inf"))
    return out
