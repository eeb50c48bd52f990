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

from dataclasses import dataclass

import torch
from torch import Tensor

METHODS = ("quest", "ds", "two_level")


@dataclass(frozen=True)
class SelectionParams:
    """Token-selection configuration of one layer.

    ``budget`` counts every attended position, sink and window included. ``window`` includes
    the current token, so it is at least 1. ``candidate_blocks`` is only used by two_level.
    """

    method: str
    budget: int
    block_size: int
    candidate_blocks: int
    sink: int
    window: int

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.sink < 0 or self.window < 1:
            raise ValueError(f"need sink >= 0 and window >= 1, got {self.sink}, {self.window}")
        if self.sink + self.window > self.budget:
            raise ValueError(
                f"sink + window ({self.sink} + {self.window}) exceeds budget {self.budget}"
            )
        if self.method == "two_level" and self.candidate_blocks < 1:
            raise ValueError(
                f"two_level needs candidate_blocks >= 1, got {self.candidate_blocks}"
            )


def _group_queries(q: Tensor, num_kv_heads: int) -> Tensor:
    """``[Hq, D]`` -> float32 ``[Hkv, G, D]``: the query heads of each kv head's group."""
    num_q_heads = q.shape[0]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    return q.float().reshape(num_kv_heads, num_q_heads // num_kv_heads, q.shape[1])


def block_minmax(keys: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Per-block elementwise min and max of the keys: float32 ``[NB, Hkv, D]`` each."""
    length, num_kv_heads, dim = keys.shape
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


def label_token_scores(q: Tensor, keys: Tensor, channels: Tensor | None) -> Tensor:
    """Double-Sparsity label score per token, max over each kv head's query heads: ``[Hkv, L]``.

    ``channels`` (long ``[Hkv, r]``) are the calibrated heavy channels of each kv head; with
    ``None`` all D channels are used, i.e. the exact q·k.
    """
    qg = _group_queries(q, keys.shape[1])  # [Hkv, G, D]
    k = keys.transpose(0, 1)  # [Hkv, L, D]
    if channels is not None:
        qg = qg.gather(2, channels[:, None, :].expand(-1, qg.shape[1], -1))
        k = k.gather(2, channels[:, None, :].expand(-1, k.shape[1], -1))
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


def _select_middle(
    q: Tensor,
    keys: Tensor,
    params: SelectionParams,
    lo: int,
    hi: int,
    channels: Tensor | None,
) -> Tensor:
    """Bool ``[Hkv, hi - lo]``: the positions picked from the middle ``M = [lo, hi)``."""
    n_sel = params.budget - params.sink - params.window
    if n_sel == 0:
        return torch.zeros(keys.shape[1], hi - lo, dtype=torch.bool, device=keys.device)
    if params.method == "ds":
        return _top_k_mask(label_token_scores(q, keys[lo:hi], channels), n_sel)

    bs = params.block_size
    first, last = lo // bs, (hi - 1) // bs  # candidate blocks: those overlapping M
    num_cand = last - first + 1
    # The slice starts on a block boundary, so its blocks are exactly the candidate blocks,
    # summarised over all their positions (sink/window ones included), like the KV pool pages.
    block_scores = quest_block_scores(q, *block_minmax(keys[first * bs : (last + 1) * bs], bs))
    if params.method == "quest":
        num_kept = n_sel // bs  # whole blocks only, so the budget is never exceeded
    else:
        num_kept = min(params.candidate_blocks, num_cand)
    block_of_pos = torch.arange(lo, hi, device=keys.device) // bs - first
    in_kept = _top_k_mask(block_scores, num_kept)[:, block_of_pos]  # [Hkv, hi - lo]
    if params.method == "quest":
        return in_kept

    # two_level: token top-k restricted to the kept blocks. Excluded positions score -inf, so
    # they only fill slots when the kept blocks hold fewer than n_sel positions; `& in_kept`
    # drops them.
    scores = label_token_scores(q, keys[lo:hi], channels).masked_fill(~in_kept, float("-inf"))
    return _top_k_mask(scores, n_sel) & in_kept


def select_token_mask(
    q: Tensor, keys: Tensor, params: SelectionParams, channels: Tensor | None = None
) -> Tensor:
    """Bool ``[Hkv, L]``: the positions each kv head attends."""
    length, num_kv_heads = keys.shape[:2]
    if length <= params.budget:
        return torch.ones(num_kv_heads, length, dtype=torch.bool, device=keys.device)
    mask = torch.zeros(num_kv_heads, length, dtype=torch.bool, device=keys.device)
    lo, hi = params.sink, length - params.window  # M; non-empty since L > budget >= sink + window
    mask[:, :lo] = True
    mask[:, hi:] = True
    mask[:, lo:hi] = _select_middle(q, keys, params, lo, hi, channels)
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
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, sm_scale: float
) -> tuple[Tensor, Tensor]:
    """Attention over each kv head's masked positions, plus the float32 LSE ``[Hq]``.

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
    Returns the output in ``o1``'s dtype and the float32 LSE of the union.
    """
    lse = torch.logaddexp(lse1.float(), lse2.float())
    ref = _zero_if_neg_inf(lse)
    w1 = torch.exp(lse1.float() - ref)[:, None]
    w2 = torch.exp(lse2.float() - ref)[:, None]
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
