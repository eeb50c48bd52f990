"""The label basis at the backend's entry: every layer's queries and keys change basis before
anything reads or stores them (``--sparse-label-config`` with a basis, selection/label_basis.py).

``q' = q Bq`` and ``k' = k Bk`` with ``Bq Bkᵀ = I`` keep every q·k, so dense attention, the exact
rerank and per-request ``dense`` rows attend what the model attends (to the KV dtype's rounding
of k'), while the label channels 0..r-1 of k' are the basis's leading coordinates. The KV cache,
the page summaries, the label cache and the CPU tier all hold k'; values are untouched.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class QKBasis:
    """Per-layer ``(Bq, Bk)`` ``[L, Hkv, D, D]`` (this rank's kv heads), applied in float32."""

    def __init__(self, query: Tensor, key: Tensor, device: torch.device | str) -> None:
        if query.shape != key.shape or query.dim() != 4 or query.shape[-1] != query.shape[-2]:
            raise ValueError(f"a label basis is two [L, Hkv, D, D] tensors, got "
                             f"{tuple(query.shape)} and {tuple(key.shape)}")
        self.query = query.to(device=device, dtype=torch.float32).contiguous()
        self.key = key.to(device=device, dtype=torch.float32).contiguous()

    @property
    def num_kv_heads(self) -> int:
        return self.query.shape[1]

    def rotate(self, layer_id: int, q: Tensor, k: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        """``q`` ``[T, Hq * D]`` or ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` (or None) in the
        basis, in their own dtypes and shapes."""
        hkv, d = self.num_kv_heads, self.query.shape[-1]
        grouped = q.reshape(q.shape[0], hkv, -1, d).float()
        q_out = torch.einsum("thgd,hde->thge", grouped, self.query[layer_id])
        # einsum's outputs are laid out head-major; SGLang's KV pool views k flat, so both leave
        # contiguous (a strided k failed set_kv_buffer on the GPU)
        q_out = q_out.to(q.dtype).reshape(q.shape).contiguous()
        if k is None:
            return q_out, None
        k_out = torch.einsum("thd,hde->the", k.reshape(k.shape[0], hkv, d).float(),
                             self.key[layer_id])
        return q_out, k_out.to(k.dtype).reshape(k.shape).contiguous()
