"""Label-channel (Double Sparsity) token scores inside candidate blocks, fused with the gather.

For request ``b`` and kv head ``g`` the candidates are blocks ``cand[b, g, c]`` (``-1`` = none);
candidate slot ``c * bs + i`` stands for position ``p = cand[b, g, c] * bs + i``. Its score is
``max_{h in group g} q_h[ch] · k[p, g, ch]`` over the label channels ``ch = channels[g]`` (all D
channels when ``channels`` is None), exactly the reference's ``label_token_scores``. The key
rows are gathered straight from the paged pool (``slot = req_to_token[row, p]``); only the
label channels are read.

Outputs: scores float32 ``[B, Hkv, C*bs]`` with ``-inf`` for positions outside the middle
``[sink, L - window)`` (and so beyond ``L``) or in a ``-1`` candidate, and optionally the
matching positions (int32, ``-1`` where the score is ``-inf``).

With ``cand=None`` every block ``0 .. num_blocks-1`` is a candidate (candidate ``c`` is block
``c``): the whole-context scoring that DS uses.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.selection.reference import label_token_scores


@triton.jit
def _label_token_scores_kernel(
    Q,
    K_BUFFER,
    REQ_TO_TOKEN,
    REQ_POOL_INDICES,
    SEQ_LENS,
    CAND,
    CHANNELS,
    SCORES,
    POSITIONS,
    PAGE_MAP,
    FORCED,
    CAND_SLOTS,
    CAND_POS,
    num_cand,
    sink,
    window,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_r2t,
    stride_cb,
    stride_cg,
    stride_chg,
    stride_ob,
    stride_og,
    stride_pb,
    stride_pg,
    stride_mr,
    stride_mg,
    stride_fb,
    stride_fg,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_CH: tl.constexpr,
    BLOCK_CH: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ALL_BLOCKS: tl.constexpr,
    HAS_CHANNELS: tl.constexpr,
    KEYS_ARE_LABELS: tl.constexpr,
    WRITE_POS: tl.constexpr,
    HAS_PAGE_MAP: tl.constexpr,
    HAS_FORCED: tl.constexpr,
    WRITE_CAND_SLOTS: tl.constexpr,
    WRITE_CAND_POS: tl.constexpr,
    BLOCK_MAX: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    tile = tl.program_id(2)

    row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int64)
    hi = seq_len - window

    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)  # candidate slot = c * bs + i
    c = t // BLOCK_SIZE
    in_range = c < num_cand
    if ALL_BLOCKS:
        blk = c.to(tl.int64)
    else:
        blk = tl.load(
            CAND + b.to(tl.int64) * stride_cb + g * stride_cg + c, mask=in_range, other=-1
        ).to(tl.int64)
    pos = blk * BLOCK_SIZE + (t % BLOCK_SIZE)
    valid = in_range & (blk >= 0) & (pos >= sink) & (pos < hi)
    if HAS_PAGE_MAP:
        # CPU tier: the block's device page for this kv head (-1: not resident, skipped).
        page = tl.load(
            PAGE_MAP + row * stride_mr + g * stride_mg + blk, mask=valid, other=-1
        ).to(tl.int64)
        valid = valid & (page >= 0)
        slot = page * BLOCK_SIZE + (t % BLOCK_SIZE)
        if KEYS_ARE_LABELS:
            # the label cache covers the logical slots (host-homed pages too): read the
            # token's labels there, and hand on its device slot
            key_slot = tl.load(REQ_TO_TOKEN + row * stride_r2t + pos, mask=valid,
                               other=0).to(tl.int64)
        else:
            key_slot = slot
    elif BLOCK_MAX:
        # Pages are blocks (page_size == block_size): one lookup per block, the same address
        # for all its tokens (one transaction), instead of one per token.
        first = tl.load(REQ_TO_TOKEN + row * stride_r2t + blk * BLOCK_SIZE, mask=valid,
                        other=0).to(tl.int64)
        slot = (first // BLOCK_SIZE) * BLOCK_SIZE + (t % BLOCK_SIZE)
        key_slot = slot
    else:
        slot = tl.load(REQ_TO_TOKEN + row * stride_r2t + pos, mask=valid, other=0).to(tl.int64)
        key_slot = slot

    r = tl.arange(0, BLOCK_CH)
    rmask = r < NUM_CH
    if HAS_CHANNELS:
        ch = tl.load(CHANNELS + g * stride_chg + r, mask=rmask, other=0).to(tl.int64)
    else:
        ch = r.to(tl.int64)
    # The label cache holds only the label channels, in order: its column r is channel ch[r].
    if KEYS_ARE_LABELS:
        k_col = r.to(tl.int64)
    else:
        k_col = ch
    k = tl.load(
        K_BUFFER + key_slot[:, None] * stride_kn + g * stride_kh + k_col[None, :],
        mask=valid[:, None] & rmask[None, :],
        other=0.0,
    )  # [BLOCK_T, BLOCK_CH], as stored

    if BLOCK_MAX:
        # every middle token of the tile: one [BLOCK_T, BLOCK_CH] x [BLOCK_CH, GROUP_PAD] GEMM
        # on the tensor cores (16-bit operands: exact products, fp32 sums), then the group max
        hh = tl.arange(0, GROUP_PAD)
        qg = tl.load(
            Q + b.to(tl.int64) * stride_qb + (g * GROUP + hh[:, None]) * stride_qh + ch[None, :],
            mask=(hh[:, None] < GROUP) & rmask[None, :],
            other=0.0,
        )
        if DOT_FP32:
            s = tl.dot(k.to(tl.float32), tl.trans(qg.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(k.to(qg.dtype), tl.trans(qg))
        score = tl.max(tl.where((hh < GROUP)[None, :], s, float("-inf")), axis=1)
    else:
        k = k.to(tl.float32)
        score = tl.full([BLOCK_T], float("-inf"), tl.float32)
        for hh in tl.static_range(GROUP):
            qh = tl.load(
                Q + b.to(tl.int64) * stride_qb + (g * GROUP + hh) * stride_qh + ch,
                mask=rmask,
                other=0.0,
            ).to(tl.float32)
            score = tl.maximum(score, tl.sum(k * qh[None, :], axis=1))
    score = tl.where(valid, score, float("-inf"))
    if BLOCK_MAX:
        # each block's largest middle score (the tile holds whole blocks), not the tokens'
        per_block = tl.max(tl.reshape(score, [BLOCK_T // BLOCK_SIZE, BLOCK_SIZE]), axis=1)
        j = tile * (BLOCK_T // BLOCK_SIZE) + tl.arange(0, BLOCK_T // BLOCK_SIZE)
        tl.store(SCORES + b.to(tl.int64) * stride_ob + g * stride_og + j, per_block,
                 mask=j < num_cand)
        return
    if HAS_FORCED:
        # The locality constraint's kept blocks (block score +inf): their middle tokens first.
        forced = tl.load(FORCED + b.to(tl.int64) * stride_fb + g * stride_fg + blk, mask=valid,
                         other=0.0)
        score = tl.where(valid & (forced == float("inf")), float("inf"), score)
    out_mask = in_range
    out_off = b.to(tl.int64) * stride_ob + g * stride_og + t
    tl.store(SCORES + out_off, score, mask=out_mask)
    # What a winner puts in the slot list (the fused top-k scatters it): its KV slot (-1 where
    # not resident), and its position whenever its block is a candidate (the cooperative
    # attention reads the positions of the winners the device does not hold).
    if WRITE_CAND_SLOTS:
        tl.store(CAND_SLOTS + out_off, tl.where(valid, slot, -1).to(tl.int32), mask=out_mask)
    if WRITE_CAND_POS:
        tl.store(CAND_POS + out_off, tl.where(in_range & (blk >= 0), pos, -1).to(tl.int32),
                 mask=out_mask)
    if WRITE_POS:
        tl.store(
            POSITIONS + b.to(tl.int64) * stride_pb + g * stride_pg + t,
            tl.where(valid, pos, -1).to(tl.int32),
            mask=out_mask,
        )


# The label-max launch: tokens (whole blocks) per program and warps. At 128k x 32, 16 bf16
# label channels, 256 and 1024 tokens with 4 warps were the fastest (404 / 402 us; 8 warps
# 468-653 us, 4096 tokens 584-1196 us: benchmarks/results/operator/label_max_launch_h200.json). The
# kernel reads ~2.7 TB/s of bf16 labels, and fp8 labels are no faster (416 us): it is bound
# by its instructions per token, not by the labels' bytes. Reading the head-major label cache
# a page at a time (one lookup and one contiguous run per page) was no faster either (434 /
# 410 us, the same scores: label_max_paged_h200.json).
LABEL_MAX_TOKENS = 256
LABEL_MAX_WARPS = 4


def label_max_block_scores_batched(
    q: Tensor,
    k_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    block_size: int,
    sink: int,
    window: int,
    num_blocks: int,
    channels: Tensor | None = None,
    out: Tensor | None = None,
    keys_are_labels: bool = False,
    tokens_per_program: int = LABEL_MAX_TOKENS,
    num_warps: int = LABEL_MAX_WARPS,
    cand: Tensor | None = None,
) -> Tensor:
    """The label-max block filter's scores: each block's largest label score over its middle
    tokens, float32 ``[B, Hkv, num_blocks]`` (``-inf`` for blocks with no middle token), what
    :func:`label_token_scores_batched` with ``cand=None`` followed by a max over each block's
    tokens gives, in one pass that writes no token score. Pages must be blocks
    (``page_size == block_size``): a block's tokens are read from its first slot's page.
    Arguments as for :func:`label_token_scores_batched`; ``tokens_per_program`` (a power of
    two, at least the block size) and ``num_warps``: the launch (the result is the same).
    ``cand`` (int ``[B, Hkv, C]`` block ids, ``-1`` = none): score only these blocks, into
    ``[B, Hkv, C]`` (the cascade's second stage, ``SelectionParams.prefilter``)."""
    num_scored = num_blocks if cand is None else cand.shape[2]
    if out is None:
        out = torch.empty(q.shape[0], k_buffer.shape[1], num_scored, dtype=torch.float32,
                          device=q.device)
    _launch_token_scores(q, k_buffer, req_to_token, req_pool_indices, seq_lens, cand,
                         block_size, sink, window, channels, num_scored, out, None, None,
                         None, keys_are_labels, None, None, block_max=True,
                         block_t=max(block_size, tokens_per_program), num_warps=num_warps)
    return out


def label_max_block_scores_batched_ref(
    q: Tensor, k_buffer: Tensor, req_to_token: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, block_size: int, sink: int, window: int, num_blocks: int,
    channels: Tensor | None = None,
) -> Tensor:
    """Plain-torch reference of :func:`label_max_block_scores_batched`."""
    scores, _ = label_token_scores_batched_ref(q, k_buffer, req_to_token, req_pool_indices,
                                               seq_lens, None, block_size, sink, window,
                                               channels, num_blocks)
    return scores.view(*scores.shape[:2], num_blocks, block_size).amax(dim=3)


def label_token_scores_batched(
    q: Tensor,
    k_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    cand: Tensor | None,
    block_size: int,
    sink: int,
    window: int,
    channels: Tensor | None = None,
    num_blocks: int | None = None,
    scores_out: Tensor | None = None,
    positions_out: Tensor | None = None,
    return_positions: bool = True,
    page_map: Tensor | None = None,
    forced_blocks: Tensor | None = None,
    keys_are_labels: bool = False,
    cand_slots_out: Tensor | None = None,
    cand_positions_out: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Token scores of the candidate blocks of every (request, kv head).

    ``q`` ``[B, Hq, D]``; ``k_buffer`` ``[num_slots, Hkv, D]``; ``cand`` int ``[B, Hkv, C]``
    block ids (``-1`` = none) or None for all ``num_blocks`` blocks; ``channels`` long
    ``[Hkv, r]`` or None (all channels). Returns ``(scores [B, Hkv, C*bs] float32,
    positions [B, Hkv, C*bs] int32 or None)``. With ``page_map`` (int32 ``[rows, Hkv,
    max_blocks]``, the CPU tier's per-head device page of each block, ``-1`` = not resident)
    keys are read through it instead of ``req_to_token``; blocks that are not resident score
    ``-inf``. The label cache covers the logical slots, so with ``keys_are_labels`` the labels
    are read at ``req_to_token``'s slot and the page map only decides residency and the
    device slot handed on. ``forced_blocks`` (float32 ``[B, Hkv, max_blocks]``, block
    scores): the middle tokens of a candidate block whose entry is ``+inf`` score ``+inf``
    (the locality constraint's kept blocks, :mod:`locality`). ``keys_are_labels``:
    ``k_buffer`` is the label cache (:mod:`label_cache`, ``[num_slots, Hkv, r]``: key column
    ``i`` holds channel ``channels[g, i]``), so the keys are read whole and only the queries at
    ``channels`` (the same products in the same order as reading the channels from the pool's
    keys; the query gather happens in the kernel, not as separate launches).

    ``cand_slots_out`` / ``cand_positions_out`` (int32, the scores' shape and strides): also
    write each candidate token's KV slot (``-1`` where its score is ``-inf`` for lying outside
    the middle or in a block that is not resident) and its position (``-1`` only in a ``-1``
    candidate): what a winner contributes to the slot list, which the fused top-k of
    :mod:`sparse_decode` scatters without looking anything up again.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if cand is None:
        if num_blocks is None:
            raise ValueError("cand=None needs num_blocks")
        num_cand = num_blocks
    else:
        num_cand = cand.shape[2]
    n_tok = num_cand * block_size
    if scores_out is None:
        scores_out = torch.empty(batch, num_kv_heads, n_tok, dtype=torch.float32, device=q.device)
    if return_positions and positions_out is None:
        positions_out = torch.empty(batch, num_kv_heads, n_tok, dtype=torch.int32, device=q.device)
    if not return_positions:
        positions_out = None
    if batch == 0 or n_tok == 0:
        return scores_out, positions_out

    _launch_token_scores(q, k_buffer, req_to_token, req_pool_indices, seq_lens, cand,
                         block_size, sink, window, channels, num_cand, scores_out,
                         positions_out, page_map, forced_blocks, keys_are_labels,
                         cand_slots_out, cand_positions_out, block_max=False)
    return scores_out, positions_out


def _launch_token_scores(
    q: Tensor, k_buffer: Tensor, req_to_token: Tensor, req_pool_indices: Tensor,
    seq_lens: Tensor, cand: Tensor | None, block_size: int, sink: int, window: int,
    channels: Tensor | None, num_cand: int, scores_out: Tensor, positions_out: Tensor | None,
    page_map: Tensor | None, forced_blocks: Tensor | None, keys_are_labels: bool,
    cand_slots_out: Tensor | None, cand_positions_out: Tensor | None, block_max: bool,
    block_t: int | None = None, num_warps: int = 4,
) -> None:
    """One launch of the token-score kernel over ``num_cand`` candidates (blocks), into
    ``scores_out`` (per token, or per block with ``block_max``)."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    n_tok = num_cand * block_size
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_buffer.stride(2) != 1:
        raise ValueError("k_buffer rows must be contiguous")
    if batch == 0 or n_tok == 0:
        return
    if keys_are_labels and (channels is None or k_buffer.shape[2] != channels.shape[-1]):
        raise ValueError("label-cache keys need their channels ([Hkv, r], r = the cache's width)")
    if channels is not None:
        if channels.shape[0] != num_kv_heads:
            raise ValueError(f"channels {tuple(channels.shape)} != [Hkv={num_kv_heads}, r]")
        num_ch = channels.shape[1]
        if channels.stride(1) != 1:
            channels = channels.contiguous()
    else:
        num_ch = head_dim
    block_ch = triton.next_power_of_2(num_ch)
    if block_max:
        block_ch = max(16, block_ch)  # the GEMM's inner dimension (zero-padded channels)
    # Keep the gathered key tile around 4K elements per program.
    # (measured on the H200 with the label cache: 64-2048 tokens x 1-8 warps all within 3%)
    if block_t is None:
        block_t = max(block_size, min(triton.next_power_of_2(n_tok), max(16, 4096 // block_ch)))
    block_t = min(block_t, max(block_size, triton.next_power_of_2(n_tok)))
    for extra in (cand_slots_out, cand_positions_out):
        if extra is not None and (extra.dtype != torch.int32 or extra.shape != scores_out.shape
                                  or extra.stride() != scores_out.stride()):
            raise ValueError("cand_slots_out / cand_positions_out must be int32 with the "
                             "scores' shape and strides")
    dummy = scores_out
    grid = (batch, num_kv_heads, triton.cdiv(n_tok, block_t))
    _label_token_scores_kernel[grid](
        q,
        k_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        cand if cand is not None else dummy,
        channels if channels is not None else dummy,
        scores_out,
        positions_out if positions_out is not None else dummy,
        page_map if page_map is not None else dummy,
        forced_blocks if forced_blocks is not None else dummy,
        cand_slots_out if cand_slots_out is not None else dummy,
        cand_positions_out if cand_positions_out is not None else dummy,
        num_cand,
        sink,
        window,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        req_to_token.stride(0),
        cand.stride(0) if cand is not None else 0,
        cand.stride(1) if cand is not None else 0,
        channels.stride(0) if channels is not None else 0,
        scores_out.stride(0),
        scores_out.stride(1),
        positions_out.stride(0) if positions_out is not None else 0,
        positions_out.stride(1) if positions_out is not None else 0,
        page_map.stride(0) if page_map is not None else 0,
        page_map.stride(1) if page_map is not None else 0,
        forced_blocks.stride(0) if forced_blocks is not None else 0,
        forced_blocks.stride(1) if forced_blocks is not None else 0,
        BLOCK_SIZE=block_size,
        GROUP=group,
        NUM_CH=num_ch,
        BLOCK_CH=block_ch,
        BLOCK_T=block_t,
        ALL_BLOCKS=cand is None,
        HAS_CHANNELS=channels is not None,
        KEYS_ARE_LABELS=keys_are_labels,
        WRITE_POS=positions_out is not None,
        HAS_PAGE_MAP=page_map is not None,
        HAS_FORCED=forced_blocks is not None,
        WRITE_CAND_SLOTS=cand_slots_out is not None,
        WRITE_CAND_POS=cand_positions_out is not None,
        BLOCK_MAX=block_max,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        # fp32 GEMMs for fp32 queries and under the CPU interpreter (which multiplies 16-bit
        # floats as raw integers); 16-bit tensor-core operands on the GPU
        DOT_FP32=q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=num_warps,
    )


def label_token_scores_batched_ref(
    q: Tensor,
    k_buffer: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    cand: Tensor | None,
    block_size: int,
    sink: int,
    window: int,
    channels: Tensor | None = None,
    num_blocks: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain-torch reference of :func:`label_token_scores_batched` (loops over requests)."""
    batch = q.shape[0]
    num_kv_heads = k_buffer.shape[1]
    if cand is None:
        cand = torch.arange(num_blocks, device=q.device).expand(batch, num_kv_heads, -1)
    num_cand = cand.shape[2]
    bs = block_size
    scores = torch.full(
        (batch, num_kv_heads, num_cand * bs), float("-inf"), dtype=torch.float32, device=q.device
    )
    positions = torch.full_like(scores, -1, dtype=torch.int32)
    for b in range(batch):
        row, length = int(req_pool_indices[b]), int(seq_lens[b])
        lo, hi = sink, length - window
        if hi <= lo:
            continue
        keys = k_buffer[req_to_token[row, :length].long()]  # [L, Hkv, D]
        all_scores = label_token_scores(q[b], keys, channels)  # [Hkv, L]
        pos = cand[b].long()[:, :, None] * bs + torch.arange(bs, device=q.device)  # [Hkv, C, bs]
        pos = pos.reshape(num_kv_heads, -1)
        valid = (cand[b].long()[:, :, None] >= 0).expand(-1, -1, bs).reshape(num_kv_heads, -1)
        valid &= (pos >= lo) & (pos < hi)
        gathered = all_scores.gather(1, pos.clamp(0, length - 1))
        scores[b] = gathered.masked_fill(~valid, float("-inf"))
        positions[b] = torch.where(valid, pos, -1).int()
    return scores, positions
