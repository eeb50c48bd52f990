"""Double Sparsity's label cache: the label channels of every key, stored contiguously.

Token scoring reads ``r`` label channels (e.g. 16 of 128) of each candidate key. Read straight
from the KV pool, those channels are scattered over the key's whole row (256 bytes for a bf16
128-dim head), so the GPU fetches every sector of it: the scoring costs as much memory traffic
as reading the keys. The label cache keeps, per layer, ``labels[slot, g, i] = k[slot, g,
channels[g, i]]`` (``[num_slots, Hkv, r]`` in the KV dtype, ``r / D`` of the key cache's size),
written beside the KV; token scoring then reads ``r`` contiguous values per key (one 32-byte
sector for 16 bf16 channels) with the queries reduced to the same channels.

Scores are unchanged: :func:`label_queries` gathers each query head's channels in the same
order, so the kernel sums the same products in the same order as when it gathers the channels
from the pool.

Both functions are a handful of torch ops (a gather and an indexed store): no host sync, safe
inside a CUDA graph. The padding slot 0 may be written several times per call (CUDA-graph
padding); it is never read by a real request.
"""

from __future__ import annotations

import torch
from torch import Tensor


def allocate_label_cache(num_slots: int, num_kv_heads: int, num_channels: int, device,
                         dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """One layer's label cache, indexed ``[num_slots, Hkv, r]`` (zeros: a slot is written before
    it is read). Stored head-major (a ``[Hkv, num_slots, r]`` tensor, permuted): the token
    scoring of one (request, kv head) reads a page's labels as one contiguous run
    (page_size * r values) instead of r values every Hkv * r."""
    store = torch.zeros(num_kv_heads, num_slots, num_channels, dtype=dtype, device=device)
    return store.permute(1, 0, 2)


def update_label_cache(labels: Tensor, k: Tensor, loc: Tensor, channels: Tensor) -> None:
    """Store the label channels of the keys ``k`` ``[n, Hkv, D]`` just written to slots ``loc``
    ``[n]``; ``channels`` long ``[Hkv, r]``."""
    if k.shape[0] == 0:
        return
    index = channels.to(device=k.device, dtype=torch.long).unsqueeze(0).expand(k.shape[0], -1, -1)
    labels[loc.long()] = torch.gather(k.view(k.shape[0], labels.shape[1], -1), 2, index).to(
        labels.dtype)


def label_queries(q: Tensor, channels: Tensor) -> Tensor:
    """``q`` ``[B, Hq, D]`` reduced to each head's kv-head label channels: ``[B, Hq, r]``."""
    batch, num_q_heads, _ = q.shape
    num_kv_heads = channels.shape[0]
    index = channels.to(device=q.device, dtype=torch.long).repeat_interleave(
        num_q_heads // num_kv_heads, dim=0)
    return torch.gather(q, 2, index.unsqueeze(0).expand(batch, -1, -1))
