"""Per-page running key min/max (the Quest block summaries), maintained as KV is written.

Pages coincide with selection blocks (``page_size == block_size``): position ``p`` of a request
lives in slot ``req_to_token[row, p]`` and ``slot % page_size == p % page_size``, so a block's
summary is the summary of its page. The summaries of one layer are two float32 tensors
``kmin``/``kmax`` of shape ``[num_pages, Hkv, D]``.

``update_block_summaries`` is called with every batch of keys written to the pool (prefill
chunks, decode tokens): a page whose first slot is written in this call starts clean (a freed
page can be handed to a new request, and its old summary must not leak into the new one); all
other writes fold into the page's running min/max, so a chunk boundary inside a page just
continues the page. Two launches, no host sync: (1) reset the pages whose first slot is written,
(2) fold every written key in with float atomic min/max (exact, order independent).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _reset_pages_kernel(
    KMIN,
    KMAX,
    LOC,
    stride_page,
    PAGE_SIZE: tl.constexpr,
    HD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(LOC + n).to(tl.int64)
    first = (slot % PAGE_SIZE) == 0
    page = slot // PAGE_SIZE
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs < HD) & first
    inf = tl.full([BLOCK], float("inf"), tl.float32)
    tl.store(KMIN + page * stride_page + offs, inf, mask=mask)
    tl.store(KMAX + page * stride_page + offs, -inf, mask=mask)


@triton.jit
def _fold_keys_kernel(
    KMIN,
    KMAX,
    K,
    LOC,
    stride_page,
    stride_kn,
    stride_kh,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_HEADS: tl.constexpr,
):
    # The summary rows are [Hkv, D] contiguous; k_new may be a strided view.
    n = tl.program_id(0)
    slot = tl.load(LOC + n).to(tl.int64)
    page = slot // PAGE_SIZE
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + n.to(tl.int64) * stride_kn + h[:, None] * stride_kh + d[None, :], mask=mask)
    k = k.to(tl.float32)
    dst = page * stride_page + h[:, None] * HEAD_DIM + d[None, :]
    tl.atomic_min(KMIN + dst, k, mask=mask, sem="relaxed")
    tl.atomic_max(KMAX + dst, k, mask=mask, sem="relaxed")


def update_block_summaries(
    kmin: Tensor, kmax: Tensor, k_new: Tensor, loc: Tensor, page_size: int
) -> None:
    """Fold the keys ``k_new`` ``[N, Hkv, D]`` written at slots ``loc`` ``[N]`` into the
    per-page summaries ``kmin``/``kmax`` (float32 ``[num_pages, Hkv, D]``, updated in place).

    A page whose first slot (``slot % page_size == 0``) is in ``loc`` is reset first. Slots
    must be distinct within a call (as SGLang's ``out_cache_loc`` is). Launch-only: no host
    sync, safe to call inside a CUDA graph.
    """
    if kmin.dtype != torch.float32 or kmax.dtype != torch.float32:
        raise TypeError("kmin/kmax must be float32")
    if kmin.shape != kmax.shape or kmin.dim() != 3:
        raise ValueError(
            f"kmin/kmax must both be [num_pages, Hkv, D], got {kmin.shape}, {kmax.shape}"
        )
    if not (kmin.is_contiguous() and kmax.is_contiguous()):
        raise ValueError("kmin/kmax must be contiguous")
    num_tokens = k_new.shape[0]
    if num_tokens == 0:
        return
    num_heads, head_dim = kmin.shape[1], kmin.shape[2]
    if tuple(k_new.shape[1:]) != (num_heads, head_dim):
        raise ValueError(f"k_new {tuple(k_new.shape)} does not match summaries {tuple(kmin.shape)}")
    if k_new.stride(2) != 1:
        k_new = k_new.contiguous()
    loc = loc.reshape(-1)
    if loc.shape[0] != num_tokens:
        raise ValueError(f"loc has {loc.shape[0]} entries for {num_tokens} keys")

    hd = num_heads * head_dim
    block = min(1024, triton.next_power_of_2(hd))
    _reset_pages_kernel[(num_tokens, triton.cdiv(hd, block))](
        kmin, kmax, loc, kmin.stride(0), PAGE_SIZE=page_size, HD=hd, BLOCK=block
    )
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 2048 // block_d))
    _fold_keys_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
        kmin,
        kmax,
        k_new,
        loc,
        kmin.stride(0),
        k_new.stride(0),
        k_new.stride(1),
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        NUM_HEADS=num_heads,
    )


def update_block_summaries_ref(
    kmin: Tensor, kmax: Tensor, k_new: Tensor, loc: Tensor, page_size: int
) -> None:
    """Plain-torch reference of :func:`update_block_summaries` (same in-place contract)."""
    loc = loc.reshape(-1).long()
    pages = loc // page_size
    first = pages[loc % page_size == 0]
    kmin[first] = float("inf")
    kmax[first] = float("-inf")
    flat = k_new.float().reshape(k_new.shape[0], -1)
    kmin.view(kmin.shape[0], -1).index_reduce_(0, pages, flat, "amin", include_self=True)
    kmax.view(kmax.shape[0], -1).index_reduce_(0, pages, flat, "amax", include_self=True)


def allocate_block_summaries(
    num_slots: int, num_kv_heads: int, head_dim: int, page_size: int, device=None
) -> tuple[Tensor, Tensor]:
    """Empty (+inf / -inf) summaries for a pool of ``num_slots`` slots: ``(kmin, kmax)``."""
    num_pages = -(-num_slots // page_size)
    kmin = torch.full((num_pages, num_kv_heads, head_dim), float("inf"), device=device)
    kmax = torch.full((num_pages, num_kv_heads, head_dim), float("-inf"), device=device)
    return kmin, kmax
