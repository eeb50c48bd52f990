"""The CPU tier's pool (TieredKVPool) from prefill through many decode steps, with the batched
kernels the GPU runs (Triton's interpreter here): every step's attention output of the tiered
pool, whose KV lives on the host with only sink/ring pages and working sets on the device,
equals the same decode over a plain pool holding everything, bit for bit:

* with a budget >= the context, under both schedules. Under ``async`` this needs the working set
  to start filled (the first step has no previous selection to attend) and the blocks that
  leave the recent-window ring to be fetched before the ring reuses their page;
* with a smaller budget, under ``sync`` (``async`` attends the previous step's choice by design:
  tests/test_memory_tier.py checks that schedule step by step).

The requests cross several block boundaries, so the ring evicts blocks during the run; after
each step every mapped block's device copy is checked against its home copy, and when the
requests leave every working-area page is free again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_ext.kernels.block_summary import allocate_block_summaries, update_block_summaries
from sglang_ext.kernels.sparse_decode import SparseDecodeWorkspace, _selection_plan, sparse_decode_batched
from sglang_ext.kernels.testing import case_generator
from sglang_ext.memory_tier.tiered_pool import TieredKVPool, plan_layout
from sglang_ext.selection.reference import SelectionParams

LAYERS, HKV, GROUP, D, PS = 2, 2, 2, 16, 4
SINK, WINDOW = 4, 8
DTYPE = torch.bfloat16


class Run:
    def __init__(self, params: SelectionParams, mode: str, prompt_lens: list[int], steps: int):
        self.params, self.steps = params, steps
        self.gen = case_generator("tier-steps", params.method, params.budget, mode)
        self.rows = list(range(1, len(prompt_lens) + 1))
        self.lens = list(prompt_lens)
        max_context = -(-(max(prompt_lens) + steps + PS) // PS) * PS
        pages_per_row = max_context // PS
        _, k_blocks, _ = _selection_plan(params, 1 << 30)
        layout = plan_layout(
            device_tokens=0, host_tokens=(len(self.rows) * pages_per_row + 4) * PS, page_size=PS,
            max_running_requests=len(self.rows), max_prefill_tokens=sum(prompt_lens),
            num_slots=max(k_blocks, 1), sink=SINK, window=WINDOW,
            summary_tokens_per_token=1 / PS, gpu_tokens=PS)  # page 0 only: all KV on the host
        self.pool = TieredKVPool(PS, DTYPE, HKV, D, LAYERS, "cpu", False, layout=layout, mode=mode)
        logical = layout.logical_tokens
        # Requests' logical pages: host-homed (>= 1), in a scattered order.
        perm = (torch.randperm(logical // PS - 1, generator=self.gen) + 1)[: len(self.rows) * pages_per_row]
        self.req_to_token = torch.zeros((len(self.rows) + 1, max_context), dtype=torch.int32)
        offs = torch.arange(max_context) % PS
        for i, row in enumerate(self.rows):
            pages = perm[i * pages_per_row:(i + 1) * pages_per_row]
            self.req_to_token[row] = (pages.repeat_interleave(PS) * PS + offs).int()
        self.pool.bind(self.req_to_token)
        # The oracle: a plain pool over the logical slots, and the summaries both share.
        self.plain_k = [torch.zeros((logical, HKV, D), dtype=DTYPE) for _ in range(LAYERS)]
        self.plain_v = [torch.zeros((logical, HKV, D), dtype=DTYPE) for _ in range(LAYERS)]
        self.summaries = [allocate_block_summaries(logical, HKV, D, PS, dtype=DTYPE)
                          for _ in range(LAYERS)]
        self.channels = torch.stack([torch.randperm(D, generator=self.gen)[:5] for _ in range(HKV)])
        batch = len(self.rows)
        self.ws_tier = SparseDecodeWorkspace(batch, HKV * GROUP, HKV, D, params,
                                             max_context // PS, "cpu", DTYPE)
        self.ws_plain = SparseDecodeWorkspace(batch, HKV * GROUP, HKV, D, params,
                                              max_context // PS, "cpu", DTYPE)

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(DTYPE)

    def _write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc(loc, None, None), k, v)
        self.plain_k[layer][loc.long()] = k
        self.plain_v[layer][loc.long()] = v
        update_block_summaries(*self.summaries[layer], k, loc, PS)

    def prefill(self) -> None:
        self.pool.prepare_extend(self.req_to_token, self.rows, self.lens, [0] * len(self.rows))
        loc = torch.cat([self.req_to_token[r, :n] for r, n in zip(self.rows, self.lens)])
        for layer in range(LAYERS):
            self._write(layer, loc, self._rand(loc.numel(), HKV, D), self._rand(loc.numel(), HKV, D))

    def decode_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        pool, r2t = self.pool, self.req_to_token
        for row in sorted(pool.pending_rows()):
            pool.start_decoding(r2t, row)
        rpi = torch.tensor(self.rows, dtype=torch.int64)
        positions = torch.tensor(self.lens)
        seq_lens = positions + 1
        out_loc = r2t[rpi, positions].long()
        pool.map_decode_tokens(r2t, rpi, seq_lens, out_loc)
        pool.verify_mappings(r2t, self.rows, seq_lens.tolist())
        outs = []
        for layer in range(LAYERS):
            self._write(layer, out_loc, self._rand(len(self.rows), HKV, D),
                        self._rand(len(self.rows), HKV, D))
            q = self._rand(len(self.rows), HKV * GROUP, D)
            kmin, kmax = self.summaries[layer]
            tier = pool.tier
            on_blocks, attend = tier.decode_hooks(layer, rpi, r2t, pool.k_buffer[layer],
                                                  pool.v_buffer[layer])
            got = sparse_decode_batched(
                q, pool.k_buffer[layer], pool.v_buffer[layer], r2t, rpi, seq_lens, kmin, kmax,
                self.params, 0.25, channels=self.channels, workspace=self.ws_tier,
                page_map=tier.page_map(layer), on_blocks=on_blocks, attend_blocks=attend,
            ).clone()
            tier.after_layer(layer, rpi, r2t, pool.k_buffer[layer], pool.v_buffer[layer])
            want = sparse_decode_batched(
                q, self.plain_k[layer], self.plain_v[layer], r2t, rpi, seq_lens, kmin, kmax,
                self.params, 0.25, channels=self.channels, workspace=self.ws_plain,
            ).clone()
            outs.append((got, want))
        pool.tier.finish_step()
        self.lens = [n + 1 for n in self.lens]
        return outs

    def finish(self) -> None:
        for row in self.rows:
            self.pool.release_row(row, self.req_to_token)
        self.pool.check_idle()


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("method", ["two_level", "quest"])
def test_budget_above_the_context_decodes_exactly(mode: str, method: str) -> None:
    params = SelectionParams(method, 96, PS, 24 if method == "two_level" else 1, SINK, WINDOW)
    run = Run(params, mode, prompt_lens=[37, 22], steps=14)
    run.prefill()
    for step in range(run.steps):
        for layer, (got, want) in enumerate(run.decode_step()):
            assert torch.equal(got, want), f"{mode} {method}: step {step} layer {layer}"
    stats = run.pool.tier.read_stats()
    assert stats["transferred_blocks"] > 0  # blocks leaving the ring were fetched into slots
    run.finish()


@pytest.mark.parametrize("method", ["two_level", "quest"])
def test_sync_schedule_with_a_small_budget_equals_the_untiered_decode(method: str) -> None:
    params = SelectionParams(method, 24, PS, 3 if method == "two_level" else 1, SINK, WINDOW)
    run = Run(params, "sync", prompt_lens=[45, 30], steps=10)
    run.prefill()
    for step in range(run.steps):
        for layer, (got, want) in enumerate(run.decode_step()):
            assert torch.equal(got, want), f"{method}: step {step} layer {layer}"
    run.finish()
