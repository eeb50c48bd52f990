"""Working-set residency update: the set difference between the blocks a decode step wants and
the blocks already on the GPU, slot reuse, and the list of host->GPU transfers (the CPU tier).

A request in the host tier keeps, per (layer, kv head), ``C`` *working-set slots* on the GPU,
each one KV page (``block_size`` tokens of one kv head) at device page ``slot_pages[row, s]``.
For one layer the state is

* ``ws_map``      int32 ``[rows, Hkv, max_blocks]``: device page holding block ``j`` of the
  request for that kv head, ``-1`` if not resident. Blocks kept resident by other means (the
  sink and the recent window, which live in ordinary, shared device pages) are mapped too and
  count as hits; this kernel never unmaps them.
* ``slot_block``  int32 ``[rows, Hkv, C]``: the block each working-set slot holds (``-1``: empty).
* ``ring_pages``/``ring_blocks`` (optional) int32 ``[rows, R]``: the tier's recent-window ring,
  whose page ``r`` holds block ``ring_blocks[row, r]`` (``-1``: none) and is reused for a newer
  block once that one leaves the window; block ``j`` can only sit in ring page ``j % R``. A
  wanted block mapped to its ring page counts as a **miss**: it gets a slot of its own while it
  is still in the ring, so that when the ring lets it go the block stays resident. Without
  that, the async schedule would attend a block chosen at the previous step (a ring hit then)
  whose page the ring has meanwhile reused, and miss its tokens for one step. A slot taken
  from a block still in the ring maps that block back to its ring page.

Given the wanted blocks ``cand [B, Hkv, C]`` (distinct block ids, ``-1`` = none; the block
filter's top-k), one program per (request, kv head):

1. hits: wanted blocks that are mapped (in a slot, or in a shared page other than a ring page);
2. misses: the other wanted blocks, in candidate order;
3. free slots: slots whose block is not wanted (or that no longer hold their block: the map
   points elsewhere), in slot order (their data stays mapped, and
   hits there later cost nothing, until a miss reuses the slot);
4. the r-th miss goes to the r-th free slot: its old block is unmapped, the new one mapped, and
   the transfer ``(host page = logical page of the block, device page)`` is written to
   ``src_pages/dst_pages [B, Hkv, C]`` at the miss's candidate index (``-1`` elsewhere), the
   layout :func:`kernels.host_gather` consumes (the kv head of entry ``[b, g, i]`` is ``g``).

Only the difference moves: a block wanted at consecutive steps is never transferred twice.
Rows whose ``tiered[row]`` is 0 (requests whose whole KV is on the GPU, and the padding row 0
of CUDA graphs) are left untouched and produce no transfers. No host sync, static shapes: safe
inside a CUDA graph. ``stats`` (int64 ``[3]``, optional) accumulates (wanted, missed,
host-homed wanted) counts: the hit rate among host-homed blocks is what sizes the transfers
(a request homed on the GPU wants blocks that always hit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _update_working_set_kernel(
    CAND,
    REQ_POOL_INDICES,
    TIERED,
    WS_MAP,
    SLOT_BLOCK,
    SLOT_PAGES,
    REQ_TO_TOKEN,
    SRC_PAGES,
    DST_PAGES,
    STATS,
    RING,
    RING_BLOCK,
    stride_ring,
    stride_cb,
    stride_cg,
    stride_mr,
    stride_mg,
    stride_sr,
    stride_sg,
    stride_pr,
    stride_r2t,
    stride_tb,
    stride_tg,
    host_page_offset,
    NUM_CAND: tl.constexpr,
    C_P2: tl.constexpr,
    S_CHUNK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_STATS: tl.constexpr,
    NUM_RING: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
    i = tl.arange(0, C_P2)
    in_c = i < NUM_CAND
    out_off = b * stride_tb + g * stride_tg + i
    if tl.load(TIERED + row) == 0:
        tl.store(SRC_PAGES + out_off, tl.full([C_P2], -1, tl.int32), mask=in_c)
        tl.store(DST_PAGES + out_off, tl.full([C_P2], -1, tl.int32), mask=in_c)
        return

    map_base = WS_MAP + row * stride_mr + g * stride_mg
    sb_base = SLOT_BLOCK + row * stride_sr + g * stride_sg
    cand = tl.load(CAND + b * stride_cb + g * stride_cg + i, mask=in_c, other=-1)
    valid = cand >= 0
    mapped_page = tl.load(map_base + cand, mask=valid, other=-1)

    # One pass over the slots in chunks: which slots are free, their rank among the free ones
    # (a running count across chunks), and the r-th miss -> the r-th free slot.
    miss = valid & (mapped_page < 0)
    if NUM_RING > 0:
        ring_base = row * stride_ring + cand % NUM_RING
        own_ring_page = tl.load(RING + ring_base, mask=valid, other=-1)
        miss = miss | (valid & (mapped_page >= 0) & (mapped_page == own_ring_page))
    miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    dst_slot = tl.full([C_P2], -1, tl.int32)
    free_before = 0
    for s0 in tl.static_range(0, NUM_CAND, S_CHUNK):
        s = s0 + tl.arange(0, S_CHUNK)
        in_s = s < NUM_CAND
        sblk = tl.load(sb_base + s, mask=in_s, other=-1)
        page = tl.load(SLOT_PAGES + row * stride_pr + s, mask=in_s, other=-1)
        # A slot really holds its block only while the map points at the slot's page.
        holds = (sblk >= 0) & (tl.load(map_base + sblk, mask=sblk >= 0, other=-1) == page)
        wanted = tl.sum(
            ((cand[:, None] == sblk[None, :]) & valid[:, None]).to(tl.int32), axis=0
        ) > 0
        free = in_s & ((wanted == 0) | (holds == 0))
        free_rank = free_before + tl.cumsum(free.to(tl.int32), axis=0) - 1
        match = miss[:, None] & free[None, :] & (miss_rank[:, None] == free_rank[None, :])
        dst_slot = tl.maximum(dst_slot, tl.max(tl.where(match, s[None, :], -1), axis=1))
        # Unmap the old block of every slot a miss takes over (back to its ring page if the
        # ring still holds it).
        taken = free & (free_rank < n_miss) & holds
        fallback = tl.full([S_CHUNK], -1, tl.int32)
        if NUM_RING > 0:
            old_ring = row * stride_ring + sblk % NUM_RING
            still = tl.load(RING_BLOCK + old_ring, mask=taken, other=-1) == sblk
            fallback = tl.where(still, tl.load(RING + old_ring, mask=taken & still, other=-1),
                                fallback)
        tl.store(map_base + sblk, fallback, mask=taken)
        free_before += tl.sum(free.to(tl.int32), axis=0)

    has_slot = miss & (dst_slot >= 0)
    dst_page = tl.load(SLOT_PAGES + row * stride_pr + dst_slot, mask=has_slot, other=-1)
    # a row whose slots were taken away (released) maps and moves nothing
    got = has_slot & (dst_page >= 0)
    tl.debug_barrier()  # evictions above land before the new mappings below
    tl.store(map_base + cand, dst_page, mask=got)
    tl.store(sb_base + dst_slot, cand, mask=got)
    # every wanted block's logical page: a miss's host page, and (stats) whether it is host-homed
    first_slot = tl.load(REQ_TO_TOKEN + row * stride_r2t + cand * BLOCK_SIZE, mask=valid, other=0)
    src_page = tl.where(got, first_slot // BLOCK_SIZE - host_page_offset, -1)
    tl.store(SRC_PAGES + out_off, src_page.to(tl.int32), mask=in_c)
    tl.store(DST_PAGES + out_off, tl.where(got, dst_page, -1).to(tl.int32), mask=in_c)
    if HAS_STATS:
        tl.atomic_add(STATS, tl.sum(valid.to(tl.int64), axis=0))
        tl.atomic_add(STATS + 1, tl.sum(got.to(tl.int64), axis=0))
        on_host = valid & (first_slot // BLOCK_SIZE >= host_page_offset)
        tl.atomic_add(STATS + 2, tl.sum(on_host.to(tl.int64), axis=0))


def update_working_set(
    cand: Tensor,
    req_pool_indices: Tensor,
    tiered: Tensor,
    ws_map: Tensor,
    slot_block: Tensor,
    slot_pages: Tensor,
    req_to_token: Tensor,
    block_size: int,
    src_pages: Tensor | None = None,
    dst_pages: Tensor | None = None,
    stats: Tensor | None = None,
    host_page_offset: int = 0,
    ring_pages: Tensor | None = None,
    ring_blocks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """One layer's residency update (see the module doc); updates ``ws_map``/``slot_block`` in
    place and returns the transfer list ``(src_pages, dst_pages)``, int32 ``[B, Hkv, C]``.
    The host page of a block is its logical page (``req_to_token[row, j*bs] // bs``) minus
    ``host_page_offset`` (the tiered pool homes logical pages ``>= offset`` on the host)."""
    batch, num_kv_heads, num_cand = cand.shape
    if slot_block.shape[-1] != num_cand or slot_pages.shape[-1] != num_cand:
        raise ValueError(
            f"{num_cand} wanted blocks per head need as many working-set slots "
            f"(slot_block {tuple(slot_block.shape)}, slot_pages {tuple(slot_pages.shape)})"
        )
    if (ring_pages is None) != (ring_blocks is None):
        raise ValueError("ring_pages and ring_blocks go together")
    checked = [("ws_map", ws_map), ("slot_block", slot_block), ("slot_pages", slot_pages),
               ("cand", cand)]
    if ring_pages is not None:
        if ring_pages.shape != ring_blocks.shape:
            raise ValueError(f"ring_pages {tuple(ring_pages.shape)} and ring_blocks "
                             f"{tuple(ring_blocks.shape)} differ")
        checked += [("ring_pages", ring_pages), ("ring_blocks", ring_blocks)]
    for name, t in checked:
        if t.dtype != torch.int32 or t.stride(-1) != 1:
            raise ValueError(f"{name} must be int32 with contiguous rows")
    if stats is not None and (stats.dtype != torch.int64 or stats.numel() != 3):
        raise ValueError(f"stats must be int64 [3] (wanted, missed, host-homed wanted), got "
                         f"{stats.dtype} {tuple(stats.shape)}")
    if src_pages is None:
        src_pages = torch.empty_like(cand)
    if dst_pages is None:
        dst_pages = torch.empty_like(cand)
    if batch == 0 or num_cand == 0:
        return src_pages, dst_pages
    c_p2 = triton.next_power_of_2(num_cand)
    s_chunk = max(1, min(c_p2, 4096 // c_p2))
    _update_working_set_kernel[(batch, num_kv_heads)](
        cand, req_pool_indices, tiered, ws_map, slot_block, slot_pages, req_to_token,
        src_pages, dst_pages, stats if stats is not None else src_pages,
        ring_pages if ring_pages is not None else src_pages,
        ring_blocks if ring_blocks is not None else src_pages,
        ring_pages.stride(0) if ring_pages is not None else 0,
        cand.stride(0), cand.stride(1), ws_map.stride(0), ws_map.stride(1),
        slot_block.stride(0), slot_block.stride(1), slot_pages.stride(0), req_to_token.stride(0),
        src_pages.stride(0), src_pages.stride(1), host_page_offset,
        NUM_CAND=num_cand, C_P2=c_p2, S_CHUNK=s_chunk, BLOCK_SIZE=block_size,
        HAS_STATS=stats is not None, num_warps=4 if c_p2 <= 128 else 8,
        NUM_RING=ring_pages.shape[-1] if ring_pages is not None else 0,
    )
    return src_pages, dst_pages


def update_working_set_ref(
    cand: Tensor,
    req_pool_indices: Tensor,
    tiered: Tensor,
    ws_map: Tensor,
    slot_block: Tensor,
    slot_pages: Tensor,
    req_to_token: Tensor,
    block_size: int,
    host_page_offset: int = 0,
    ring_pages: Tensor | None = None,
    ring_blocks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Plain-Python oracle of :func:`update_working_set` (same in-place updates and result)."""
    batch, num_kv_heads, num_cand = cand.shape
    src = torch.full_like(cand, -1)
    dst = torch.full_like(cand, -1)
    for b in range(batch):
        row = int(req_pool_indices[b])
        if int(tiered[row]) == 0:
            continue
        for g in range(num_kv_heads):
            wanted = [int(x) for x in cand[b, g]]
            slots = [int(x) for x in slot_block[row, g]]
            wanted_set = {x for x in wanted if x >= 0}
            ring = ring_pages[row].tolist() if ring_pages is not None else []
            ring_of = ring_blocks[row].tolist() if ring_blocks is not None else []

            def in_own_ring_page(blk: int) -> bool:
                return bool(ring) and int(ws_map[row, g, blk]) == ring[blk % len(ring)]

            misses = [i for i, blk in enumerate(wanted)
                      if blk >= 0 and (int(ws_map[row, g, blk]) < 0 or in_own_ring_page(blk))]
            pages = [int(x) for x in slot_pages[row]]
            holds = [blk >= 0 and int(ws_map[row, g, blk]) == pages[s] for s, blk in enumerate(slots)]
            free = [s for s, blk in enumerate(slots) if blk not in wanted_set or not holds[s]]
            for i, s in zip(misses, free):
                old = slots[s]
                page = pages[s]
                if holds[s]:
                    still = bool(ring) and ring_of[old % len(ring)] == old
                    ws_map[row, g, old] = ring[old % len(ring)] if still else -1
                if page < 0:  # a released row's slots: nothing mapped, nothing moved
                    continue
                blk = wanted[i]
                ws_map[row, g, blk] = page
                slot_block[row, g, s] = blk
                src[b, g, i] = int(req_to_token[row, blk * block_size]) // block_size - host_page_offset
                dst[b, g, i] = page
    return src, dst
