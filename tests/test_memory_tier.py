"""The CPU KV tier's engine (sglang_ext/memory_tier) against the untiered decode pipeline.

* host round trip: KV written through to the host store and gathered back by block is
  bit-exact (the Triton scatter/gather kernels, and the plain-torch CPU path);
* ``sync``: a tiered batch (whole KV on the host, only sink/window pages and the working set
  on the GPU, device buffers poisoned) decodes bit-identically to the untiered pipeline over
  the full GPU pool, step after step, and each step transfers exactly the wanted blocks that
  were not resident (the set difference);
* ``async``: each step equals the untiered pipeline told to attend the blocks chosen at the
  previous step (AsyncTLS's schedule); the first step attends sink + window only;
* resident (untiered) rows decode through the page map like before and cause no transfers.
"""

import pytest
import torch

from sglang_ext.kernels.host_gather import gather_host_blocks
from sglang_ext.kernels.host_scatter import scatter_to_host, scatter_to_host_ref
from sglang_ext.kernels.sparse_decode import (
    DecodeRows,
    LayerCache,
    SelectionInputs,
    SparseDecodeWorkspace,
    sparse_decode_batched,
)
from sglang_ext.kernels.testing import case_generator, make_paged_batch, random_values
from sglang_ext.memory_tier.host_store import HostKVStore
from sglang_ext.memory_tier.working_set import WorkingSetTier
from sglang_ext.selection.reference import SelectionParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
POISON = 77.0


def test_host_round_trip_kernels_bit_exact():
    gen = case_generator("tier-roundtrip")
    hkv, d, bs, pages = 3, 8, 4, 10
    src = random_values(gen, pages * bs, hkv, d, dtype=torch.bfloat16)
    loc = torch.randperm(pages * bs, generator=gen).int()
    loc[5] = -1  # skipped
    host = torch.full((hkv, pages * bs, d), 3.0, dtype=torch.bfloat16)
    host_ref = host.clone()
    scatter_to_host(src, host, loc)
    scatter_to_host_ref(src, host_ref, loc)
    assert torch.equal(host, host_ref)
    # gather every (page, head) back into a poisoned device pool at shuffled pages
    dev = torch.full((pages * bs, hkv, d), POISON, dtype=torch.bfloat16)
    heads = torch.arange(hkv).repeat_interleave(pages).int()
    src_pages = torch.arange(pages).repeat(hkv).int()
    dst_pages = torch.randperm(pages, generator=gen).repeat(hkv).int()
    gather_host_blocks(host, dev, heads, src_pages, dst_pages, bs)
    for p in range(pages):
        dp = int(dst_pages[p])
        assert torch.equal(dev[dp * bs:(dp + 1) * bs], host[:, p * bs:(p + 1) * bs].transpose(0, 1))
    # written tokens came back bit-exact
    back = torch.empty_like(src)
    for i, s in enumerate(loc.tolist()):
        if s >= 0:
            dp = int(dst_pages[s // bs])
            back[i] = dev[dp * bs + s % bs]
    keep = loc >= 0
    assert torch.equal(back[keep], src[keep])


def test_host_store_cpu_path_round_trip():
    gen = case_generator("tier-store")
    store = HostKVStore(2, 2, 8, 8, 32, 4, torch.bfloat16)
    k = random_values(gen, 32, 2, 8, dtype=torch.bfloat16)
    v = random_values(gen, 32, 2, 8, dtype=torch.bfloat16)
    loc = torch.randperm(32, generator=gen).int()
    store.write(1, loc, k, v)
    kk, vv = store.read_tokens(1, loc)
    assert torch.equal(kk, k) and torch.equal(vv, v)
    dev_k = torch.full((40, 2, 8), POISON, dtype=torch.bfloat16)
    dev_v = dev_k.clone()
    heads = torch.tensor([0, 1, 1], dtype=torch.int32)
    store.load(1, heads, torch.tensor([2, 2, -1], dtype=torch.int32),
               torch.tensor([9, 3, 5], dtype=torch.int32), dev_k, dev_v)
    assert torch.equal(dev_k[36:40, 0], store.k[1][0, 8:12])
    assert torch.equal(dev_v[12:16, 1], store.v[1][1, 8:12])
    assert (dev_k[20:24] == POISON).all()  # the skipped entry


class TieredSetup:
    """One layer: the untiered pool (``pb``) and, beside it, the tier: host store holding the
    whole pool, a poisoned device pool holding only sink/window pages + working-set slots for
    tiered rows and every page of resident rows."""

    def __init__(self, pb, params, tiered_batch_entries, mode, device, timing=False):
        bs = params.block_size
        self.pb, self.params = pb, params
        num_slots_pool = pb.k_buffer.shape[0]
        hkv, d = pb.k_buffer.shape[1], pb.k_buffer.shape[2]
        self.host = HostKVStore(1, hkv, d, pb.v_buffer.shape[2], num_slots_pool, bs, pb.k_buffer.dtype)
        self.host.k[0].copy_(pb.k_buffer.transpose(0, 1).cpu())
        self.host.v[0].copy_(pb.v_buffer.transpose(0, 1).cpu())
        workspace = SparseDecodeWorkspace(len(pb.lens), 0 + pb_q_heads(pb), hkv, pb.v_buffer.shape[2],
                                          params, pb.max_blocks, device, pb.k_buffer.dtype)
        self.workspace = workspace
        num_cand = workspace.k_blocks
        rows = pb.req_to_token.shape[0]
        self.tier = WorkingSetTier(
            num_layers=1, num_kv_heads=hkv, max_rows=rows, max_blocks=pb.max_blocks,
            num_slots=num_cand, page_size=bs, max_batch=len(pb.lens), host=self.host,
            device=device, mode=mode, timing=timing,
        )
        # device pool: page 0 = padding page, then pages handed out as needed
        total_pages = 1 + sum(-(-n // bs) for n in pb.lens) + len(pb.lens) * num_cand
        self.dev_k = torch.full((total_pages * bs, hkv, d), POISON, dtype=pb.k_buffer.dtype, device=device)
        self.dev_v = torch.full((total_pages * bs, hkv, pb.v_buffer.shape[2]), -POISON,
                                dtype=pb.v_buffer.dtype, device=device)
        self.dev_k[:bs] = pb.k_buffer[:bs]  # the padding page, as the pool has it
        self.dev_v[:bs] = pb.v_buffer[:bs]
        next_page = 1
        for b, length in enumerate(pb.lens):
            row = int(pb.req_pool_indices[b])
            nblocks = -(-length // bs)
            if b in tiered_batch_entries:
                keep = sorted(set(range(-(-params.sink // bs)))
                              | set(range(max(length - params.window, 0) // bs, nblocks)))
            else:
                keep = list(range(nblocks))
            pages = torch.arange(next_page, next_page + len(keep))
            next_page += len(keep)
            for blk, page in zip(keep, pages.tolist()):
                src = pb.req_to_token[row, blk * bs].long() // bs
                self.dev_k[page * bs:(page + 1) * bs] = pb.k_buffer[src * bs:(src + 1) * bs]
                self.dev_v[page * bs:(page + 1) * bs] = pb.v_buffer[src * bs:(src + 1) * bs]
            self.tier.map_resident(row, torch.tensor(keep, device=device), pages.to(device))
            if b in tiered_batch_entries:
                self.tier.attach(row, torch.arange(next_page, next_page + num_cand, device=device))
                next_page += num_cand
        assert next_page <= total_pages

    def step_tiered(self, q, channels, before_fence=None):
        pb = self.pb
        on_blocks, attend = self.tier.decode_hooks(0, pb.req_pool_indices, pb.req_to_token,
                                                   self.dev_k, self.dev_v)
        out = sparse_decode_batched(
            q, LayerCache(self.dev_k, self.dev_v, pb.kmin, pb.kmax, channels=channels),
            _rows(pb), self.params, 0.3, self.workspace,
            SelectionInputs(page_map=self.tier.page_map(0), on_blocks=on_blocks,
                            attend_blocks=attend),
        ).clone()
        self.tier.after_layer(0, pb.req_pool_indices, pb.req_to_token, self.dev_k, self.dev_v)
        if before_fence is not None:
            before_fence()  # stands for the layers after this one (compute the prefetch hides in)
        self.tier.finish_step()
        return out


def _rows(pb):
    return DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens)


def pb_q_heads(pb):
    return pb.k_buffer.shape[1] * 2  # GQA group of 2 in these tests


def _untiered(pb, q, params, channels, attend_blocks=None, seen=None):
    ws = SparseDecodeWorkspace(q.shape[0], q.shape[1], pb.k_buffer.shape[1], pb.v_buffer.shape[2],
                               params, pb.max_blocks, q.device, q.dtype)

    def on_blocks(blocks):
        if seen is not None:
            seen.append(blocks.clone())

    return sparse_decode_batched(
        q, LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax, channels=channels), _rows(pb),
        params, 0.3, ws, SelectionInputs(on_blocks=on_blocks, attend_blocks=attend_blocks),
    ).clone()


def _case(method, device, dtype=torch.bfloat16, lens=(70, 23, 95), steps=3, mode="sync",
          timing=False):
    hkv, d, bs = 2, 16, 4
    params = SelectionParams(method, 32, bs, 10 if method == "two_level" else 1, 4, 8)
    gen = case_generator("tier", method, mode, lens)
    pb = make_paged_batch(gen, list(lens), hkv, d, bs, dtype=dtype, device=device)
    channels = torch.stack([torch.randperm(d, generator=gen)[:5] for _ in range(hkv)]).to(device)
    # entry 1 (23 tokens, within the budget) stays resident; the others are tiered
    setup = TieredSetup(pb, params, {0, 2}, mode, device, timing=timing)
    qs = [random_values(gen, len(lens), 2 * hkv, d, dtype=dtype, device=device) for _ in range(steps)]
    return pb, params, channels, setup, qs


@pytest.mark.parametrize("method", ["two_level", "quest"])
def test_sync_tier_equals_untiered_and_moves_only_the_difference(method):
    pb, params, channels, setup, qs = _case(method, DEVICE)
    tier = setup.tier
    moved_total = 0
    for q in qs:
        before = tier.page_maps.clone()
        seen = []
        expected = _untiered(pb, q, params, channels, seen=seen)
        got = setup.step_tiered(q, channels)
        assert torch.equal(got, expected)
        # transfers == wanted blocks of tiered rows that were not mapped before the step
        wanted = seen[0]
        misses = 0
        for b in (0, 2):
            row = int(pb.req_pool_indices[b])
            for g in range(wanted.shape[1]):
                for blk in wanted[b, g].tolist():
                    if blk >= 0 and int(before[row, 0, g, blk]) < 0:
                        misses += 1
        moved_total += misses
        assert tier.read_stats()["transferred_blocks"] == moved_total
    assert moved_total > 0
    # the resident row never got working-set state
    row1 = int(pb.req_pool_indices[1])
    assert int(tier.tiered[row1]) == 0 and (tier.slot_block[row1] == -1).all()


def test_async_tier_attends_previous_selection():
    pb, params, channels, setup, qs = _case("two_level", DEVICE, mode="async")
    prev = torch.full_like(setup.tier._wanted[0, :len(pb.lens)], -1)
    for step, q in enumerate(qs):
        seen = []
        # the untiered pipeline told to attend the previous step's blocks; for the resident
        # row the tier attends its own (fully mapped) previous blocks as well
        expected = _untiered(pb, q, params, channels, attend_blocks=prev.clone(), seen=seen)
        got = setup.step_tiered(q, channels)
        assert torch.equal(got, expected), f"step {step}"
        prev = seen[0]
    stats = setup.tier.read_stats()
    assert stats["transferred_blocks"] > 0 and 0.0 <= stats["hit_rate"] < 1.0


def test_detach_forgets_row():
    pb, params, channels, setup, qs = _case("two_level", DEVICE, steps=1)
    setup.step_tiered(qs[0], channels)
    row = int(pb.req_pool_indices[0])
    setup.tier.detach(row)
    t = setup.tier
    assert int(t.tiered[row]) == 0
    assert (t.page_maps[row] == -1).all() and (t.slot_block[row] == -1).all()
    assert (t.slot_pages[row] == -1).all()


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gpu_tier_modes(mode):
    pb, params, channels, setup, qs = _case("two_level", "cuda", lens=(700, 23, 950), steps=4,
                                            mode=mode)
    prev = torch.full_like(setup.tier._wanted[0, :len(pb.lens)], -1)
    for q in qs:
        seen = []
        expected = _untiered(pb, q, params, channels,
                             attend_blocks=prev.clone() if mode == "async" else None, seen=seen)
        got = setup.step_tiered(q, channels)
        torch.cuda.synchronize()
        assert torch.equal(got, expected)
        prev = seen[0]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_tier_timing_on_the_cpu_counts_every_transfer_as_waited_for(mode):
    """--sparse-tier-timing: the same outputs; the transfer time is measured, and without a
    side stream (CPU) the step waits for all of it, so nothing is hidden."""
    pb, params, channels, timed, qs = _case("two_level", "cpu", mode=mode, timing=True)
    *_, plain, _ = _case("two_level", "cpu", mode=mode)
    for q in qs:
        assert torch.equal(timed.step_tiered(q, channels), plain.step_tiered(q, channels))
    stats = timed.tier.read_stats()
    assert stats["transfer_s"] > 0 and stats["exposed_transfer_s"] == stats["transfer_s"]
    assert stats["hidden_fraction"] == 0.0
    assert "transfer_s" not in plain.tier.read_stats()


def test_tier_timing_starts_at_the_first_tiered_request():
    """Steps before any row is tiered (SGLang's CUDA-graph capture and warm-up) are not timed
    into the counters: the clock is zeroed when the first row is attached, and only then."""
    host = HostKVStore(1, 2, 16, 16, 64, 4, torch.bfloat16)
    tier = WorkingSetTier(num_layers=1, num_kv_heads=2, max_rows=3, max_blocks=16, num_slots=4,
                          page_size=4, max_batch=2, host=host, device="cpu", timing=True)
    tier.clock.buf[2:] = 10**9  # what the warm-up's untiered fetches accumulated
    assert tier.read_stats()["transfer_s"] == 1.0
    tier.attach(0, torch.arange(4))
    assert tier.read_stats()["transfer_s"] == 0.0
    tier.clock.buf[2] = 5 * 10**8  # a tiered step's transfer time
    tier.attach(1, torch.arange(4, 8))  # a later attach keeps the count
    assert tier.read_stats()["transfer_s"] == 0.5


@gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gpu_tier_timing_sees_the_prefetch_hidden_behind_compute(mode):
    """async: the prefetch runs on the side stream while the compute stream is busy (a 20 ms
    sleep kernel standing for the remaining layers), so almost none of it is waited for; sync:
    all of it is. Also under CUDA graph replay of the clock kernels (kernels/stream_clock.py)."""
    pb, params, channels, setup, qs = _case("two_level", "cuda", lens=(700, 23, 950), steps=4,
                                            mode=mode, timing=True)
    busy = lambda: torch.cuda._sleep(40_000_000)  # noqa: E731 (~20 ms at ~2 GHz)
    for q in qs:
        setup.step_tiered(q, channels, before_fence=busy)
    torch.cuda.synchronize()
    stats = setup.tier.read_stats()
    assert stats["transfer_s"] > 0, stats
    if mode == "async":
        assert stats["hidden_fraction"] > 0.9, stats
    else:
        assert stats["hidden_fraction"] == 0.0
