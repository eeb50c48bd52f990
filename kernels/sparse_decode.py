"""The batched, static-shape, CUDA-graph-safe sparse decode pipeline (SGLang layouts).

``sparse_decode_batched`` runs, for a whole decode batch, what the reference's
``select_token_mask`` + ``sparse_attention`` do per request:

1. per (request, kv head), exactly ``params.budget`` position slots are built:
   ``L <= budget``: positions ``0 .. L-1`` (rest ``-1``, dense decode);
   otherwise: ``[0, sink)``, ``[L - window, L)`` and the ``n_sel = budget - sink - window``
   selected middle positions (``-1`` where fewer are selected):

   * quest: all middle positions of the top ``n_sel // bs`` blocks by Quest bound
     (``block_scores`` + ``topk``);
   * two_level: top ``candidate_blocks`` blocks by Quest bound, then the top ``n_sel`` tokens
     of those blocks by label score (``block_scores`` + ``topk`` + ``token_scores`` + ``topk``);
   * ds: top ``n_sel`` tokens of the whole middle by label score (two_level with every block a
     candidate: ``token_scores`` + ``topk``);
2. positions are mapped to KV-pool slots through ``req_to_token`` (this file's kernel, which
   also assembles the slot list; by default it runs in the same kernel as the last top-k, one
   program per (request, kv head), which saves a launch and the round trip of the top-k
   indices);
3. ``sparse_attention`` over the slots (split-KV + LSE merge).

With NOSA's locality constraint (``params.locality_blocks = k_e > 0``, two_level only; see
:mod:`locality`) the block top-k keeps ``candidate_blocks + k_e`` blocks, of which the
request's query-agnostic set ``E_t`` (forced first by a ``+inf`` block score after the rule's
update), and the token top-k takes ``E_t``'s middle tokens first (``+inf`` token scores):
launches +2 (the rule before the block top-k, γ(t) after the assembly). Its limit on new filter
blocks (``params.locality_new_blocks``) adds 4 around the block top-k: the candidates outside the
previous filter, their top-``F``, the others set to ``-inf``, and the filter recorded.

Launches per step: two_level 4 for the selection (block scores, block top-k, token scores,
token top-k + assembly) + 2 for the attention; quest 2 + 2; ds 2 + 2.

Every shape depends only on (B, budget, max_blocks) and the static params: no ``.item()``, no
host sync, no data-dependent Python control flow, so it can be captured in a CUDA graph. Scratch
comes from a :class:`SparseDecodeWorkspace` (sized for the largest batch) so graph replays reuse
the same addresses. Padded batch entries (``req_pool_idx`` 0, ``seq_len`` 1) decode densely over
position 0 and touch nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.kernels.block_scores import quest_block_scores_batched
from sglang_ext.kernels.locality import (
    KERNEL_SCORE_KINDS,
    LocalityLayerState,
    bitmap_words,
    limit_new_blocks_batched,
    locality_gamma_batched,
    locality_update_batched,
    record_filter_batched,
)
from sglang_ext.kernels.sparse_attention import (
    default_num_splits,
    sparse_attention_batched,
    split_layout,
)
from sglang_ext.kernels.token_scores import (
    label_max_block_scores_batched,
    label_token_scores_batched,
)
from sglang_ext.kernels.rerank import exact_rerank_scores, shortlist_selection, take_top
from sglang_ext.kernels.topk import _topk_row, topk_launch_config, topk_masked
from sglang_ext.selection.params import SelectionParams, label_storage_dtype
from sglang_ext.selection.reference import select_token_mask, sparse_attention_with_lse

# Slots the fused top-k + assembly kernel assembles per pass. At 19 requests x 32k, block 32,
# budget 2048: 1024 took 14.5 us per layer against 20.8 us for the whole list in one pass
# (operator_h200_bs32_b19_asm1024.json / _asm2048.json, CUDA graphs).
ASSEMBLE_TILE = 1024
# Registers per thread of the fused top-k + assembly: 128 keeps two 8-warp programs per SM (a
# row of up to 4096 candidates), as the kernel compiled before the scatter; uncapped, the
# scatter variant takes 166 (one program per SM, so a batch's 160+ rows run in two waves).
# Capped, ptxas spills nothing (sm_90, cuobjdump --dump-resource-usage).
TOPK_ASSEMBLE_MAXNREG = 128
# Digit widths of the two radix selects (kernels/topk.py). On the H200 at 10 requests x 128k,
# block 32, continuous scores (sparse_attention_h200_fp8_summaries_128k.json, --stages topk):
# the block top-k (5,138 blocks of a 164k grid, 16 warps) 20.2 us per layer at 7 bits against
# 23.1 at 8; the token top-k (4,096 candidates, 8 warps) 13.8 us at 6 bits against 15.5.
# Fewer bits are more passes, which a row of tied scores runs to the end (SGLang's dummy
# weights, whose keys round to zero labels, or a decode over a zeroed pool): there 8 bits win
# (SGLANG_EXT_TOPK_RADIX_BITS=8,8 restores them).
BLOCK_TOPK_RADIX_BITS = 7
TOKEN_TOPK_RADIX_BITS = 6
# How the selected part of the slot list is read back from the top-k results.
_MODE_NONE = 0  # nothing selected (n_sel == 0, or quest with n_sel < bs)
_MODE_BLOCKS = 1  # quest: top block ids; slot j -> block top[j // bs], offset j % bs
_MODE_CAND_TOKENS = 2  # two_level: top indices into the candidate tokens (cand[i // bs], i % bs)
_MODE_ALL_TOKENS = 3  # ds: top indices are positions


@triton.jit
def _assemble_tile(
    b,
    g,
    j,
    REQ_TO_TOKEN,
    REQ_POOL_INDICES,
    SEQ_LENS,
    TOP,
    CAND,
    SLOTS,
    POSITIONS,
    PAGE_MAP,
    stride_r2t,
    stride_tb,
    stride_tg,
    stride_cb,
    stride_cg,
    stride_sb,
    stride_sg,
    stride_pb,
    stride_pg,
    stride_mr,
    stride_mg,
    BUDGET: tl.constexpr,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_TOP: tl.constexpr,
    MODE: tl.constexpr,
    WRITE_POS: tl.constexpr,
    HAS_PAGE_MAP: tl.constexpr,
    SELECTED_ELSEWHERE: tl.constexpr = False,
):
    """Slots ``j`` (a vector of slot-list indices) of (request ``b``, kv head ``g``).
    ``SELECTED_ELSEWHERE``: a sparse row's selected part (from ``SINK + WINDOW`` on) is
    written by the fused top-k's scatter; only its sink and window (and dense rows) here."""
    in_budget = j < BUDGET
    row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int64)
    hi = seq_len - WINDOW  # the middle is [SINK, hi)

    jj = j - (SINK + WINDOW)  # index among the selected slots
    if MODE == 1:
        sel = in_budget & (jj >= 0) & (jj < NUM_TOP * BLOCK_SIZE)
        blk = tl.load(
            TOP + b * stride_tb + g * stride_tg + jj // BLOCK_SIZE, mask=sel, other=-1
        ).to(tl.int64)
        pos_sel = blk * BLOCK_SIZE + jj % BLOCK_SIZE
        ok = sel & (blk >= 0) & (pos_sel >= SINK) & (pos_sel < hi)
    elif MODE == 2:
        sel = in_budget & (jj >= 0) & (jj < NUM_TOP)
        idx = tl.load(TOP + b * stride_tb + g * stride_tg + jj, mask=sel, other=-1).to(tl.int64)
        cblk = tl.load(
            CAND + b * stride_cb + g * stride_cg + idx // BLOCK_SIZE,
            mask=sel & (idx >= 0),
            other=-1,
        ).to(tl.int64)
        pos_sel = cblk * BLOCK_SIZE + idx % BLOCK_SIZE
        ok = sel & (idx >= 0) & (cblk >= 0)
    elif MODE == 3:
        sel = in_budget & (jj >= 0) & (jj < NUM_TOP)
        idx = tl.load(TOP + b * stride_tb + g * stride_tg + jj, mask=sel, other=-1).to(tl.int64)
        pos_sel = idx
        ok = sel & (idx >= 0)
    else:
        pos_sel = jj.to(tl.int64)
        ok = jj < 0  # never true where it is used

    pos_sparse = tl.where(
        j < SINK,
        j.to(tl.int64),
        tl.where(j < SINK + WINDOW, hi + (j - SINK), tl.where(ok, pos_sel, -1)),
    )
    pos_dense = tl.where(j < seq_len, j.to(tl.int64), -1)
    pos = tl.where(seq_len <= BUDGET, pos_dense, pos_sparse)
    has = in_budget & (pos >= 0)
    if HAS_PAGE_MAP:
        # CPU tier: the position's device slot for this kv head (-1: not resident, skipped).
        page = tl.load(
            PAGE_MAP + row * stride_mr + g * stride_mg + pos // BLOCK_SIZE, mask=has, other=-1
        ).to(tl.int64)
        slot = tl.where(has & (page >= 0), page * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    else:
        slot = tl.load(REQ_TO_TOKEN + row * stride_r2t + pos, mask=has, other=-1)
        slot = tl.where(has, slot, -1)
    store = in_budget
    if SELECTED_ELSEWHERE:
        store = store & ((seq_len <= BUDGET) | (j < SINK + WINDOW))
    tl.store(SLOTS + b * stride_sb + g * stride_sg + j, slot.to(tl.int32), mask=store)
    if WRITE_POS:
        tl.store(POSITIONS + b * stride_pb + g * stride_pg + j, pos.to(tl.int32), mask=store)


@triton.jit
def _assemble_slots_kernel(
    REQ_TO_TOKEN,
    REQ_POOL_INDICES,
    SEQ_LENS,
    TOP,
    CAND,
    SLOTS,
    POSITIONS,
    PAGE_MAP,
    stride_r2t,
    stride_tb,
    stride_tg,
    stride_cb,
    stride_cg,
    stride_sb,
    stride_sg,
    stride_pb,
    stride_pg,
    stride_mr,
    stride_mg,
    BUDGET: tl.constexpr,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_TOP: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    WRITE_POS: tl.constexpr,
    HAS_PAGE_MAP: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    _assemble_tile(
        b, g, j, REQ_TO_TOKEN, REQ_POOL_INDICES, SEQ_LENS, TOP, CAND, SLOTS, POSITIONS, PAGE_MAP,
        stride_r2t, stride_tb, stride_tg, stride_cb, stride_cg, stride_sb, stride_sg, stride_pb,
        stride_pg, stride_mr, stride_mg, BUDGET, SINK, WINDOW, BLOCK_SIZE, NUM_TOP, MODE,
        WRITE_POS, HAS_PAGE_MAP,
    )


@triton.jit
def _topk_assemble_kernel(
    SCORES,
    REQ_TO_TOKEN,
    REQ_POOL_INDICES,
    SEQ_LENS,
    TOP,
    CAND,
    SLOTS,
    POSITIONS,
    PAGE_MAP,
    stride_scb,
    stride_scg,
    stride_r2t,
    stride_tb,
    stride_tg,
    stride_cb,
    stride_cg,
    stride_sb,
    stride_sg,
    stride_pb,
    stride_pg,
    stride_mr,
    stride_mg,
    BUDGET: tl.constexpr,
    SINK: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_TOP: tl.constexpr,
    MODE: tl.constexpr,
    ASM_BLOCK: tl.constexpr,
    WRITE_POS: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    RESIDENT: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    EARLY_EXIT: tl.constexpr,
    HAS_PAGE_MAP: tl.constexpr,
    K_ROWS,
    N_ROWS,
    HAS_K_ROWS: tl.constexpr,
    HAS_N_ROWS: tl.constexpr,
    CAND_SLOTS,
    CAND_POS,
    SCATTER: tl.constexpr,
):
    """The last top-k of the selection and the slot assembly of its row, in one program per
    (request, kv head).

    ``SCATTER`` (two_level): the token scoring left each candidate token's slot (and position)
    beside its score (``CAND_SLOTS`` / ``CAND_POS``, the scores' strides), so the top-k's
    compaction writes the winners' slots straight into the slot list; the tiles then write
    only the sink and window (or a dense row whole). Otherwise the winners go to TOP (global
    scratch, re-read from L1/L2 after a CTA barrier) and the whole slot list is assembled
    from them: per slot a chain of dependent loads, winner -> candidate block -> slot."""
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    k_row = None
    n_row = None
    if HAS_K_ROWS:
        k_row = tl.load(K_ROWS + b)
    if HAS_N_ROWS:
        n_row = tl.load(N_ROWS + b)
    row_scores = SCORES + b * stride_scb + g * stride_scg
    if SCATTER:
        seq_len = tl.load(SEQ_LENS + b)
        sparse_row = seq_len > BUDGET  # a dense row's list is positions 0 .. L-1 (tiles below)
        sel_slots = SLOTS + b * stride_sb + g * stride_sg + SINK + WINDOW
        cand_slots = CAND_SLOTS + b * stride_scb + g * stride_scg
        if WRITE_POS:
            _topk_row(
                row_scores, sel_slots, N, K, BLOCK, OUT_BLOCK, RESIDENT, RADIX_BITS,
                EARLY_EXIT, k_row, n_row, payload=cand_slots,
                dst2=POSITIONS + b * stride_pb + g * stride_pg + SINK + WINDOW,
                payload2=CAND_POS + b * stride_scb + g * stride_scg, write=sparse_row,
            )
        else:
            _topk_row(
                row_scores, sel_slots, N, K, BLOCK, OUT_BLOCK, RESIDENT, RADIX_BITS,
                EARLY_EXIT, k_row, n_row, payload=cand_slots, write=sparse_row,
            )
        # the tiles left: a sparse row's sink and window, a dense row's whole list
        tiles_end = tl.where(sparse_row, SINK + WINDOW, BUDGET)
        for t in tl.static_range((BUDGET + ASM_BLOCK - 1) // ASM_BLOCK):
            if t * ASM_BLOCK < tiles_end:
                j = t * ASM_BLOCK + tl.arange(0, ASM_BLOCK)
                _assemble_tile(
                    b, g, j, REQ_TO_TOKEN, REQ_POOL_INDICES, SEQ_LENS, TOP, CAND, SLOTS,
                    POSITIONS, PAGE_MAP, stride_r2t, stride_tb, stride_tg, stride_cb,
                    stride_cg, stride_sb, stride_sg, stride_pb, stride_pg, stride_mr,
                    stride_mg, BUDGET, SINK, WINDOW, BLOCK_SIZE, NUM_TOP, 0,  # _MODE_NONE
                    WRITE_POS, HAS_PAGE_MAP, SELECTED_ELSEWHERE=True,
                )
    else:
        _topk_row(
            row_scores, TOP + b * stride_tb + g * stride_tg,
            N, K, BLOCK, OUT_BLOCK, RESIDENT, RADIX_BITS, EARLY_EXIT, k_row, n_row,
        )
        tl.debug_barrier()  # the row's winners, written by all threads, are visible to all
        for t in tl.static_range((BUDGET + ASM_BLOCK - 1) // ASM_BLOCK):
            j = t * ASM_BLOCK + tl.arange(0, ASM_BLOCK)
            _assemble_tile(
                b, g, j, REQ_TO_TOKEN, REQ_POOL_INDICES, SEQ_LENS, TOP, CAND, SLOTS, POSITIONS,
                PAGE_MAP, stride_r2t, stride_tb, stride_tg, stride_cb, stride_cg, stride_sb,
                stride_sg, stride_pb, stride_pg, stride_mr, stride_mg, BUDGET, SINK, WINDOW,
                BLOCK_SIZE, NUM_TOP, MODE, WRITE_POS, HAS_PAGE_MAP,
            )


class SelectionSizes(NamedTuple):
    """The static shape of a selection: how the slot list is read back (``mode``), the k of the
    block top-k and the k of the token top-k (0: that stage does not run)."""

    mode: int
    k_blocks: int
    k_tokens: int


def selection_sizes(params: SelectionParams) -> SelectionSizes:
    """The top-k sizes a setting runs with (e.g. to size what depends on the block filter's k,
    such as the CPU tier's working sets)."""
    n_sel = params.budget - params.sink - params.window
    bs = params.block_size
    if n_sel <= 0:
        return SelectionSizes(_MODE_NONE, 0, 0)
    if params.method == "quest":
        num_kept = n_sel // bs
        return SelectionSizes(_MODE_BLOCKS, num_kept, 0) if num_kept > 0 else \
            SelectionSizes(_MODE_NONE, 0, 0)
    if params.method == "two_level":
        # The locality constraint's E_t rides along in the block top-k, ranked first.
        return SelectionSizes(_MODE_CAND_TOKENS,
                              params.candidate_blocks + params.locality_blocks, n_sel)
    if params.method == "ds":
        return SelectionSizes(_MODE_ALL_TOKENS, 0, n_sel)
    raise ValueError(f"unknown method {params.method!r}")


@dataclass(frozen=True)
class DecodeRows:
    """Which requests a batched call decodes, in SGLang's layout: ``req_to_token`` int32
    ``[rows, max_context]`` (each request row's KV slots by position), ``req_pool_indices``
    ``[B]`` (the batch's rows) and ``seq_lens`` ``[B]`` (current token included, its KV
    already written)."""

    req_to_token: Tensor
    req_pool_indices: Tensor
    seq_lens: Tensor


@dataclass(frozen=True)
class LayerCache:
    """One layer's KV and the side buffers the selection reads.

    ``k_buffer``/``v_buffer`` ``[num_slots, Hkv, D/Dv]``; ``kmin``/``kmax`` the page summaries
    (:mod:`block_summary`; unused by ds); ``channels`` long ``[Hkv, r]`` label channels or None
    (all channels); ``labels`` the label cache (:mod:`label_cache`: the ``channels`` of every
    key stored contiguously, so token scoring reads r/D of the key bytes); ``k_scale`` /
    ``v_scale`` an 8-bit KV cache's scales (the selection ranks stored keys, which a positive
    scale does not reorder)."""

    k_buffer: Tensor
    v_buffer: Tensor | None = None
    kmin: Tensor | None = None
    kmax: Tensor | None = None
    channels: Tensor | None = None
    labels: Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0


@dataclass(frozen=True)
class SelectionInputs:
    """What optional features add to one layer's selection (all None: the plain pipeline).

    * the CPU tier (quest and two_level): ``page_map`` (int32 ``[rows, Hkv, max_blocks]``)
      addresses keys by per-head device page instead of ``req_to_token`` (blocks not resident
      are skipped); ``on_blocks(blocks)`` is called with the block filter's result
      ``[B, Hkv, k]`` before the token stage (to fetch or prefetch those blocks);
      ``attend_blocks`` replaces that result for the rest of the step (the blocks chosen at the
      previous step, already resident: the asynchronous mode). The label cache is indexed by
      logical slot (it covers host-homed pages), so labels are read through ``req_to_token``
      and the page map only decides residency and the device slots.
    * the accuracy guard: ``row_ks`` = (per-request k of the block top-k, of the token top-k),
      int32 ``[B]`` each or None, every value at most the workspace's k: a request's smaller
      budget inside a workspace sized for the largest (:mod:`selection.guard`).
    * NOSA's locality constraint: ``locality`` (needed iff ``params.locality_blocks > 0``), the
      layer's state (:mod:`locality`), updated in place; each request's γ(t) of this step is
      left in ``workspace.gamma[:B]`` (``-1``: not measured).
    * cooperative attention: ``on_token_scores(scores, cand)`` (two_level, eager only) may change
      the token scores ``[B, Hkv, C*bs]`` of the candidates ``cand`` ``[B, Hkv, C]`` in place
      before the token top-k (it scores there the blocks the CPU attends from host memory).
    * the asynchronous block filter: ``candidates`` (int32 ``[B, Hkv, k]``, k = the block
      top-k's: :func:`select_blocks_batched`'s result, possibly of an earlier query) replaces
      the block filter; block ids outside this step's middle (or ``-1``) select nothing. Not
      with the tier, the locality constraint or ``row_ks``.
    """

    page_map: Tensor | None = None
    on_blocks: Callable[[Tensor], None] | None = None
    attend_blocks: Tensor | None = None
    row_ks: tuple[Tensor | None, Tensor | None] | None = None
    locality: LocalityLayerState | None = None
    on_token_scores: Callable[[Tensor, Tensor], None] | None = None
    candidates: Tensor | None = None

    @property
    def tiered(self) -> bool:
        return (self.page_map is not None or self.on_blocks is not None
                or self.attend_blocks is not None)

    def is_plain(self) -> bool:
        return all(getattr(self, name) is None for name in self.__dataclass_fields__)


class SparseDecodeWorkspace:
    """Preallocated scratch of :func:`sparse_decode_batched` for batches up to ``max_batch``.

    Holding one per (layer shape, params) and passing it on every call keeps every
    intermediate at a fixed address, which CUDA-graph replays need. The output returned by
    :func:`sparse_decode_batched` is a view of ``self.out``: it is overwritten by the next call.
    ``max_blocks`` (static) must cover the longest request: ``ceil(max_context / block_size)``
    (blocks past it are never scored). ``topk_impl`` ("triton" / "torch"),
    ``topk_radix_bits`` (one digit width for both top-k, or a ``(block, token)`` pair; default
    ``BLOCK_TOPK_RADIX_BITS`` / ``TOKEN_TOPK_RADIX_BITS``) and ``block_score_precision`` pick
    the variants of :mod:`topk` and :mod:`block_scores`. ``fuse_assemble`` (Triton top-k only)
    runs the last top-k and the slot assembly as one kernel (one launch less per step); False
    keeps them separate.
    ``assemble_tile``: slots the fused kernel assembles per pass (default ``ASSEMBLE_TILE``;
    each pass is one chain of dependent loads, winner -> candidate block -> req_to_token).
    ``scatter_selected`` (two_level with the fused kernel): the token scoring also writes each
    candidate token's slot and position, and the fused top-k scatters its winners' straight
    into the slot list (no chain of loads per slot); False assembles them as above. The slot
    lists are identical; so is the time, as measured (operator_h200_bs32_fp8_scatter.json:
    within 1 us per layer at 5 and 20 requests x 32k / 128k; 0.91 ms per step either way in
    the 32k server profile).
    """

    def __init__(
        self,
        max_batch: int,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim_v: int,
        params: SelectionParams,
        max_blocks: int,
        device,
        dtype: torch.dtype = torch.bfloat16,
        num_splits: int | None = None,
        topk_impl: str = "triton",
        block_score_precision: str | None = None,
        topk_radix_bits: int | tuple[int, int] | None = None,
        fuse_assemble: bool = True,
        assemble_tile: int = ASSEMBLE_TILE,
        scatter_selected: bool = True,
    ) -> None:
        if num_q_heads % num_kv_heads:
            raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
        self.max_batch = max_batch
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim_v = head_dim_v
        self.params = params
        self.max_blocks = max_blocks
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_splits = num_splits
        self.topk_impl = topk_impl
        self.block_score_precision = block_score_precision
        if topk_radix_bits is None:
            topk_radix_bits = (BLOCK_TOPK_RADIX_BITS, TOKEN_TOPK_RADIX_BITS)
        elif isinstance(topk_radix_bits, int):
            topk_radix_bits = (topk_radix_bits, topk_radix_bits)
        self.block_topk_radix_bits, self.token_topk_radix_bits = topk_radix_bits
        self.fuse_assemble = fuse_assemble and topk_impl == "triton"
        if assemble_tile < 16 or assemble_tile & (assemble_tile - 1):
            raise ValueError(f"assemble_tile must be a power of two >= 16, got {assemble_tile}")
        self.assemble_tile = assemble_tile
        # --sparse-rerank: the selection lists a widened budget's shortlist, which the exact
        # rerank (kernels/rerank.py) cuts to params.budget.
        self.selection_params = shortlist_selection(params) if params.rerank else params
        self.mode, self.k_blocks, self.k_tokens = selection_sizes(self.selection_params)
        # the cascade (params.prefilter): the bound's pages that the label maximum then ranks
        self.k_prefilter = prefilter_blocks(self.selection_params)
        self.scatter_selected = (scatter_selected and self.fuse_assemble
                                 and self.mode == _MODE_CAND_TOKENS)

        bs = params.block_size
        kw = {"device": self.device}
        shape = (max_batch, num_kv_heads)
        f32, i32 = torch.float32, torch.int32
        self.block_scores = self.top_blocks = self.token_scores = self.top_tokens = None
        if self.k_blocks:
            self.block_scores = torch.empty(*shape, max_blocks, dtype=f32, **kw)
            self.top_blocks = torch.empty(*shape, self.k_blocks, dtype=i32, **kw)
        self.prefilter_top = self.prefilter_scores = self.prefilter_pick = None
        if self.k_prefilter:
            self.prefilter_top = torch.empty(*shape, self.k_prefilter, dtype=i32, **kw)
            self.prefilter_scores = torch.empty(*shape, self.k_prefilter, dtype=f32, **kw)
            self.prefilter_pick = torch.empty(*shape, self.k_blocks, dtype=i32, **kw)
        if self.k_tokens:
            num_cand = self.k_blocks if self.mode == _MODE_CAND_TOKENS else max_blocks
            self.token_scores = torch.empty(*shape, num_cand * bs, dtype=f32, **kw)
            self.top_tokens = torch.empty(*shape, self.k_tokens, dtype=i32, **kw)
        self.cand_slots = self.cand_positions = None
        if self.scatter_selected:
            self.cand_slots = torch.empty_like(self.token_scores, dtype=i32)
            self.cand_positions = torch.empty_like(self.token_scores, dtype=i32)
        listed = self.selection_params.budget
        self.slots = torch.empty(*shape, listed, dtype=i32, **kw)
        self.positions = torch.empty(*shape, listed, dtype=i32, **kw)
        self.rerank_scores = self.rerank_top = self.reranked_slots = None
        self.reranked_positions = None
        if params.rerank:
            self.rerank_scores = torch.empty(*shape, listed, dtype=f32, **kw)
            self.rerank_top = torch.empty(*shape, params.budget, dtype=i32, **kw)
            self.reranked_slots = torch.empty(*shape, params.budget, dtype=i32, **kw)
            self.reranked_positions = torch.empty(*shape, params.budget, dtype=i32, **kw)
        self.attended_bitmap = self.gamma = None
        if params.locality_blocks:
            if params.eviction_score not in KERNEL_SCORE_KINDS:
                raise ValueError(f"the batched decode's locality constraint takes eviction "
                                 f"scores {KERNEL_SCORE_KINDS}, not {params.eviction_score!r}")
            # γ(t): this step's attended blocks per (request, kv head), and γ per request.
            self.attended_bitmap = torch.empty(*shape, bitmap_words(max_blocks), dtype=i32, **kw)
            self.gamma = torch.empty(max_batch, dtype=f32, **kw)
        self.fresh_block_scores = self.admitted_blocks = None
        if params.locality_new_blocks:  # the limit on new filter blocks: its top-k's in and out
            self.fresh_block_scores = torch.empty(*shape, max_blocks, dtype=f32, **kw)
            self.admitted_blocks = torch.empty(*shape, params.locality_new_blocks, dtype=i32,
                                               **kw)
        # The split count only falls as the batch grows: size for batch 1.
        max_splits = split_layout(params.budget, self._splits_for(1))[1]
        self.partial_o = torch.empty(
            max_batch, num_q_heads, max_splits, head_dim_v, dtype=f32, **kw
        )
        self.partial_lse = torch.empty(max_batch, num_q_heads, max_splits, dtype=f32, **kw)
        self.out = torch.empty(max_batch, num_q_heads, head_dim_v, dtype=dtype, **kw)
        self.lse = torch.empty(max_batch, num_q_heads, dtype=f32, **kw)

    def _splits_for(self, batch: int) -> int:
        if self.num_splits is not None:
            return self.num_splits
        return default_num_splits(batch, self.num_kv_heads, self.params.budget, self.device)

    def check(self, batch: int, num_q_heads: int, num_kv_heads: int, head_dim_v: int,
              params: SelectionParams, dtype: torch.dtype) -> None:
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the workspace's max_batch {self.max_batch}")
        if (num_q_heads, num_kv_heads, head_dim_v) != (
            self.num_q_heads, self.num_kv_heads, self.head_dim_v
        ):
            raise ValueError("head shape differs from the workspace's")
        if params != self.params:
            raise ValueError(f"params {params} differ from the workspace's {self.params}")
        if dtype != self.dtype:
            raise ValueError(f"q dtype {dtype} differs from the workspace's {self.dtype}")


def _token_keys(k_buffer: Tensor, labels: Tensor | None, channels: Tensor | None,
                params: SelectionParams) -> tuple[Tensor, bool]:
    """What token scores read: the label cache when there is one (over the logical slots: with
    the tier's page map too), else the pool's keys; and whether it is the label cache."""
    if labels is not None:
        if channels is None or labels.shape[1:] != channels.shape:
            raise ValueError("labels need their channels ([Hkv, r], matching the cache)")
        want = label_storage_dtype(params.label_dtype, k_buffer.dtype)
        if labels.dtype != want:
            raise ValueError(f"label_dtype {params.label_dtype!r} stores labels as {want}, "
                             f"the cache holds {labels.dtype}")
        return labels, True
    if params.label_dtype != "auto" and channels is not None:
        # the rounded labels exist only in the cache: the pool's keys would score unrounded
        raise ValueError(f"label_dtype {params.label_dtype!r} needs the label cache (labels)")
    return k_buffer, False


def prefilter_blocks(params: SelectionParams) -> int:
    """How many pages the cascade's bound keeps for the label maximum to rank (0: no cascade)."""
    if not params.prefilter or params.block_score != "label_max":
        return 0
    return params.prefilter * selection_sizes(params).k_blocks


def _block_scores(q: Tensor, cache: LayerCache, rows: DecodeRows, ws: SparseDecodeWorkspace,
                  tok_keys: Tensor | None, from_labels: bool, bound: bool = False) -> Tensor:
    """The batch's block scores (``params.block_score``, or the bound with ``bound``), into the
    workspace's buffer: Quest's bound from the page summaries, or each block's largest label
    score over its middle tokens
    (:func:`~sglang_ext.kernels.token_scores.label_max_block_scores_batched`)."""
    p = ws.selection_params
    batch = q.shape[0]
    if p.block_score == "label_max" and not bound:
        return label_max_block_scores_batched(
            q, tok_keys, rows.req_to_token, rows.req_pool_indices, rows.seq_lens, p.block_size,
            p.sink, p.window, ws.max_blocks, channels=cache.channels,
            out=ws.block_scores[:batch], keys_are_labels=from_labels)
    if cache.kmin is None or cache.kmax is None:
        raise ValueError(f"{p.method} with block_score 'bound' needs the block summaries "
                         f"kmin/kmax")
    return quest_block_scores_batched(
        q, cache.kmin, cache.kmax, rows.req_to_token, rows.req_pool_indices, rows.seq_lens,
        p.block_size, p.sink, p.window, ws.max_blocks, out=ws.block_scores[:batch],
        precision=ws.block_score_precision,
    )


def _cascade_candidates(q: Tensor, cache: LayerCache, rows: DecodeRows,
                        ws: SparseDecodeWorkspace, tok_keys: Tensor, from_labels: bool,
                        k_block_rows: Tensor | None) -> Tensor:
    """The cascade's block filter (``params.prefilter``): Quest's bound keeps ``k_prefilter``
    pages, the label maximum scores only those and keeps ``k_blocks`` of them. Returns their
    block ids, int32 ``[B, Hkv, k_blocks]`` in ascending order, ``-1`` padded (what the block
    top-k gives without the cascade)."""
    p = ws.selection_params
    batch = q.shape[0]
    bound = _block_scores(q, cache, rows, ws, tok_keys, from_labels, bound=True)
    pre = topk_masked(bound, ws.k_prefilter, out=ws.prefilter_top[:batch], impl=ws.topk_impl,
                      radix_bits=ws.block_topk_radix_bits)
    label_max = label_max_block_scores_batched(
        q, tok_keys, rows.req_to_token, rows.req_pool_indices, rows.seq_lens, p.block_size,
        p.sink, p.window, ws.max_blocks, channels=cache.channels,
        out=ws.prefilter_scores[:batch], keys_are_labels=from_labels, cand=pre)
    pick = topk_masked(label_max, ws.k_blocks, out=ws.prefilter_pick[:batch],
                       impl=ws.topk_impl, radix_bits=ws.block_topk_radix_bits,
                       k_rows=k_block_rows)
    top = ws.top_blocks[:batch]
    torch.gather(pre, 2, pick.clamp(min=0).long(), out=top)
    return top.masked_fill_(pick < 0, -1)


def _with_contiguous_channels(cache: LayerCache, device: torch.device) -> LayerCache:
    channels = cache.channels
    if channels is None:
        return cache
    channels = channels.to(device=device)
    if channels.stride(-1) != 1:
        channels = channels.contiguous()
    return cache if channels is cache.channels else replace(cache, channels=channels)


def _check_inputs(params: SelectionParams, reranked: SelectionParams, ws: SparseDecodeWorkspace,
                  inputs: SelectionInputs, batch: int, num_kv_heads: int) -> None:
    """One line for each combination the pipeline does not run."""
    # The tier's inputs combine: the shortlist's slots are device rows through the page map.
    if reranked.rerank and not replace(inputs, page_map=None, on_blocks=None,
                                       attend_blocks=None).is_plain():
        raise ValueError("the exact rerank does not combine with the locality constraint, "
                         "per-request top-k sizes, given candidates or cooperative attention")
    if (inputs.locality is not None) != bool(params.locality_blocks):
        raise ValueError("the locality state goes with params.locality_blocks > 0 (and only)")
    if inputs.locality is not None and inputs.row_ks is not None:
        raise ValueError("per-request top-k sizes do not combine with the locality constraint")
    if inputs.candidates is not None:
        if inputs.tiered or inputs.locality is not None or inputs.row_ks is not None:
            raise ValueError("given candidates do not combine with the tier, the locality "
                             "constraint or per-request top-k sizes")
        if inputs.candidates.shape != (batch, num_kv_heads, ws.k_blocks) or not ws.k_blocks:
            raise ValueError(f"candidates {tuple(inputs.candidates.shape)} must be [B, Hkv, "
                             f"{ws.k_blocks}] of a block-filter method (quest, two_level)")
    if inputs.tiered and ws.mode not in (_MODE_BLOCKS, _MODE_CAND_TOKENS):
        raise ValueError(f"the CPU tier needs a block filter (quest or two_level), not "
                         f"{params.method}")
    if ws.k_prefilter and (inputs.tiered or inputs.locality is not None
                           or inputs.attend_blocks is not None):
        raise ValueError("the cascade (prefilter) does not combine with the tier or the "
                         "locality constraint")


_PLAIN = SelectionInputs()


def select_slots_batched(
    q: Tensor,
    cache: LayerCache,
    rows: DecodeRows,
    params: SelectionParams,
    workspace: SparseDecodeWorkspace | None = None,
    inputs: SelectionInputs = _PLAIN,
    return_positions: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Step 1-2 of the pipeline: the ``budget`` KV slots (int32 ``[B, Hkv, budget]``, ``-1``
    padded) each (request, kv head) attends; with ``return_positions`` also their positions.
    ``cache``: the layer's keys and side buffers (:class:`LayerCache`; values unused);
    ``inputs``: what optional features add (:class:`SelectionInputs`)."""
    batch, num_q_heads, _ = q.shape
    k_buffer = cache.k_buffer
    num_kv_heads = k_buffer.shape[1]
    if workspace is None:
        workspace = SparseDecodeWorkspace(
            batch, num_q_heads, num_kv_heads, k_buffer.shape[2], params,
            triton.cdiv(rows.req_to_token.shape[1], params.block_size), q.device, q.dtype,
        )
    ws = workspace
    if batch > ws.max_batch or params != ws.params:
        raise ValueError("batch/params do not fit the workspace")
    reranked = params
    params = ws.selection_params  # what the stages below list: the shortlist with a rerank
    _check_inputs(params, reranked, ws, inputs, batch, num_kv_heads)
    cache = _with_contiguous_channels(cache, q.device)
    channels, locality, page_map = cache.channels, inputs.locality, inputs.page_map
    req_to_token, req_pool_indices, seq_lens = rows.req_to_token, rows.req_pool_indices, \
        rows.seq_lens
    bs = params.block_size
    tiered = inputs.tiered
    top, cand = ws.slots, ws.slots  # dummies for unused pointers
    final = None  # (scores, k, out) of the last top-k when it is fused with the assembly

    k_block_rows, k_token_rows = inputs.row_ks if inputs.row_ks is not None else (None, None)
    # two_level with per-request candidate counts: a row's token scores past its candidates'
    # tokens are all -inf, which the token top-k may skip.
    n_token_rows = None
    if k_block_rows is not None and ws.mode == _MODE_CAND_TOKENS:
        n_token_rows = k_block_rows * bs

    write_pos = return_positions or locality is not None or bool(reranked.rerank)
    # The fused top-k scatters the winners' slots (and positions) that the token scoring left.
    scatter = ws.scatter_selected and ws.k_tokens > 0

    def run_topk(scores, k, out, last, bits, k_rows, n_rows=None):
        nonlocal final
        # The tier needs the block filter's result before the assembly: no fusion then.
        if last and ws.fuse_assemble and not (tiered and ws.mode == _MODE_BLOCKS):
            final = (scores, k, bits, k_rows, n_rows)
            return out
        return topk_masked(scores, k, out=out, impl=ws.topk_impl,
                           radix_bits=bits, k_rows=k_rows, n_rows=n_rows)

    tok_keys, from_labels = k_buffer, False
    if ws.k_tokens or params.block_score == "label_max":
        tok_keys, from_labels = _token_keys(k_buffer, cache.labels, channels, params)
    if params.block_score == "label_max" and page_map is not None and not from_labels:
        raise ValueError("the label-max block filter under the CPU tier needs the label cache "
                         "(host-homed keys are not resident)")
    if inputs.candidates is not None:
        top = cand = inputs.candidates
    elif ws.k_prefilter:
        top = cand = _cascade_candidates(q, cache, rows, ws, tok_keys, from_labels,
                                         k_block_rows)
        if inputs.on_blocks is not None:
            inputs.on_blocks(top)
    elif ws.k_blocks:
        scores = _block_scores(q, cache, rows, ws, tok_keys, from_labels)
        if locality is not None:
            locality_update_batched(locality, scores, req_to_token, req_pool_indices, seq_lens,
                                    params)
            if params.locality_new_blocks:
                limit_new_blocks_batched(locality, scores, req_pool_indices, seq_lens, params,
                                         ws.fresh_block_scores[:batch],
                                         ws.admitted_blocks[:batch], impl=ws.topk_impl)
        top = cand = run_topk(scores, ws.k_blocks, ws.top_blocks[:batch], not ws.k_tokens,
                              ws.block_topk_radix_bits, k_block_rows)
        if locality is not None and params.locality_new_blocks:
            record_filter_batched(locality, top, req_pool_indices, seq_lens, params)
        if inputs.on_blocks is not None:
            inputs.on_blocks(top)
        if inputs.attend_blocks is not None:
            top = cand = inputs.attend_blocks[:batch]
    if ws.k_tokens:
        tok_scores, _ = label_token_scores_batched(
            q, tok_keys, req_to_token, req_pool_indices, seq_lens,
            cand if ws.mode == _MODE_CAND_TOKENS else None, bs, params.sink, params.window,
            channels=channels, num_blocks=ws.max_blocks, scores_out=ws.token_scores[:batch],
            return_positions=False, page_map=page_map,
            forced_blocks=ws.block_scores[:batch] if locality is not None else None,
            keys_are_labels=from_labels,
            cand_slots_out=ws.cand_slots[:batch] if scatter else None,
            cand_positions_out=ws.cand_positions[:batch] if scatter and write_pos else None,
        )
        if inputs.on_token_scores is not None:
            inputs.on_token_scores(tok_scores, cand)
        top = run_topk(tok_scores, ws.k_tokens, ws.top_tokens[:batch], True,
                       ws.token_topk_radix_bits, k_token_rows,
                       n_token_rows)

    slots = ws.slots[:batch]
    positions = ws.positions[:batch]
    if batch:
        common = (
            req_to_token, req_pool_indices, seq_lens, top, cand, slots, positions,
            page_map if page_map is not None else slots,
            req_to_token.stride(0), top.stride(0), top.stride(1), cand.stride(0),
            cand.stride(1), slots.stride(0), slots.stride(1), positions.stride(0),
            positions.stride(1),
            page_map.stride(0) if page_map is not None else 0,
            page_map.stride(1) if page_map is not None else 0,
        )
        consts = dict(
            BUDGET=params.budget, SINK=params.sink, WINDOW=params.window, BLOCK_SIZE=bs,
            NUM_TOP=ws.k_blocks if ws.mode == _MODE_BLOCKS else ws.k_tokens, MODE=ws.mode,
            WRITE_POS=write_pos,
            HAS_PAGE_MAP=page_map is not None,
        )
        block = min(1024, triton.next_power_of_2(params.budget))
        if final is None:
            grid = (batch, num_kv_heads, triton.cdiv(params.budget, block))
            _assemble_slots_kernel[grid](*common, BLOCK=block, num_warps=4, **consts)
        else:
            fscores, k, bits, k_rows, n_rows = final
            _topk_assemble_kernel[(batch, num_kv_heads)](
                fscores, *common[:8], fscores.stride(0), fscores.stride(1), *common[8:],
                K_ROWS=slots if k_rows is None else k_rows, HAS_K_ROWS=k_rows is not None,
                N_ROWS=slots if n_rows is None else n_rows, HAS_N_ROWS=n_rows is not None,
                ASM_BLOCK=min(ws.assemble_tile, triton.next_power_of_2(params.budget)),
                CAND_SLOTS=ws.cand_slots if scatter else slots,
                CAND_POS=ws.cand_positions if scatter else slots, SCATTER=scatter,
                EARLY_EXIT=True, **consts,
                **topk_launch_config(fscores.shape[-1], k, bits),
                maxnreg=TOPK_ASSEMBLE_MAXNREG,
            )
        if locality is not None:
            locality_gamma_batched(locality, positions, slots, req_pool_indices, seq_lens,
                                   params, ws.attended_bitmap, ws.gamma)
    if reranked.rerank:
        scores = exact_rerank_scores(q, k_buffer, slots, positions, seq_lens, reranked,
                                     ws.rerank_scores[:batch])
        slots, positions = ws.reranked_slots[:batch], ws.reranked_positions[:batch]
        take_top(ws.slots[:batch], ws.positions[:batch], scores, reranked.budget,
                 ws.rerank_top[:batch], slots, positions, impl=ws.topk_impl)
    return (slots, positions) if return_positions else slots


def select_blocks_batched(
    q: Tensor,
    cache: LayerCache,
    rows: DecodeRows,
    params: SelectionParams,
    workspace: SparseDecodeWorkspace,
    out_table: Tensor | None = None,
) -> Tensor:
    """The block filter alone (quest / two_level): the top ``workspace.k_blocks`` blocks of
    every (request, kv head), int32 ``[B, Hkv, k]`` (a view of the workspace's ``top_blocks``;
    ``-1`` past a short middle). What :func:`select_slots_batched` takes as
    ``SelectionInputs.candidates``: the asynchronous block filter runs it on a side stream for
    the next step. ``out_table`` (int32 ``[rows, Hkv, k]``, per request row): the top-k writes
    each request's blocks straight into its row ``req_pool_indices[b]`` instead, and the table
    is returned. The label-max filter reads ``cache``'s keys (or labels) and channels."""
    ws = workspace
    batch = q.shape[0]
    if not ws.k_blocks or params != ws.params or batch > ws.max_batch:
        raise ValueError("select_blocks_batched needs a block-filter method (quest, two_level) "
                         "and a workspace that fits the batch and params")
    tok_keys, from_labels = None, False
    if params.block_score == "label_max":
        tok_keys, from_labels = _token_keys(cache.k_buffer, cache.labels, cache.channels,
                                            params)
    scores = _block_scores(q, cache, rows, ws, tok_keys, from_labels)
    if out_table is not None:
        return topk_masked(scores, ws.k_blocks, out=out_table, impl=ws.topk_impl,
                           radix_bits=ws.block_topk_radix_bits, out_rows=rows.req_pool_indices)
    return topk_masked(scores, ws.k_blocks, out=ws.top_blocks[:batch], impl=ws.topk_impl,
                       radix_bits=ws.block_topk_radix_bits)


def sparse_decode_batched(
    q: Tensor,
    cache: LayerCache,
    rows: DecodeRows,
    params: SelectionParams,
    sm_scale: float,
    workspace: SparseDecodeWorkspace | None = None,
    inputs: SelectionInputs = _PLAIN,
    return_lse: bool = False,
    out: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """One sparse decode step for a batch: ``out [B, Hq, Dv]`` in q's dtype (and the float32
    LSE ``[B, Hq]`` with ``return_lse``).

    ``q`` ``[B, Hq, D]``; ``cache`` the layer's KV and side buffers (:class:`LayerCache`);
    ``rows`` the batch (:class:`DecodeRows`); ``inputs`` what optional features add
    (:class:`SelectionInputs`; with the tier's, the attention reads the per-head device slots).
    Pages must have ``page_size == params.block_size``. With a ``workspace`` the result is a
    view of its buffers (valid until the next call). ``out`` (``[B, Hq, Dv]``, q's dtype): the
    output's destination instead of the workspace's buffer (which the next call overwrites), so
    a caller that keeps every layer's output needs no copy.
    """
    batch, num_q_heads, _ = q.shape
    k_buffer, v_buffer = cache.k_buffer, cache.v_buffer
    if workspace is None:
        workspace = SparseDecodeWorkspace(
            batch, num_q_heads, k_buffer.shape[1], v_buffer.shape[2], params,
            triton.cdiv(rows.req_to_token.shape[1], params.block_size), q.device, q.dtype,
        )
    workspace.check(batch, num_q_heads, k_buffer.shape[1], v_buffer.shape[2], params, q.dtype)
    slots = select_slots_batched(q, cache, rows, params, workspace, inputs)
    out, lse = sparse_attention_batched(
        q, k_buffer, v_buffer, slots, sm_scale,
        num_splits=workspace._splits_for(batch),
        out=workspace.out[:batch] if out is None else out, lse=workspace.lse[:batch],
        partial_o=workspace.partial_o[:batch], partial_lse=workspace.partial_lse[:batch],
        k_scale=cache.k_scale, v_scale=cache.v_scale,
    )
    return (out, lse) if return_lse else out


def sparse_decode_batched_ref(
    q: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    params: SelectionParams,
    sm_scale: float,
    channels: Tensor | None = None,
    block_queries: Tensor | None = None,
    block_lens: Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Per-request oracle: ``select_token_mask`` + ``sparse_attention_with_lse`` on the keys
    gathered in position order. Returns ``(out [B, Hq, Dv], lse [B, Hq], masks)`` with
    ``masks[b]`` the bool ``[Hkv, L_b]`` selection. ``block_queries`` ``[B, Hq, D]`` /
    ``block_lens`` ``[B]``: the blocks were chosen by these queries at these lengths (the
    asynchronous block filter, ``candidates``). ``k_scale``/``v_scale``: the KV's scales."""
    batch, num_q_heads = q.shape[:2]
    out = torch.empty(batch, num_q_heads, v_buffer.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)
    masks = []
    for b in range(batch):
        row, length = int(req_pool_indices[b]), int(seq_lens[b])
        slots = req_to_token[row, :length].long()
        keys, values = k_buffer[slots], v_buffer[slots]
        if block_queries is None:
            mask = select_token_mask(q[b], keys, params, channels)
        else:
            mask = select_token_mask(q[b], keys, params, channels, block_query=block_queries[b],
                                     block_length=int(block_lens[b]))
        out[b], lse[b] = sparse_attention_with_lse(q[b], keys, values, mask, sm_scale * k_scale,
                                                   v_scale)
        masks.append(mask)
    return out, lse, masks
