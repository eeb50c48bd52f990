"""Host (CPU) copy of the whole KV cache, head-major so one (page, kv head) is contiguous."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from sglang_ext.kernels.host_gather import check_transfer_list, gather_host_blocks, pinned_empty
from sglang_ext.kernels.host_scatter import scatter_to_host


def same_bytes(a: torch.dtype, b: torch.dtype) -> bool:
    """Whether rows of ``a`` and ``b`` are the same bytes: equal dtypes, or an 8-bit float and
    the ``uint8`` SGLang stores it as (``MHATokenToKVPool.store_dtype``)."""
    return a == b or (torch.uint8 in (a, b) and a.itemsize == b.itemsize)


def as_stored(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` as ``dtype``: the same bytes reinterpreted where :func:`same_bytes` (a view:
    writes through it land in ``x``), else a numeric cast (a copy)."""
    if x.dtype == dtype:
        return x
    if same_bytes(x.dtype, dtype):
        return x.view(dtype)
    return x.to(dtype)


class HostKVStore:
    """K and V of every logical KV slot, per layer ``[Hkv, num_slots, D]`` in host memory
    (pinned when CUDA is available): block ``p`` of kv head ``h`` is the contiguous run
    ``[h, p*page_size : (p+1)*page_size]`` (4 KiB for 16 tokens x 128 dims x bf16), which is
    what a per-head transfer moves.

    ``dtype`` is the KV cache's (an fp8 cache keeps one byte per value on the host too, so host
    bytes and PCIe bytes per token halve); device rows stored as ``uint8`` (SGLang's storage of
    fp8) are read and written as the same bytes (:func:`as_stored`).

    ``v_head_dim == 0`` stores K alone (``v`` is None): an MLA pool's one latent row per token
    (``R + P`` dims, one "kv head") is both its key and, as the view ``[..., :R]``, its value,
    so copying the row moves V too."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 num_slots: int, page_size: int, dtype: torch.dtype) -> None:
        if num_slots % page_size:
            raise ValueError(f"num_slots {num_slots} is not a multiple of page_size {page_size}")
        self.page_size = page_size
        self.num_slots = num_slots
        self.k = [pinned_empty((num_kv_heads, num_slots, head_dim), dtype) for _ in range(num_layers)]
        self.v: Optional[list[Tensor]] = None if v_head_dim == 0 else [
            pinned_empty((num_kv_heads, num_slots, v_head_dim), dtype) for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + (self.v or []))

    def buffers(self, layer: int) -> list[Tensor]:
        """The layer's stored buffers: ``[K, V]``, or ``[K]`` when V is K's view."""
        return [self.k[layer]] + ([] if self.v is None else [self.v[layer]])

    def write(self, layer: int, loc: Tensor, k: Tensor, v: Optional[Tensor] = None) -> None:
        """Write-through of tokens just stored in the device pool: ``k``/``v`` ``[n, Hkv, D]``
        at logical slots ``loc`` (on the device of ``k``; ``-1`` skips). ``v`` is ignored when
        the store keeps no V."""
        for host, x in zip(self.buffers(layer), (k, v)):
            if x.device.type == "cpu":
                loc_ = loc.long()
                keep = loc_ >= 0
                host[:, loc_[keep]] = as_stored(x[keep], host.dtype).transpose(0, 1)
            else:
                scatter_to_host(as_stored(x, host.dtype).contiguous(), host, loc)

    def load(self, layer: int, heads: Tensor, src_pages: Tensor, dst_pages: Tensor,
             k_buffer: Tensor, v_buffer: Optional[Tensor] = None,
             max_programs: int | None = None) -> None:
        """Copy blocks ``src_pages`` (host pages = logical pages) of kv heads ``heads`` into
        device pages ``dst_pages`` of the layer's pool buffers (``-1`` skips), K and V in one
        launch; ``max_programs`` caps the SMs the copy occupies (to leave the rest to kernels
        running beside it). Without a stored V, ``v_buffer`` (a view of ``k_buffer``'s rows
        for an MLA pool) is ignored: copying K's rows filled it."""
        if k_buffer.device.type == "cpu":
            check_transfer_list(heads, src_pages, dst_pages)  # the kernel's rules on CPU too
            keep = src_pages >= 0
            h, s, d = heads[keep].long(), src_pages[keep].long(), dst_pages[keep].long()
            offs = torch.arange(self.page_size)
            src_tok = (s[:, None] * self.page_size + offs).reshape(-1)
            dst_tok = (d[:, None] * self.page_size + offs).reshape(-1)
            hh = h[:, None].expand(-1, self.page_size).reshape(-1)
            for host, dev in zip(self.buffers(layer), (k_buffer, v_buffer)):
                target = as_stored(dev, host.dtype) if same_bytes(dev.dtype, host.dtype) else dev
                target[dst_tok, hh] = host[hh, src_tok].to(target.dtype)
            return
        has_v = self.v is not None
        gather_host_blocks(self.k[layer], as_stored(k_buffer, self.k[layer].dtype), heads,
                           src_pages, dst_pages, self.page_size,
                           host_v=self.v[layer] if has_v else None,
                           dev_v=as_stored(v_buffer, self.v[layer].dtype) if has_v else None,
                           max_programs=max_programs)

    def read_tokens(self, layer: int, slots: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        """``[n, Hkv, D]`` K and V (None when not stored) of logical slots (tests, debugging)."""
        s = slots.long().cpu()
        k = self.k[layer][:, s].transpose(0, 1)
        return k, None if self.v is None else self.v[layer][:, s].transpose(0, 1)
