"""Double Sparsity's label cache: the label channels of every key, stored contiguously.

Token scoring reads ``r`` label channels (e.g. 16 of 128) of each candidate key. Read straight
from the KV pool, those channels are scattered over the key's whole row (256 bytes for a bf16
128-dim head), so the GPU fetches every sector of it: the scoring costs as much memory traffic
as reading the keys. The label cache keeps, per layer, ``labels[slot, g, i] = k[slot, g,
channels[g, i]]`` (``[num_slots, Hkv, r]`` in the KV dtype, ``r / D`` of the key cache's size),
written beside the KV; token scoring (:mod:`token_scores`, ``keys_are_labels``) then reads ``r``
contiguous values per key (one 32-byte sector for 16 bf16 channels) and the queries at the same
channels, so it sums the same products in the same order as when it gathers the channels from
the pool: the scores are unchanged. With ``--sparse-label-dtype fp8_e4m3`` the cache holds the
channels rounded to fp8 (one byte each: half the memory and the reads); the reference then
scores the same rounded values (``label_token_scores``'s ``label_dtype``).

:func:`update_label_cache` is one Triton launch per written batch (one program per key): a
decode step writes every layer's labels, and the torch formulation
(:func:`update_label_cache_ref`: an index conversion, a gather and an indexed store) cost three
launches per layer. No host sync, safe inside a CUDA graph. The padding slot 0 may be written
several times per call (CUDA-graph padding); it is never read by a real request.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.selection.reference import to_label_storage


def allocate_label_cache(num_slots: int, num_kv_heads: int, num_channels: int, device,
                         dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """One layer's label cache, indexed ``[num_slots, Hkv, r]`` (zeros: a slot is written before
    it is read). Stored head-major (a ``[Hkv, num_slots, r]`` tensor, permuted): the token
    scoring of one (request, kv head) reads a page's labels as one contiguous run
    (page_size * r values) instead of r values every Hkv * r."""
    store = torch.zeros(num_kv_heads, num_slots, num_channels, dtype=dtype, device=device)
    return store.permute(1, 0, 2)


@triton.jit
def _write_labels_kernel(
    LABELS,
    K,
    LOC,
    CHANNELS,
    stride_ls,
    stride_lg,
    stride_kn,
    stride_kh,
    stride_cg,
    NUM_CH: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK: tl.constexpr,
    SATURATE_AT: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(LOC + n).to(tl.int64)
    e = tl.arange(0, BLOCK)  # (kv head, label index) flattened
    ok = e < NUM_KV_HEADS * NUM_CH
    g = e // NUM_CH
    i = e % NUM_CH
    ch = tl.load(CHANNELS + g * stride_cg + i, mask=ok, other=0).to(tl.int64)
    val = tl.load(K + n * stride_kn + g * stride_kh + ch, mask=ok, other=0.0)
    if SATURATE_AT > 0:  # fp8 labels narrowed here: clamp, then round to nearest even
        val = tl.minimum(tl.maximum(val.to(tl.float32), -SATURATE_AT), SATURATE_AT)
        val = val.to(LABELS.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(LABELS + slot * stride_ls + g * stride_lg + i, val.to(LABELS.dtype.element_ty),
             mask=ok)


def update_label_cache(labels: Tensor, k: Tensor, loc: Tensor, channels: Tensor) -> None:
    """Store the label channels of the keys ``k`` ``[n, Hkv, D]`` just written to slots ``loc``
    ``[n]``; ``channels`` ``[Hkv, r]`` (integer, on k's device)."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, r = labels.shape[1], labels.shape[2]
    if tuple(channels.shape) != (num_kv_heads, r) or k.shape[1] != num_kv_heads:
        raise ValueError(f"channels {tuple(channels.shape)} / keys {tuple(k.shape)} do not match "
                         f"the label cache {tuple(labels.shape)}")
    if labels.stride(2) != 1:
        raise ValueError("the label cache's rows must be contiguous (allocate_label_cache)")
    saturate_at = 0.0
    if k.dtype != labels.dtype:
        if (labels.dtype == torch.float8_e4m3fn and k.is_cuda
                and os.environ.get("TRITON_INTERPRET") != "1"):
            # fp8 labels: narrowed inside the kernel (a torch cast of the whole key rows was
            # two more launches per layer and a copy of every key)
            saturate_at = torch.finfo(labels.dtype).max
        else:
            # Narrowing in torch (round to nearest even; Triton's CPU interpreter truncates),
            # saturating for fp8 labels.
            k = to_label_storage(k, labels.dtype)
    if k.stride(2) != 1:
        k = k.contiguous()
    if channels.stride(1) != 1:
        channels = channels.contiguous()
    loc = loc.reshape(-1)
    if loc.shape[0] != num_tokens:
        raise ValueError(f"loc has {loc.shape[0]} entries for {num_tokens} keys")
    _write_labels_kernel[(num_tokens,)](
        labels, k, loc, channels, labels.stride(0), labels.stride(1), k.stride(0), k.stride(1),
        channels.stride(0), NUM_CH=r, NUM_KV_HEADS=num_kv_heads,
        BLOCK=triton.next_power_of_2(num_kv_heads * r), SATURATE_AT=saturate_at, num_warps=1,
    )


def update_label_cache_ref(labels: Tensor, k: Tensor, loc: Tensor, channels: Tensor) -> None:
    """Plain-torch reference of :func:`update_label_cache` (same in-place contract)."""
    if k.shape[0] == 0:
        return
    index = channels.to(device=k.device, dtype=torch.long).unsqueeze(0).expand(k.shape[0], -1, -1)
    labels[loc.long()] = to_label_storage(
        torch.gather(k.view(k.shape[0], labels.shape[1], -1), 2, index), labels.dtype)
