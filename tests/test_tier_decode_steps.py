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

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_ext.config import dense_middle_blocks
from sglang_ext.kernels.block_summary import allocate_block_summaries, update_block_summaries
from sglang_ext.kernels.label_cache import allocate_label_cache, update_label_cache
from sglang_ext.kernels.locality import LocalityKernelState, update_eviction_page_scores
from sglang_ext.kernels.sparse_decode import (
    DecodeRows,
    LayerCache,
    SelectionInputs,
    SparseDecodeWorkspace,
    selection_sizes,
    sparse_decode_batched,
)
from sglang_ext.kernels.testing import case_generator
from sglang_ext.memory_tier.tiered_pool import TieredKVPool, plan_layout
from sglang_ext.selection.reference import SelectionParams

DTYPE = torch.bfloat16
FP8 = torch.float8_e4m3fn
gpu = pytest.mark.gpu


@dataclass(frozen=True)
class Shape:
    layers: int = 2
    kv_heads: int = 2
    group: int = 2  # query heads per kv head
    head_dim: int = 16
    page_size: int = 4
    sink: int = 4
    window: int = 8
    device: str = "cpu"


SMALL = Shape()
# The TP=2 server check's per-rank shapes (Qwen3-14B: 8 kv heads and 40 q heads over 2 ranks,
# dim 128; block 16; budget 2048 over a 1536-token prompt), on the GPU with its side stream.
SERVER_GPU = Shape(layers=3, kv_heads=4, group=5, head_dim=128, page_size=16, sink=16,
                   window=64, device="cuda")


class Run:
    def __init__(self, params: SelectionParams, mode: str, prompt_lens: list[int], steps: int,
                 shape: Shape = SMALL, kv_dtype: torch.dtype = DTYPE, labels: bool = False,
                 sync_steps: int = 0, attend_resident: bool = False):
        self.params, self.steps, self.shape, self.kv_dtype = params, steps, shape, kv_dtype
        sh, ps = shape, shape.page_size
        dev = self.device = torch.device(sh.device)
        self.gen = case_generator("tier-steps", params.method, params.budget, mode, sh)
        self.rows = list(range(1, len(prompt_lens) + 1))
        self.lens = list(prompt_lens)
        max_context = -(-(max(prompt_lens) + steps + ps) // ps) * ps
        k_blocks = selection_sizes(params).k_blocks
        pages_per_row = max_context // ps
        layout = plan_layout(
            device_tokens=0, host_tokens=(len(self.rows) * pages_per_row + 4) * ps, page_size=ps,
            max_running_requests=len(self.rows), max_prefill_tokens=sum(prompt_lens),
            num_slots=max(k_blocks, 1), sink=sh.sink, window=sh.window,
            side_tokens_per_token=1 / ps, gpu_tokens=ps)  # page 0 only: all KV on the host
        self.pool = TieredKVPool(ps, kv_dtype, sh.kv_heads, sh.head_dim, sh.layers, sh.device, False,
                                 layout=layout, mode=mode, sync_steps=sync_steps,
                                 attend_resident=attend_resident)
        logical = layout.logical_tokens
        # Requests' logical pages: host-homed (>= 1), in a scattered order.
        perm = (torch.randperm(logical // ps - 1, generator=self.gen) + 1)[: len(self.rows) * pages_per_row]
        self.req_to_token = torch.zeros((len(self.rows) + 1, max_context), dtype=torch.int32)
        offs = torch.arange(max_context) % ps
        for i, row in enumerate(self.rows):
            pages = perm[i * pages_per_row:(i + 1) * pages_per_row]
            self.req_to_token[row] = (pages.repeat_interleave(ps) * ps + offs).int()
        self.req_to_token = self.req_to_token.to(dev)
        self.pool.bind(self.req_to_token)
        # The oracle: a plain pool over the logical slots, and the summaries both share.
        kv_shape = (logical, sh.kv_heads, sh.head_dim)
        self.plain_k = [torch.zeros(kv_shape, dtype=kv_dtype, device=dev)
                        for _ in range(sh.layers)]
        self.plain_v = [torch.zeros(kv_shape, dtype=kv_dtype, device=dev)
                        for _ in range(sh.layers)]
        self.summaries = [allocate_block_summaries(logical, sh.kv_heads, sh.head_dim, ps,
                                                   device=dev, dtype=DTYPE)
                          for _ in range(sh.layers)]
        self.channels = torch.stack([torch.randperm(sh.head_dim, generator=self.gen)[:5]
                                     for _ in range(sh.kv_heads)]).to(dev)
        # the label cache over the logical slots (host-homed pages too), which both paths read
        self.labels = [allocate_label_cache(logical, sh.kv_heads, self.channels.shape[1], dev)
                       for _ in range(sh.layers)] if labels else [None] * sh.layers
        batch = len(self.rows)
        workspace = lambda: SparseDecodeWorkspace(  # noqa: E731
            batch, sh.kv_heads * sh.group, sh.kv_heads, sh.head_dim, params, max_context // ps,
            sh.device, DTYPE)
        self.ws_tier, self.ws_plain = workspace(), workspace()
        # The locality constraint (key_norm): each path keeps its own kept sets, both read the
        # page scores the writes maintain.
        self.locality = None
        if params.locality_blocks:
            state = lambda: LocalityKernelState(  # noqa: E731
                num_layers=sh.layers, rows=len(self.rows) + 1, num_kv_heads=sh.kv_heads,
                k_e=params.locality_blocks, max_blocks=max_context // ps, num_slots=logical,
                page_size=ps, device=dev, limit_new_blocks=params.locality_new_blocks > 0)
            self.locality = (state(), state())
            self.locality[1].page_scores = self.locality[0].page_scores

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(device=self.device, dtype=DTYPE)

    def _write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.set_kv_buffer(SimpleNamespace(layer_id=layer), KVWriteLoc(loc, None, None), k, v)
        k, v = k.to(self.kv_dtype), v.to(self.kv_dtype)  # what the cache stores
        self.plain_k[layer][loc.long()] = k
        self.plain_v[layer][loc.long()] = v
        update_block_summaries(*self.summaries[layer], k.to(DTYPE), loc, self.shape.page_size)
        if self.labels[layer] is not None:
            update_label_cache(self.labels[layer], k.to(DTYPE), loc, self.channels)
        if self.locality is not None:
            update_eviction_page_scores(self.locality[0].page_scores[layer], k, loc,
                                        self.shape.page_size, "key_norm")

    def prefill(self) -> None:
        self.pool.prepare_extend(self.req_to_token, self.rows, self.lens, [0] * len(self.rows))
        loc = torch.cat([self.req_to_token[r, :n] for r, n in zip(self.rows, self.lens)])
        sh = self.shape
        for layer in range(sh.layers):
            self._write(layer, loc, self._rand(loc.numel(), sh.kv_heads, sh.head_dim),
                        self._rand(loc.numel(), sh.kv_heads, sh.head_dim))

    def decode_step(self, follow_tier: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's (tiered, plain) outputs of one step. ``follow_tier``: the plain decode
        attends the blocks the tier attended (given candidates), not its own selection."""
        pool, r2t, sh, dev = self.pool, self.req_to_token, self.shape, self.device
        for row in sorted(pool.pending_rows()):
            pool.start_decoding(r2t, row)
        rpi = torch.tensor(self.rows, dtype=torch.int64, device=dev)
        positions = torch.tensor(self.lens, device=dev)
        seq_lens = positions + 1
        out_loc = r2t[rpi, positions].long()
        pool.map_decode_tokens(r2t, rpi, seq_lens, out_loc)
        pool.verify_mappings(r2t, self.rows, seq_lens.tolist())
        outs = []
        batch = len(self.rows)
        for layer in range(sh.layers):
            self._write(layer, out_loc, self._rand(batch, sh.kv_heads, sh.head_dim),
                        self._rand(batch, sh.kv_heads, sh.head_dim))
            q = self._rand(batch, sh.kv_heads * sh.group, sh.head_dim)
            kmin, kmax = self.summaries[layer]
            tier = pool.tier
            on_blocks, attend = tier.decode_hooks(layer, rpi, r2t, pool.k_buffer[layer],
                                                  pool.v_buffer[layer])
            rows = DecodeRows(r2t, rpi, seq_lens)
            # an 8-bit pool stores bytes, which the backend reads viewed as the KV dtype
            keys, values = (buf[layer] if buf[layer].dtype == self.kv_dtype
                            else buf[layer].view(self.kv_dtype)
                            for buf in (pool.k_buffer, pool.v_buffer))
            got = sparse_decode_batched(
                q, LayerCache(keys, values, kmin, kmax, channels=self.channels,
                              labels=self.labels[layer]),
                rows, self.params, 0.25, self.ws_tier,
                SelectionInputs(page_map=tier.page_map(layer), on_blocks=on_blocks,
                                attend_blocks=attend, locality=self._locality(0, layer)),
            ).clone()
            followed = attend.clone() if follow_tier else None
            tier.after_layer(layer, rpi, r2t, pool.k_buffer[layer], pool.v_buffer[layer])
            want = sparse_decode_batched(
                q, LayerCache(self.plain_k[layer], self.plain_v[layer], kmin, kmax,
                              channels=self.channels, labels=self.labels[layer]),
                rows, self.params, 0.25, self.ws_plain,
                SelectionInputs(locality=self._locality(1, layer), candidates=followed),
            ).clone()
            outs.append((got, want))
        pool.tier.finish_step()
        self.lens = [n + 1 for n in self.lens]
        return outs

    def _locality(self, path: int, layer: int):
        return None if self.locality is None else self.locality[path].layer(layer)

    def prefill_decode_and_compare(self, label: str) -> None:
        """The whole run: prefill, every step compared (:meth:`decode_all_and_compare`), and
        every page freed at the end."""
        self.prefill()
        self.decode_all_and_compare(label)
        self.finish()

    def decode_all_and_compare(self, label: str) -> None:
        """Every step, every layer: the tiered decode equals the plain pool's bit for bit; some
        blocks moved from the host."""
        for step in range(self.steps):
            for layer, (got, want) in enumerate(self.decode_step()):
                assert torch.equal(got, want), f"{label}: step {step} layer {layer}"
        assert self.pool.tier.read_stats()["transferred_blocks"] > 0

    def finish(self) -> None:
        for row in self.rows:
            self.pool.release_row(row, self.req_to_token)
        self.pool.check_idle()


def test_the_mapping_check_finds_a_device_copy_that_differs_from_its_home() -> None:
    """SGLANG_EXT_TIER_VERIFY=2's check (verify_mappings, which the serving tests run at every
    step): one changed value of one mapped block's device copy, in any layer, is reported."""
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    params = SelectionParams("two_level", 96, ps, dense_middle_blocks(96, sink, window, ps),
                             sink, window)
    run = Run(params, "sync", prompt_lens=[44, 30], steps=2)
    run.prefill()
    run.decode_step()
    pool, r2t = run.pool, run.req_to_token
    seq_lens = [n + 1 for n in run.lens]
    pool.verify_mappings(r2t, run.rows, seq_lens)  # intact: nothing to report
    layer, head = SMALL.layers - 1, SMALL.kv_heads - 1
    maps = pool.tier.page_maps[run.rows[1], layer, head]
    block = int((maps >= 0).nonzero()[0])
    row_of_token = int(maps[block]) * ps + 1
    pool.tier_buffers(layer)[1][row_of_token, head] += 1.0  # a value, not a key
    with pytest.raises(AssertionError, match=f"block {block} layer {layer} head {head}"):
        pool.verify_mappings(r2t, run.rows, seq_lens)


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("method", ["two_level", "quest"])
@pytest.mark.parametrize("lens, steps", [([68, 23], 14), ([92, 40], 4)])
def test_budget_above_the_context_decodes_exactly(mode: str, method: str, lens: list[int],
                                                  steps: int) -> None:
    """The second case reaches the budget (contexts of 93..96 tokens at budget 96, still dense):
    the last middle block shares its page with the window's first tokens (in the recent-window
    ring) and needs a working-set slot too. With one candidate block fewer than
    config.dense_middle_blocks (what it allowed before) the tier dropped a middle block the
    untiered dense decode attends."""
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    # two_level: the fewest candidate blocks the tier accepts (config.dense_middle_blocks)
    candidates = dense_middle_blocks(96, sink, window, ps) if method == "two_level" else 1
    params = SelectionParams(method, 96, ps, candidates, sink, window)
    run = Run(params, mode, prompt_lens=lens, steps=steps)
    run.prefill()
    for step in range(run.steps):
        for layer, (got, want) in enumerate(run.decode_step()):
            assert torch.equal(got, want), f"{mode} {method}: step {step} layer {layer}"
    assert max(run.lens) <= 96
    stats = run.pool.tier.read_stats()
    assert stats["transferred_blocks"] > 0  # blocks leaving the ring were fetched into slots
    run.finish()


@pytest.mark.parametrize("method", ["two_level", "quest", "locality", "locality_limited"])
def test_sync_schedule_with_a_small_budget_equals_the_untiered_decode(method: str) -> None:
    """(``locality``: two_level with one query-agnostic block per kv head, whose kept set rides
    in the working set: the block filter's k is candidates + k_e; ``locality_limited``: of
    those, at most one block per step from outside the last filter.)"""
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    local = method.startswith("locality")
    limit = int(method == "locality_limited")
    method = "two_level" if local else method
    params = SelectionParams(method, 24, ps, 3 if method == "two_level" else 1, sink, window,
                             locality_blocks=int(local), eviction_score="key_norm",
                             locality_new_blocks=limit)
    run = Run(params, "sync", prompt_lens=[45, 30], steps=10)
    run.prefill()
    for step in range(run.steps):
        for layer, (got, want) in enumerate(run.decode_step()):
            assert torch.equal(got, want), f"{method}: step {step} layer {layer}"
    run.finish()


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_gpu_server_shapes_budget_above_the_context_decodes_exactly(mode: str) -> None:
    """The TP=2 server check (benchmarks/device/run.sh tp2-greedy) found the tier's greedy
    outputs drifting from the untiered server's at near ties. This is the same comparison at that
    check's shapes on the GPU, where the async schedule's side stream and the real kernels run:
    bit-exact here means the drift comes from outside the pool and the kernels."""
    sh = SERVER_GPU
    candidates = dense_middle_blocks(2048, sh.sink, sh.window, sh.page_size)
    params = SelectionParams("two_level", 2048, sh.page_size, candidates, sh.sink, sh.window)
    run = Run(params, mode, prompt_lens=[1536, 1530, 1100], steps=40, shape=sh)
    run.prefill()
    for step in range(run.steps):
        for layer, (got, want) in enumerate(run.decode_step()):
            assert torch.equal(got, want), f"{mode}: step {step} layer {layer}"
    run.finish()


def _held_copies(run: Run, row: int, blocks: list[int]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """What SGLang's radix dedup does to ``blocks`` of ``row`` after its prefill: pages the
    cache already holds (here: unused logical pages whose KV another request computed, a bit
    off this one's) replace the row's freshly written pages. Their home copies and the oracle's
    plain pool get that KV; returns (start, old slots, new slots) of the rewrite."""
    ps, pool = run.shape.page_size, run.pool
    used = set((run.req_to_token[1:, ::ps] // ps).flatten().tolist())
    spare = [lp for lp in range(pool.layout.gpu_pages, pool.layout.logical_tokens // ps)
             if lp not in used][:len(blocks)]
    assert len(spare) == len(blocks)
    start, end = blocks[0] * ps, (blocks[-1] + 1) * ps
    old = run.req_to_token[row, start:end].clone()
    new = torch.cat([lp * ps + torch.arange(ps) for lp in spare]).to(old)
    for layer in range(run.shape.layers):
        for plain in (run.plain_k[layer], run.plain_v[layer]):
            plain[new.long()] = plain[old.long()] + 0.125
        pool.host.write(layer, pool.host_slots(new), run.plain_k[layer][new.long()],
                        run.plain_v[layer][new.long()])
        update_block_summaries(*run.summaries[layer], run.plain_k[layer][new.long()], new, ps)
    return start, old, new


@pytest.mark.parametrize("when", ["before_decoding", "after_start_decoding"])
def test_radix_dedup_repoints_a_prefilled_rows_blocks(when: str) -> None:
    """SGLang's cache_unfinished_req re-points a prefilled row's pages at equal pages the radix
    cache already holds and frees the row's own (ReqToTokenPool.write, hooked): the tier's
    copies of those blocks (staged pages; after start_decoding, as under the overlap scheduler:
    ring pages and working-set slots) must take the held pages' KV and nothing may stay
    translated to the freed pages. A soak run on the CPU found the ring copy of such a block
    differing from its home (SGLANG_EXT_TIER_VERIFY=2) and the freed page still translated."""
    _check_radix_dedup(when, SMALL, "sync", 96, prompt_lens=[44, 30], blocks=[7, 8, 9, 10])


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_radix_dedup_after_start_decoding_under_async() -> None:
    """The same on the GPU at served shapes under the async schedule (the real gather kernel):
    the soak on real weights crashed here with an illegal memory access when the re-point
    handed the gather a strided column of the page map."""
    _check_radix_dedup("after_start_decoding", SERVER_GPU, "async", 768, prompt_lens=[704, 530],
                       blocks=[38, 39, 40, 41])


def _check_radix_dedup(when: str, shape: Shape, mode: str, budget: int, prompt_lens: list[int],
                       blocks: list[int]) -> None:
    """``blocks``: consecutive whole blocks of row 1's prompt (the cache dedups whole pages)."""
    ps, sink, window = shape.page_size, shape.sink, shape.window
    params = SelectionParams("two_level", budget, ps,
                             dense_middle_blocks(budget, sink, window, ps), sink, window)
    run = Run(params, mode, prompt_lens=prompt_lens, steps=6, shape=shape)
    run.prefill()
    pool, row = run.pool, 1
    if when == "after_start_decoding":
        pool.start_decoding(run.req_to_token, row)
    # the prompt's last blocks (in the window ring) and ones before them (middle blocks,
    # preloaded into working-set slots)
    start, old, new = _held_copies(run, row, blocks)
    pool.repoint_pages(row, start, run.req_to_token, new)
    run.req_to_token[row, start:start + new.numel()] = new  # SGLang's write itself
    freed = (old[::ps] // ps).long()
    assert bool((pool.dev_page_of_lp[freed] < 0).all())
    for step in range(run.steps):
        for layer, (got, want) in enumerate(run.decode_step()):  # verify_mappings inside
            assert torch.equal(got, want), f"{when}: step {step} layer {layer}"
    assert bool((pool.dev_page_of_lp[freed] < 0).all())
    run.finish()


@pytest.mark.parametrize("mode, budget", [("sync", 24), ("async", 96)])
def test_the_exact_rerank_under_the_tier_equals_the_untiered_rerank(mode: str, budget: int) -> None:
    """``--sparse-rerank`` under the tier: the shortlist's slots are device rows through the page
    map, which the rerank reads exactly as the untiered path reads the pool (under ``sync`` at a
    small budget; under ``async``, which attends the previous step's blocks, at a budget >= the
    context)."""
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    candidates = 6 if mode == "sync" else dense_middle_blocks(budget, sink, window, ps)
    params = SelectionParams("two_level", budget, ps, candidates, sink, window, rerank=2,
                             rerank_min_tokens=16)
    run = Run(params, mode, prompt_lens=[45, 30] if mode == "sync" else [68, 23], steps=8)
    run.prefill_decode_and_compare(mode)


@pytest.mark.parametrize("mode, budget, block_score, rerank", [
    ("sync", 24, "label_max", 0), ("sync", 24, "label_max", 2), ("async", 96, "label_max", 0)])
def test_the_label_cache_under_the_tier_equals_the_untiered_label_cache(
        mode: str, budget: int, block_score: str, rerank: int) -> None:
    """The label cache under the tier: it covers the logical slots, so the label-max block
    filter ranks host-homed blocks from their labels, and token scores read labels at the
    logical slot while the page map decides residency and the device slot. Every step equals
    the untiered decode over the same label cache, with the rerank too (the recommended
    setting)."""
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    candidates = 6 if mode == "sync" else dense_middle_blocks(budget, sink, window, ps)
    params = SelectionParams("two_level", budget, ps, candidates, sink, window,
                             block_score=block_score, rerank=rerank,
                             rerank_min_tokens=16 if rerank else 0)
    run = Run(params, mode, prompt_lens=[45, 30] if mode == "sync" else [68, 23], steps=8,
              labels=True)
    run.prefill_decode_and_compare(f"{mode} {block_score} rerank {rerank}")


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("labels", [False, True], ids=["keys", "label_cache"])
def test_gpu_tier_at_served_shapes_equals_the_untiered_decode(mode: str, labels: bool) -> None:
    """The two tests above on the GPU at served shapes (the real token-score, rerank and gather
    kernels, the async schedule's side stream): the rerank 4 reading the shortlist's keys
    through the page map, and with the label cache the label maximum ranking host-homed blocks
    from their labels. Under ``sync`` a budget well under the context (with the rerank 4:
    its shortlist is wider than the budget); under ``async`` the whole context (the rerank on
    the resident keys alone)."""
    sh = SERVER_GPU
    budget, lens = (256, [1500, 1100]) if mode == "sync" else (2048, [1536, 1100])
    candidates = 80 if mode == "sync" else dense_middle_blocks(budget, sh.sink, sh.window,
                                                                sh.page_size)
    params = SelectionParams("two_level", budget, sh.page_size, candidates, sh.sink, sh.window,
                             block_score="label_max" if labels else "bound",
                             rerank=4 if mode == "sync" or not labels else 0,
                             rerank_min_tokens=0)
    run = Run(params, mode, prompt_lens=lens, steps=16, shape=sh, labels=labels)
    run.prefill_decode_and_compare(f"{mode} labels={labels}")


@pytest.mark.parametrize("sync_steps", [0, 3])
def test_async_first_steps_fetched_in_line_decode_exactly(sync_steps: int) -> None:
    """``--sparse-tier-sync-steps``: under ``async`` a request's first N steps fetch their own
    selection before attending it, so at a budget well under the context they equal the
    untiered decode bit for bit; later steps attend the previous step's blocks again and
    differ. Without it (N = 0) the lagged schedule already differs in the first steps."""
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    params = SelectionParams("two_level", 24, ps, 3, sink, window)
    run = Run(params, "async", prompt_lens=[45, 30], steps=5 if sync_steps else 3,
              sync_steps=sync_steps)
    run.prefill()
    exact = [all(torch.equal(got, want) for got, want in run.decode_step())
             for _ in range(run.steps)]
    if sync_steps:
        assert exact[:3] == [True] * 3, exact
        assert not all(exact[3:]), exact  # the lag is back after the first steps
    else:
        assert not all(exact), exact
    assert run.pool.tier.read_stats()["transferred_blocks"] > 0
    run.finish()


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("labels", [False, True], ids=["keys", "label_cache_rerank4"])
def test_gpu_async_first_steps_fetched_in_line_at_served_shapes(labels: bool) -> None:
    """The in-line first steps on the GPU at served shapes, beside the side stream's prefetch:
    at a budget under the context they equal the untiered decode (with the label cache and the
    rerank 4 too: the recommended setting)."""
    sh = SERVER_GPU
    params = SelectionParams("two_level", 256, sh.page_size, 80, sh.sink, sh.window,
                             block_score="label_max" if labels else "bound",
                             rerank=4 if labels else 0, rerank_min_tokens=0)
    run = Run(params, "async", prompt_lens=[1500, 1100], steps=4, shape=sh, sync_steps=4,
              labels=labels)
    run.prefill_decode_and_compare(f"async, first 4 steps in line, labels={labels}")


@pytest.mark.parametrize("method, mode, budget", [
    ("two_level", "sync", 24), ("quest", "sync", 24), ("two_level", "async", 96)])
def test_an_fp8_tier_decodes_what_an_fp8_pool_decodes(method: str, mode: str,
                                                      budget: int) -> None:
    """``--kv-cache-dtype fp8_e4m3`` under the tier: the pool keeps fp8 rows (one byte a value)
    on the host, moves them as bytes and hands the batched kernels fp8 rows; every step equals
    the same decode over a plain fp8 pool, bit for bit (at budget 96 the whole context, under
    ``async``; the small budget under ``sync``, as for bf16 above)."""
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    candidates = (dense_middle_blocks(budget, sink, window, ps) if budget == 96 else 3) \
        if method == "two_level" else 1
    params = SelectionParams(method, budget, ps, candidates, sink, window)
    run = Run(params, mode, prompt_lens=[45, 30] if budget == 24 else [68, 23], steps=8,
              kv_dtype=FP8)
    assert run.pool.k_buffer[0].dtype == torch.uint8 and run.pool.host.k[0].dtype == FP8
    run.prefill_decode_and_compare(f"{mode} {method}")


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_gpu_fp8_tier_decodes_what_an_fp8_pool_decodes(mode: str) -> None:
    """The fp8 tier on the GPU at a served model's shapes (the real kernels reading fp8 rows, the
    async schedule's side stream): bit-exact against a plain fp8 pool, the whole context under
    both schedules and a budget under the context under ``sync``. What start-up's refusal of
    ``--sparse-tier`` with ``--kv-cache-dtype fp8_e4m3`` waits for."""
    sh = SERVER_GPU
    cases = [(2048, [1536, 1530, 1100])] + ([(256, [700, 480])] if mode == "sync" else [])
    for budget, lens in cases:
        candidates = (dense_middle_blocks(budget, sh.sink, sh.window, sh.page_size)
                      if budget >= max(lens) + 40 else 12)
        params = SelectionParams("two_level", budget, sh.page_size, candidates, sh.sink,
                                 sh.window)
        run = Run(params, mode, prompt_lens=lens, steps=24, shape=sh, kv_dtype=FP8)
        run.prefill()
        for step in range(run.steps):
            for layer, (got, want) in enumerate(run.decode_step()):
                assert torch.equal(got, want), f"{mode} {budget}: step {step} layer {layer}"
        run.finish()


def test_a_release_waits_for_the_forward_that_may_still_hold_the_request(monkeypatch) -> None:
    """SGLang's overlap scheduler frees a request that finished at step t from its schedule
    stream while step t+1, which may still decode it, runs on the forward stream: the tier
    orders the release's device writes (its tables cleared) after that forward."""
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    params = SelectionParams("two_level", 24, ps, 3, sink, window)
    run = Run(params, "async", prompt_lens=[45, 30], steps=1, sync_steps=2)
    run.prefill()
    run.decode_step()
    events: list[str] = []

    class FakeStream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: "FakeStream") -> None:
            events.append(f"{self.name} waits for {other.name}")

    schedule = FakeStream("schedule")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: schedule)
    run.pool._forward_stream = FakeStream("forward")  # what note_forward_stream records
    detach = run.pool.tier.detach
    monkeypatch.setattr(run.pool.tier, "detach",
                        lambda row: (events.append(f"detach {row}"), detach(row)))
    run.pool.release_row(run.rows[0], run.req_to_token)
    assert events == ["schedule waits for forward", f"detach {run.rows[0]}"]
    monkeypatch.undo()
    run.pool._forward_stream = None  # a CPU pool records none
    run.pool.release_row(run.rows[1], run.req_to_token)
    run.pool.check_idle()


def test_resident_first_keeps_this_steps_resident_blocks_and_fills_the_misses() -> None:
    from sglang_ext.memory_tier.working_set import resident_first

    page_map = torch.full((3, 1, 10), -1, dtype=torch.int32)
    page_map[2, 0, [1, 2, 5, 7]] = torch.tensor([11, 12, 15, 17], dtype=torch.int32)
    current = torch.tensor([[[1, 3, 5, 4]]], dtype=torch.int32)  # 3 and 4 are on the host
    previous = torch.tensor([[[7, 5, 2, 1]]], dtype=torch.int32)  # 7 and 2 left the selection
    got = resident_first(current, previous, page_map, torch.tensor([2]))
    assert got.tolist() == [[[1, 7, 5, 2]]]
    # no stand-in left (-1 in the previous step's blocks): the miss is skipped
    got = resident_first(current, torch.tensor([[[5, -1, 7, 1]]], dtype=torch.int32), page_map,
                         torch.tensor([2]))
    assert got.tolist() == [[[1, 7, 5, -1]]]


def check_resident_attend(params: SelectionParams, prompt_lens: list[int], steps: int,
                          sync_steps: int, shape: Shape = SMALL) -> None:
    """Under ``async`` with and without ``--sparse-tier-async-attend resident``: every step
    equals the plain decode attending the blocks the tier attended; with it, those include every
    block of this step's selection that was resident, and more of this step's selection is
    attended than under ``previous``."""
    current_share = {}
    for attend_resident in (False, True):
        run = Run(params, "async", prompt_lens=prompt_lens, steps=steps, shape=shape,
                  sync_steps=sync_steps, attend_resident=attend_resident)
        tier = run.pool.tier
        seen = {"wanted": 0, "attended": 0}
        hooks = tier.decode_hooks

        def counting_hooks(layer, *args, _hooks=hooks, _tier=tier, _seen=seen):
            on_blocks, attend = _hooks(layer, *args)
            page_map = _tier.page_map(layer)
            rpi = args[0]

            def on(blocks):
                heads = torch.arange(blocks.shape[1], device=blocks.device)
                resident = (page_map[rpi[:, None, None], heads[None, :, None],
                                     blocks.clamp(min=0)] >= 0) & (blocks >= 0)
                on_blocks(blocks)
                same = (attend[..., :, None] == blocks[..., None, :]).any(-1) & (attend >= 0)
                if attend_resident:  # every resident block of this step's selection attended
                    kept = (blocks[..., :, None] == attend[..., None, :]).any(-1)
                    assert bool((kept | ~resident).all())
                _seen["wanted"] += int((blocks >= 0).sum())
                _seen["attended"] += int(same.sum())
            return on, attend
        tier.decode_hooks = counting_hooks
        run.prefill()
        for step in range(run.steps):
            for layer, (got, want) in enumerate(run.decode_step(follow_tier=True)):
                assert torch.equal(got, want), f"{attend_resident}: step {step} layer {layer}"
        if attend_resident:  # the tier's own count of what this test counts
            assert tier.read_stats()["attended_current"] == seen["attended"] / seen["wanted"]
        run.finish()
        current_share[attend_resident] = seen["attended"] / seen["wanted"]
    assert current_share[True] > current_share[False], current_share


@pytest.mark.parametrize("sync_steps", [0, 2])
def test_async_attending_the_resident_blocks_first(sync_steps: int) -> None:
    ps, sink, window = SMALL.page_size, SMALL.sink, SMALL.window
    check_resident_attend(SelectionParams("two_level", 24, ps, 3, sink, window), [45, 30],
                          steps=4, sync_steps=sync_steps)


@gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_async_attending_the_resident_blocks_first_at_served_shapes() -> None:
    """The same on the GPU at served shapes, the side stream's prefetch alongside, after two
    steps fetched in line."""
    sh = SERVER_GPU
    params = SelectionParams("two_level", 256, sh.page_size, 80, sh.sink, sh.window)
    check_resident_attend(params, [1500, 1100], steps=6, sync_steps=2, shape=sh)

