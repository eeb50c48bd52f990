"""The batched Triton kernels on SGLang's MLA pool layout against the MLA torch reference
(sglang_ext/selection/mla.py).

MLA pool: one latent "kv head" per token, rows of R + P dims (latent, then RoPE), all Hq query
heads in its group, and V the strided view ``k_buffer[..., :R]`` of the same storage
(``make_paged_batch(latent_values=R)``). On the CPU the kernels run in Triton's interpreter
(tests/conftest.py) at small shapes (R 32 + P 16, Hq 4-8); the ``gpu`` tests use DeepSeek-V2-
Lite's layer (Hq 16, 512 + 64, bf16) at 32k tokens.
"""

from __future__ import annotations

import pytest
import torch

from sglang_ext.kernels.block_scores import (
    quest_block_scores_batched,
    quest_block_scores_batched_ref,
)
from sglang_ext.kernels.block_summary import update_block_summaries_ref
from sglang_ext.kernels.sparse_attention import (
    sparse_attention_batched,
    sparse_attention_batched_ref,
)
from sglang_ext.kernels.sparse_decode import (
    DecodeRows,
    LayerCache,
    SparseDecodeWorkspace,
    select_slots_batched,
    sparse_decode_batched,
)
from sglang_ext.kernels.testing import PagedBatch, case_generator, make_paged_batch, random_values
from sglang_ext.kernels.token_scores import (
    label_token_scores_batched,
    label_token_scores_batched_ref,
)
from sglang_ext.selection import SelectionParams
from sglang_ext.selection.mla import (
    mla_dense_decode,
    mla_select_token_mask,
    mla_sparse_decode_with_lse,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}

R, P = 32, 16  # small latent + RoPE widths for the interpreter
SCALING = 0.125


def _mla_batch(gen, lens, rank, rope, bs, dtype, device=DEVICE, **kw) -> PagedBatch:
    pb = make_paged_batch(gen, lens, 1, rank + rope, bs, dtype=dtype, device=device,
                          latent_values=rank, **kw)
    assert pb.v_buffer.data_ptr() == pb.k_buffer.data_ptr()  # V is the latent view, no copy
    return pb


def _cache(pb: PagedBatch, channels=None) -> LayerCache:
    return LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax, channels=channels)


def _rows(pb: PagedBatch) -> DecodeRows:
    return DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens)


def _check_decode(pb: PagedBatch, q, params, rank, channels=None, workspace=None,
                  dtype=torch.bfloat16):
    """Pipeline vs the MLA reference per request: the same position set, slots that are
    req_to_token of those positions, the same latent outputs / LSE."""
    batch, hq, _ = q.shape
    if workspace is None:
        workspace = SparseDecodeWorkspace(batch, hq, 1, rank, params, pb.max_blocks, q.device,
                                          q.dtype)
    cache, rows = _cache(pb, channels), _rows(pb)
    slots, pos = select_slots_batched(q, cache, rows, params, workspace, return_positions=True)
    slots, pos = slots.clone(), pos.clone()
    out, lse = sparse_decode_batched(q, cache, rows, params, SCALING, workspace, return_lse=True)
    assert out.shape == (batch, hq, rank)
    for b, length in enumerate(pb.lens):
        keys = pb.keys(b)
        mask = mla_select_token_mask(q[b], keys, params, rank, channels)
        got = pos[b, 0][pos[b, 0] >= 0].long().sort().values
        assert torch.equal(got, mask[0].nonzero().flatten()), f"request {b} (L={length})"
        row = int(pb.req_pool_indices[b])
        valid = pos[b, 0] >= 0
        assert torch.equal(slots[b, 0][valid], pb.req_to_token[row, pos[b, 0][valid].long()])
        assert (slots[b, 0][~valid] == -1).all()
        ref_out, ref_lse = mla_sparse_decode_with_lse(q[b], keys, params, SCALING, rank, channels)
        torch.testing.assert_close(out[b].float(), ref_out.float(), **TOL[dtype])
        torch.testing.assert_close(lse[b], ref_lse, rtol=1e-4, atol=1e-3)
    return out


def test_block_summaries_over_latent_rows():
    """update_block_summaries (run by make_paged_batch over 3 write chunks) on [N, 1, R + P]
    rows equals the torch reference's summaries."""
    gen = case_generator("mla-summaries")
    pb = _mla_batch(gen, [37, 90], R, P, 8, torch.bfloat16)
    kmin, kmax = pb.kmin.clone().fill_(0), pb.kmax.clone().fill_(0)
    for b in range(2):
        row = int(pb.req_pool_indices[b])
        loc = pb.req_to_token[row, : pb.lens[b]].long()
        update_block_summaries_ref(kmin, kmax, pb.k_buffer[loc], loc, 8)
    pages = torch.cat([pb.req_to_token[int(r), : n : 8].long() // 8
                       for r, n in zip(pb.req_pool_indices, pb.lens)])
    assert torch.equal(pb.kmin[pages], kmin[pages]) and torch.equal(pb.kmax[pages], kmax[pages])


@pytest.mark.parametrize("precision", ["ieee", "fma", "tc"])
def test_block_scores_all_heads_one_latent_head(precision):
    """The Quest bound for Hq heads sharing the latent head, as GEMMs over R + P dims."""
    hq, bs = 8, 8
    gen = case_generator("mla-block-scores", precision)
    dtype = torch.bfloat16 if precision == "tc" else torch.float32
    pb = _mla_batch(gen, [45, 130], R, P, bs, dtype, dyadic=True)
    q = random_values(gen, 2, hq, R + P, dtype=dtype, device=DEVICE, dyadic=True)
    args = (q, pb.kmin, pb.kmax, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, bs, 4, 8,
            pb.max_blocks)
    got = quest_block_scores_batched(*args, precision=precision)
    torch.testing.assert_close(got, quest_block_scores_batched_ref(*args), rtol=0, atol=0)


@pytest.mark.parametrize("use_channels", [False, True], ids=["exact", "labels"])
def test_token_scores_over_latent_rows(use_channels):
    hq, bs = 6, 4
    gen = case_generator("mla-token-scores", use_channels)
    pb = _mla_batch(gen, [50, 77], R, P, bs, torch.float32)
    q = random_values(gen, 2, hq, R + P, device=DEVICE)
    cand = torch.tensor([[[2, 9, -1, 5]], [[0, 18, 7, 3]]], dtype=torch.int32, device=DEVICE)
    channels = (torch.tensor([[1, 30, 32, 47, 8]], device=DEVICE) if use_channels else None)
    args = (q, pb.k_buffer, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, cand, bs, 3, 5)
    scores, positions = label_token_scores_batched(*args, channels=channels)
    ref_scores, ref_positions = label_token_scores_batched_ref(*args, channels=channels)
    torch.testing.assert_close(scores, ref_scores, **TOL[torch.float32])
    assert torch.equal(positions, ref_positions)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_values_from_the_latent_view(dtype):
    """sparse_attention over selected latent rows, V = k_buffer[..., :R] (no copy)."""
    hq = 8
    gen = case_generator("mla-attention", dtype)
    pb = _mla_batch(gen, [60, 90], R, P, 4, dtype, summary_chunks=0)
    q = random_values(gen, 2, hq, R + P, dtype=dtype, device=DEVICE)
    slots = torch.stack([pb.req_to_token[int(r), torch.randperm(n, generator=gen)[:40]]
                         for r, n in zip(pb.req_pool_indices, pb.lens)])[:, None].to(DEVICE)
    slots[0, 0, 5:9] = -1  # padding anywhere
    out, lse = sparse_attention_batched(q, pb.k_buffer, pb.v_buffer, slots, SCALING)
    ref_out, ref_lse = sparse_attention_batched_ref(q, pb.k_buffer, pb.v_buffer, slots, SCALING)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    torch.testing.assert_close(lse, ref_lse, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
def test_pipeline_matches_mla_reference(method):
    """Selection + attention for Hq = 8 heads on one latent head, ragged lengths below / at /
    past the budget, against mla_select_token_mask + the MLA attention."""
    hq, bs, sink, window, budget = 8, 8, 4, 8, 48
    params = SelectionParams(method, budget, bs, 5, sink, window)
    gen = case_generator("mla-pipeline", method)
    pb = _mla_batch(gen, [budget, budget + 1, 200, 301], R, P, bs, torch.bfloat16)
    q = random_values(gen, 4, hq, R + P, dtype=torch.bfloat16, device=DEVICE)
    _check_decode(pb, q, params, R)


def test_pipeline_with_label_channels_fp32():
    hq, bs = 4, 4
    params = SelectionParams("two_level", 40, bs, 6, 3, 5)
    gen = case_generator("mla-labels")
    pb = _mla_batch(gen, [90, 150], R, P, bs, torch.float32)
    q = random_values(gen, 2, hq, R + P, device=DEVICE)
    channels = torch.randperm(R + P, generator=gen)[:10][None].to(DEVICE)
    _check_decode(pb, q, params, R, channels=channels, dtype=torch.float32)


def test_budget_covering_context_is_dense_mla():
    """budget >= context: the kernels' output is dense MLA attention (softmax(q·K^T)·K[:, :R])."""
    hq, bs = 8, 8
    params = SelectionParams("two_level", 256, bs, 8, 16, 64)
    gen = case_generator("mla-dense")
    pb = _mla_batch(gen, [1, 77, 256], R, P, bs, torch.float32)
    q = random_values(gen, 3, hq, R + P, device=DEVICE)
    out = sparse_decode_batched(q, _cache(pb), _rows(pb), params, SCALING)
    for b in range(3):
        torch.testing.assert_close(out[b], mla_dense_decode(q[b], pb.keys(b), SCALING, R),
                                   **TOL[torch.float32])


# DeepSeek-V2-Lite's MLA layer: 16 heads, kv_lora_rank 512, qk_rope_head_dim 64; 32k context.
GPU_LENS = [32768, 20000, 4097, 1000]


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["quest", "ds", "two_level"])
@pytest.mark.parametrize("use_channels", [False, True], ids=["exact", "labels"])
def test_gpu_deepseek_v2_lite_shapes(method, use_channels):
    """Hq 16, 512 + 64, bf16, L up to 32k, budget 2048, bs 16, B 4. Dyadic q/k make every score
    exact in fp32 (|sum| of 576 products of 1/32-multiples stays below 2^24 ulps), so the sets
    must agree exactly, ties included."""
    gen = case_generator("gpu-mla", method, use_channels)
    pb = _mla_batch(gen, GPU_LENS, 512, 64, 16, torch.bfloat16, device="cuda",
                    summary_chunks=4, dyadic=True)
    q = random_values(gen, 4, 16, 576, dtype=torch.bfloat16, device="cuda", dyadic=True)
    params = SelectionParams(method, 2048, 16, 2 * -(-(2048 - 80) // 16), 16, 64)
    channels = torch.randperm(576, generator=gen)[:32][None].cuda() if use_channels else None
    _check_decode(pb, q, params, 512, channels=channels)


@gpu
@needs_cuda
def test_gpu_deepseek_v3_heads():
    """128 heads on the latent head (DeepSeek-V3 at TP 1): the kernels keep their per-program
    tiles bounded (head tiles, split head dim) and still equal the reference."""
    gen = case_generator("gpu-mla-128")
    pb = _mla_batch(gen, [8192, 3000], 512, 64, 16, torch.bfloat16, device="cuda",
                    summary_chunks=2, dyadic=True)
    q = random_values(gen, 2, 128, 576, dtype=torch.bfloat16, device="cuda", dyadic=True)
    params = SelectionParams("two_level", 1024, 16, 2 * -(-(1024 - 80) // 16), 16, 64)
    _check_decode(pb, q, params, 512)


@pytest.fixture
def small_tiles(monkeypatch):
    """Shrink the tile limits so the interpreter's small shapes take the wide-head paths
    real MLA shapes take on the GPU: 48-dim heads walked in 3 chunks of 16 (like 576 in 9 of
    64), 32-wide values as "wide" (32-slot value tiles), 16-head tiles for a 32-head group."""
    import sglang_ext.kernels.sparse_attention as sa

    monkeypatch.setattr(sa, "_MAX_WHOLE_HEAD_DIM", 16)
    monkeypatch.setattr(sa, "_D_CHUNK", 16)
    monkeypatch.setattr(sa, "_ACC_ELEMENTS", 16 * R)
    monkeypatch.setattr(sa, "_WIDE_DV", R)
    assert sa.head_dim_tiling(R + P) == (16, 3)


@pytest.mark.parametrize("method", ["quest", "two_level"])
def test_wide_head_paths_match_reference(small_tiles, method):
    """Chunked q·k (attention and block scores) and several head tiles per kv head give the
    reference's sets and outputs."""
    hq, bs = 32, 8
    params = SelectionParams(method, 48, bs, 5, 4, 8)
    gen = case_generator("mla-wide", method)
    pb = _mla_batch(gen, [40, 150, 233], R, P, bs, torch.bfloat16, dyadic=True)
    q = random_values(gen, 3, hq, R + P, dtype=torch.bfloat16, device=DEVICE, dyadic=True)
    ws = SparseDecodeWorkspace(3, hq, 1, R, params, pb.max_blocks, q.device, q.dtype,
                               block_score_precision="tc")
    _check_decode(pb, q, params, R, workspace=ws)
    args = (q, pb.kmin, pb.kmax, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, bs, 4, 8,
            pb.max_blocks)
    for precision in ("ieee", "tc"):
        got = quest_block_scores_batched(*args, precision=precision)
        torch.testing.assert_close(got, quest_block_scores_batched_ref(*args), rtol=0, atol=0)
    with pytest.raises(ValueError, match="fma"):
        quest_block_scores_batched(*args, precision="fma")


@gpu
@needs_cuda
def test_gpu_dense_budget_equals_sglang_triton_mla_decode():
    """budget >= context at DeepSeek-V2-Lite shapes: our kernels' latent output equals SGLang's
    own MLA decode kernel (decode_attention_fwd with has_mla, the triton backend's) on the same
    pool rows."""
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    lens = [4096, 1500, 77]
    gen = case_generator("gpu-mla-sglang")
    pb = _mla_batch(gen, lens, 512, 64, 16, torch.bfloat16, device="cuda", summary_chunks=2)
    q = random_values(gen, 3, 16, 576, dtype=torch.bfloat16, device="cuda")
    params = SelectionParams("two_level", 4096, 16, 256, 16, 64)
    ours = sparse_decode_batched(q, _cache(pb), _rows(pb), params, SCALING)
    rows = [pb.req_to_token[int(r), :n] for r, n in zip(pb.req_pool_indices, lens)]
    kv_indices = torch.cat(rows).long()
    kv_indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                             device="cuda")
    splits = 8
    o = torch.empty(3, 16, 512, dtype=torch.bfloat16, device="cuda")
    decode_attention_fwd(
        q, pb.k_buffer, pb.v_buffer, o, kv_indptr, kv_indices,
        torch.empty(3, 16, splits, 512, dtype=torch.float32, device="cuda"),
        torch.empty(3, 16, splits, dtype=torch.float32, device="cuda"),
        torch.full((3,), splits, dtype=torch.int32, device="cuda"), splits, SCALING, 1.0, 1.0,
        has_mla=True)
    torch.testing.assert_close(ours.float(), o.float(), **TOL[torch.bfloat16])
