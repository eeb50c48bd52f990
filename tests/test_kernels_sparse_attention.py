"""Split-KV sparse decode attention over selected slots (kernels/sparse_attention.py) against
the reference ``sparse_attention_with_lse``."""

import pytest
import torch

from sglang_ext.kernels.sparse_attention import (
    sparse_attention_batched,
    sparse_attention_batched_ref,
)
from sglang_ext.kernels.testing import (
    case_generator,
    make_paged_batch,
    random_values,
)
from sglang_ext.selection.reference import merge_attention_states

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HEADS = [(4, 4), (6, 2), (4, 1)]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _random_selection(gen, pb, num_sel):
    """Distinct slots of each request (any position), -1 padding scattered anywhere; one
    (request, kv head) with nothing selected."""
    batch, hkv = len(pb.lens), pb.k_buffer.shape[1]
    sel = torch.full((batch, hkv, num_sel), -1, dtype=torch.int64)
    for b, length in enumerate(pb.lens):
        row = int(pb.req_pool_indices[b])
        slots = pb.req_to_token[row, :length].cpu().long()
        for g in range(hkv):
            n = min(length, num_sel)
            pick = slots[torch.randperm(length, generator=gen)[:n]]
            where = torch.randperm(num_sel, generator=gen)[:n]
            sel[b, g, where] = pick
    sel[0, -1] = -1
    return sel


def _check(pb, q, sel, sm_scale, num_splits, dtype, **variant):
    batch, hq = q.shape[:2]
    dv = pb.v_buffer.shape[2]
    out = torch.full((batch, hq, dv), float("nan"), dtype=q.dtype, device=q.device)
    lse = torch.full((batch, hq), float("nan"), device=q.device)
    got_o, got_l = sparse_attention_batched(
        q, pb.k_buffer, pb.v_buffer, sel, sm_scale, num_splits=num_splits, out=out, lse=lse,
        **variant)
    assert got_o.data_ptr() == out.data_ptr() and got_l.data_ptr() == lse.data_ptr()
    ref_o, ref_l = sparse_attention_batched_ref(q, pb.k_buffer, pb.v_buffer, sel, sm_scale)
    assert not got_o.isnan().any() and not got_l.isnan().any()
    assert got_o.dtype == q.dtype and got_l.dtype == torch.float32
    torch.testing.assert_close(got_o.float(), ref_o.float(), **TOL[dtype])
    assert torch.equal(got_l.isinf(), ref_l.isinf())
    fin = ref_l.isfinite()
    torch.testing.assert_close(got_l[fin], ref_l[fin], rtol=1e-4, atol=1e-4)
    return got_o, got_l


@pytest.mark.parametrize("hq,hkv", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_matches_reference(hq, hkv, dtype, num_splits):
    gen = case_generator("attn", hq, hkv, dtype, num_splits)
    head_dim, head_dim_v, bs = 32, 16, 4
    pb = make_paged_batch(gen, [5, 40, 77], hkv, head_dim, bs, dtype=dtype, device=DEVICE,
                          head_dim_v=head_dim_v, summary_chunks=0)
    q = random_values(gen, 3, hq, head_dim, dtype=dtype, device=DEVICE)
    sel = _random_selection(gen, pb, 48).to(DEVICE)
    _check(pb, q, sel, head_dim ** -0.5, num_splits, dtype)


def _check_fp8_kv(pb, q, sel, kv_dtype, scales, num_splits=None):
    """The attention over 8-bit copies of ``pb``'s KV, read times ``scales`` (k, v), against the
    reference over the same stored values; and the error a q rounded to fp8 would add."""
    k_scale, v_scale = scales
    sm_scale = q.shape[-1] ** -0.5
    k8, v8 = pb.k_buffer.to(kv_dtype), pb.v_buffer.to(kv_dtype)
    got_o, got_l = sparse_attention_batched(q, k8, v8, sel, sm_scale, num_splits=num_splits,
                                            k_scale=k_scale, v_scale=v_scale)
    ref_o, ref_l = sparse_attention_batched_ref(q, k8, v8, sel, sm_scale, k_scale, v_scale)
    assert got_o.dtype == q.dtype
    torch.testing.assert_close(got_o.float(), ref_o.float(), rtol=2e-2, atol=2e-2 * v_scale)
    fin = ref_l.isfinite()
    assert torch.equal(fin, got_l.isfinite())
    torch.testing.assert_close(got_l[fin], ref_l[fin], rtol=1e-3, atol=1e-3)
    # the same stored values with q rounded to fp8 (what the kernel did before, to give tl.dot
    # equal operand types): the error the upcast avoids
    q8_o, _ = sparse_attention_batched_ref(q.to(kv_dtype).to(q.dtype), k8, v8, sel, sm_scale,
                                           k_scale, v_scale)
    got_err = (got_o.float() - ref_o.float()).abs().max()
    assert got_err * 4 < (q8_o.float() - ref_o.float()).abs().max()


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 3.0)], ids=["unscaled", "scaled"])
def test_fp8_kv_cache_reads_keys_and_values_times_their_scales(kv_dtype, scales):
    """--kv-cache-dtype fp8: 8-bit K/V tiles are upcast to q's bf16 in registers and read as
    stored x k_scale / v_scale (SGLang's per-layer scales). The reference sees the same stored
    values, so what is left is bf16 rounding."""
    gen = case_generator("attn-fp8", kv_dtype, scales)
    hq, hkv, d, bs = 6, 2, 64, 4
    pb = make_paged_batch(gen, [5, 40, 77], hkv, d, bs, dtype=torch.bfloat16, device=DEVICE,
                          summary_chunks=0)
    q = random_values(gen, 3, hq, d, dtype=torch.bfloat16, device=DEVICE) * 2
    sel = _random_selection(gen, pb, 48).to(DEVICE)
    _check_fp8_kv(pb, q, sel, kv_dtype, scales, num_splits=2)


@pytest.mark.parametrize("early_v", [False, True], ids=["v_after", "v_early"])
@pytest.mark.parametrize("skip_pad_tiles", [False, True], ids=["masked", "branch"])
def test_launch_variants_match_reference(early_v, skip_pad_tiles):
    """V gathered beside K, and padding tiles run masked instead of skipped: the same
    attention, padding-only tiles included (a row left-packed to half the workspace)."""
    gen = case_generator("attn-variants", early_v, skip_pad_tiles)
    hq, hkv, d, bs = 6, 2, 32, 4
    pb = make_paged_batch(gen, [70, 90], hkv, d, bs, dtype=torch.bfloat16, device=DEVICE,
                          summary_chunks=0)
    q = random_values(gen, 2, hq, d, dtype=torch.bfloat16, device=DEVICE)
    sel = _random_selection(gen, pb, 64)
    packed = torch.full_like(sel[1, 0], -1)
    live = sel[1, 0][sel[1, 0] >= 0][:16]
    packed[:live.numel()] = live  # one head's row: 16 slots, then 48 of padding (3 tiles of 16)
    sel[1, 0] = packed
    _check(pb, q, sel.to(DEVICE), d ** -0.5, 2, torch.bfloat16, early_v=early_v,
           skip_pad_tiles=skip_pad_tiles)


@pytest.mark.parametrize("block_n,num_splits", [(16, 3), (32, 2)])
def test_tile_size_and_split_count_do_not_change_the_result(block_n, num_splits):
    """Tiles of 16 or 32 slots (the default is 64) over splits whose chunk is then a multiple
    of the smaller tile: the same attention."""
    gen = case_generator("attn-tiles", block_n, num_splits)
    hq, hkv, d, bs = 4, 2, 32, 4
    pb = make_paged_batch(gen, [50, 100], hkv, d, bs, dtype=torch.bfloat16, device=DEVICE,
                          summary_chunks=0)
    q = random_values(gen, 2, hq, d, dtype=torch.bfloat16, device=DEVICE)
    sel = _random_selection(gen, pb, 80).to(DEVICE)
    _check(pb, q, sel, d ** -0.5, num_splits, torch.bfloat16, block_n=block_n)


def test_split_layout_follows_the_tile_size():
    from sglang_ext.kernels.sparse_attention import split_layout

    assert split_layout(2048, 4) == (512, 4)
    assert split_layout(2048, 48, block_n=32) == (64, 32)  # 48 asked: chunks of 2 tiles of 32
    assert split_layout(2048, 48) == (64, 32)  # 64-slot tiles: at most 32 splits


def test_few_rows_aim_for_more_programs_and_splits_only_fall_with_the_batch():
    from sglang_ext.kernels.sparse_attention import (
        FEW_ROWS_PROGRAMS_PER_SM,
        PROGRAMS_PER_SM,
        default_num_splits,
        default_programs_per_sm,
    )

    assert FEW_ROWS_PROGRAMS_PER_SM > PROGRAMS_PER_SM
    # 17 requests x 8 kv heads on an H200
    assert default_programs_per_sm(136, 132) == FEW_ROWS_PROGRAMS_PER_SM
    assert default_programs_per_sm(240, 132) == PROGRAMS_PER_SM  # 30 requests
    # the workspace sizes its partial buffers for batch 1: no batch may need more splits
    splits = [default_num_splits(b, 2, 2048, "cpu") for b in range(1, 40)]
    assert all(a >= b for a, b in zip(splits, splits[1:]))


def test_split_count_aims_at_programs_per_sm():
    from sglang_ext.kernels.sparse_attention import default_num_splits

    # 4 "SMs" off CUDA: 2 x 4 programs over 1 x 2 rows -> 4 splits; 8 per SM -> 16, capped by
    # the 2048 / 64 = 32 tiles of the row
    assert default_num_splits(1, 2, 2048, "cpu", programs_per_sm=2) == 4
    assert default_num_splits(1, 2, 2048, "cpu", programs_per_sm=8) == 16
    assert default_num_splits(1, 1, 128, "cpu", programs_per_sm=64) == 2


def test_int32_slots_and_lse_merge():
    """int32 slot lists; the LSE composes: attention over A ∪ B == merge(attn(A), attn(B))."""
    gen = case_generator("attn-merge")
    hq, hkv, d = 6, 2, 16
    pb = make_paged_batch(gen, [60, 33], hkv, d, 8, device=DEVICE, summary_chunks=0)
    q = random_values(gen, 2, hq, d, device=DEVICE)
    sel = _random_selection(gen, pb, 32)
    sel[0, -1] = sel[0, 0]  # make every head non-empty for the merge
    both, _ = _check(pb, q, sel.int().to(DEVICE), 0.3, 2, torch.float32)
    a, b = sel.clone(), sel.clone()
    a[..., 16:], b[..., :16] = -1, -1
    oa, la = sparse_attention_batched(q, pb.k_buffer, pb.v_buffer, a.to(DEVICE), 0.3)
    ob, lb = sparse_attention_batched(q, pb.k_buffer, pb.v_buffer, b.to(DEVICE), 0.3)
    merged, _ = merge_attention_states(oa.reshape(-1, d), la.reshape(-1), ob.reshape(-1, d),
                                       lb.reshape(-1))
    torch.testing.assert_close(merged.view_as(both), both, rtol=1e-4, atol=1e-5)


@gpu
@needs_cuda
@pytest.mark.parametrize("num_splits", [None, 1, 32])
def test_gpu_real_shapes(num_splits):
    gen = case_generator("gpu-attn", num_splits)
    pb = make_paged_batch(gen, [32768, 32768 - 3, 2000, 1], 8, 128, 16, dtype=torch.bfloat16,
                          device="cuda", summary_chunks=0)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    sel = _random_selection(gen, pb, 2048).cuda()
    _check(pb, q, sel, 128 ** -0.5, num_splits, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("early_v", [False, True], ids=["v_after", "v_early"])
@pytest.mark.parametrize("skip_pad_tiles", [False, True], ids=["masked", "branch"])
def test_gpu_launch_variants(early_v, skip_pad_tiles):
    gen = case_generator("gpu-attn-variants", early_v, skip_pad_tiles)
    pb = make_paged_batch(gen, [32768, 2000, 1], 8, 128, 16, dtype=torch.bfloat16,
                          device="cuda", summary_chunks=0)
    q = random_values(gen, 3, 32, 128, dtype=torch.bfloat16, device="cuda")
    sel = _random_selection(gen, pb, 2048).cuda()
    _check(pb, q, sel, 128 ** -0.5, None, torch.bfloat16, early_v=early_v,
           skip_pad_tiles=skip_pad_tiles)


@gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_gpu_fp8_kv_real_shapes(kv_dtype):
    """Qwen3-8B's heads over an fp8 cache on the GPU (tensor-core dots of the upcast tiles)."""
    gen = case_generator("gpu-attn-fp8", kv_dtype)
    pb = make_paged_batch(gen, [32768, 2000, 1], 8, 128, 16, dtype=torch.bfloat16,
                          device="cuda", summary_chunks=0)
    q = random_values(gen, 3, 32, 128, dtype=torch.bfloat16, device="cuda") * 2
    sel = _random_selection(gen, pb, 2048).cuda()
    _check_fp8_kv(pb, q, sel, kv_dtype, (0.5, 3.0))
