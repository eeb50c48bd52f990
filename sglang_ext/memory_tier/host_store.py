"""Host (CPU) copy of the whole KV cache, head-major so one (page, kv head) is contiguous."""

from __future__ import annotations

import torch
from torch import Tensor

from sglang_ext.kernels.host_gather import gather_host_blocks, pinned_empty
from sglang_ext.kernels.host_scatter import scatter_to_host


class HostKVStore:
    """K and V of every logical KV slot, per layer ``[Hkv, num_slots, D]`` in host memory
    (pinned when CUDA is available): block ``p`` of kv head ``h`` is the contiguous run
    ``[h, p*page_size : (p+1)*page_size]`` (4 KiB for 16 tokens x 128 dims x bf16), which is
    what a per-head transfer moves."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 num_slots: int, page_size: int, dtype: torch.dtype) -> None:
        if num_slots % page_size:
            raise ValueError(f"num_slots {num_slots} is not a multiple of page_size {page_size}")
        self.page_size = page_size
        self.num_slots = num_slots
        self.k = [pinned_empty((num_kv_heads, num_slots, head_dim), dtype) for _ in range(num_layers)]
        self.v = [pinned_empty((num_kv_heads, num_slots, v_head_dim), dtype) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, loc: Tensor, k: Tensor, v: Tensor) -> None:
        """Write-through of tokens just stored in the device pool: ``k``/``v`` ``[n, Hkv, D]``
        at logical slots ``loc`` (on the device of ``k``; ``-1`` skips)."""
        if k.device.type == "cpu":
            loc_ = loc.long()
            keep = loc_ >= 0
            self.k[layer][:, loc_[keep]] = k[keep].transpose(0, 1).to(self.k[layer].dtype)
            self.v[layer][:, loc_[keep]] = v[keep].transpose(0, 1).to(self.v[layer].dtype)
            return
        scatter_to_host(k.contiguous(), self.k[layer], loc)
        scatter_to_host(v.contiguous(), self.v[layer], loc)

    def load(self, layer: int, heads: Tensor, src_pages: Tensor, dst_pages: Tensor,
             k_buffer: Tensor, v_buffer: Tensor, max_programs: int | None = None) -> None:
        """Copy blocks ``src_pages`` (host pages = logical pages) of kv heads ``heads`` into
        device pages ``dst_pages`` of the layer's pool buffers (``-1`` skips), K and V in one
        launch; ``max_programs`` caps the SMs the copy occupies (to leave the rest to kernels
        running beside it)."""
        if k_buffer.device.type == "cpu":
            keep = src_pages >= 0
            h, s, d = heads[keep].long(), src_pages[keep].long(), dst_pages[keep].long()
            offs = torch.arange(self.page_size)
            src_tok = (s[:, None] * self.page_size + offs).reshape(-1)
            dst_tok = (d[:, None] * self.page_size + offs).reshape(-1)
            hh = h[:, None].expand(-1, self.page_size).reshape(-1)
            k_buffer[dst_tok, hh] = self.k[layer][hh, src_tok].to(k_buffer.dtype)
            v_buffer[dst_tok, hh] = self.v[layer][hh, src_tok].to(v_buffer.dtype)
            return
        gather_host_blocks(self.k[layer], k_buffer, heads, src_pages, dst_pages, self.page_size,
                           host_v=self.v[layer], dev_v=v_buffer, max_programs=max_programs)

    def read_tokens(self, layer: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """``[n, Hkv, D]`` K and V of logical slots (tests, debugging)."""
        s = slots.long().cpu()
        return self.k[layer][:, s].transpose(0, 1), self.v[layer][:, s].transpose(0, 1)
