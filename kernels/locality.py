"""NOSA's locality constraint in the batched, CUDA-graph-safe decode (the oracle is
:func:`sglang_ext.selection.locality.select_token_mask_locality`).

The constraint splits two_level's selected part: ``k_e`` blocks per (request, kv head) — the
query-agnostic set ``E_t`` — are kept by a fixed per-block eviction score under NOSA's rule
(candidates = ``E_{t-1}`` plus the blocks that just entered the middle; a candidate not kept is
evicted for good), the rest of the budget stays query-aware. In the batched pipeline
(:func:`sglang_ext.kernels.sparse_decode.select_slots_batched`) that is three additions:

1. **Page scores** (:func:`update_eviction_page_scores`), maintained as KV is written, like the
   page summaries: NOSA's two-stage pooled score (mean over 4-token sub-blocks, max over the
   block) of each page from its tokens' scores (``key_norm``: the key's L2 norm; ``learned``:
   the eviction head ``A·softplus(w·v + b)`` of the value). A page keeps two floats per kv head,
   the max over its completed sub-blocks' means and the running sum of the sub-block being
   written, so a page written over several calls (prefill chunks, decode tokens) needs no other
   state. A block's score is fixed once its page is complete; every block that enters the middle
   is complete (the window spans at least ``block_size - 1`` tokens, checked at start-up).
2. **The rule** (:func:`locality_update_batched`, one program per (request, kv head), after the
   Quest block scores): ``E_t`` is kept per request row as ``k_e`` block ids sorted by (score,
   lower id first), with their scores. The blocks that entered the middle since the last step
   are those after ``seen_upto`` (blocks are seen in order: every block up to the middle's last
   one has been a candidate), so "evicted" needs no state: seen and not kept. New blocks are
   merged into the sorted set tile by tile (rank = how many beat it; the kept set is already
   ranked, so only [k_e, tile] and [tile, tile] comparisons are needed). Then ``E_t``'s blocks
   get a block score of ``+inf``: the block top-k (``k = candidate_blocks + k_e``) takes them
   first and the top ``candidate_blocks`` of the other blocks, exactly the oracle's query-aware
   blocks; the token scoring gives ``E_t``'s middle tokens ``+inf`` too, so the token top-k
   (``k = n_sel``) takes them first and fills the rest of the budget (the oracle's per-head
   ``n_q``, which differs between heads whose ``E_t`` holds the partial last middle block) with
   the best query-aware tokens.
   With a limit on new filter blocks (``params.locality_new_blocks = F``, the oracle's
   ``_admit_new_blocks``; :func:`limit_new_blocks_batched`, then :func:`record_filter_batched`
   after the block top-k) a per-(row, kv head) bitmap keeps the last sparse step's filter;
   of the candidates outside it, only the top ``F`` by Quest bound keep their score.
3. **γ(t)** (:func:`locality_gamma_batched`, after the slot assembly): the share of a step's
   attended blocks that were attended at the request's previous sparse step, mean over kv heads,
   from a per-(row, kv head) bitmap of the previous step's blocks; accumulated on the device
   (sum, count, min) for the backend to read now and then.

Everything is static-shape with no host sync; loops have static trip counts (skipped tiles do
no work), so each step is captured in the decode CUDA graph. State lives in preallocated
tensors indexed by request row (:class:`LocalityKernelState`); a row that gets a new request is
reset before its prefill (:meth:`LocalityKernelState.reset_rows`). Contexts within the budget
decode densely and leave the state alone, as in the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.kernels.topk import topk_masked
from sglang_ext.selection.eviction_head import SUB_BLOCK
from sglang_ext.selection.locality import two_stage_pool

KERNEL_SCORE_KINDS = ("key_norm", "learned")  # "attention" needs the step's probabilities
_NO_BLOCK = tl.constexpr(1 << 30)  # id of an empty lane: loses every tie


def sub_block_size(block_size: int) -> int:
    """Tokens per sub-block of NOSA's two-stage pooling (``two_stage_pool``'s ``sub``)."""
    return max(1, min(SUB_BLOCK, block_size))


# ---------------------------------------------------------------------------- page scores


@triton.jit
def _log1p(u):
    """log(1 + u) accurate for tiny u (Goldberg's trick; no log1p in Triton's core)."""
    w = 1.0 + u
    return tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))


@triton.jit
def _update_page_scores_kernel(
    PAGE_SCORES,
    X,
    LOC,
    W,
    BIAS,
    SCALE,
    num_tokens,
    stride_pp,
    stride_ph,
    stride_xn,
    stride_xh,
    PAGE_SIZE: tl.constexpr,
    SUB: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LEARNED: tl.constexpr,
):
    """Program (n, g): if entry n starts a run (the call's consecutive entries on one page),
    fold the run's token scores of kv head g into its page's (max, partial) pair."""
    n = tl.program_id(0)
    g = tl.program_id(1)
    slot = tl.load(LOC + n).to(tl.int64)
    page = slot // PAGE_SIZE
    prev = tl.load(LOC + n - 1, mask=n > 0, other=0).to(tl.int64)
    if (n == 0) | ((prev // PAGE_SIZE) != page):
        o0 = slot % PAGE_SIZE
        # Lanes are page offsets: the run's token i sits at offset o0 + i.
        o = tl.arange(0, PAGE_SIZE)
        idx = n + (o - o0)
        cand = (o >= o0) & (idx < num_tokens)
        slots = tl.load(LOC + idx, mask=cand, other=-1).to(tl.int64)
        in_run = cand & (slots == page * PAGE_SIZE + o)  # consecutive, same page
        run_len = tl.sum(in_run.to(tl.int32), axis=0)
        o_end = o0 + run_len - 1

        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        x = tl.load(
            X + idx.to(tl.int64)[:, None] * stride_xn + g * stride_xh + d[None, :],
            mask=in_run[:, None] & dmask[None, :], other=0.0,
        ).to(tl.float32)  # [PAGE, D]
        if LEARNED:
            w = tl.load(W + g * HEAD_DIM + d, mask=dmask, other=0.0)
            z = tl.sum(x * w[None, :], axis=1) + tl.load(BIAS + g)
            # torch's softplus (threshold 20), computed without overflow
            soft = tl.where(z > 20.0, z, tl.maximum(z, 0.0) + _log1p(tl.exp(-tl.abs(z))))
            score = tl.load(SCALE + g) * soft
        else:
            score = tl.sqrt(tl.sum(x * x, axis=1))
        score = tl.where(in_run, score, 0.0)

        base = PAGE_SCORES + page * stride_pp + g * stride_ph
        reset = o0 == 0  # the page's first token: a reused page forgets its old request
        old_max = tl.where(reset, float("-inf"), tl.load(base))
        old_partial = tl.where(reset, 0.0, tl.load(base + 1))
        # The unfinished sub-block's earlier tokens join the sub-block the run continues.
        score += tl.where(o == (o0 // SUB) * SUB, old_partial, 0.0)
        sums = tl.sum(tl.reshape(score, (PAGE_SIZE // SUB, SUB)), axis=1)
        j = tl.arange(0, PAGE_SIZE // SUB)
        done_now = ((j + 1) * SUB > o0) & ((j + 1) * SUB <= o_end + 1)
        new_max = tl.maximum(old_max, tl.max(tl.where(done_now, sums / SUB, float("-inf")),
                                              axis=0))
        open_sub = ((o_end + 1) % SUB != 0) & (j == o_end // SUB)
        new_partial = tl.sum(tl.where(open_sub, sums, 0.0), axis=0)
        tl.store(base, new_max)
        tl.store(base + 1, new_partial)


def allocate_eviction_page_scores(num_slots: int, num_kv_heads: int, page_size: int,
                                  device: Any = None) -> Tensor:
    """Per-page eviction score state for ``num_slots`` KV slots: float32 ``[num_pages, Hkv,
    2]`` (max over completed sub-blocks' means, running sum of the open sub-block)."""
    num_pages = -(-num_slots // page_size)
    state = torch.zeros(num_pages, num_kv_heads, 2, dtype=torch.float32, device=device)
    state[..., 0] = float("-inf")
    return state


def update_eviction_page_scores(
    page_scores: Tensor, x: Tensor, loc: Tensor, page_size: int, kind: str,
    head: tuple[Tensor, Tensor, Tensor] | None = None,
) -> None:
    """Fold the tokens written at slots ``loc`` ``[N]`` into their pages' eviction scores
    (in place). ``x`` ``[N, Hkv, D]``: the keys (``kind="key_norm"``) or the values
    (``"learned"``, with ``head`` = float32 ``(weight [Hkv, D], bias [Hkv], scale [Hkv])``).
    Same precondition as :func:`~sglang_ext.kernels.block_summary.update_block_summaries`:
    within one call, a page's entries are consecutive and in position order. Launch-only."""
    if kind not in KERNEL_SCORE_KINDS:
        raise ValueError(f"kind must be one of {KERNEL_SCORE_KINDS}, got {kind!r}")
    if (kind == "learned") != (head is not None):
        raise ValueError("the learned score needs the eviction head (and only it does)")
    num_tokens, num_kv_heads, head_dim = x.shape
    if num_tokens == 0:
        return
    if page_scores.shape[1:] != (num_kv_heads, 2) or not page_scores.is_contiguous():
        raise ValueError(f"page_scores must be contiguous [pages, {num_kv_heads}, 2]")
    if x.stride(2) != 1:
        x = x.contiguous()
    loc = loc.reshape(-1)
    weight, bias, scale = head if head is not None else (page_scores,) * 3
    _update_page_scores_kernel[(num_tokens, num_kv_heads)](
        page_scores, x, loc, weight, bias, scale, num_tokens,
        page_scores.stride(0), page_scores.stride(1), x.stride(0), x.stride(1),
        PAGE_SIZE=page_size, SUB=sub_block_size(page_size), HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), LEARNED=kind == "learned", num_warps=4,
    )


def pooled_page_scores_ref(token_scores: Tensor, block_size: int) -> Tensor:
    """Reference of the pooled scores of complete pages: ``two_stage_pool`` of the tokens'
    scores ``[Hkv, n]`` (positions in order, ``n`` a multiple of ``block_size``)."""
    return two_stage_pool(token_scores, block_size, sub_block_size(block_size))


def eviction_head_tensors(head: Any, layer: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(weight [Hkv, D], bias [Hkv], scale [Hkv])`` float32 of one layer of an
    :class:`~sglang_ext.selection.eviction_head.EvictionHeads`, for the kernel."""
    return tuple(t[layer].detach().float().contiguous()
                 for t in (head.weight, head.bias, head.scale))


# ------------------------------------------------------------------------------ the rule


@triton.jit
def _beats(score_a, id_a, score_b, id_b):
    """Whether a ranks before b: higher score, ties to the lower block id."""
    return (score_a > score_b) | ((score_a == score_b) & (id_a < id_b))


@triton.jit
def _locality_update_kernel(
    KEEP_IDS,
    KEEP_SCORES,
    SEEN_UPTO,
    PAGE_SCORES,
    BLOCK_SCORES,
    REQ_TO_TOKEN,
    REQ_POOL_INDICES,
    SEQ_LENS,
    stride_kr,
    stride_kg,
    stride_sr,
    stride_pp,
    stride_ph,
    stride_bb,
    stride_bg,
    stride_r2t,
    max_blocks,
    BUDGET: tl.constexpr,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    K_E: tl.constexpr,
    K_PAD: tl.constexpr,
    TILE: tl.constexpr,
    NUM_TILES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int64)
    if seq_len > BUDGET:  # contexts within the budget decode densely: state untouched
        row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
        last = (seq_len - WINDOW - 1) // BLOCK_SIZE  # the middle's last block
        seen = tl.load(SEEN_UPTO + row * stride_sr + g).to(tl.int64)
        start = tl.maximum(seen + 1, SINK // BLOCK_SIZE)  # first block not yet a candidate
        keep_ids = KEEP_IDS + row * stride_kr + g * stride_kg
        keep_scores = KEEP_SCORES + row * stride_kr + g * stride_kg
        c = tl.arange(0, K_PAD)
        t = tl.arange(0, TILE)
        for it in range(NUM_TILES):
            tile_start = start + it * TILE
            if tile_start <= last:
                cur_id = tl.load(keep_ids + c, mask=c < K_E, other=-1)
                cur_ok = cur_id >= 0
                cur_score = tl.load(keep_scores + c, mask=cur_ok, other=float("-inf"))
                cur_key = tl.where(cur_ok, cur_id, _NO_BLOCK)
                blk = tile_start + t
                new = (blk <= last) & (blk < max_blocks)
                first_slot = tl.load(REQ_TO_TOKEN + row * stride_r2t + blk * BLOCK_SIZE,
                                     mask=new, other=0)
                page = first_slot.to(tl.int64) // BLOCK_SIZE
                new_score = tl.load(PAGE_SCORES + page * stride_pp + g * stride_ph, mask=new,
                                    other=float("-inf"))
                new_score = tl.where(new, new_score, float("-inf"))
                new_key = tl.where(new, blk, _NO_BLOCK)
                # The kept set is stored ranked, so a kept block's rank is its index plus the
                # new blocks that beat it; a new block's, the blocks of both kinds that beat it.
                beat_kept = _beats(new_score[None, :], new_key[None, :], cur_score[:, None],
                                   cur_key[:, None])
                rank_kept = c + tl.sum(beat_kept.to(tl.int32), axis=1)
                beat_new = _beats(cur_score[None, :], cur_key[None, :], new_score[:, None],
                                  new_key[:, None])
                beat_new_t = _beats(new_score[None, :], new_key[None, :], new_score[:, None],
                                    new_key[:, None])
                rank_new = tl.sum(beat_new.to(tl.int32), axis=1) + tl.sum(
                    beat_new_t.to(tl.int32), axis=1)
                tl.debug_barrier()  # every lane has read the kept set before it is rewritten
                keep_kept = cur_ok & (rank_kept < K_E)
                tl.store(keep_ids + rank_kept, cur_id, mask=keep_kept)
                tl.store(keep_scores + rank_kept, cur_score, mask=keep_kept)
                keep_new = new & (rank_new < K_E)
                tl.store(keep_ids + rank_new, blk.to(tl.int32), mask=keep_new)
                tl.store(keep_scores + rank_new, new_score, mask=keep_new)
                tl.debug_barrier()
        tl.store(SEEN_UPTO + row * stride_sr + g, tl.maximum(seen, last).to(tl.int32))
        # E_t first: its blocks outrank every Quest bound in the block top-k.
        kept = tl.load(keep_ids + c, mask=c < K_E, other=-1)
        tl.store(BLOCK_SCORES + b * stride_bb + g * stride_bg + kept, float("inf"),
                 mask=kept >= 0)


def locality_update_batched(
    state: "LocalityLayerState", block_scores: Tensor, req_to_token: Tensor,
    req_pool_indices: Tensor, seq_lens: Tensor, params: Any, tile: int = 32,
) -> None:
    """NOSA's rule for one layer of a decode batch (see the module docstring): updates
    ``state``'s kept sets and sets ``block_scores`` (float32 ``[B, Hkv, max_blocks]``, the
    Quest scores) to ``+inf`` on each request's ``E_t``. Launch-only."""
    batch, num_kv_heads, max_blocks = block_scores.shape
    k_e = state.keep_ids.shape[-1]
    if batch == 0:
        return
    _locality_update_kernel[(batch, num_kv_heads)](
        state.keep_ids, state.keep_scores, state.seen_upto, state.page_scores, block_scores,
        req_to_token, req_pool_indices, seq_lens,
        state.keep_ids.stride(0), state.keep_ids.stride(1), state.seen_upto.stride(0),
        state.page_scores.stride(0), state.page_scores.stride(1), block_scores.stride(0),
        block_scores.stride(1), req_to_token.stride(0), max_blocks,
        BUDGET=params.budget, SINK=params.sink, WINDOW=params.window,
        BLOCK_SIZE=params.block_size, K_E=k_e, K_PAD=triton.next_power_of_2(k_e), TILE=tile,
        NUM_TILES=triton.cdiv(max_blocks, tile), num_warps=4,
    )


# ------------------------------------------------------- the limit on new filter blocks


@triton.jit
def _has_prev(prev, NUM_WORDS: tl.constexpr, WORD_BLOCK: tl.constexpr,
              WORD_TILES: tl.constexpr):
    """Whether a row's bitmap of the previous filter has any bit set (a previous sparse step)."""
    any_bit = tl.zeros([], tl.int32)
    for wt in range(WORD_TILES):
        w = wt * WORD_BLOCK + tl.arange(0, WORD_BLOCK)
        words = tl.load(prev + w, mask=w < NUM_WORDS, other=0)
        any_bit = tl.maximum(any_bit, tl.max((words != 0).to(tl.int32), axis=0))
    return any_bit


@triton.jit
def _fresh_scores_kernel(
    BLOCK_SCORES,
    FRESH,
    PREV_FILTER,
    REQ_POOL_INDICES,
    SEQ_LENS,
    stride_bb,
    stride_bg,
    stride_pr,
    stride_pg,
    max_blocks,
    BUDGET: tl.constexpr,
    NUM_WORDS: tl.constexpr,
    WORD_BLOCK: tl.constexpr,
    WORD_TILES: tl.constexpr,
    TILE: tl.constexpr,
    NUM_TILES: tl.constexpr,
):
    """Program (b, g): ``FRESH`` = the block scores of the query-aware candidates outside the
    previous filter (``-inf`` elsewhere, and everywhere for rows without a previous sparse
    step), the input of the top-``F`` that admits them."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    seq_len = tl.load(SEQ_LENS + b)
    row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
    prev = PREV_FILTER + row * stride_pr + g * stride_pg
    limited = (seq_len > BUDGET) & (_has_prev(prev, NUM_WORDS, WORD_BLOCK, WORD_TILES) > 0)
    scores = BLOCK_SCORES + b * stride_bb + g * stride_bg
    fresh = FRESH + b * stride_bb + g * stride_bg
    for it in range(NUM_TILES):
        j = it * TILE + tl.arange(0, TILE)
        ok = j < max_blocks
        s = tl.load(scores + j, mask=ok & limited, other=float("-inf"))
        word = tl.load(prev + j // 32, mask=ok & limited, other=0)
        resident = ((word >> (j % 32)) & 1) != 0
        tl.store(fresh + j, tl.where(resident | (s == float("inf")), float("-inf"), s), mask=ok)


@triton.jit
def _admit_kernel(
    BLOCK_SCORES,
    FRESH,
    ADMITTED,
    stride_bb,
    stride_bg,
    stride_ab,
    stride_ag,
    max_blocks,
    LIMIT: tl.constexpr,
    LIMIT_PAD: tl.constexpr,
    TILE: tl.constexpr,
    NUM_TILES: tl.constexpr,
):
    """Program (b, g): every candidate outside the previous filter (finite in ``FRESH``) sits
    this step out (``-inf``) except the ``LIMIT`` admitted ones (``ADMITTED``, the top-k of
    ``FRESH``), which get their score back. Rows that are not limited have an all ``-inf``
    ``FRESH`` (no admitted ids either), so they are left as they are."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    scores = BLOCK_SCORES + b * stride_bb + g * stride_bg
    fresh = FRESH + b * stride_bb + g * stride_bg
    for it in range(NUM_TILES):
        j = it * TILE + tl.arange(0, TILE)
        f = tl.load(fresh + j, mask=j < max_blocks, other=float("-inf"))
        tl.store(scores + j, float("-inf"), mask=(j < max_blocks) & (f > float("-inf")))
    tl.debug_barrier()
    a = tl.arange(0, LIMIT_PAD)
    ids = tl.load(ADMITTED + b * stride_ab + g * stride_ag + a, mask=a < LIMIT, other=-1)
    tl.store(scores + ids, tl.load(fresh + ids, mask=ids >= 0, other=0.0), mask=ids >= 0)


@triton.jit
def _record_filter_kernel(
    TOP_BLOCKS,
    PREV_FILTER,
    REQ_POOL_INDICES,
    SEQ_LENS,
    stride_tb,
    stride_tg,
    stride_pr,
    stride_pg,
    BUDGET: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    NUM_WORDS: tl.constexpr,
    WORD_BLOCK: tl.constexpr,
    WORD_TILES: tl.constexpr,
):
    """Program (b, g) of a sparse row: the row's bitmap becomes this step's block filter."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    if tl.load(SEQ_LENS + b) > BUDGET:
        row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
        prev = PREV_FILTER + row * stride_pr + g * stride_pg
        for wt in range(WORD_TILES):
            w = wt * WORD_BLOCK + tl.arange(0, WORD_BLOCK)
            tl.store(prev + w, tl.zeros([WORD_BLOCK], tl.int32), mask=w < NUM_WORDS)
        tl.debug_barrier()
        c = tl.arange(0, K_PAD)
        blk = tl.load(TOP_BLOCKS + b * stride_tb + g * stride_tg + c, mask=c < K, other=-1)
        tl.atomic_or(prev + blk // 32, (1 << (blk % 32)).to(tl.int32), mask=blk >= 0)


def _word_tiling(words: int) -> dict[str, int]:
    block = min(1024, triton.next_power_of_2(words))
    return dict(NUM_WORDS=words, WORD_BLOCK=block, WORD_TILES=triton.cdiv(words, block))


def limit_new_blocks_batched(
    state: "LocalityLayerState", block_scores: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, params: Any, fresh: Tensor, admitted: Tensor, impl: str = "triton",
    tile: int = 1024,
) -> None:
    """``params.locality_new_blocks`` for one layer of a decode batch, after the rule (E_t at
    ``+inf``) and before the block top-k: per sparse request with a previous sparse step and kv
    head, of the candidates outside the previous filter (``state.prev_filter``) only the
    ``F`` best keep their score in ``block_scores`` (float32 ``[B, Hkv, max_blocks]``, in place),
    the others get ``-inf``, which the top-k never takes (the oracle's ``_admit_new_blocks``).
    ``fresh`` (float32, like ``block_scores``) and ``admitted`` (int32 ``[B, Hkv, F]``) are
    workspace. Launch-only."""
    batch, num_kv_heads, max_blocks = block_scores.shape
    if batch == 0:
        return
    limit = params.locality_new_blocks
    prev = state.prev_filter
    tiles = dict(TILE=min(tile, triton.next_power_of_2(max_blocks)))
    tiles["NUM_TILES"] = triton.cdiv(max_blocks, tiles["TILE"])
    _fresh_scores_kernel[(batch, num_kv_heads)](
        block_scores, fresh, prev, req_pool_indices, seq_lens, block_scores.stride(0),
        block_scores.stride(1), prev.stride(0), prev.stride(1), max_blocks,
        BUDGET=params.budget, **_word_tiling(prev.shape[-1]), **tiles, num_warps=4,
    )
    topk_masked(fresh, limit, out=admitted, impl=impl)
    _admit_kernel[(batch, num_kv_heads)](
        block_scores, fresh, admitted, block_scores.stride(0), block_scores.stride(1),
        admitted.stride(0), admitted.stride(1), max_blocks, LIMIT=limit,
        LIMIT_PAD=triton.next_power_of_2(limit), **tiles, num_warps=4,
    )


def record_filter_batched(state: "LocalityLayerState", top_blocks: Tensor,
                          req_pool_indices: Tensor, seq_lens: Tensor, params: Any) -> None:
    """After the block top-k (``top_blocks`` int32 ``[B, Hkv, k]``, ``-1`` padded): each sparse
    request's filter, E_t included, becomes its row's previous filter. Launch-only."""
    batch, num_kv_heads, k = top_blocks.shape
    if batch == 0:
        return
    prev = state.prev_filter
    _record_filter_kernel[(batch, num_kv_heads)](
        top_blocks, prev, req_pool_indices, seq_lens, top_blocks.stride(0),
        top_blocks.stride(1), prev.stride(0), prev.stride(1), BUDGET=params.budget, K=k,
        K_PAD=triton.next_power_of_2(k), **_word_tiling(prev.shape[-1]), num_warps=4,
    )


# ---------------------------------------------------------------------------------- γ(t)


@triton.jit
def _popcount(words):
    """Set bits of each 32-bit word (SWAR, no intrinsic: also runs in the interpreter)."""
    x = words.to(tl.int64) & 0xFFFFFFFF
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0xFF


@triton.jit
def _locality_gamma_kernel(
    PREV,
    CUR,
    POSITIONS,
    SLOTS,
    REQ_POOL_INDICES,
    SEQ_LENS,
    STATS,
    GAMMA,
    stride_pr,
    stride_pg,
    stride_cb,
    stride_cg,
    stride_sb,
    stride_sg,
    BUDGET: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    NUM_WORDS: tl.constexpr,
    WORD_BLOCK: tl.constexpr,
    WORD_TILES: tl.constexpr,
    POS_BLOCK: tl.constexpr,
    POS_TILES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b)
    gamma = tl.full([], -1.0, tl.float32)
    if seq_len > BUDGET:
        row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
        share_sum = tl.zeros([], tl.float32)
        had_prev = tl.zeros([], tl.int32)
        for g in range(NUM_KV_HEADS):
            cur = CUR + b * stride_cb + g * stride_cg
            prev = PREV + row * stride_pr + g * stride_pg
            for wt in range(WORD_TILES):
                w = wt * WORD_BLOCK + tl.arange(0, WORD_BLOCK)
                tl.store(cur + w, tl.zeros([WORD_BLOCK], tl.int32), mask=w < NUM_WORDS)
            tl.debug_barrier()
            for jt in range(POS_TILES):
                j = jt * POS_BLOCK + tl.arange(0, POS_BLOCK)
                at = b * stride_sb + g * stride_sg + j
                pos = tl.load(POSITIONS + at, mask=j < BUDGET, other=-1)
                ok = (pos >= 0) & (tl.load(SLOTS + at, mask=j < BUDGET, other=-1) >= 0)
                blk = pos // BLOCK_SIZE
                # Runs of positions in one block (sink, window, a block's tokens) set its bit
                # once: only a run's first entry issues the atomic.
                before = tl.load(POSITIONS + at - 1, mask=(j > 0) & (j < BUDGET), other=-1)
                before_ok = (before >= 0) & (tl.load(SLOTS + at - 1, mask=(j > 0) & (j < BUDGET),
                                                     other=-1) >= 0)
                repeat = before_ok & (before // BLOCK_SIZE == blk)
                bit = (1 << (blk % 32)).to(tl.int32)
                tl.atomic_or(cur + blk // 32, bit, mask=ok & ~repeat)
            tl.debug_barrier()
            now = tl.zeros([], tl.int64)
            both = tl.zeros([], tl.int64)
            prev_any = tl.zeros([], tl.int32)
            for wt in range(WORD_TILES):
                w = wt * WORD_BLOCK + tl.arange(0, WORD_BLOCK)
                wm = w < NUM_WORDS
                c = tl.load(cur + w, mask=wm, other=0)
                p = tl.load(prev + w, mask=wm, other=0)
                now += tl.sum(_popcount(c), axis=0)
                both += tl.sum(_popcount(c & p), axis=0)
                prev_any = tl.maximum(prev_any, tl.max((p != 0).to(tl.int32), axis=0))
                tl.store(prev + w, c, mask=wm)
            share_sum += both.to(tl.float32) / tl.maximum(now, 1).to(tl.float32)
            had_prev = tl.maximum(had_prev, prev_any)
        if had_prev > 0:  # as in the oracle: only once the request has a previous step
            gamma = share_sum / NUM_KV_HEADS
            tl.atomic_add(STATS, gamma)
            tl.atomic_add(STATS + 1, 1.0)
            tl.atomic_min(STATS + 2, gamma)
    tl.store(GAMMA + b, gamma)


def locality_gamma_batched(
    state: "LocalityLayerState", positions: Tensor, slots: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, params: Any, scratch: Tensor, gamma_out: Tensor,
) -> None:
    """γ(t) of one layer of a decode batch: for each sparse request, the share of the blocks
    it attends now (``positions`` / ``slots`` int32 ``[B, Hkv, budget]`` from the assembly,
    attended where both are ``>= 0``) that it attended at its previous sparse step, mean over
    kv heads (``gamma_out[b]``, ``-1`` where not measured: dense rows, first sparse step),
    accumulated into ``state.gamma_stats`` (sum, count, min). ``scratch``: int32 ``[>= B, Hkv,
    words]``. Launch-only."""
    batch, num_kv_heads, budget = positions.shape
    if batch == 0:
        return
    pos_block = min(1024, triton.next_power_of_2(budget))
    _locality_gamma_kernel[(batch,)](
        state.prev_attended, scratch, positions, slots, req_pool_indices, seq_lens,
        state.gamma_stats, gamma_out,
        state.prev_attended.stride(0), state.prev_attended.stride(1), scratch.stride(0),
        scratch.stride(1), positions.stride(0), positions.stride(1),
        BUDGET=budget, BLOCK_SIZE=params.block_size, NUM_KV_HEADS=num_kv_heads,
        **_word_tiling(state.prev_attended.shape[-1]),
        POS_BLOCK=pos_block, POS_TILES=triton.cdiv(budget, pos_block), num_warps=4,
    )


def bitmap_words(max_blocks: int) -> int:
    return -(-max_blocks // 32)


# --------------------------------------------------------------------------------- state


@dataclass
class LocalityLayerState:
    """One layer's view of :class:`LocalityKernelState`, what the pipeline takes."""

    keep_ids: Tensor  # int32 [rows, Hkv, k_e]: E_t, ranked; -1 = empty
    keep_scores: Tensor  # float32 [rows, Hkv, k_e]: their eviction scores
    seen_upto: Tensor  # int32 [rows, Hkv]: last block that has been a candidate (-1: none)
    page_scores: Tensor  # float32 [num_pages, Hkv, 2]: see update_eviction_page_scores
    prev_attended: Tensor  # int32 [rows, Hkv, words]: blocks attended at the last sparse step
    gamma_stats: Tensor  # float32 [3]: sum, count, min of γ (shared by the layers)
    prev_filter: Tensor | None = None  # int32 [rows, Hkv, words]: the last sparse step's block
    # filter, E_t included (only with a limit on new blocks)


class LocalityKernelState:
    """Device state of the locality constraint for every layer and request row: the kept
    sets, the seen watermark, the γ bitmaps (all by row) and the page scores (by KV page);
    with ``limit_new_blocks`` (``params.locality_new_blocks > 0``) also a bitmap of each row's
    last block filter."""

    def __init__(self, *, num_layers: int, rows: int, num_kv_heads: int, k_e: int,
                 max_blocks: int, num_slots: int, page_size: int, device: Any,
                 limit_new_blocks: bool = False) -> None:
        if k_e < 1:
            raise ValueError(f"k_e must be >= 1, got {k_e}")
        kw: dict[str, Any] = {"device": device}
        shape = (num_layers, rows, num_kv_heads)
        self.keep_ids = torch.full((*shape, k_e), -1, dtype=torch.int32, **kw)
        self.keep_scores = torch.zeros((*shape, k_e), dtype=torch.float32, **kw)
        self.seen_upto = torch.full(shape, -1, dtype=torch.int32, **kw)
        self.prev_attended = torch.zeros((*shape, bitmap_words(max_blocks)), dtype=torch.int32,
                                         **kw)
        self.prev_filter = (torch.zeros_like(self.prev_attended) if limit_new_blocks else None)
        self.page_scores = [allocate_eviction_page_scores(num_slots, num_kv_heads, page_size,
                                                          device) for _ in range(num_layers)]
        self.gamma_stats = torch.empty(3, dtype=torch.float32, **kw)
        self.clear_gamma_stats()

    def layer(self, index: int) -> LocalityLayerState:
        return LocalityLayerState(
            self.keep_ids[index], self.keep_scores[index], self.seen_upto[index],
            self.page_scores[index], self.prev_attended[index], self.gamma_stats,
            None if self.prev_filter is None else self.prev_filter[index])

    def reset_rows(self, rows: Tensor) -> None:
        """Rows about to hold a new request forget the previous one's (static-shape fills)."""
        rows = rows.long()
        self.keep_ids.index_fill_(1, rows, -1)
        self.seen_upto.index_fill_(1, rows, -1)
        self.prev_attended.index_fill_(1, rows, 0)
        if self.prev_filter is not None:
            self.prev_filter.index_fill_(1, rows, 0)

    def clear_gamma_stats(self) -> None:
        self.gamma_stats[:2].zero_()
        self.gamma_stats[2:].fill_(float("inf"))

    def take_gamma_stats(self) -> tuple[float, int, float]:
        """(sum, count, min) of γ since the last call, then cleared (a host sync: rarely)."""
        total, count, minimum = self.gamma_stats.tolist()
        self.clear_gamma_stats()
        return total, int(count), minimum

    def nbytes(self) -> int:
        tensors = [self.keep_ids, self.keep_scores, self.seen_upto, self.prev_attended,
                   *self.page_scores, *([] if self.prev_filter is None else [self.prev_filter])]
        return sum(t.numel() * t.element_size() for t in tensors)
