"""Plain-torch reference for two-level sparse decode attention.

This module is the oracle the Triton kernels are tested against and what the CPU serving
backend runs each decode step. It handles one request's decode step:

* ``q``: ``[Hq, D]``, the new token's query (post-RoPE);
* ``keys``: ``[L, Hkv, D]`` and ``values``: ``[L, Hkv, Dv]``, the whole context in position
  order, the new token included as position ``L - 1``.

Query head ``h`` belongs to kv head ``h // (Hq // Hkv)``. Selection is per kv head: all query
heads of a group share one token set. Blocks are aligned at absolute positions (they coincide
with the KV pool's pages) and the last one may be partial. Scores are float32 whatever the
input dtype. Top-k ties go to the lower block / position so the oracle is deterministic.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import Tensor

from sglang_ext.selection.params import (  # noqa: F401  (the oracle's callers import them here too)
    BLOCK_SCORES,
    FP8_LABELS,
    FP8_MAX,
    FP8_SUMMARIES,
    LABEL_DTYPES,
    METHODS,
    SCORINGS,
    SUMMARY_DTYPE_NAMES,
    SelectionParams,
    label_storage_dtype,
    shortlist_tokens,
    summary_storage_dtype,
)


def to_label_storage(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in the label cache's storage dtype, rounded to nearest. fp8 saturates at its
    largest finite value (448 for e4m3): a plain cast turns anything beyond it into NaN."""
    if dtype == FP8_LABELS:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def to_fp8_directed(x: Tensor, up: bool) -> Tensor:
    """``x`` rounded to the float8_e4m3fn grid toward +inf (``up``) or -inf, as float8_e4m3fn.
    Values beyond ±448 saturate there (a plain cast would make them NaN). The kernels round the
    same way (:mod:`~sglang_ext.kernels.block_summary`): one round to nearest, then a step of
    one fp8 value where that went the wrong way."""
    x = x.float().clamp(-FP8_MAX, FP8_MAX)
    bits = x.to(FP8_SUMMARIES).view(torch.uint8).to(torch.int32)
    back = bits.to(torch.uint8).view(FP8_SUMMARIES).float()
    neg = bits >= 0x80  # sign-magnitude: a step away from zero is +1 on either side
    if up:
        step = back < x
        new = torch.where(neg, torch.where(bits == 0x80, 0x01, bits - 1), bits + 1)
    else:
        step = back > x
        new = torch.where(neg, bits + 1, torch.where(bits == 0x00, 0x81, bits - 1))
    return torch.where(step, new, bits).to(torch.uint8).view(FP8_SUMMARIES)


def round_summaries(kmin: Tensor, kmax: Tensor, summary_dtype: str) -> tuple[Tensor, Tensor]:
    """Block summaries as ``summary_dtype`` stores them, in float32: fp8 rounds every min down
    and every max up (:func:`to_fp8_directed`); "auto" keeps them (exact)."""
    if summary_dtype == "auto":
        return kmin, kmax
    if summary_dtype != "fp8_e4m3":
        raise ValueError(f"summary_dtype must be one of {SUMMARY_DTYPE_NAMES}, got "
                         f"{summary_dtype!r}")
    return to_fp8_directed(kmin, up=False).float(), to_fp8_directed(kmax, up=True).float()


def _group_queries(q: Tensor, num_kv_heads: int) -> Tensor:
    """``[Hq, D]`` -> float32 ``[Hkv, G, D]``: the query heads of each kv head's group."""
    num_q_heads = q.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    return q.float().reshape(num_kv_heads, num_q_heads // num_kv_heads, q.shape[1])


def widen_8bit_keys(keys: Tensor) -> Tensor:
    """Keys of an fp8 KV cache as bf16 (exact: every fp8 e4m3/e5m2 value is a bf16 value),
    others as they are: torch has no min/max or gather over 8-bit floats on the CPU."""
    return keys.to(torch.bfloat16) if keys.element_size() == 1 else keys


def block_minmax(keys: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Per-block elementwise min and max of the keys: float32 ``[NB, Hkv, D]`` each."""
    length, num_kv_heads, dim = keys.shape
    keys = widen_8bit_keys(keys)
    num_full = length // block_size
    full = keys[: num_full * block_size].reshape(num_full, block_size, num_kv_heads, dim)
    tail = keys[num_full * block_size :]  # the partial last block, possibly empty
    # min/max are exact in any float dtype: reduce in the input dtype and convert only the
    # summaries, not the whole context.
    mins, maxs = [full.amin(dim=1)], [full.amax(dim=1)]
    if tail.shape[0]:
        mins.append(tail.amin(dim=0, keepdim=True))
        maxs.append(tail.amax(dim=0, keepdim=True))
    return torch.cat(mins).float(), torch.cat(maxs).float()


def quest_block_scores(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Quest upper bound of q·k per block, max over each kv head's query heads: ``[Hkv, NB]``.

    The bound is ``sum_d max(q_d * kmax_d, q_d * kmin_d)``. Because ``kmin_d <= kmax_d``, the
    term is ``q_d * kmax_d`` when ``q_d >= 0`` and ``q_d * kmin_d`` when ``q_d < 0``, i.e.
    exactly ``q⁺_d * kmax_d + q⁻_d * kmin_d`` with ``q⁺ = max(q, 0)``, ``q⁻ = min(q, 0)`` (the
    other part is zero). Summing over d gives two GEMMs per kv-head group, which is how the GPU
    kernels compute it.
    """
    qg = _group_queries(q, kmin.shape[1])
    kmin_t = kmin.float().permute(1, 2, 0)  # [Hkv, D, NB]
    kmax_t = kmax.float().permute(1, 2, 0)
    bound = torch.bmm(qg.clamp(min=0), kmax_t) + torch.bmm(qg.clamp(max=0), kmin_t)
    return bound.amax(dim=1)


def label_max_block_scores(scores: Tensor, offset: int, block_size: int) -> Tensor:
    """Each block's largest token score: ``[Hkv, NB]`` from the scores ``[Hkv, M]`` of the
    positions ``offset .. offset + M`` (blocks aligned at absolute positions; positions outside
    the scored span count as ``-inf``)."""
    head = offset % block_size
    tail = (-(offset + scores.shape[1])) % block_size
    padded = torch.nn.functional.pad(scores, (head, tail), value=float("-inf"))
    return padded.reshape(scores.shape[0], -1, block_size).amax(dim=2)


def label_token_scores(q: Tensor, keys: Tensor, channels: Tensor | None,
                       label_dtype: str = "auto") -> Tensor:
    """Double-Sparsity label score per token, max over each kv head's query heads: ``[Hkv, L]``.

    ``channels`` (long ``[Hkv, r]``) are the calibrated heavy channels of each kv head; with
    ``None`` all D channels are used, i.e. the exact q·k. ``label_dtype`` (with channels): the
    label values as the label cache stores them (:func:`to_label_storage`), e.g. rounded to
    fp8, so that this reference scores what the batched decode scores.
    """
    qg = _group_queries(q, keys.shape[1])  # [Hkv, G, D]
    k = widen_8bit_keys(keys).transpose(0, 1)  # [Hkv, L, D]
    if channels is not None:
        qg = qg.gather(2, channels[:, None, :].expand(-1, qg.shape[1], -1))
        k = k.gather(2, channels[:, None, :].expand(-1, k.shape[1], -1))
        if label_dtype != "auto":
            k = to_label_storage(k, label_storage_dtype(label_dtype, k.dtype))
    return torch.bmm(qg, k.float().transpose(1, 2)).amax(dim=1)


def _top_k_mask(scores: Tensor, k: int) -> Tensor:
    """Bool mask of the ``k`` largest entries of each row, ties going to the lower index."""
    if k == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    # topk alone breaks ties arbitrarily; keep everything above the k-th value, then fill
    # the remaining slots with the earliest entries equal to it.
    kth = scores.topk(k, dim=1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    remaining = k - above.sum(dim=1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=1) <= remaining))


def output_aware_token_mask(scores: Tensor, value_norms: Tensor, total: int,
                            sm_scale: float) -> Tensor:
    """Fluxion's output-aware choice: bool ``[Hkv, M]`` with at most ``total`` entries overall.

    Each kv head's label scores (``-inf`` outside its candidates) give an estimate of its
    attention weights, ``softmax(score * sm_scale)``; a token's estimated contribution to the
    head's output is that weight times its value norm, normalised so that each head's
    contributions sum to 1. The ``total`` largest contributions over all heads are kept: a head
    whose attention is concentrated gives up slots to heads whose attention is spread out, and
    the tokens that move the output most win within a head. Ties go to the lower index, head
    by head."""
    weights = torch.softmax(scores.float() * sm_scale, dim=-1).nan_to_num(0.0)
    contrib = weights * value_norms.float()
    contrib = contrib / contrib.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    flat = contrib.reshape(1, -1)
    total = min(total, flat.shape[1])
    return _top_k_mask(flat, total).view_as(scores) & (scores > float("-inf"))


def rerank_top_k_mask(q: Tensor, keys: Tensor, label_scores: Tensor, k: int,
                      shortlist_size: int) -> Tensor:
    """Bool ``[Hkv, M]``: the ``k`` best of ``keys`` ``[M, Hkv, D]`` by label score, or with a
    ``shortlist_size`` (0: no rerank) by the exact q·k (all channels, max over each kv head's
    query heads) among the ``shortlist_size`` best by label score. Positions scored ``-inf``
    (outside the kept blocks) are never shortlisted."""
    if not shortlist_size:
        return _top_k_mask(label_scores, k)
    shortlist = _top_k_mask(label_scores, min(shortlist_size, label_scores.shape[1]))
    shortlist &= label_scores > float("-inf")
    exact = label_token_scores(q, keys, None).masked_fill(~shortlist, float("-inf"))
    return _top_k_mask(exact, k) & shortlist


def _bound_block_scores(q: Tensor, keys: Tensor, first: int, last: int,
                        params: SelectionParams) -> Tensor:
    """Quest's bound of the blocks ``first .. last``: ``[Hkv, last - first + 1]``. The slice
    starts on a block boundary, so its blocks are exactly these, summarised over all their
    positions (sink/window ones included), like the KV pool pages, and stored as
    ``params.summary_dtype`` stores them."""
    bs = params.block_size
    summaries = block_minmax(keys[first * bs : (last + 1) * bs], bs)
    return quest_block_scores(q, *round_summaries(*summaries, params.summary_dtype))


def _select_middle(
    q: Tensor,
    keys: Tensor,
    params: SelectionParams,
    lo: int,
    hi: int,
    channels: Tensor | None,
    values: Tensor | None = None,
    block_query: Tensor | None = None,
    block_hi: int | None = None,
) -> Tensor:
    """Bool ``[Hkv, hi - lo]``: the positions picked from the middle ``M = [lo, hi)``.

    ``block_query`` / ``block_hi`` (quest, two_level): the blocks are ranked by this query over
    the middle ``[lo, block_hi)`` of an earlier step (the asynchronous block filter: the
    previous step's query and middle); blocks past it are not kept."""
    n_sel = params.budget - params.sink - params.window
    if n_sel == 0:
        return torch.zeros(keys.shape[1], hi - lo, dtype=torch.bool, device=keys.device)
    shortlist = shortlist_tokens(params) if params.rerank else 0
    if params.rerank and hi - lo <= shortlist:
        return _top_k_mask(label_token_scores(q, keys[lo:hi], None), n_sel)
    if params.method == "ds":
        return rerank_top_k_mask(q, keys[lo:hi],
                                 label_token_scores(q, keys[lo:hi], channels, params.label_dtype),
                                 n_sel, shortlist)

    bs = params.block_size
    block_q = q if block_query is None else block_query
    block_hi = hi if block_hi is None else block_hi
    first, last = lo // bs, (block_hi - 1) // bs  # candidate blocks: those overlapping M
    num_cand = max(last - first + 1, 0)
    block_of_pos = torch.arange(lo, hi, device=keys.device) // bs - first
    token_scores = None
    if num_cand and params.block_score == "label_max":
        # the largest label score of each block's middle positions
        block_token_scores = label_token_scores(block_q, keys[lo:block_hi], channels,
                                                params.label_dtype)
        block_scores = label_max_block_scores(block_token_scores, lo, bs)
        if params.prefilter:
            # the cascade: the label maximum ranks only the bound's prefilter x candidates
            survivors = _top_k_mask(_bound_block_scores(block_q, keys, first, last, params),
                                    min(params.prefilter * params.candidate_blocks, num_cand))
            block_scores = block_scores.masked_fill(~survivors, float("-inf"))
        if block_query is None:
            token_scores = block_token_scores  # the same query and span: no second pass
    elif num_cand:
        block_scores = _bound_block_scores(block_q, keys, first, last, params)
    if num_cand:
        if params.method == "quest":
            num_kept = n_sel // bs  # whole blocks only, so the budget is never exceeded
        else:
            num_kept = min(params.candidate_blocks, num_cand)
        kept = _top_k_mask(block_scores, num_kept)
    else:
        kept = torch.zeros(keys.shape[1], 0, dtype=torch.bool, device=keys.device)
    # positions in blocks the filter did not see (past block_hi) are not kept
    kept = torch.cat([kept, kept.new_zeros(kept.shape[0], 1)], dim=1)
    in_kept = kept[:, block_of_pos.clamp(max=num_cand)]  # [Hkv, hi - lo]
    if params.method == "quest":
        return in_kept

    # two_level: token top-k restricted to the kept blocks. Excluded positions score -inf, so
    # they only fill slots when the kept blocks hold fewer than n_sel positions; `& in_kept`
    # drops them.
    if token_scores is None:
        token_scores = label_token_scores(q, keys[lo:hi], channels, params.label_dtype)
    scores = token_scores.masked_fill(~in_kept, float("-inf"))
    if params.scoring == "output_aware":
        if values is None:
            raise ValueError("output_aware scoring needs the values")
        norms = values[lo:hi].float().norm(dim=-1).transpose(0, 1)  # [Hkv, M]
        return output_aware_token_mask(scores, norms, n_sel * keys.shape[1],
                                       q.shape[-1] ** -0.5) & in_kept
    return rerank_top_k_mask(q, keys[lo:hi], scores, n_sel, shortlist) & in_kept


def retrieval_params(params: SelectionParams, num_kv_heads: int, num_retrieval: int) -> SelectionParams:
    """The selection of each retrieval head when the others stream: the layer's selected-token
    budget (``budget - sink - window`` per kv head) is shared by the retrieval heads, so the
    layer attends as many tokens as without the policy (candidate blocks scale alike)."""
    n_sel = params.budget - params.sink - params.window
    share = n_sel * num_kv_heads // num_retrieval
    cand = -(-params.candidate_blocks * share // n_sel) if n_sel else params.candidate_blocks
    return dataclasses.replace(params, budget=params.sink + params.window + share,
                               candidate_blocks=cand)


def select_token_mask(
    q: Tensor, keys: Tensor, params: SelectionParams, channels: Tensor | None = None,
    values: Tensor | None = None, streaming: Tensor | None = None,
    block_query: Tensor | None = None, block_length: int | None = None,
) -> Tensor:
    """Bool ``[Hkv, L]``: the positions each kv head attends. ``values`` are needed by output-
    aware scoring; ``streaming`` (bool ``[Hkv]``, with ``params.head_policy``) marks the kv
    heads that attend their sink and window only: they are not scored. ``block_query`` and
    ``block_length`` (quest, two_level): the block filter ran at an earlier step, with that
    step's query and length (AsyncTLS's asynchronous filter; the same summaries as long as
    ``window >= block_size``, so that the blocks it saw were complete then)."""
    length, num_kv_heads = keys.shape[:2]
    if length <= params.budget:
        return torch.ones(num_kv_heads, length, dtype=torch.bool, device=keys.device)
    mask = torch.zeros(num_kv_heads, length, dtype=torch.bool, device=keys.device)
    lo, hi = params.sink, length - params.window  # M; non-empty since L > budget >= sink + window
    mask[:, :lo] = True
    mask[:, hi:] = True
    if params.head_policy and streaming is not None:
        scored = (~streaming.to(keys.device)).nonzero().flatten()
        if scored.numel():
            group = q.shape[0] // num_kv_heads
            q_rows = (scored[:, None] * group + torch.arange(group, device=q.device)).flatten()
            mask[scored, lo:hi] = _select_middle(
                q[q_rows], keys[:, scored], retrieval_params(params, num_kv_heads, scored.numel()),
                lo, hi, None if channels is None else channels[scored],
                None if values is None else values[:, scored])
        return mask
    if block_query is not None and params.method not in ("quest", "two_level"):
        raise ValueError("block_query needs a block filter (quest, two_level)")
    block_hi = None if block_length is None else block_length - params.window
    mask[:, lo:hi] = _select_middle(q, keys, params, lo, hi, channels, values, block_query,
                                    block_hi)
    return mask


def _mask_to_indices(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Left-pack each row's True positions: (``idx`` long ``[H, n]``, ``valid`` bool ``[H, n]``).

    ``n`` is the largest row count; padding slots hold position 0 and are not valid.
    """
    counts = mask.sum(dim=1)
    n = int(counts.max()) if mask.numel() else 0
    rows, pos = mask.nonzero(as_tuple=True)  # row-major: positions ascend within a row
    row_start = counts.cumsum(0) - counts
    slot = torch.arange(rows.numel(), device=mask.device) - row_start[rows]
    idx = torch.zeros(mask.shape[0], n, dtype=torch.long, device=mask.device)
    idx[rows, slot] = pos
    valid = torch.arange(n, device=mask.device) < counts[:, None]
    return idx, valid


def _zero_if_neg_inf(lse: Tensor) -> Tensor:
    """Replace ``-inf`` (an empty set) by 0 so ``exp(x - lse)`` gives 0 instead of NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def sparse_attention_with_lse(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, sm_scale: float,
    v_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Attention over each kv head's masked positions, plus the float32 LSE ``[Hq]``; values
    read times ``v_scale`` (an fp8 KV cache's; its k_scale goes into ``sm_scale``).

    Returns ``[Hq, Dv]`` in q's dtype (fp32 math). A head with an empty mask gets output 0
    and LSE ``-inf``, the identity of :func:`merge_attention_states`.
    """
    num_kv_heads = keys.shape[1]
    if mask.shape != (num_kv_heads, keys.shape[0]):
        expected = (num_kv_heads, keys.shape[0])
        raise ValueError(f"mask shape {tuple(mask.shape)} != (Hkv, L) = {expected}")
    qg = _group_queries(q, num_kv_heads)  # [Hkv, G, D]
    # Gather only the selected tokens: the cost scales with the budget, not the context.
    idx, valid = _mask_to_indices(mask)
    heads = torch.arange(num_kv_heads, device=keys.device)[:, None]
    k_sel = keys[idx, heads].float()  # [Hkv, n, D]
    v_sel = values[idx, heads].float()  # [Hkv, n, Dv]
    scores = torch.bmm(qg, k_sel.transpose(1, 2)) * sm_scale  # [Hkv, G, n]
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G]
    probs = torch.exp(scores - _zero_if_neg_inf(lse)[..., None])
    out = torch.bmm(probs, v_sel)  # [Hkv, G, Dv]
    if v_scale != 1.0:
        out = out * v_scale
    return out.reshape(q.shape[0], -1).to(q.dtype), lse.reshape(-1)


def sparse_attention(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, sm_scale: float
) -> Tensor:
    """Attention of each query head over its kv head's masked positions: ``[Hq, Dv]``."""
    return sparse_attention_with_lse(q, keys, values, mask, sm_scale)[0]


def merge_attention_states(
    o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor
) -> tuple[Tensor, Tensor]:
    """Exact merge of two partial attentions over disjoint position sets.

    Each part is re-weighted by its share of the total softmax mass ``exp(lse_i - lse)``.
    ``o`` ``[..., Dv]`` with ``lse`` ``[...]`` (any leading dims). Returns the output in
    ``o1``'s dtype and the float32 LSE of the union; an empty part (LSE ``-inf``) contributes
    nothing, two give output 0 and LSE ``-inf``.
    """
    lse = torch.logaddexp(lse1.float(), lse2.float())
    ref = _zero_if_neg_inf(lse)
    w1 = torch.exp(lse1.float() - ref)[..., None]
    w2 = torch.exp(lse2.float() - ref)[..., None]
    return (w1 * o1.float() + w2 * o2.float()).to(o1.dtype), lse


def sparse_decode(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    params: SelectionParams,
    sm_scale: float,
    channels: Tensor | None = None,
) -> Tensor:
    """One sparse decode step: select each kv head's tokens, then attend over them."""
    mask = select_token_mask(q, keys, params, channels)
    return sparse_attention(q, keys, values, mask, sm_scale)


# --------------------------------------------------------------------------------------
# Many requests at once (the CPU serving path)
# --------------------------------------------------------------------------------------


def _top_k_rows(scores: Tensor, k: Tensor) -> Tensor:
    """:func:`_top_k_mask` with a per-row ``k`` (long ``[R]``, each at most the row's finite
    entries): bool mask of each row's ``k`` largest entries, ties going to the lower index."""
    k_max = int(k.max()) if k.numel() else 0
    if k_max == 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    top = scores.topk(k_max, dim=1).values  # sorted, largest first
    kth = top.gather(1, (k - 1).clamp(min=0)[:, None])
    above = scores > kth
    tied = scores == kth
    remaining = k[:, None] - above.sum(dim=1, keepdim=True)
    return (above | (tied & (tied.cumsum(dim=1) <= remaining))) & (k[:, None] > 0)


def _families(slot_rows: Tensor, seq_lens: "list[int]") -> "list[list[int]]":
    """Requests grouped by shared prompt: two requests are related when they hold the same pool
    slot at the middle position of the shorter one (radix-cache sharing is by prefix).
    Returns the connected groups, each in request order."""
    n = len(seq_lens)
    lengths = torch.tensor(seq_lens, device=slot_rows.device)
    mid = (torch.minimum(lengths[:, None], lengths[None, :]) // 2).long()  # [B, B]
    rows = slot_rows.long()
    a = rows.gather(1, mid)  # a[i, j] = slot of request i at mid(i, j)
    related = (a == a.T).tolist()
    label = list(range(n))

    def find(i: int) -> int:
        while label[i] != i:
            label[i] = label[label[i]]
            i = label[i]
        return i

    for i in range(n):
        for j in range(i + 1, n):
            if related[i][j]:
                ri, rj = find(i), find(j)
                if ri != rj:
                    label[max(ri, rj)] = min(ri, rj)
    groups: dict = {}
    for i in range(n):
        groups.setdefault(find(i), []).append(i)
    return list(groups.values())


class BatchedSparseDecode:
    """One decode step of many requests over one KV pool, each request selecting and attending
    exactly as :func:`sparse_decode` would for it alone (the same token sets; sums may round
    differently in the last bit), for the CPU serving path.

    ``slot_rows`` (``[B, >= max(seq_lens)]``, the requests' ``req_to_token`` rows) maps each
    position to its pool slot; every request must be longer than its budget. Requests that
    share a prompt through the radix cache share pool slots: key-side work (label-channel keys,
    block min/max) is done once per distinct slot / block, and per request only scores are
    gathered. A block is identified by the slot of its last position (in SGLang a shared slot
    implies a shared prefix); block sharing is verified and dropped if the slots disagree.

    Build it once per step (the index work is the same for every layer), then call
    :meth:`decode` per layer.
    """

    # Entries of a [requests x distinct slots] score matrix computed at once (memory bound).
    MAX_SCORE_ENTRIES = 1 << 24

    def __init__(self, slot_rows: Tensor, seq_lens: "list[int]", params: "list[SelectionParams]",
                 split_families: bool = True):
        if len(seq_lens) != len(params) or not seq_lens:
            raise ValueError("need one SelectionParams per request and at least one request")
        for n, p in zip(seq_lens, params):
            if n <= p.budget:
                raise ValueError(f"a request of {n} tokens is within its budget {p.budget}: dense")
        dev = slot_rows.device
        # Requests that share no prompt are scored separately (the scores are computed for every
        # request x distinct slot of its part of the batch).
        self.parts = None
        if split_families and len(seq_lens) > 1:
            family = _families(slot_rows, seq_lens)
            if len(family) > 1:
                self.parts = [
                    (torch.tensor(members, dtype=torch.long, device=dev),
                     BatchedSparseDecode(slot_rows[members], [seq_lens[i] for i in members],
                                         [params[i] for i in members], split_families=False))
                    for members in family
                ]
                return
        self.batch = len(seq_lens)
        self.max_len = max(seq_lens)
        self.params = list(params)
        # How the labels and summaries are stored is the server's (quest scores no labels, ds
        # no summaries): one setting each for the batch.
        label_dtypes = {p.label_dtype for p in params if p.method != "quest"}
        summary_dtypes = {p.summary_dtype for p in params if p.method != "ds"}
        if len(label_dtypes) > 1 or len(summary_dtypes) > 1:
            raise ValueError(f"one label_dtype and one summary_dtype per batch, got "
                             f"{sorted(label_dtypes)} and {sorted(summary_dtypes)}")
        self.label_dtype = label_dtypes.pop() if label_dtypes else "auto"
        self.summary_dtype = summary_dtypes.pop() if summary_dtypes else "auto"
        lengths = torch.tensor(seq_lens, device=dev)
        pos = torch.arange(self.max_len, device=dev)
        valid = pos < lengths[:, None]
        slots = slot_rows[:, : self.max_len].long()
        slots = torch.where(valid, slots, slots[:, :1])  # padding: a slot of the request itself
        self.slots = slots  # [B, Lmax]
        self.uniq, self.inv = torch.unique(slots, return_inverse=True)  # [U], [B, Lmax]

        sink = torch.tensor([p.sink for p in params], device=dev)
        window = torch.tensor([p.window for p in params], device=dev)
        lo, hi = sink, lengths - window
        self.n_sel = torch.tensor([p.budget - p.sink - p.window for p in params], device=dev)
        self.rerank = torch.tensor([p.rerank for p in params], device=dev)
        self.shortlist = torch.tensor([shortlist_tokens(p) if p.rerank else 0 for p in params],
                                      device=dev)
        self.middle = (pos >= lo[:, None]) & (pos < hi[:, None])  # [B, Lmax]
        self.always = valid & ~self.middle  # sink and window
        self.methods = {m: torch.tensor([i for i, p in enumerate(params) if p.method == m],
                                        dtype=torch.long, device=dev)
                        for m in METHODS if any(p.method == m for p in params)}
        self.uses_tokens = any(p.method != "quest" for p in params)
        # Attention in groups of equal budget: each group gathers at most its budget per row.
        by_budget: dict = {}
        for i, p in enumerate(params):
            by_budget.setdefault(p.budget, []).append(i)
        self.attend_groups = [torch.tensor(m, dtype=torch.long, device=dev)
                              for _, m in sorted(by_budget.items())]

        # Block work per block size: requests, their blocks' distinct (shared) entries.
        self.block_groups = []
        for bs in sorted({p.block_size for p in params if p.method != "ds"}):
            members = [i for i, p in enumerate(params) if p.method != "ds" and p.block_size == bs]
            self.block_groups.append(self._block_group(bs, members, lengths, lo, hi))

    def _block_group(self, bs: int, members: "list[int]", lengths: Tensor, lo: Tensor,
                     hi: Tensor) -> dict:
        dev = self.slots.device
        b = torch.tensor(members, dtype=torch.long, device=dev)
        n = lengths[b]
        num_blocks = -(-self.max_len // bs)
        nb = torch.arange(num_blocks, device=dev)
        block_pos = nb[:, None] * bs + torch.arange(bs, device=dev)  # [NB, bs]
        # Positions of each block, clipped to the request (a partial block repeats its last
        # position, which leaves min/max unchanged).
        bpos = torch.minimum(block_pos[None], (n - 1)[:, None, None])  # [Bg, NB, bs]
        bslots = self.slots[b].gather(1, bpos.reshape(len(members), -1)).view(bpos.shape)
        exists = nb[None] * bs < n[:, None]  # [Bg, NB]
        key = torch.where(exists, bslots[..., -1], torch.full_like(bslots[..., -1], -1))
        ukey, binv = torch.unique(key, return_inverse=True)
        flat = bslots.reshape(-1, bs)
        rep = torch.empty(ukey.numel(), dtype=torch.long, device=dev)
        rep.scatter_(0, binv.reshape(-1), torch.arange(binv.numel(), device=dev))
        same = (flat[rep[binv.reshape(-1)]] == flat).all(dim=1) | ~exists.reshape(-1)
        if not bool(same.all()):  # slots shared out of prefix order: no block sharing
            binv = torch.arange(binv.numel(), device=dev).view(binv.shape)
            rep = binv.reshape(-1)
        # Each distinct block's positions as indices into the distinct slots.
        inv_g = self.inv[b].gather(1, bpos.reshape(len(members), -1)).view(-1, bs)
        first = lo[b] // bs
        last = (hi[b] - 1) // bs
        cand = (nb[None] >= first[:, None]) & (nb[None] <= last[:, None])  # [Bg, NB]
        num_cand = last - first + 1
        kept = torch.tensor(
            [self.params[i].budget - self.params[i].sink - self.params[i].window for i in members],
            device=dev) // bs
        is_two = torch.tensor([self.params[i].method == "two_level" for i in members], device=dev)
        cands = torch.tensor([self.params[i].candidate_blocks for i in members], device=dev)
        num_kept = torch.where(is_two, torch.minimum(cands, num_cand), kept)
        label_max = torch.tensor([self.params[i].block_score == "label_max" for i in members],
                                 dtype=torch.bool, device=dev)
        # the cascade's survivors: the bound's prefilter x candidate blocks (0: no cascade)
        prefilter = torch.tensor([self.params[i].prefilter for i in members], device=dev)
        survivors = torch.minimum(prefilter * cands, num_cand)
        return {"bs": bs, "members": b, "binv": binv, "block_u": inv_g[rep], "cand": cand,
                "label_max": label_max, "cascade": prefilter > 0, "survivors": survivors,
                "num_kept": num_kept, "block_of_pos": torch.arange(self.max_len, device=dev) // bs}

    def _pairwise_max(self, qg: Tensor, keys_t: Tensor, idx: Tensor) -> Tensor:
        """max over each kv head's query heads of ``qg @ keys_t``, gathered per request:
        ``qg`` float [Hkv, B*G, C], ``keys_t`` float [Hkv, C, N], ``idx`` long [B, M] into N.
        Returns float [Hkv, B, M]."""
        num_kv, bg, _ = qg.shape
        batch = idx.shape[0]
        group = bg // batch
        n = keys_t.shape[2]
        step = max(1, self.MAX_SCORE_ENTRIES // max(1, num_kv * group * n))
        out = []
        for s in range(0, batch, step):
            e = min(batch, s + step)
            part = torch.bmm(qg[:, s * group : e * group], keys_t)  # [Hkv, b*G, N]
            part = part.view(num_kv, e - s, group, n).amax(dim=2)  # [Hkv, b, N]
            out.append(part.gather(2, idx[s:e][None].expand(num_kv, -1, -1)))
        return torch.cat(out, dim=1)

    def decode(self, q: Tensor, k_buf: Tensor, v_buf: Tensor, sm_scale: float,
               channels: Tensor | None = None) -> Tensor:
        """``q`` [B, Hq, D] -> [B, Hq, Dv] in q's dtype; ``k_buf``/``v_buf`` [slots, Hkv, D]."""
        if self.parts is not None:
            out = q.new_empty(q.shape[0], q.shape[1], v_buf.shape[-1])
            for members, part in self.parts:
                out[members] = part.decode(q[members], k_buf, v_buf, sm_scale, channels)
            return out
        batch, num_q_heads, dim = q.shape
        num_kv = k_buf.shape[1]
        group = num_q_heads // num_kv
        neg_inf = float("-inf")
        qg = q.float().reshape(batch, num_kv, group, dim).transpose(0, 1).reshape(num_kv, batch * group, dim)
        ku = widen_8bit_keys(k_buf.index_select(0, self.uniq))  # [U, Hkv, D], distinct slots
        selected = torch.zeros(batch, num_kv, self.max_len, dtype=torch.bool, device=q.device)

        tok_scores = None
        if self.uses_tokens:
            qs, ks = qg, ku
            if channels is not None:
                qs = qg.gather(2, channels[:, None, :].expand(-1, qg.shape[1], -1))
                ks = ku.gather(2, channels[None].expand(ku.shape[0], -1, -1))
                if self.label_dtype != "auto":  # the labels as the label cache stores them
                    ks = to_label_storage(ks, label_storage_dtype(self.label_dtype, ks.dtype))
            ks_t = ks.float().permute(1, 2, 0)  # [Hkv, C, U]
            tok_scores = self._pairwise_max(qs, ks_t, self.inv).transpose(0, 1)  # [B, Hkv, Lmax]
        exact_scores: list[Tensor] = []  # the exact q.k of every position, once a row reranks

        def exact() -> Tensor:
            if not exact_scores:
                keys_t = ku.float().permute(1, 2, 0)  # [Hkv, D, U]
                exact_scores.append(self._pairwise_max(qg, keys_t, self.inv).transpose(0, 1))
            return exact_scores[0]

        for g in self.block_groups:
            b = g["members"]
            by_label_max = g["label_max"]
            cascade = g["cascade"]
            bound = None
            if not bool(by_label_max.all()) or bool(cascade.any()):
                kb = ku.index_select(0, g["block_u"].reshape(-1)).view(*g["block_u"].shape, *ku.shape[1:])  # [UB, bs, Hkv, D]
                kmin, kmax = round_summaries(kb.amin(dim=1).float(), kb.amax(dim=1).float(),
                                             self.summary_dtype)
                kmin = kmin.permute(1, 2, 0)  # [Hkv, D, UB]
                kmax = kmax.permute(1, 2, 0)
                qb = qg.view(num_kv, batch, group, dim)[:, b].reshape(num_kv, -1, dim)
                bound = self._bound(qb, kmin, kmax, g["binv"]).transpose(0, 1)  # [Bg, Hkv, NB]
            if bool(by_label_max.any()):
                middle = tok_scores[b].masked_fill(~self.middle[b][:, None], neg_inf)
                label_max = label_max_block_scores(middle.reshape(-1, self.max_len), 0,
                                                   g["bs"]).view(len(b), num_kv, -1)
                if bool(cascade.any()):
                    # the label maximum ranks only the bound's best prefilter x candidates
                    by_bound = bound.masked_fill(~g["cand"][:, None], neg_inf)
                    survivors = _top_k_rows(by_bound.reshape(-1, bound.shape[-1]),
                                            g["survivors"].repeat_interleave(num_kv))
                    label_max = label_max.masked_fill(
                        cascade[:, None, None] & ~survivors.view(bound.shape), neg_inf)
                bound = label_max if bound is None else torch.where(
                    by_label_max[:, None, None], label_max, bound)
            bound = bound.masked_fill(~g["cand"][:, None], neg_inf)  # [Bg, Hkv, NB]
            kept = _top_k_rows(bound.reshape(-1, bound.shape[-1]),
                               g["num_kept"].repeat_interleave(num_kv)).view(bound.shape)
            in_kept = kept[:, :, g["block_of_pos"]] & self.middle[b][:, None]  # [Bg, Hkv, Lmax]
            is_quest = torch.tensor([self.params[i].method == "quest" for i in b.tolist()],
                                    device=q.device)
            quest_rows = is_quest.nonzero().squeeze(1)
            if quest_rows.numel():
                selected[b[quest_rows]] = in_kept[quest_rows]
            two_rows = (~is_quest).nonzero().squeeze(1)
            if two_rows.numel():
                rows = b[two_rows]
                s = tok_scores[rows].masked_fill(~in_kept[two_rows], neg_inf)
                selected[rows] = self._top_tokens(rows, s, exact)

        ds = self.methods.get("ds")
        if ds is not None and ds.numel():
            s = tok_scores[ds].masked_fill(~self.middle[ds][:, None], neg_inf)
            selected[ds] = self._top_tokens(ds, s, exact)

        mask = selected | self.always[:, None]  # [B, Hkv, Lmax]
        if len(self.attend_groups) == 1:
            return self._attend(q, mask, self.slots, k_buf, v_buf, sm_scale)
        out = q.new_empty(batch, num_q_heads, v_buf.shape[-1])
        for members in self.attend_groups:
            out[members] = self._attend(q[members], mask[members], self.slots[members], k_buf,
                                        v_buf, sm_scale)
        return out

    def _top_tokens(self, rows: Tensor, scores: Tensor, exact: Callable[[], Tensor]) -> Tensor:
        """Bool ``[R, Hkv, Lmax]``: each row's ``n_sel`` best of its label ``scores`` (``-inf``:
        not eligible), or where the row reranks :func:`rerank_top_k_mask`'s choice (a middle
        within :func:`shortlist_tokens` ranked whole by the exact q·k). ``exact()``: the exact
        q·k ``[B, Hkv, Lmax]``, computed once for the batch."""
        num_kv, length = scores.shape[1], scores.shape[2]
        flat = scores.reshape(-1, length)
        n_sel = self.n_sel[rows].repeat_interleave(num_kv)
        eligible = flat > float("-inf")
        picked = _top_k_rows(flat, n_sel) & eligible
        rerank = self.rerank[rows].repeat_interleave(num_kv)
        if bool((rerank > 0).any()):
            shortlist_k = torch.where(rerank > 0, self.shortlist[rows].repeat_interleave(num_kv),
                                      n_sel).clamp(max=length)
            shortlist = _top_k_rows(flat, shortlist_k) & eligible
            middle = self.middle[rows].repeat_interleave(num_kv, dim=0)
            whole = (middle.sum(1) <= shortlist_k)[:, None]
            shortlist = torch.where(whole, middle, shortlist)
            by_exact = exact()[rows].reshape(-1, length).masked_fill(~shortlist, float("-inf"))
            reranked = _top_k_rows(by_exact, n_sel) & shortlist
            picked = torch.where((rerank > 0)[:, None], reranked, picked)
        return picked.view(scores.shape)

    @staticmethod
    def _attend(q: Tensor, mask: Tensor, slots: Tensor, k_buf: Tensor, v_buf: Tensor,
                sm_scale: float) -> Tensor:
        """sparse_attention_with_lse of each request over its mask [B, Hkv, Lmax]."""
        batch, num_q_heads, dim = q.shape
        num_kv = mask.shape[1]
        group = num_q_heads // num_kv
        idx, valid = _mask_to_indices(mask.reshape(batch * num_kv, -1))  # [B*Hkv, n]
        n = idx.shape[1]
        slot = slots.gather(1, idx.view(batch, num_kv * n)).view(batch, num_kv, n)
        flat = (slot * num_kv + torch.arange(num_kv, device=q.device)[None, :, None]).reshape(-1)
        k_sel = k_buf.reshape(-1, k_buf.shape[-1]).index_select(0, flat).view(batch * num_kv, n, -1).float()
        v_sel = v_buf.reshape(-1, v_buf.shape[-1]).index_select(0, flat).view(batch * num_kv, n, -1).float()
        qh = q.float().reshape(batch * num_kv, group, dim)
        scores = torch.bmm(qh, k_sel.transpose(1, 2)) * sm_scale  # [B*Hkv, G, n]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - _zero_if_neg_inf(lse)[..., None])
        out = torch.bmm(probs, v_sel)  # [B*Hkv, G, Dv]
        return out.reshape(batch, num_q_heads, -1).to(q.dtype)

    def _bound(self, qb: Tensor, kmin: Tensor, kmax: Tensor, binv: Tensor) -> Tensor:
        """Quest bound of every request's blocks: [Hkv, Bg, NB] (as quest_block_scores)."""
        num_kv, bg, _ = qb.shape
        batch = binv.shape[0]
        group = bg // batch
        n = kmin.shape[2]
        step = max(1, self.MAX_SCORE_ENTRIES // max(1, num_kv * group * n))
        out = []
        for s in range(0, batch, step):
            e = min(batch, s + step)
            qs = qb[:, s * group : e * group]
            part = torch.bmm(qs.clamp(min=0), kmax) + torch.bmm(qs.clamp(max=0), kmin)
            part = part.view(num_kv, e - s, group, n).amax(dim=2)
            out.append(part.gather(2, binv[s:e][None].expand(num_kv, -1, -1)))
        return torch.cat(out, dim=1)
