"""NOSA's locality constraint in the batched decode (kernels/locality.py through
kernels/sparse_decode.py) against the per-request oracle ``select_token_mask_locality``, over a
multi-step decode trace of several requests of different lengths (one starts within the budget
and turns sparse mid-trace): the same selected token sets per (request, kv head) every step, the
attention output within tolerance, the same kept sets E_t, the same γ(t); the eviction rule holds
on the kernel state (a dropped block never returns) and γ(t) >= k_e / k. The KV, its page
summaries and its page eviction scores are written the way a server writes them (a prompt in
chunks that split pages, then one token per step), over pages holding stale state."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch

from sglang_ext.kernels.block_summary import update_block_summaries
from sglang_ext.kernels.locality import (
    LocalityKernelState,
    eviction_head_tensors,
    pooled_page_scores_ref,
    update_eviction_page_scores,
)
from sglang_ext.kernels.sparse_decode import (
    DecodeRows,
    LayerCache,
    SelectionInputs,
    SparseDecodeWorkspace,
    select_slots_batched,
    sparse_decode_batched,
)
from sglang_ext.kernels.testing import case_generator, make_paged_batch, random_values
from sglang_ext.selection.eviction_head import EvictionHeads
from sglang_ext.selection.locality import LocalityState, select_token_mask_locality
from sglang_ext.selection.reference import SelectionParams, sparse_attention
from fake_backend import FakeReqToTokenPool

HQ, HKV, D, BS = 4, 2, 16, 4
# sink 3: the first middle block is partial; n_sel = 31 tokens (7 whole blocks); k_e = 3;
# (8 + 3) candidate blocks hold more tokens than n_sel, so the token top-k chooses.
PARAMS = SelectionParams("two_level", 40, BS, 8, 3, 6, locality_blocks=3,
                         eviction_score="key_norm")
SCALE = D ** -0.5


@dataclass
class Trace:
    """A paged pool holding every request's final KV; ``written`` positions are 'in the pool'
    as far as the summaries and page scores know."""

    pb: object
    starts: list[int]
    kmin: torch.Tensor = None
    kmax: torch.Tensor = None
    page_scores: torch.Tensor = None
    channels: torch.Tensor = None
    qs: list[torch.Tensor] = field(default_factory=list)


def _write(trace: Trace, positions: list[list[int]], params: SelectionParams, head) -> None:
    """Write the given positions of each request (one call, like one SGLang batch)."""
    pb = trace.pb
    dev = pb.k_buffer.device
    loc = torch.cat([pb.req_to_token[int(pb.req_pool_indices[b]),
                                      torch.tensor(p, device=dev)].long()
                     for b, p in enumerate(positions) if p])
    update_block_summaries(trace.kmin, trace.kmax, pb.k_buffer[loc], loc, BS)
    if trace.page_scores is not None:
        x = pb.v_buffer[loc] if params.eviction_score == "learned" else pb.k_buffer[loc]
        update_eviction_page_scores(trace.page_scores, x, loc, BS, params.eviction_score, head)


def _trace(name: str, starts: list[int], steps: int, params: SelectionParams, head,
           page_scores: torch.Tensor | None, device: str = "cpu") -> Trace:
    gen = case_generator("locality-kernels", name)
    pb = make_paged_batch(gen, [s + steps for s in starts], HKV, D, BS, summary_chunks=0,
                          device=device)
    num_pages = pb.k_buffer.shape[0] // BS
    trace = Trace(pb, starts)
    # stale summaries and page scores, as pages freed by earlier requests have
    trace.kmin = (torch.randn(num_pages, HKV, D, generator=gen) - 5).to(device)
    trace.kmax = (torch.randn(num_pages, HKV, D, generator=gen) + 5).to(device)
    if page_scores is not None:
        trace.page_scores = page_scores
        trace.page_scores.copy_(torch.randn(page_scores.shape, generator=gen) * 50)
    # the prompts (all but their last token), in two calls that split pages
    cut = [int(torch.randint(1, s - 1, (1,), generator=gen)) for s in starts]
    _write(trace, [list(range(c)) for c in cut], params, head)
    _write(trace, [list(range(c, s - 1)) for c, s in zip(cut, starts)], params, head)
    trace.channels = torch.stack([torch.randperm(D, generator=gen)[:5]
                                  for _ in range(HKV)]).to(device)
    trace.qs = [random_values(gen, len(starts), HQ, D, device=device) for _ in range(steps)]
    return trace


def _heads(seed: int) -> EvictionHeads:
    return EvictionHeads(1, HKV, D, generator=torch.Generator().manual_seed(seed))


def _evicted(state: LocalityKernelState, row: int, g: int, first: int) -> set[int]:
    """Blocks seen and not kept, from the kernel state."""
    kept = {int(x) for x in state.keep_ids[0, row, g] if x >= 0}
    return set(range(first, int(state.seen_upto[0, row, g]) + 1)) - kept


def _run(name: str, params: SelectionParams, starts: list[int], steps: int,
         heads: EvictionHeads | None = None, device: str = "cpu",
         oracle_states: list[LocalityState] | None = None) -> list[list[float]]:
    """Kernels vs oracle over the trace; returns the γ(t) the kernels measured per request
    (and the oracle's per-request states in ``oracle_states``, if given)."""
    k_e = params.locality_blocks
    head = None
    if heads is not None:
        heads = heads.to(device)
        head = eviction_head_tensors(heads, 0)
    rows = None
    state = None
    if k_e:
        probe = make_paged_batch(case_generator("locality-kernels", name),
                                 [s + steps for s in starts], HKV, D, BS, summary_chunks=0)
        rows = probe.req_to_token.shape[0]
        state = LocalityKernelState(num_layers=1, rows=rows, num_kv_heads=HKV, k_e=k_e,
                                    max_blocks=probe.max_blocks,
                                    num_slots=probe.k_buffer.shape[0], page_size=BS,
                                    device=device,
                                    limit_new_blocks=params.locality_new_blocks > 0)
    trace = _trace(name, starts, steps, params, head,
                   state.page_scores[0] if state is not None else None, device)
    pb = trace.pb
    batch = len(starts)
    ws = SparseDecodeWorkspace(batch + 1, HQ, HKV, D, params, pb.max_blocks, device,
                               torch.float32)
    ref_states = [LocalityState(num_kv_heads=HKV) for _ in starts]
    gammas: list[list[float]] = [[] for _ in starts]
    evicted_before: dict[tuple[int, int], set[int]] = {}
    first = params.sink // BS
    for t in range(steps):
        lens = [s + t for s in starts]
        _write(trace, [[n - 1] for n in lens], params, head)  # this step's token
        # one padding entry (row 0, length 1), as SGLang's CUDA graphs add
        rows_t = torch.cat([pb.req_pool_indices,
                            torch.zeros(1, dtype=torch.int64, device=device)])
        lens_t = torch.tensor(lens + [1], dtype=torch.int32, device=device)
        q = torch.cat([trace.qs[t], trace.qs[t][:1]])
        cache = LayerCache(pb.k_buffer, pb.v_buffer, trace.kmin, trace.kmax,
                           channels=trace.channels)
        decode_rows = DecodeRows(pb.req_to_token, rows_t, lens_t)
        out = sparse_decode_batched(
            q, cache, decode_rows, params, SCALE, ws,
            SelectionInputs(locality=state.layer(0) if state is not None else None))
        if state is None:  # positions are only kept for γ: ask for them
            select_slots_batched(q, cache, decode_rows, params, ws, return_positions=True)
        positions = ws.positions[:batch].clone()
        for b, length in enumerate(lens):
            row = int(pb.req_pool_indices[b])
            idx = pb.req_to_token[row, :length].long()
            keys, values = pb.k_buffer[idx], pb.v_buffer[idx]
            n_before = len(ref_states[b].locality)
            mask = select_token_mask_locality(
                trace.qs[t][b], keys, params, ref_states[b], k_e, trace.channels,
                params.eviction_score, values, None if heads is None else heads.layer(0))
            where = f"step {t} request {b} (L={length})"
            for g in range(HKV):
                got = positions[b, g][positions[b, g] >= 0].long().sort().values
                assert torch.equal(got, mask[g].nonzero().flatten().to(device)), \
                    f"{where} head {g}"
            torch.testing.assert_close(out[b], sparse_attention(trace.qs[t][b], keys, values,
                                                                mask, SCALE),
                                       rtol=1e-4, atol=1e-5)
            if state is None:
                continue
            if length > params.budget:
                ref_keep = ref_states[b].keep
                for g in range(HKV):
                    kept = sorted(int(x) for x in state.keep_ids[0, row, g] if x >= 0)
                    assert kept == ref_keep[g].nonzero().flatten().tolist(), f"{where} E_t"
                    evicted = _evicted(state, row, g, first)
                    assert not (evicted_before.get((b, g), set()) & set(kept)), "came back"
                    assert evicted >= evicted_before.get((b, g), set())
                    evicted_before[b, g] = evicted
            measured = float(ws.gamma[b])
            if len(ref_states[b].locality) > n_before:
                assert measured == pytest.approx(ref_states[b].locality[-1], abs=1e-6), where
                gammas[b].append(measured)
            else:
                assert measured == -1.0, where
        if state is not None:
            assert float(ws.gamma[batch]) == -1.0  # the padding entry is never measured
    if oracle_states is not None:
        oracle_states.extend(ref_states)
    return gammas


def _floor(params: SelectionParams) -> float:
    """NOSA's bound k_e / k, k = most blocks one step can attend: the sink's and window's
    blocks (one more where they straddle), the k_e blocks, one per query-aware token."""
    p = params
    n_q = p.budget - p.sink - p.window - p.locality_blocks * p.block_size
    k = -(-p.sink // p.block_size) + -(-p.window // p.block_size) + 1 + p.locality_blocks + n_q
    return p.locality_blocks / k


@pytest.mark.parametrize("kind", ["key_norm", "learned"])
def test_batched_locality_equals_the_oracle_over_a_decode_trace(kind):
    params = replace(PARAMS, eviction_score=kind)
    heads = _heads(11) if kind == "learned" else None
    gammas = _run(kind, params, starts=[33, 58, 83], steps=14, heads=heads)
    assert all(gammas), "every request was measured"
    assert min(g for per in gammas for g in per) >= _floor(params)


def test_batched_new_block_limit_equals_the_oracle():
    """With at most 2 query-aware blocks per step from outside the last filter (of 8), the
    batched decode still selects the oracle's tokens, E_t and γ every step; the oracle's own
    trace shows the limit held and was needed."""
    params = replace(PARAMS, locality_new_blocks=2)
    states: list[LocalityState] = []
    gammas = _run("new-blocks", params, starts=[33, 58, 83], steps=14, oracle_states=states)
    assert min(g for per in gammas for g in per) >= _floor(params)
    admitted = [n for st in states for n in st.new_blocks]
    assert admitted and max(admitted) == 2  # held, and reached
    unlimited: list[LocalityState] = []
    _run("new-blocks", PARAMS, starts=[33, 58, 83], steps=14, oracle_states=unlimited)
    assert max(n for st in unlimited for n in st.new_blocks) > 2  # the limit changed something


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,new_blocks", [("key_norm", 0), ("learned", 0), ("key_norm", 2)])
def test_compiled_kernels_equal_the_oracle_on_the_gpu(kind, new_blocks):
    """The same trace with the compiled kernels (barriers, atomics, loops) on the GPU."""
    params = replace(PARAMS, eviction_score=kind, locality_new_blocks=new_blocks)
    heads = _heads(11) if kind == "learned" else None
    gammas = _run("gpu-" + kind, params, starts=[33, 58, 83], steps=14, heads=heads,
                  device="cuda")
    assert min(g for per in gammas for g in per) >= _floor(params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("new_blocks", [0, 2])
def test_locality_decode_step_replays_in_a_cuda_graph(new_blocks):
    """One decode step with the locality constraint captured in a CUDA graph and replayed over
    the following steps gives what eager calls on a copy of the state give."""
    params = replace(PARAMS, locality_new_blocks=new_blocks)
    starts, steps = [57, 90], 6
    gen = case_generator("locality-graph")
    pb = make_paged_batch(gen, [s + steps for s in starts], HKV, D, BS, device="cuda",
                          summary_chunks=1)
    state = lambda: LocalityKernelState(  # noqa: E731
        num_layers=1, rows=pb.req_to_token.shape[0], num_kv_heads=HKV, k_e=3,
        max_blocks=pb.max_blocks, num_slots=pb.k_buffer.shape[0], page_size=BS, device="cuda",
        limit_new_blocks=new_blocks > 0)
    eager_state, graph_state = state(), state()
    for s in (eager_state, graph_state):  # scores of every page (the KV is all written)
        idx = torch.arange(pb.k_buffer.shape[0], device="cuda")
        update_eviction_page_scores(s.page_scores[0], pb.k_buffer, idx, BS, "key_norm")
    ws_eager, ws_graph = (SparseDecodeWorkspace(2, HQ, HKV, D, params, pb.max_blocks, "cuda",
                                                torch.float32) for _ in range(2))
    q = torch.zeros(2, HQ, D, device="cuda")
    lens = torch.tensor(starts, dtype=torch.int32, device="cuda")
    common = (q, LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax),
              DecodeRows(pb.req_to_token, pb.req_pool_indices, lens), params, SCALE)
    # warm up (compiles) on throwaway state, then capture
    scratch = state()
    sparse_decode_batched(*common, workspace=ws_graph,
                          inputs=SelectionInputs(locality=scratch.layer(0)))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = sparse_decode_batched(*common, workspace=ws_graph,
                                          inputs=SelectionInputs(locality=graph_state.layer(0)))
    for t in range(steps):
        q.copy_(random_values(gen, 2, HQ, D, device="cuda"))
        lens.copy_(torch.tensor([s + t for s in starts], dtype=torch.int32))
        want = sparse_decode_batched(*common, workspace=ws_eager,
                                     inputs=SelectionInputs(locality=eager_state.layer(0))).clone()
        graph.replay()
        torch.testing.assert_close(out_graph, want, rtol=0, atol=0)
        assert torch.equal(graph_state.keep_ids, eager_state.keep_ids)
        assert torch.equal(ws_graph.gamma[:2], ws_eager.gamma[:2])
        if new_blocks:
            assert torch.equal(graph_state.prev_filter, eager_state.prev_filter)


def test_ke_zero_is_two_level():
    """Without the constraint the batched two_level is the oracle's k_e = 0 selection."""
    _run("ke0", replace(PARAMS, locality_blocks=0), starts=[45, 70], steps=4)


def test_page_scores_pool_like_the_oracle():
    """Complete pages' scores (written in chunks over stale pages) are NOSA's two-stage pooled
    token scores: key norms, and the eviction head of the values."""
    gen = case_generator("locality-page-scores")
    heads = _heads(3)
    for kind in ("key_norm", "learned"):
        pb = make_paged_batch(gen, [37, 64], HKV, D, BS, summary_chunks=0)
        state = LocalityKernelState(num_layers=1, rows=pb.req_to_token.shape[0],
                                    num_kv_heads=HKV, k_e=1, max_blocks=pb.max_blocks,
                                    num_slots=pb.k_buffer.shape[0], page_size=BS, device="cpu")
        scores = state.page_scores[0]
        scores.copy_(torch.randn(scores.shape, generator=gen) * 50)
        head = eviction_head_tensors(heads, 0) if kind == "learned" else None
        for b, length in enumerate(pb.lens):
            idx = pb.req_to_token[int(pb.req_pool_indices[b]), :length].long()
            for lo, hi in ((0, 5), (5, 6), (6, 19), (19, length)):  # chunks splitting pages
                loc = idx[lo:hi]
                x = pb.v_buffer[loc] if kind == "learned" else pb.k_buffer[loc]
                update_eviction_page_scores(scores, x, loc, BS, kind, head)
            full = length // BS * BS
            if kind == "learned":
                token = heads.token_scores(0, pb.v_buffer[idx[:full]])
            else:
                token = pb.k_buffer[idx[:full]].float().norm(dim=2).T
            want = pooled_page_scores_ref(token, BS)  # [Hkv, blocks]
            pages = idx[:full:BS] // BS
            torch.testing.assert_close(scores[pages, :, 0].T, want, rtol=1e-5, atol=1e-6)


def test_new_request_in_a_reused_row_starts_clean():
    """reset_rows forgets the kept sets, the watermark and the γ bitmap of a row."""
    state = LocalityKernelState(num_layers=2, rows=4, num_kv_heads=HKV, k_e=2, max_blocks=40,
                                num_slots=64, page_size=BS, device="cpu")
    state.keep_ids.fill_(7)
    state.seen_upto.fill_(9)
    state.prev_attended.fill_(3)
    state.reset_rows(torch.tensor([2]))
    assert (state.keep_ids[:, 2] == -1).all() and (state.seen_upto[:, 2] == -1).all()
    assert (state.prev_attended[:, 2] == 0).all()
    assert (state.keep_ids[:, 1] == 7).all() and (state.prev_attended[:, 3] == 3).all()


# ------------------------------------------------------------------- through the backend


class _Extend:
    def is_decode_or_idle(self) -> bool:
        return False

    def is_idle(self) -> bool:
        return False


@pytest.mark.parametrize("kind", ["key_norm", "learned"])
def test_backend_kernel_decode_with_locality(kind, tmp_path, monkeypatch):
    """The backend's batched (triton) decode with --sparse-locality-blocks, two layers: KV and
    page scores written by prefill and decode, a row reused by a new request mid-trace (its
    state starts clean), every step's output equal to the oracle's per (request, layer), and
    γ read from the device into the metrics."""
    from types import SimpleNamespace

    from fake_backend import DecodeMode, FakePool
    from sglang_ext.attention import sparse_backend
    from sglang_ext.attention.features import locality as locality_feature
    from sglang_ext.attention.features.locality import KernelLocality
    from sglang_ext.config import build_config
    from sglang_ext.selection.eviction_head import save_eviction_heads

    monkeypatch.setattr(locality_feature, "LOCALITY_READ_EVERY", 1)
    layers, slots = 2, 1024
    gen = case_generator("locality-backend", kind)
    heads = EvictionHeads(layers, HKV, D, generator=gen)
    path = tmp_path / "heads.safetensors"
    save_eviction_heads(heads, path, model="tiny")
    cfg = build_config(budget=40, block_size=BS, sink=3, window=6, candidate_blocks=8,
                       locality_blocks=3, eviction_score=kind, impl="triton",
                       eviction_head=str(path) if kind == "learned" else None)
    params = replace(PARAMS, eviction_score=kind)
    pool = FakePool([torch.full((slots, HKV, D), 40.0) for _ in range(layers)],
                    [torch.full((slots, HKV, D), -40.0) for _ in range(layers)])
    pool.head_num, pool.v_head_dim = HKV, D
    runner = SimpleNamespace(
        device="cpu", token_to_kv_pool=pool, dtype=torch.float32,
        server_args=SimpleNamespace(page_size=BS, enable_metrics=False),
        req_to_token_pool=FakeReqToTokenPool(torch.zeros(4, 128, dtype=torch.int32)),
        model_config=SimpleNamespace(num_hidden_layers=layers, head_dim=D,
                                     num_attention_heads=HQ, get_total_num_kv_heads=lambda: HKV))
    backend = sparse_backend.SparseDecodeBackend(runner, cfg)
    observed = []
    backend.decoder.feature(KernelLocality).metrics = SimpleNamespace(
        observe_many=lambda *a: observed.append(a))

    def write(l, loc):
        pool.k[l][loc] = torch.randn(len(loc), HKV, D, generator=gen)
        pool.v[l][loc] = torch.randn(len(loc), HKV, D, generator=gen)
        return pool.k[l][loc].reshape(len(loc), -1), pool.v[l][loc].reshape(len(loc), -1)

    backend._dense = SimpleNamespace(  # the dense delegate: the prompt's KV is written here
        init_forward_metadata=lambda fb: None,
        forward_extend=lambda q, k, v, layer, fb, **kw: torch.zeros(q.shape[0], HQ * D))
    layer_objs = [SimpleNamespace(layer_id=l, tp_q_head_num=HQ, tp_k_head_num=HKV,
                                  qk_head_dim=D, v_head_dim=D, scaling=SCALE)
                  for l in range(layers)]
    table = runner.req_to_token_pool.req_to_token
    lengths: dict[int, int] = {}
    oracle: dict[tuple[int, int], LocalityState] = {}

    def prefill(row: int, base: int, length: int) -> None:
        table[row] = torch.arange(base, base + 128, dtype=torch.int32)
        loc = table[row, :length - 1].long()
        batch = SimpleNamespace(forward_mode=_Extend(), req_pool_indices=torch.tensor([row]),
                                out_cache_loc=loc)
        backend.init_forward_metadata(batch)
        for l, layer in enumerate(layer_objs):
            k, v = write(l, loc)
            backend.forward_extend(torch.zeros(len(loc), HQ * D), k, v, layer, batch)
            oracle[row, l] = LocalityState(num_kv_heads=HKV)
        lengths[row] = length - 1

    def decode(rows: list[int]) -> None:
        for row in rows:
            lengths[row] += 1
        lens = torch.tensor([lengths[r] for r in rows], dtype=torch.int32)
        loc = torch.stack([table[r, lengths[r] - 1] for r in rows]).long()
        batch = SimpleNamespace(forward_mode=DecodeMode(), req_pool_indices=torch.tensor(rows),
                                seq_lens=lens, seq_lens_cpu=lens, out_cache_loc=loc)
        backend.init_forward_metadata(batch)
        for l, layer in enumerate(layer_objs):
            q = torch.randn(len(rows), HQ * D, generator=gen)
            k, v = torch.randn(len(rows), HKV * D, generator=gen), torch.randn(
                len(rows), HKV * D, generator=gen)
            out = backend.forward_decode(q, k, v, layer, batch).view(len(rows), HQ, D)
            for i, row in enumerate(rows):
                idx = table[row, :lengths[row]].long()
                keys, values = pool.k[l][idx], pool.v[l][idx]
                qi = q[i].view(HQ, D)
                mask = select_token_mask_locality(qi, keys, params, oracle[row, l], 3, None,
                                                  kind, values, heads.layer(l))
                torch.testing.assert_close(out[i], sparse_attention(qi, keys, values, mask,
                                                                    SCALE),
                                           rtol=1e-4, atol=1e-5)

    prefill(1, 4 * BS, 50)
    prefill(2, 40 * BS, 37)
    for _ in range(5):
        decode([1, 2])
    prefill(2, 80 * BS, 60)  # row 2 now holds a new request
    for _ in range(4):
        decode([2, 1])
    assert observed and sum(count for _, count, _ in observed) > 0
    assert min(minimum for _, _, minimum in observed) >= _floor(params)
