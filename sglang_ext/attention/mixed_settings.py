"""Per-request sparse settings on the batched (Triton) decode: rows of one batch that asked for
different settings (``custom_params.sparse``, see :mod:`request_overrides`) decode in groups,
one kernel pipeline per distinct setting, and ``dense`` rows attend their whole context
exactly.

A batch whose rows all use the server's setting never comes here: it replays the decode CUDA
graph as before. A batch holding an overriding row runs eagerly (patches/cuda_graph.py keeps
it off the graph), since each setting needs its own top-k sizes and scratch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from sglang_ext.kernels.sparse_decode import DecodeRows, LayerCache
from sglang_ext.selection import SelectionParams

# Which per-request settings the batched decode serves; the others need the reference decode
# (reference-only features) or a server started with them (state the kernels keep per row).
KERNEL_SERVES = {
    "block_filter": ("sync",),
    "scoring": ("score",),
    "locality_blocks": (0,),
    "head_policy": (False,),
}


def unsupported_override(params: Optional[SelectionParams], block_size: int) -> Optional[str]:
    """Why the batched decode cannot serve this request's setting (one line), or None."""
    if params is None:
        return None
    if params.block_size != block_size:
        return (f"block_size {params.block_size} differs from the server's --sparse-block-size "
                f"{block_size} (the KV pool's pages are the blocks)")
    for key, allowed in KERNEL_SERVES.items():
        if getattr(params, key) not in allowed:
            return f"{key} {getattr(params, key)!r} needs --sparse-impl reference"
    return None


@dataclass(frozen=True)
class RowGroup:
    """The rows of a batch that share one setting (``None``: dense)."""

    params: Optional[SelectionParams]
    rows: Tensor  # long [n], indices into the batch, on the device


def group_rows(sparsity: Sequence[Optional[SelectionParams]], device) -> list[RowGroup]:
    """Batch rows grouped by setting, in order of first appearance."""
    order: dict = {}
    for i, p in enumerate(sparsity):
        order.setdefault(p, []).append(i)
    return [RowGroup(p, torch.tensor(rows, dtype=torch.long, device=device))
            for p, rows in order.items()]


def dense_slots(req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor,
                num_kv_heads: int) -> Tensor:
    """int32 ``[B, Hkv, K]``: every position's slot (``-1`` past a row's length), the same for
    every kv head: what exact attention over the whole context reads. ``K`` is the longest
    row rounded up to a power of two (at least 256), so that the attention kernel meets few
    distinct shapes as the rows grow (each new one is a compile)."""
    longest = int(seq_lens.max()) if seq_lens.numel() else 0
    width = max(256, 1 << max(longest - 1, 0).bit_length())
    pos = torch.arange(width, device=req_to_token.device)
    rows = req_to_token[req_pool_indices.long()]
    if rows.shape[1] < width:
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]))
    slots = torch.where(pos[None] < seq_lens[:, None], rows[:, :width], -1).to(torch.int32)
    return slots[:, None, :].expand(-1, num_kv_heads, -1)


class MixedSettingsDecode:
    """The grouped decode of one backend: one workspace per (setting, batch size) seen, reused
    across steps and layers (eager only: nothing here is captured)."""

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim_v: int, max_blocks: int,
                 device, dtype: torch.dtype, topk_radix_bits=None) -> None:
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim_v = head_dim_v
        self.max_blocks = max_blocks
        self.device = device
        self.dtype = dtype
        self.topk_radix_bits = topk_radix_bits
        self._workspaces: dict[SelectionParams, object] = {}

    def workspace(self, params: SelectionParams, batch: int):
        from sglang_ext.kernels.sparse_decode import SparseDecodeWorkspace

        ws = self._workspaces.get(params)
        if ws is None or ws.max_batch < batch:
            ws = SparseDecodeWorkspace(batch, self.num_q_heads, self.num_kv_heads,
                                       self.head_dim_v, params, self.max_blocks, self.device,
                                       self.dtype, topk_radix_bits=self.topk_radix_bits)
            self._workspaces[params] = ws
        return ws

    def decode(self, groups: Sequence[RowGroup], q: Tensor, cache: LayerCache, rows: DecodeRows,
               sm_scale: float) -> Tensor:
        """``[B, Hq, Dv]``: each group's rows decoded with its setting."""
        from sglang_ext.kernels.sparse_attention import sparse_attention_batched
        from sglang_ext.kernels.sparse_decode import sparse_decode_batched

        k_buffer, v_buffer = cache.k_buffer, cache.v_buffer
        out = q.new_empty(q.shape[0], q.shape[1], v_buffer.shape[2])
        for group in groups:
            index = group.rows
            group_rows_ = DecodeRows(rows.req_to_token, rows.req_pool_indices[index],
                                     rows.seq_lens[index])
            q_g = q[index]
            if group.params is None:
                slots = dense_slots(rows.req_to_token, group_rows_.req_pool_indices,
                                    group_rows_.seq_lens, k_buffer.shape[1])
                out[index], _ = sparse_attention_batched(q_g, k_buffer, v_buffer, slots,
                                                         sm_scale, k_scale=cache.k_scale,
                                                         v_scale=cache.v_scale)
                continue
            out[index] = sparse_decode_batched(
                q_g, cache, group_rows_, group.params, sm_scale,
                workspace=self.workspace(group.params, index.numel()))
        return out
