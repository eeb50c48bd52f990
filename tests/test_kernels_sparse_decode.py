"""The batched sparse decode pipeline (kernels/sparse_decode.py) against the per-request oracle:
``select_token_mask`` + ``sparse_attention`` of sglang_ext.selection.reference.

Block summaries come from ``update_block_summaries`` over KV written in several chunks (see
``make_paged_batch``). Checks: the same selected position SET per (request, kv head), slots
that are ``req_to_token`` of those positions, outputs/LSE within tolerance.
"""


import dataclasses

import torch


import pytest

from sglang_ext.kernels.block_summary import update_block_summaries
from sglang_ext.kernels.rerank import shortlist_selection
from sglang_ext.kernels.sparse_decode import (
    DecodeRows,
    LayerCache,
    SelectionInputs,
    SparseDecodeWorkspace,
    select_blocks_batched,
    select_slots_batched,
    sparse_decode_batched,
    sparse_decode_batched_ref,
)
from sglang_ext.kernels.testing import (
    case_generator,
    make_paged_batch,
    random_values,
)
from sglang_ext.selection.reference import SelectionParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _channels(gen, hkv, head_dim, r, device):
    return torch.stack([torch.randperm(head_dim, generator=gen)[:r] for _ in range(hkv)]).to(device)


def _poison(ws):
    """Fill every workspace buffer with NaN / -7 so unwritten entries cannot pass."""
    for name, buf in vars(ws).items():
        if isinstance(buf, torch.Tensor):
            buf.fill_(float("nan") if buf.is_floating_point() else -7)
    return ws


def _cache(pb, channels=None, kmin=None, kmax=None, **kw):
    """The batch's layer: its keys, values and summaries (``kmin``/``kmax`` override those)."""
    return LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin if kmin is None else kmin,
                      pb.kmax if kmax is None else kmax, channels=channels, **kw)


def _rows(pb, req_pool_indices=None, seq_lens=None):
    """The batch's rows (``req_pool_indices``/``seq_lens`` override the batch's)."""
    return DecodeRows(pb.req_to_token,
                      pb.req_pool_indices if req_pool_indices is None else req_pool_indices,
                      pb.seq_lens if seq_lens is None else seq_lens)


def _workspace(pb, q, params):
    return SparseDecodeWorkspace(q.shape[0], q.shape[1], pb.k_buffer.shape[1],
                                 pb.v_buffer.shape[2], params, pb.max_blocks, q.device, q.dtype)


def _run_and_check(pb, q, params, channels, workspace=None, dtype=torch.bfloat16, max_diff=0,
                   block_q=None, kv_scales=(1.0, 1.0)):
    """Pipeline vs oracle on one batch. ``max_diff``: positions allowed to differ per
    (request, kv head) (0 = exact sets; only the torch.topk path under near-ties needs more).
    ``block_q``: the asynchronous block filter: the blocks are chosen by this query one step
    earlier (at ``seq_lens - 1``) and passed as ``candidates``. ``kv_scales``: an 8-bit KV
    cache's (k_scale, v_scale)."""
    head_dim = q.shape[2]
    k_scale, v_scale = kv_scales
    if workspace is None:
        workspace = _workspace(pb, q, params)
    candidates = block_lens = None
    if block_q is not None:
        block_lens = pb.seq_lens - 1
        candidates = select_blocks_batched(
            block_q, _cache(pb), _rows(pb, seq_lens=block_lens), params,
            _poison(_workspace(pb, q, params))).clone()
    _poison(workspace)
    sm_scale = head_dim ** -0.5
    cache = _cache(pb, channels, k_scale=k_scale, v_scale=v_scale)
    inputs = SelectionInputs(candidates=candidates)
    slots, pos = select_slots_batched(q, cache, _rows(pb), params, workspace, inputs,
                                      return_positions=True)
    slots, pos = slots.clone(), pos.clone()
    out, lse = sparse_decode_batched(q, cache, _rows(pb), params, sm_scale, workspace, inputs,
                                     return_lse=True)
    ref_out, ref_lse, masks = sparse_decode_batched_ref(
        q, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, params,
        sm_scale, channels, block_queries=block_q, block_lens=block_lens, k_scale=k_scale,
        v_scale=v_scale,
    )
    assert slots.shape == pos.shape == (q.shape[0], pb.k_buffer.shape[1], params.budget)
    assert (pos >= -1).all() and (slots >= -1).all(), "unwritten entries"
    for b, length in enumerate(pb.lens):
        row = int(pb.req_pool_indices[b])
        for g in range(pb.k_buffer.shape[1]):
            p = pos[b, g]
            valid = p >= 0
            got = p[valid].long().sort().values
            expect = masks[b][g].nonzero().flatten()
            where = f"request {b} (L={length}) kv head {g}"
            if max_diff == 0:
                assert torch.equal(got, expect), f"{where}: selected set differs"
            else:
                common = torch.isin(got, expect).sum()
                assert got.numel() == got.unique().numel(), f"{where}: duplicates"
                assert expect.numel() - common <= max_diff, f"{where}: sets differ"
            assert torch.equal(slots[b, g][~valid], torch.full_like(slots[b, g][~valid], -1))
            assert torch.equal(slots[b, g][valid], pb.req_to_token[row, p[valid].long()])
    if max_diff == 0:
        torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
        torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-3)
    return out, lse, masks


# Per case: (Hq, Hkv, head_dim, bs, sink, window, budget); budget - sink - window = n_sel.
SHAPES = [(6, 2, 32, 4, 3, 5, 24), (4, 4, 16, 8, 3, 5, 40), (4, 1, 32, 4, 0, 1, 21)]


def _lens_for(bs, budget):
    """Ragged lengths: below / at / one past the budget, around block boundaries, long."""
    return [[budget // 2, budget, budget + 1], [4 * bs * 2 - 1, 8 * bs + 1, 97]]


@pytest.mark.parametrize("method", ["quest", "ds", "two_level", "two_level_label_max"])
@pytest.mark.parametrize("use_channels", [False, True], ids=["allch", "labels"])
def test_matches_reference(method, use_channels):
    label_max = method.endswith("_label_max")
    method = method.removesuffix("_label_max")
    case = ["quest", "ds", "two_level"].index(method) + 3 * use_channels + label_max
    hq, hkv, head_dim, bs, sink, window, budget = SHAPES[(case + use_channels) % 3]
    n_sel = budget - sink - window
    # two_level: sometimes fewer candidate tokens than n_sel (slots stay -1), sometimes more
    cand_blocks = (n_sel // bs - 1) if case % 2 else (2 * n_sel // bs)
    params = SelectionParams(method, budget, bs, max(cand_blocks, 1), sink, window,
                             block_score="label_max" if label_max else "bound")
    for i, lens in enumerate(_lens_for(bs, budget)):
        gen = case_generator("decode", method, use_channels, i)
        dtype = torch.float32 if (use_channels and i) else torch.bfloat16
        pb = make_paged_batch(gen, lens, hkv, head_dim, bs, dtype=dtype, device=DEVICE,
                              summary_chunks=3)
        q = random_values(gen, len(lens), hq, head_dim, dtype=dtype, device=DEVICE)
        channels = _channels(gen, hkv, head_dim, 5, DEVICE) if use_channels else None
        _run_and_check(pb, q, params, channels, dtype=dtype)


@pytest.mark.parametrize("method", ["quest", "two_level"])
def test_blocks_chosen_a_step_earlier_match_reference(method):
    """The asynchronous block filter: blocks ranked by the previous step's query over the
    previous step's middle, tokens (two_level) by this step's query; lengths where the middle
    just gained a block the earlier filter never saw (L - window - 1 on a block boundary)."""
    hq, hkv, d, bs, sink, window, budget = 6, 2, 32, 4, 3, 8, 27
    n_sel = budget - sink - window
    params = SelectionParams(method, budget, bs, 2 * n_sel // bs, sink, window)
    lens = [budget // 2, budget + 1, 8 * bs + window + 1, 97, 130]
    gen = case_generator("async-blocks", method)
    pb = make_paged_batch(gen, lens, hkv, d, bs, dtype=torch.float32, device=DEVICE)
    q = random_values(gen, len(lens), hq, d, device=DEVICE)
    q_prev = random_values(gen, len(lens), hq, d, device=DEVICE)
    channels = _channels(gen, hkv, d, 5, DEVICE)
    _, _, stale = _run_and_check(pb, q, params, channels, dtype=torch.float32, block_q=q_prev)
    # the earlier query chose other tokens than this step's would: the check can tell them apart
    _, _, fresh = _run_and_check(pb, q, params, channels, dtype=torch.float32)
    assert any(not torch.equal(a, b) for a, b in zip(stale, fresh))
    # this step's own query as the earlier one at this length: the same as the in-line filter
    ws = _workspace(pb, q, params)
    same = select_blocks_batched(q, _cache(pb), _rows(pb), params, ws).clone()
    given = select_slots_batched(q, _cache(pb, channels), _rows(pb), params,
                                 _workspace(pb, q, params),
                                 SelectionInputs(candidates=same)).clone()
    inline = select_slots_batched(q, _cache(pb, channels), _rows(pb), params, ws)
    assert torch.equal(given, inline)


def test_given_candidates_are_checked():
    params = SelectionParams("two_level", 27, 4, 8, 3, 8)
    gen = case_generator("async-shape")
    pb = make_paged_batch(gen, [60, 70], 2, 16, 4, device=DEVICE)
    q = random_values(gen, 2, 4, 16, device=DEVICE)
    bad = torch.zeros(2, 2, 5, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="candidates"):
        select_slots_batched(q, _cache(pb), _rows(pb), params, _workspace(pb, q, params),
                             SelectionInputs(candidates=bad))
    ds = SelectionParams("ds", 27, 4, 8, 3, 8)
    with pytest.raises(ValueError, match="block-filter"):
        select_blocks_batched(q, _cache(pb), _rows(pb), ds, _workspace(pb, q, ds))


def test_fp32_ties_exact():
    """Dyadic keys/queries make many scores tie exactly; the Triton top-k breaks ties to the
    lower block / position like the oracle, so the sets still agree exactly."""
    hq, hkv, d, bs = 6, 2, 16, 4
    for method in ("quest", "two_level"):
        params = SelectionParams(method, 20, bs, 3, 2, 3)
        gen = case_generator("ties", method)
        pb = make_paged_batch(gen, [61, 90], hkv, d, bs, dtype=torch.float32, device=DEVICE,
                              dyadic=True)
        q = random_values(gen, 2, hq, d, device=DEVICE, dyadic=True)
        _run_and_check(pb, q, params, _channels(gen, hkv, d, 4, DEVICE), dtype=torch.float32)


@pytest.mark.parametrize("method,n_sel", [("quest", 3), ("two_level", 0), ("ds", 0)])
def test_degenerate_budgets(method, n_sel):
    """Nothing to select in the middle (quest with n_sel < bs, or n_sel == 0): sink + window
    only, as in the oracle."""
    hq, hkv, d, bs, sink, window = 4, 2, 16, 4, 2, 6
    params = SelectionParams(method, sink + window + n_sel, bs, 2, sink, window)
    gen = case_generator("degenerate", method)
    pb = make_paged_batch(gen, [params.budget, 30, 51], hkv, d, bs, dtype=torch.float32,
                          device=DEVICE)
    q = random_values(gen, 3, hq, d, device=DEVICE)
    _run_and_check(pb, q, params, None, dtype=torch.float32)


def test_padding_entries_and_workspace_reuse():
    """Padded batch entries (row 0, seq_len 1) change nothing for the real ones; a workspace
    sized for 5 serves batches of 5 and 2 and gives the fresh-workspace results."""
    hq, hkv, d, bs = 6, 2, 32, 4
    params = SelectionParams("two_level", 24, bs, 4, 3, 5)
    gen = case_generator("padding")
    pb = make_paged_batch(gen, [70, 30, 23], hkv, d, bs, device=DEVICE)
    q = random_values(gen, 5, hq, d, dtype=torch.float32, device=DEVICE)
    ws = SparseDecodeWorkspace(5, hq, hkv, d, params, pb.max_blocks, DEVICE, torch.float32)
    cache = _cache(pb)
    real = sparse_decode_batched(q[:3], cache, _rows(pb), params, 0.2).clone()
    rows = torch.cat([pb.req_pool_indices, torch.zeros(2, dtype=torch.int64, device=DEVICE)])
    lens = torch.cat([pb.seq_lens, torch.ones(2, dtype=torch.int32, device=DEVICE)])
    padded = sparse_decode_batched(q, cache, _rows(pb, rows, lens), params, 0.2, workspace=ws)
    assert padded.data_ptr() == ws.out.data_ptr()
    torch.testing.assert_close(padded[:3], real, rtol=0, atol=0)
    assert padded[3:].isfinite().all()
    # padded entries attend exactly the padding slot 0
    torch.testing.assert_close(padded[3:], pb.v_buffer[0].repeat_interleave(hq // hkv, 0)
                               .expand(2, -1, -1))
    again = sparse_decode_batched(q[1:3], cache,
                                  _rows(pb, pb.req_pool_indices[1:], pb.seq_lens[1:]),
                                  params, 0.2, workspace=ws)
    torch.testing.assert_close(again, real[1:], rtol=0, atol=0)
    with pytest.raises(ValueError):
        sparse_decode_batched(q, cache, _rows(pb, rows, lens),
                              SelectionParams("quest", 24, bs, 4, 3, 5), 0.2, workspace=ws)


@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
def test_unfused_assembly_and_radix_bits(method):
    """The separate top-k + assembly launches (fuse_assemble=False), a 6-bit radix, the
    tensor-core block scores, the fused assembly in 16-slot passes and (two_level) the fused
    kernel assembling the winners' slots instead of scattering them give the oracle's sets too,
    and the same slots as the default (fused, scattered, 8-bit, fma, one pass) path."""
    hq, hkv, d, bs = 6, 2, 32, 4
    params = SelectionParams(method, 24, bs, 4, 3, 5)
    gen = case_generator("unfused", method)
    pb = make_paged_batch(gen, [20, 61, 90], hkv, d, bs, dtype=torch.bfloat16, device=DEVICE)
    q = random_values(gen, 3, hq, d, dtype=torch.bfloat16, device=DEVICE)
    args = (q, _cache(pb), _rows(pb), params)
    default = select_slots_batched(*args).clone()
    for kw in (dict(fuse_assemble=False), dict(topk_radix_bits=6), dict(topk_radix_bits=(8, 8)),
               dict(topk_radix_bits=(5, 7)), dict(block_score_precision="tc"), dict(assemble_tile=16),
               dict(scatter_selected=False), dict(scatter_selected=False, assemble_tile=16)):
        if method == "ds" and "block_score_precision" in kw:
            continue  # no block scores
        ws = SparseDecodeWorkspace(3, hq, hkv, d, params, pb.max_blocks, DEVICE, torch.bfloat16,
                                   **kw)
        _run_and_check(pb, q, params, None, workspace=ws)
        assert torch.equal(select_slots_batched(*args, workspace=ws), default)
    with pytest.raises(ValueError, match="assemble_tile"):
        SparseDecodeWorkspace(3, hq, hkv, d, params, pb.max_blocks, DEVICE, assemble_tile=100)


def test_output_goes_where_the_caller_asks():
    """``out=``: the attention writes the caller's tensor (each layer's own, no copy) and the
    values equal those left in the workspace's shared buffer."""
    hq, hkv, d, bs = 6, 2, 32, 4
    params = SelectionParams("two_level", 24, bs, 4, 3, 5)
    gen = case_generator("decode-out")
    pb = make_paged_batch(gen, [20, 61, 90], hkv, d, bs, dtype=torch.bfloat16, device=DEVICE)
    q = random_values(gen, 3, hq, d, dtype=torch.bfloat16, device=DEVICE)
    ws = SparseDecodeWorkspace(3, hq, hkv, d, params, pb.max_blocks, DEVICE, torch.bfloat16)
    args = (q, _cache(pb), _rows(pb), params, d ** -0.5)
    shared = sparse_decode_batched(*args, workspace=ws).clone()
    mine = torch.full_like(shared, float("nan"))
    got = sparse_decode_batched(*args, workspace=ws, out=mine)
    assert got.data_ptr() == mine.data_ptr() and torch.equal(mine, shared)


def test_float32_summaries_select_the_same():
    """Summaries kept in float32 instead of the KV dtype (bf16): identical block scores, so
    identical selections (bf16 min/max are exact)."""
    hq, hkv, d, bs = 4, 2, 32, 4
    params = SelectionParams("two_level", 24, bs, 5, 3, 5)
    gen = case_generator("fp32-summaries")
    pb = make_paged_batch(gen, [50, 97], hkv, d, bs, dtype=torch.bfloat16, device=DEVICE)
    assert pb.kmin.dtype == torch.bfloat16
    q = random_values(gen, 2, hq, d, dtype=torch.bfloat16, device=DEVICE)
    got_bf16 = select_slots_batched(q, _cache(pb), _rows(pb), params).clone()
    got_fp32 = select_slots_batched(q, _cache(pb, kmin=pb.kmin.float(), kmax=pb.kmax.float()),
                                    _rows(pb), params)
    assert torch.equal(got_bf16, got_fp32)


def _fp8_summaries_select_what_the_reference_selects(method, device, lens, hq, hkv, d, bs,
                                                     budget, cand, sink, window):
    """fp8 summaries (--sparse-summary-dtype fp8_e4m3, built by the update kernel) and params
    that say so: the pipeline's sets are the oracle's, which rounds the keys' block min/max
    alike; and the rounding matters on this data (the exact summaries' oracle differs)."""
    gen = case_generator("fp8-summaries", method, device)
    params = SelectionParams(method, budget, bs, cand, sink, window, summary_dtype="fp8_e4m3")
    pb = make_paged_batch(gen, lens, hkv, d, bs, dtype=torch.bfloat16, device=device,
                          summary_dtype=torch.float8_e4m3fn)
    q = random_values(gen, len(lens), hq, d, dtype=torch.bfloat16, device=device)
    channels = _channels(gen, hkv, d, max(1, d // 8), device)
    _run_and_check(pb, q, params, channels)
    exact = dataclasses.replace(params, summary_dtype="auto")
    tail = (pb.req_to_token, pb.req_pool_indices, pb.seq_lens)
    _, _, masks = sparse_decode_batched_ref(q, pb.k_buffer, pb.v_buffer, *tail, params, 1.0,
                                            channels)
    _, _, exact_masks = sparse_decode_batched_ref(q, pb.k_buffer, pb.v_buffer, *tail, exact,
                                                  1.0, channels)
    assert any(not torch.equal(m, e) for m, e in zip(masks, exact_masks)), \
        "fp8 rounding changed no selection: the test data cannot tell"


@pytest.mark.parametrize("method", ["quest", "two_level"])
def test_fp8_summaries_select_what_the_reference_selects(method):
    _fp8_summaries_select_what_the_reference_selects(method, DEVICE, [20, 90, 151, 260], 6, 2,
                                                     32, 4, 32, 4, 4, 4)


@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
def test_fp8_kv_cache_matches_reference(method):
    """--kv-cache-dtype fp8_e4m3 (float32 summaries, label scores from the stored fp8 keys):
    the pipeline selects the oracle's sets and attends like it, keys and values read times the
    layer's scales."""
    hq, hkv, d, bs = 6, 2, 32, 4
    params = SelectionParams(method, 32, bs, 4, 4, 4)
    gen = case_generator("fp8-kv", method)
    pb = make_paged_batch(gen, [20, 90, 151], hkv, d, bs, dtype=torch.float8_e4m3fn,
                          device=DEVICE, summary_dtype=torch.float32)
    assert pb.k_buffer.dtype == torch.float8_e4m3fn and pb.kmin.dtype == torch.float32
    q = random_values(gen, 3, hq, d, dtype=torch.bfloat16, device=DEVICE)
    channels = _channels(gen, hkv, d, max(1, d // 8), DEVICE)
    out, _, _ = _run_and_check(pb, q, params, channels, kv_scales=(0.5, 2.0))
    assert out.dtype == torch.bfloat16


def test_torch_topk_impl():
    hq, hkv, d, bs = 4, 4, 16, 4
    params = SelectionParams("two_level", 24, bs, 4, 3, 5)
    gen = case_generator("torch-topk")
    pb = make_paged_batch(gen, [25, 64, 99], hkv, d, bs, dtype=torch.bfloat16, device=DEVICE)
    q = random_values(gen, 3, hq, d, dtype=torch.bfloat16, device=DEVICE)
    ws = SparseDecodeWorkspace(3, hq, hkv, d, params, pb.max_blocks, DEVICE, torch.bfloat16,
                               topk_impl="torch")
    _run_and_check(pb, q, params, None, workspace=ws)


# ------------------------------------------------------------------------------------ GPU

GPU_LENS = [32768, 32768 - 5, 2048 + 1, 2048]  # long, long, budget + 1, budget


def _gpu_params(method):
    # SparseConfig defaults: sink 16, window 64, budget 2048, bs 16, candidates 2x the need
    return SelectionParams(method, 2048, 16, 2 * -(-(2048 - 80) // 16), 16, 64)


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
@pytest.mark.parametrize("use_channels", [False, True], ids=["allch", "labels"])
def test_gpu_real_shapes(method, use_channels):
    """Qwen3-8B layer (Hq 32, Hkv 8, D 128, bf16), L 32k, budget 2048, bs 16, B 4. Dyadic q/k
    make every score exact in fp32, so sets must agree exactly, ties included."""
    gen = case_generator("gpu-decode", method, use_channels)
    pb = make_paged_batch(gen, GPU_LENS, 8, 128, 16, dtype=torch.bfloat16, device="cuda",
                          summary_chunks=4, dyadic=True)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda", dyadic=True)
    channels = _channels(gen, 8, 128, 16, "cuda") if use_channels else None
    _run_and_check(pb, q, _gpu_params(method), channels)


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["quest", "two_level"])
def test_gpu_tensor_core_block_scores_exact(method):
    """Real shapes, dyadic q/k: the tensor-core block scores ("tc") select exactly the
    oracle's sets (every sum is exact whatever the accumulation order)."""
    gen = case_generator("gpu-tc", method)
    pb = make_paged_batch(gen, GPU_LENS, 8, 128, 16, dtype=torch.bfloat16, device="cuda",
                          summary_chunks=4, dyadic=True)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda", dyadic=True)
    params = _gpu_params(method)
    ws = SparseDecodeWorkspace(4, 32, 8, 128, params, pb.max_blocks, "cuda", torch.bfloat16,
                               block_score_precision="tc")
    _run_and_check(pb, q, params, _channels(gen, 8, 128, 16, "cuda"), workspace=ws)


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
def test_gpu_selection_variants_same_slots(method):
    """Real shapes, continuous values: float32 summaries, the unfused top-k + assembly, a
    6-bit radix and the fused kernel assembling instead of scattering the winners' slots select
    exactly the slots of the default path (bf16 summaries, fused, scattered)."""
    gen = case_generator("gpu-variants", method)
    pb = make_paged_batch(gen, GPU_LENS, 8, 128, 16, dtype=torch.bfloat16, device="cuda",
                          summary_chunks=4)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    params = _gpu_params(method)
    channels = _channels(gen, 8, 128, 16, "cuda")
    # fp32 products summed in one order everywhere ("fma"); the tensor-core block scores (the
    # GPU default for bf16) sum in another order: compared on dyadic data above
    fma = dict(block_score_precision="fma")
    default = select_slots_batched(q, _cache(pb, channels), _rows(pb), params,
                                   workspace=SparseDecodeWorkspace(
                                       4, 32, 8, 128, params, pb.max_blocks, "cuda",
                                       torch.bfloat16, **fma)).clone()
    for summaries, kw in (((pb.kmin.float(), pb.kmax.float()), {}),
                          ((pb.kmin, pb.kmax), dict(fuse_assemble=False)),
                          ((pb.kmin, pb.kmax), dict(topk_radix_bits=6)),
                          ((pb.kmin, pb.kmax), dict(assemble_tile=1024)),
                          ((pb.kmin, pb.kmax), dict(scatter_selected=False))):
        ws = SparseDecodeWorkspace(4, 32, 8, 128, params, pb.max_blocks, "cuda", torch.bfloat16,
                                   **fma, **kw)
        kmin, kmax = summaries
        got = select_slots_batched(q, _cache(pb, channels, kmin, kmax), _rows(pb), params,
                                   workspace=ws)
        assert torch.equal(got, default), kw


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["quest", "two_level"])
def test_gpu_fp8_summaries_real_shapes(method):
    """The same at a Qwen3-8B layer's shapes, budget 2048, block 32."""
    _fp8_summaries_select_what_the_reference_selects(method, "cuda", [4097, 20000, 33000], 32,
                                                     8, 128, 32, 2048, 124, 16, 64)


@gpu
@needs_cuda
def test_gpu_torch_topk_continuous():
    """torch.topk path, continuous random values: sets equal up to rare fp32 near-ties."""
    gen = case_generator("gpu-decode-torch")
    pb = make_paged_batch(gen, GPU_LENS, 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    params = _gpu_params("two_level")
    ws = SparseDecodeWorkspace(4, 32, 8, 128, params, pb.max_blocks, "cuda", torch.bfloat16,
                               topk_impl="torch")
    _run_and_check(pb, q, params, None, workspace=ws, max_diff=32)


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["quest", "two_level"])
def test_gpu_cuda_graph_replay(method):
    """Capture once, replay with new q and grown seq_lens (new tokens written and folded into
    the summaries outside the graph): each replay equals the eager result."""
    gen = case_generator("gpu-graph", method)
    lens = [32768 - 5, 20001, 4093]  # not page aligned: the next token's slot is allocated
    pb = make_paged_batch(gen, lens, 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    params = _gpu_params(method)
    channels = _channels(gen, 8, 128, 16, "cuda")
    rows = torch.cat([pb.req_pool_indices, torch.zeros(1, dtype=torch.int64, device="cuda")])
    seq = torch.cat([pb.seq_lens, torch.ones(1, dtype=torch.int32, device="cuda")])  # + padding
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    ws = SparseDecodeWorkspace(4, 32, 8, 128, params, pb.max_blocks, "cuda", torch.bfloat16)

    def step(q_, rows_, seq_, workspace):
        return sparse_decode_batched(q_, _cache(pb, channels), _rows(pb, rows_, seq_), params,
                                     128 ** -0.5, workspace=workspace)

    static_q, static_rows, static_seq = q.clone(), rows.clone(), seq.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(static_q, static_rows, static_seq, ws)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_q, static_rows, static_seq, ws)

    for it in range(3):
        if it:
            # decode step: write each real request's new token, fold it into the summaries
            new_pos = seq[:3].long()
            loc = pb.req_to_token[rows[:3], new_pos].long()
            new_k = random_values(gen, 3, 8, 128, dtype=torch.bfloat16, device="cuda")
            pb.k_buffer[loc] = new_k
            pb.v_buffer[loc] = random_values(gen, 3, 8, 128, dtype=torch.bfloat16, device="cuda")
            update_block_summaries(pb.kmin, pb.kmax, new_k, loc, 16)
            seq[:3] += 1
            q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
        static_q.copy_(q)
        static_seq.copy_(seq)
        graph.replay()
        torch.cuda.synchronize()
        eager = step(q, rows, seq, None)
        torch.testing.assert_close(static_out, eager, rtol=0, atol=0)


def _gpu_dyadic_case(*tag):
    """A Qwen3-8B layer's batch at GPU_LENS (block 16), dyadic q/k (exact scores), 16 label
    channels: (batch, q, channels)."""
    gen = case_generator(*tag)
    pb = make_paged_batch(gen, GPU_LENS, 8, 128, 16, dtype=torch.bfloat16, device="cuda",
                          summary_chunks=4, dyadic=True)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda", dyadic=True)
    return pb, q, _channels(gen, 8, 128, 16, "cuda")


@pytest.mark.parametrize("method", ["ds", "two_level", "two_level_label_max"])
@pytest.mark.parametrize("rerank,floor", [(2, 0), (3, 0), (2, 40)])
def test_exact_rerank_matches_reference(method, rerank, floor):
    """--sparse-rerank: the shortlist's slot list cut to the budget by the exact q·k selects
    the reference's sets, for contexts within the budget, within the widened budget (ranked
    whole) and past it; with --sparse-rerank-min-tokens the shortlist is at least the floor."""
    label_max = method.endswith("_label_max")
    method = method.removesuffix("_label_max")
    bs, sink, window, budget = 4, 3, 5, 24
    n_sel = budget - sink - window
    # candidates: what two_level caps the shortlist at (without a floor, under rerank x n_sel)
    candidates = 2 * (floor or n_sel) // bs
    params = SelectionParams(method, budget, bs, candidates, sink,
                             window, rerank=rerank, rerank_min_tokens=floor,
                             block_score="label_max" if label_max else "bound")
    shortlist = max(rerank * n_sel, floor)
    wide = budget + min(shortlist, params.candidate_blocks * bs
                        if method == "two_level" else shortlist) - n_sel
    assert shortlist_selection(params).budget == wide
    lens = [budget, budget + 7, wide, wide + 1, 97]
    _check_small_fp32(params, lens, "decode-rerank", method, label_max, rerank, floor)


def _check_small_fp32(params, lens, *tag):
    """6 query / 2 kv heads of 32 dims, fp32, 5 label channels: the kernels' sets and outputs
    against the oracle's."""
    gen = case_generator(*tag)
    pb = make_paged_batch(gen, lens, 2, 32, params.block_size, dtype=torch.float32,
                          device=DEVICE, summary_chunks=3)
    q = random_values(gen, len(lens), 6, 32, dtype=torch.float32, device=DEVICE)
    channels = _channels(gen, 2, 32, 5, DEVICE)
    _run_and_check(pb, q, params, channels, dtype=torch.float32)


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["ds", "two_level"])
def test_gpu_exact_rerank_real_shapes(method):
    """Qwen3-8B layer, L 32k, budget 2048, 4x rerank, dyadic q/k (exact scores): the reference's
    sets."""
    pb, q, channels = _gpu_dyadic_case("gpu-decode-rerank", method)
    params = dataclasses.replace(_gpu_params(method), rerank=4)
    if method == "two_level":
        params = dataclasses.replace(params, candidate_blocks=4 * params.candidate_blocks)
    _run_and_check(pb, q, params, channels)


@pytest.mark.parametrize("prefilter", [2, 3])
@pytest.mark.parametrize("rerank", [0, 2])
def test_cascade_matches_reference(prefilter, rerank):
    """--sparse-block-prefilter: the bound keeps prefilter x candidates pages, the label
    maximum ranks only those; the kernels select the oracle's sets, for contexts whose blocks
    all survive the bound and for longer ones."""
    bs, sink, window, budget = 4, 3, 5, 24
    n_sel = budget - sink - window
    params = SelectionParams("two_level", budget, bs, 2 * n_sel // bs, sink, window,
                             block_score="label_max", prefilter=prefilter, rerank=rerank)
    _check_small_fp32(params, [budget + 7, 61, 97, 150], "decode-cascade", prefilter, rerank)


@gpu
@needs_cuda
@pytest.mark.parametrize("rerank", [0, 4])
def test_gpu_cascade_real_shapes(rerank):
    """Qwen3-8B layer, L 32k, budget 2048, cascade x2 (and 4x rerank), dyadic q/k (exact
    scores): the reference's sets."""
    pb, q, channels = _gpu_dyadic_case("gpu-decode-cascade", rerank)
    params = dataclasses.replace(_gpu_params("two_level"), block_score="label_max",
                                 prefilter=2, rerank=rerank)
    _run_and_check(pb, q, params, channels)
