"""The CPU tier's extend scratch (sglang_ext/memory_tier/tiered_pool.py).

A prompt is never staged on the GPU: its KV goes to its homes (GPU-homed rows, or the host copy),
and an extend batch that touches a host-homed page attends through one layer of scratch rows,
filled per layer from the prefix pages' homes. What SGLang's dense extend backend reads there
(``get_key_buffer`` / ``get_value_buffer`` at the rows of ``dev_req_to_token``) must be every
token of every row of the batch, bit-exact, at every layer and chunk, whatever order the backend
reads and writes in; the homes must hold the new tokens afterwards; a batch with only GPU-homed
pages reads the pool in place; and the scratch costs one layer, not a prompt of every layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_ext.kernels.testing import case_generator
from sglang_ext.memory_tier.tiered_pool import TieredKVPool, plan_layout

PS, HEADS, DIM, LAYERS = 4, 2, 8, 3
GPU_PAGES = 10  # logical pages [0, 10) are homed on the GPU (page 0: padding)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, needs_cuda])]


def _rows_of(pages: list[int], n: int) -> torch.Tensor:
    offs = torch.arange(PS)
    return (torch.tensor(pages)[:, None] * PS + offs).reshape(-1)[:n].to(torch.int32)


class Side:
    """A tiered pool and the plain KV every logical slot should hold."""

    def __init__(self, device: str, max_prefill: int = 64) -> None:
        self.layout = plan_layout(
            device_tokens=0, host_tokens=64 * PS, page_size=PS, max_running_requests=3,
            max_prefill_tokens=max_prefill, num_slots=4, sink=PS, window=2 * PS,
            side_tokens_per_token=1 / PS, gpu_tokens=GPU_PAGES * PS, layers=LAYERS)
        self.pool = TieredKVPool(PS, torch.bfloat16, HEADS, DIM, LAYERS, device, False,
                                 layout=self.layout, mode="sync")
        self.device = device
        self.r2t = torch.zeros((4, 64), dtype=torch.int32)
        # row 1: GPU-homed and host-homed pages mixed; row 2 shares row 1's first 2 pages (a
        # radix hit) and goes on mostly on the host; row 3 lives on the GPU only
        self.r2t[1, :32] = _rows_of([1, 12, 2, 13, 14, 3, 15, 16], 32)
        self.r2t[2, :32] = _rows_of([1, 12, 20, 4, 21, 22, 23, 24], 32)
        self.r2t[3, :16] = _rows_of([5, 6, 7, 8], 16)
        self.r2t = self.r2t.to(device)
        self.pool.bind(self.r2t)
        logical = self.layout.logical_tokens
        self.gen = case_generator("tier-extend-scratch")
        self.plain = [[torch.zeros(logical, HEADS, DIM, dtype=torch.bfloat16) for _ in range(2)]
                      for _ in range(LAYERS)]

    def extend(self, rows: list[int], seq_lens: list[int], prefix_lens: list[int],
               read_before_write: bool) -> None:
        """One extend batch through the pool the way SGLang's backends drive it, checking at
        every layer that the rows the backend reads are the batch's tokens."""
        pool, r2t = self.pool, self.r2t
        pool.prepare_extend(r2t, rows, seq_lens, prefix_lens)
        loc = torch.cat([r2t[r, p:n] for r, n, p in zip(rows, seq_lens, prefix_lens)])
        for layer in range(LAYERS):
            if read_before_write:  # FlashInfer's paged path: get_kv_buffer, then set_kv_buffer
                pool.get_kv_buffer(layer)
            k, v = (torch.randn(loc.shape[0], HEADS, DIM, generator=self.gen)
                    .to(torch.bfloat16) for _ in range(2))
            pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc(loc, None, None),
                               k.to(self.device), v.to(self.device))
            self.plain[layer][0][loc.long().cpu()] = k
            self.plain[layer][1][loc.long().cpu()] = v
            got_k, got_v = pool.get_kv_buffer(layer)
            for row, n in zip(rows, seq_lens):
                at = pool.dev_req_to_token[row, :n].long()
                slots = r2t[row, :n].long().cpu()
                assert torch.equal(got_k[at].cpu(), self.plain[layer][0][slots]), (layer, row)
                assert torch.equal(got_v[at].cpu(), self.plain[layer][1][slots]), (layer, row)

    def check_homes(self, rows: list[int], seq_lens: list[int]) -> None:
        g = self.layout.gpu_tokens
        for row, n in zip(rows, seq_lens):
            slots = self.r2t[row, :n].long().cpu()
            for layer in range(LAYERS):
                on_gpu = slots[slots < g]
                assert torch.equal(self.pool.k_buffer[layer][on_gpu.to(self.device)].cpu(),
                                   self.plain[layer][0][on_gpu])
                host_k, host_v = self.pool.host.read_tokens(layer, slots[slots >= g] - g)
                assert torch.equal(host_k.cpu(), self.plain[layer][0][slots[slots >= g]])
                assert torch.equal(host_v.cpu(), self.plain[layer][1][slots[slots >= g]])


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_extends_read_every_token_from_the_scratch(device: str) -> None:
    side = Side(device)
    pool = side.pool
    # row 1's first chunk; then its second (the prefix ends inside a page) beside row 2, whose
    # 8-token prefix is row 1's (radix hit: a GPU- and a host-homed page)
    side.extend([1], [10], [0], read_before_write=True)
    assert pool._extend is not None
    side.extend([1, 2], [23, 19], [10, 8], read_before_write=False)
    side.extend([1, 2], [30, 29], [23, 19], read_before_write=True)
    side.check_homes([1, 2], [30, 29])
    # the decode step that follows reads the pool in place
    for row in (1, 2):
        pool.start_decoding(side.r2t, row)
    rpi = torch.tensor([1, 2], device=device)
    seq = torch.tensor([31, 30], device=device)
    pool.map_decode_tokens(side.r2t, rpi, seq, side.r2t[rpi, seq - 1].long())
    assert pool.get_key_buffer(0) is pool.k_buffer[0]
    pool.verify_mappings(side.r2t, [1, 2], seq.tolist())
    for row in (1, 2):
        pool.release_row(row, side.r2t)
    pool.check_idle()


@pytest.mark.parametrize("device", DEVICES)
def test_a_batch_on_gpu_homed_pages_reads_the_pool_in_place(device: str) -> None:
    side = Side(device)
    side.extend([3], [9], [0], read_before_write=True)
    side.extend([3], [16], [9], read_before_write=False)
    pool = side.pool
    assert pool._extend is None and pool.get_key_buffer(1) is pool.k_buffer[1]
    assert torch.equal(pool.dev_req_to_token[3, :16], side.r2t[3, :16])
    side.check_homes([3], [16])
    pool.release_row(3, side.r2t)
    pool.check_idle()


def test_a_batch_beyond_the_scratch_is_refused_with_a_clear_error() -> None:
    side = Side("cpu", max_prefill=8)  # scratch: 2 + 3 + 1 pages
    with pytest.raises(RuntimeError, match="does not fit in the extend scratch"):
        side.pool.prepare_extend(side.r2t, [1, 2], [30, 29], [0, 0])


def test_the_scratch_costs_one_layer_and_the_working_area_holds_working_sets_only() -> None:
    """At the H200's shapes (36 layers, 128k context, 32k chunks, 16 running requests) the
    device slots the scratch takes are 1/36 of its rows; a prompt staged in every layer would
    have taken them all."""
    common = dict(device_tokens=700_000, host_tokens=650_000, page_size=16,
                  max_running_requests=16, max_prefill_tokens=163_840 + 32_768, num_slots=246,
                  sink=64, window=256, side_tokens_per_token=1 / 16)
    one = plan_layout(**common, layers=1)
    deep = plan_layout(**common, layers=36)
    per_request = (deep.sink_pages + deep.ring_pages + deep.num_slots) * 16
    assert deep.work_tokens == 16 * per_request
    assert deep.scratch_tokens >= 163_840 + 32_768 and deep.scratch_tokens == one.scratch_tokens
    saved = deep.gpu_tokens - one.gpu_tokens
    assert saved >= (deep.scratch_tokens - deep.scratch_tokens // 36) / (1 + 1 / 16) - 16
    side = Side("cpu")
    rows = side.layout.scratch_tokens
    assert [tuple(t.shape) for t in side.pool.scratch] == [(rows, HEADS, DIM)] * 2
