"""PagedTokenToKVPoolAllocator on CPU: plain-torch page allocation.

SGLang 0.5.16's paged allocator (``--page-size`` > 1) and ``get_last_loc`` launch Triton
kernels, which have no driver on a CPU-only machine. The CPU KV tier moves whole pages, so on
CPU it needs paged allocation: these AROUND hooks run the same allocation in torch when the
allocator lives on the CPU (SGLang's own ``alloc_extend_naive`` for extends) and leave every
other device untouched.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _around_get_last_loc(original: Callable, req_to_token: torch.Tensor,
                         req_pool_indices_tensor: torch.Tensor,
                         prefix_lens_tensor: torch.Tensor) -> torch.Tensor:
    if req_to_token.device.type != "cpu":
        return original(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)


def _around_alloc_extend(original: Callable, self: Any, prefix_lens: torch.Tensor,
                         prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                         seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor,
                         extend_num_tokens: int, num_new_pages: int | None = None) -> Any:
    if torch.device(self.device).type != "cpu":
        return original(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                        extend_num_tokens, num_new_pages)
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive, get_num_new_pages

    if num_new_pages is None:
        num_new_pages = get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size,
                                          prefix_lens=prefix_lens_cpu)
    if num_new_pages > len(self.free_pages):
        return None
    out = torch.empty((extend_num_tokens,), dtype=torch.int64, device=self.device)
    alloc_extend_naive(prefix_lens, seq_lens, last_loc, self.free_pages, out, self.page_size,
                       self.device)
    self.free_pages = self.free_pages[num_new_pages:]
    return out


def _around_alloc_decode(original: Callable, self: Any, seq_lens: torch.Tensor,
                         seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> Any:
    if torch.device(self.device).type != "cpu":
        return original(self, seq_lens, seq_lens_cpu, last_loc)
    # A token starts a new page when the previous one ended a page; new pages are taken from
    # the free list in batch order (what SGLang's alloc_decode_kernel does).
    new_page = (last_loc + 1) % self.page_size == 0
    num_new_pages = int(new_page.sum())
    if num_new_pages > len(self.free_pages):
        return None
    rank = torch.cumsum(new_page.to(torch.int64), 0) - 1
    fresh = self.free_pages[rank.clamp(min=0)] * self.page_size if num_new_pages else last_loc
    out = torch.where(new_page, fresh, last_loc + 1).to(torch.int64)
    self.free_pages = self.free_pages[num_new_pages:]
    return out


HOOKS = (
    ("sglang.srt.mem_cache.allocation.get_last_loc", _around_get_last_loc, "AROUND"),
    ("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_extend",
     _around_alloc_extend, "AROUND"),
    ("sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.alloc_decode",
     _around_alloc_decode, "AROUND"),
)
