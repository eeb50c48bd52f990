"""NOSA-style locality-constrained selection (reference implementation, plain torch).

The middle of the context (between sink and window) is covered by two parts:

* a **query-agnostic** set ``E_t`` of at most ``k_e`` blocks per kv head, chosen by an eviction
  score with NOSA's rule: the candidates at step ``t`` are ``E_{t-1}`` plus the blocks that just
  entered the middle (they left the recent window); ``E_t`` is the top ``k_e`` of them, and a
  candidate not kept is **evicted for good** (it is never a candidate again);
* a **query-aware** part: two_level's block filter + token top-k over the other middle blocks,
  with what is left of the token budget. With ``params.locality_new_blocks = F > 0`` the filter
  admits at most ``F`` blocks per step that were not in the previous step's filter (``E_{t-1}``
  included): the best ``F`` of those by Quest bound compete with the previous ones, the rest sit
  the step out. A host tier keeps exactly the filter's blocks on the GPU, so ``F`` bounds the
  blocks one step transfers per kv head, while the filter still spans the whole middle (a
  filter sized down to cut transfers costs accuracy: README, NOSA locality). A request's first
  sparse step has no previous filter and is not limited.

Every block of ``E_t`` was attended at ``t-1`` (as a member of ``E_{t-1}`` or of the window), so
at least ``|E_t|`` of the blocks a head attends persist from one step to the next: the locality
``γ(t) ≥ |E_t| / (blocks attended)``, which is what keeps a host tier's transfers small.
With ``k_e = 0`` the selection is exactly two_level's.

Training-free eviction scores (``score_kind``):

* ``attention``: decayed accumulated attention mass of the block (the share of softmax weight
  its tokens received, summed over the group's query heads), ``s <- decay * s + mass``, from
  the probabilities the decode step computes anyway;
* ``key_norm``: query-independent, two-stage pooled: mean key norm inside sub-blocks, max over
  the block's sub-blocks (computed once per block).

Trained score (``learned``): NOSA's eviction head (:mod:`.eviction_head`), a per-(layer, kv
head) score of each token's value, pooled the same two-stage way; fixed once a block exists, so
each block is scored once.

State is per (request, layer): :class:`LocalityState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sglang_ext.selection.params import SelectionParams
from sglang_ext.selection.reference import (
    _group_queries,
    _top_k_mask,
    block_minmax,
    label_token_scores,
    quest_block_scores,
)

SCORE_KINDS = ("attention", "key_norm", "learned")


@dataclass
class LocalityState:
    """Per (request, layer) state of the query-agnostic part, ``[Hkv, blocks]`` tensors that
    grow with the context."""

    num_kv_heads: int
    keep: Tensor = field(default=None)  # bool: E_t
    seen: Tensor = field(default=None)  # bool: has been a candidate (evicted = seen & ~keep)
    score: Tensor = field(default=None)  # float32 eviction score
    prev_blocks: Tensor = field(default=None)  # bool: blocks attended at the previous step
    prev_filter: Tensor = field(default=None)  # bool: the previous step's block filter and E_t
    new_blocks: list[int] = field(default_factory=list)  # per step: most query-aware blocks of a
    # head outside the previous filter (what locality_new_blocks bounds)
    locality: list[float] = field(default_factory=list)  # γ(t) per step (mean over heads)
    floor: list[float] = field(default_factory=list)  # |E_t| / blocks attended, min over heads
    scored_blocks: int = 0  # ``learned``: blocks whose (fixed) score is already in ``score``

    def grow(self, num_blocks: int) -> None:
        if self.keep is not None and self.keep.shape[1] >= num_blocks:
            return
        old = 0 if self.keep is None else self.keep.shape[1]
        pad = num_blocks - old

        def extend(t: Tensor | None, fill, dtype) -> Tensor:
            new = torch.full((self.num_kv_heads, pad), fill, dtype=dtype)
            return new if t is None else torch.cat([t, new], dim=1)

        self.keep = extend(self.keep, False, torch.bool)
        self.seen = extend(self.seen, False, torch.bool)
        self.score = extend(self.score, 0.0, torch.float32)
        self.prev_blocks = extend(self.prev_blocks, False, torch.bool)
        self.prev_filter = extend(self.prev_filter, False, torch.bool)

    @property
    def evicted(self) -> Tensor:
        return self.seen & ~self.keep


def select_token_mask_locality(
    q: Tensor, keys: Tensor, params: SelectionParams, state: LocalityState, k_e: int,
    channels: Tensor | None = None, score_kind: str = "attention",
    values: Tensor | None = None, eviction_head: Any = None,
) -> Tensor:
    """Bool ``[Hkv, L]``: sink + window + the tokens of ``E_t`` + the query-aware tokens.
    Updates ``state`` (``E_t``, evictions, γ(t)); call :func:`update_eviction_scores` after
    the attention for the ``attention`` score. ``learned`` needs ``values`` (``[L, Hkv, D]``)
    and ``eviction_head`` (an object with ``token_scores(values) -> [Hkv, n]``, e.g.
    :class:`~sglang_ext.selection.eviction_head.LayerEvictionHead`)."""
    if params.method != "two_level":
        raise ValueError("locality-constrained selection builds on two_level")
    length, num_kv_heads = keys.shape[:2]
    device = keys.device
    if length <= params.budget:
        return torch.ones(num_kv_heads, length, dtype=torch.bool, device=device)
    bs = params.block_size
    lo, hi = params.sink, length - params.window
    first, last = lo // bs, (hi - 1) // bs
    num_blocks = last + 1
    state.grow(num_blocks)
    blocks = torch.arange(num_blocks)
    eligible = (blocks >= first)[None, :].expand(num_kv_heads, -1)

    if score_kind == "key_norm":
        _key_norm_scores(keys, bs, state, num_blocks)
    elif score_kind == "learned":
        if values is None or eviction_head is None:
            raise ValueError("the learned eviction score needs the values and an eviction head")
        _learned_scores(values, eviction_head, bs, state, num_blocks)
    elif score_kind != "attention":
        raise ValueError(f"score_kind must be one of {SCORE_KINDS}")

    # Candidates: the previous set plus blocks entering the middle for the first time.
    keep_prev = state.keep[:, :num_blocks]
    new = eligible & ~state.seen[:, :num_blocks]
    cand = keep_prev | new
    n_sel = params.budget - params.sink - params.window
    k_e = min(k_e, n_sel // bs)
    scores = state.score[:, :num_blocks].masked_fill(~cand, float("-inf"))
    keep = _top_k_mask(scores, min(k_e, num_blocks)) & cand
    state.seen[:, :num_blocks] |= cand
    state.keep[:, :num_blocks] = keep  # the rest of cand is evicted for good

    mask = torch.zeros(num_kv_heads, length, dtype=torch.bool, device=device)
    mask[:, :lo] = True
    mask[:, hi:] = True
    pos = torch.arange(lo, hi)
    block_of_pos = pos // bs
    in_keep = keep.to(device)[:, block_of_pos]  # [Hkv, hi - lo]
    mask[:, lo:hi] = in_keep

    # Query-aware part over the other middle blocks, with the rest of the token budget.
    n_q = n_sel - in_keep.sum(dim=1)  # per head
    bscores = quest_block_scores(q, *block_minmax(keys[first * bs:(last + 1) * bs], bs))
    keep_mid = keep[:, first:num_blocks].to(device)
    bscores = bscores.masked_fill(keep_mid, float("-inf"))
    prev_filter = state.prev_filter[:, first:num_blocks].to(device)
    if params.locality_new_blocks and bool(prev_filter.any()):
        bscores = _admit_new_blocks(bscores, prev_filter, params.locality_new_blocks)
    kept = _top_k_mask(bscores, min(params.candidate_blocks, last - first + 1))
    kept &= bscores > float("-inf")  # E_t's blocks, and (limited) the ones sitting out
    if bool(prev_filter.any()):
        state.new_blocks.append(int((kept & ~prev_filter).sum(dim=1).max()))
    state.prev_filter[:, :num_blocks] = False
    state.prev_filter[:, first:num_blocks] = (kept | keep_mid).cpu()
    in_kept = kept[:, block_of_pos - first]
    tok = label_token_scores(q, keys[lo:hi], channels, params.label_dtype).masked_fill(
        ~in_kept, float("-inf"))
    for h in range(num_kv_heads):  # the remaining budget differs per head
        k = int(n_q[h])
        if k > 0:
            mask[h, lo:hi] |= _top_k_mask(tok[h:h + 1], min(k, hi - lo))[0] & in_kept[h]

    # γ(t): share of the blocks attended now that were attended at the previous step.
    attended = torch.nn.functional.pad(mask.cpu(), (0, (-length) % bs)).reshape(
        num_kv_heads, -1, bs).any(dim=2)
    state.grow(attended.shape[1])
    prev = state.prev_blocks[:, :attended.shape[1]]
    if bool(prev.any()):
        n_now = attended.sum(dim=1).clamp(min=1)
        state.locality.append(float(((attended & prev).sum(dim=1) / n_now).mean()))
        state.floor.append(float((keep.sum(dim=1) / n_now).min()))
    state.prev_blocks[:, :attended.shape[1]] = attended
    return mask


def _admit_new_blocks(bscores: Tensor, prev_filter: Tensor, limit: int) -> Tensor:
    """``bscores`` (``[Hkv, n]``, ``-inf`` = not a query-aware candidate) with every block
    outside ``prev_filter`` set to ``-inf`` except the ``limit`` best of them per head (ties to
    the lower block, like every top-k here)."""
    fresh = bscores.masked_fill(prev_filter, float("-inf"))
    admitted = _top_k_mask(fresh, min(limit, fresh.shape[1])) & (fresh > float("-inf"))
    return bscores.masked_fill(~(prev_filter | admitted), float("-inf"))


def two_stage_pool(token_scores: Tensor, block_size: int, sub_block: int = 4) -> Tensor:
    """NOSA's block score from token scores ``[..., n]`` (``n`` a multiple of ``block_size``):
    the mean over sub-blocks of ``sub_block`` tokens, then the max over the block's sub-blocks:
    ``[..., n // block_size]``. The mean smooths single-token spikes, the max keeps a block
    whose one part matters."""
    sub = max(1, min(sub_block, block_size))
    n = token_scores.shape[-1]
    shape = token_scores.shape[:-1] + (n // block_size, block_size // sub, sub)
    return token_scores.reshape(shape).mean(dim=-1).amax(dim=-1)


def _key_norm_scores(keys: Tensor, bs: int, state: LocalityState, num_blocks: int) -> None:
    """Two-stage pooled key norms (mean over sub-blocks of 4 tokens, max over the block)."""
    n = num_blocks * bs
    norms = keys[:n].float().norm(dim=2).transpose(0, 1)  # [Hkv, n]
    state.score[:, :num_blocks] = two_stage_pool(norms, bs).cpu()


def _learned_scores(values: Tensor, head: Any, bs: int, state: LocalityState,
                    num_blocks: int) -> None:
    """Eviction-head scores of the blocks not scored yet (a block's score is fixed: it depends
    on its tokens' values only, and a block is only scored once all its tokens exist)."""
    done = state.scored_blocks
    full = min(num_blocks, values.shape[0] // bs)  # a window shorter than a block: wait
    if full <= done:
        return
    token = head.token_scores(values[done * bs:full * bs])  # [Hkv, n]
    state.score[:, done:full] = two_stage_pool(token, bs).cpu()
    state.scored_blocks = full


def update_eviction_scores(
    state: LocalityState, q: Tensor, keys: Tensor, mask: Tensor, sm_scale: float,
    block_size: int, decay: float = 0.9,
) -> None:
    """``attention`` score: ``s <- decay * s + mass`` with each block's attention mass this step
    (softmax over the attended positions, summed over the kv head's query heads)."""
    length, num_kv_heads = keys.shape[:2]
    qg = _group_queries(q, num_kv_heads)  # [Hkv, G, D]
    logits = torch.bmm(qg, keys.float().permute(1, 2, 0)) * sm_scale  # [Hkv, G, L]
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=2).sum(dim=1)  # [Hkv, L]
    num_blocks = (length + block_size - 1) // block_size
    mass = torch.nn.functional.pad(probs, (0, num_blocks * block_size - length)).reshape(
        num_kv_heads, num_blocks, block_size).sum(dim=2).cpu()
    state.grow(num_blocks)
    state.score[:, :num_blocks] = decay * state.score[:, :num_blocks] + mass
    state.score[:, num_blocks:] *= decay


class LocalityMetrics:
    """The locality constraint's γ in SGLang's Prometheus endpoint (``--enable-metrics``): the
    mean and the minimum of γ(t) (the share of a step's attended blocks attended at the step
    before) over the last ``every`` (request, layer) selections (reference decode) or over the
    selections since the last read of the device counters (batched decode)."""

    PREFIX = "sglang_ext:locality_"

    def __init__(self, every: int = 64) -> None:
        from prometheus_client import Counter, Gauge

        p = self.PREFIX
        self.every = every
        self._recent: list[float] = []
        self.gamma = Gauge(p + "gamma", "Mean share of attended blocks kept from the step before "
                           "(last selections)", multiprocess_mode="mostrecent")
        self.gamma_min = Gauge(p + "gamma_min", "Smallest such share (last selections)",
                               multiprocess_mode="mostrecent")
        self.selections = Counter(p + "selections", "(request, layer) selections under the "
                                  "locality constraint")

    def observe(self, gamma: float) -> None:
        self._recent.append(gamma)
        if len(self._recent) >= self.every:
            self.observe_many(sum(self._recent), len(self._recent), min(self._recent))
            self._recent.clear()

    def observe_many(self, total: float, count: int, minimum: float) -> None:
        """``count`` selections at once by their sum and minimum of γ (the batched decode
        accumulates them on the device and reads them now and then)."""
        self.gamma.set(total / count)
        self.gamma_min.set(minimum)
        self.selections.inc(count)
