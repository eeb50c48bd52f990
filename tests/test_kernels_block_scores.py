"""Batched Quest block scores (kernels/block_scores.py) against the per-request reference."""


import torch


import math

import pytest

from sglang_ext.kernels.block_scores import (
    quest_block_scores_batched,
    quest_block_scores_batched_ref,
)
from sglang_ext.kernels.testing import (
    case_generator,
    make_paged_batch,
    random_values,
)
from sglang_ext.selection.reference import block_minmax, quest_block_scores, round_summaries

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (Hq, Hkv): MHA, GQA, MQA
HEADS = [(4, 4), (6, 2), (4, 1)]


def _check(pb, q, sink, window, rtol=1e-5, atol=1e-4, precision=None, summary_dtype="auto"):
    bs = pb.page_size
    shape = (q.shape[0], pb.k_buffer.shape[1], pb.max_blocks)
    out = torch.full(shape, float("nan"), device=q.device)
    got = quest_block_scores_batched(
        q, pb.kmin, pb.kmax, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, bs, sink,
        window, pb.max_blocks, out=out, precision=precision,
    )
    assert got.data_ptr() == out.data_ptr()
    assert not got.isnan().any(), "unwritten entries"
    ref = quest_block_scores_batched_ref(
        q, pb.kmin, pb.kmax, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, bs, sink,
        window, pb.max_blocks,
    )
    finite = ref.isfinite()
    assert torch.equal(got.isfinite(), finite)
    assert (got[~finite] == float("-inf")).all()
    torch.testing.assert_close(got[finite], ref[finite], rtol=rtol, atol=atol)
    # and against the selection reference on the keys themselves (summaries built from writes)
    for b, length in enumerate(pb.lens):
        lo, hi = sink, length - window
        if hi <= lo:
            assert not finite[b].any()
            continue
        first, last = lo // bs, (hi - 1) // bs
        keys = pb.keys(b)[first * bs : (last + 1) * bs]
        expect = quest_block_scores(q[b], *round_summaries(*block_minmax(keys, bs),
                                                           summary_dtype))
        torch.testing.assert_close(got[b, :, first : last + 1], expect, rtol=rtol, atol=atol)
        assert finite[b, :, first : last + 1].all() and finite[b].sum() == expect.numel()


@pytest.mark.parametrize("hq,hkv", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("bs,head_dim,precision", [(4, 16, "ieee"), (8, 32, "fma")])
def test_matches_reference(hq, hkv, bs, head_dim, precision):
    sink, window = 3, 5
    # ragged: no middle, middle of one position, around block boundaries, long
    all_lens = [1, sink + window, sink + window + 1, 2 * bs, 2 * bs + 1, 4 * bs - 1, 97, 60]
    for i in range(0, len(all_lens), 4):
        lens = all_lens[i : i + 4]
        gen = case_generator("block_scores", hq, hkv, bs, head_dim, i)
        pb = make_paged_batch(gen, lens, hkv, head_dim, bs, dtype=torch.bfloat16, device=DEVICE)
        q = random_values(gen, len(lens), hq, head_dim, dtype=torch.bfloat16, device=DEVICE)
        _check(pb, q, sink, window, precision=precision)


def test_no_sink_and_fp32():
    gen = case_generator("block_scores_nosink")
    lens = [33, 17, 50]
    pb = make_paged_batch(gen, lens, 3, 32, 4, dtype=torch.float32, device=DEVICE)
    q = random_values(gen, 3, 9, 32, device=DEVICE)
    for precision in (None, "ieee", "tf32x3", "fma"):
        _check(pb, q, sink=0, window=1, precision=precision)


@pytest.mark.parametrize("precision", ["fma", "ieee"])
def test_bf16_summaries_equal_float32(precision):
    """bf16 keys: summaries kept in bf16 (the default, 2 bytes per value) give bit-identical
    scores to the same summaries in float32; a dtype mismatch is refused."""
    gen = case_generator("block_scores_bf16", precision)
    lens = [45, 77]
    pb = make_paged_batch(gen, lens, 2, 32, 4, dtype=torch.bfloat16, device=DEVICE)
    assert pb.kmin.dtype == pb.kmax.dtype == torch.bfloat16
    q = random_values(gen, 2, 6, 32, dtype=torch.bfloat16, device=DEVICE)
    common = (pb.req_to_token, pb.req_pool_indices, pb.seq_lens, 4, 3, 5, pb.max_blocks)
    got = quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, precision=precision)
    wide = quest_block_scores_batched(q, pb.kmin.float(), pb.kmax.float(), *common,
                                      precision=precision)
    assert torch.equal(got, wide)
    _check(pb, q, 3, 5, precision=precision)
    with pytest.raises(TypeError):
        quest_block_scores_batched(q, pb.kmin, pb.kmax.float(), *common)


def test_tensor_core_path():
    """precision "tc" (bf16 q and summaries straight into tl.dot): close to the reference on
    continuous values, bit-identical to the fp32 "fma" path on dyadic values (every sum is
    exact), and refused unless q and the summaries share a 16-bit dtype."""
    gen = case_generator("block_scores_tc")
    lens = [45, 77, 9]
    pb = make_paged_batch(gen, lens, 2, 32, 4, dtype=torch.bfloat16, device=DEVICE)
    q = random_values(gen, 3, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    _check(pb, q, 3, 5, precision="tc")
    dy = make_paged_batch(gen, lens, 2, 32, 4, dtype=torch.bfloat16, device=DEVICE, dyadic=True)
    qd = random_values(gen, 3, 8, 32, dtype=torch.bfloat16, device=DEVICE, dyadic=True)
    common = (dy.req_to_token, dy.req_pool_indices, dy.seq_lens, 4, 3, 5, dy.max_blocks)
    tc = quest_block_scores_batched(qd, dy.kmin, dy.kmax, *common, precision="tc")
    fma = quest_block_scores_batched(qd, dy.kmin, dy.kmax, *common, precision="fma")
    assert torch.equal(tc, fma)
    for block_nb in (16, 32):  # other tile sizes give the same scores
        assert torch.equal(quest_block_scores_batched(qd, dy.kmin, dy.kmax, *common,
                                                      precision="tc", block_nb=block_nb), tc)
    with pytest.raises(TypeError):
        quest_block_scores_batched(qd.float(), dy.kmin, dy.kmax, *common, precision="tc")


@pytest.mark.parametrize("precision", ["fma", "ieee", "tc", "tc_fp16"])
def test_fp8_summaries(precision):
    """fp8 summaries (min rounded down, max up) are read as stored: the scores of the reference
    on those values, and of the selection reference rounding the keys' block min/max alike;
    on dyadic values the tensor-core path equals "fma" bit for bit."""
    gen = case_generator("block_scores_fp8", precision)
    lens = [45, 77, 9]
    pb = make_paged_batch(gen, lens, 2, 32, 4, dtype=torch.bfloat16, device=DEVICE,
                          summary_dtype=torch.float8_e4m3fn, value_scale=3.0)
    q = random_values(gen, 3, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    _check(pb, q, 3, 5, precision=precision, summary_dtype="fp8_e4m3")
    dy = make_paged_batch(gen, lens, 2, 32, 4, dtype=torch.bfloat16, device=DEVICE, dyadic=True,
                          summary_dtype=torch.float8_e4m3fn)
    qd = random_values(gen, 3, 8, 32, dtype=torch.bfloat16, device=DEVICE, dyadic=True)
    common = (dy.req_to_token, dy.req_pool_indices, dy.seq_lens, 4, 3, 5, dy.max_blocks)
    fma = quest_block_scores_batched(qd, dy.kmin, dy.kmax, *common, precision="fma")
    assert torch.equal(quest_block_scores_batched(qd, dy.kmin, dy.kmax, *common, precision="tc"),
                       fma)
    assert torch.equal(quest_block_scores_batched(qd, dy.kmin, dy.kmax, *common,
                                                  precision="tc_fp16"), fma)


def test_fp16_operands_clamp_q_and_refuse_bf16_summaries():
    """"tc_fp16" rounds q to fp16: a q value past fp16's range scores as if clamped to
    ±65504 (finite, not inf or nan); bf16 summaries (not exact in fp16) are refused."""
    gen = case_generator("block_scores_fp16_operands")
    lens = [45, 77]
    pb = make_paged_batch(gen, lens, 2, 32, 4, dtype=torch.bfloat16, device=DEVICE,
                          summary_dtype=torch.float8_e4m3fn)
    q = random_values(gen, 2, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    q[0, 1, 3], q[1, 5, 0] = 1e6, -3e5
    common = (pb.req_to_token, pb.req_pool_indices, pb.seq_lens, 4, 3, 5, pb.max_blocks)
    got = quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, precision="tc_fp16")
    clamped = q.float().clamp(-65504, 65504).to(torch.float16).float()
    want = quest_block_scores_batched_ref(clamped, pb.kmin, pb.kmax, *common)
    assert torch.equal(got.isfinite(), want.isfinite()) and not got.isnan().any()
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-2)
    bf16 = make_paged_batch(gen, lens, 2, 32, 4, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="tc_fp16"):
        quest_block_scores_batched(q, bf16.kmin, bf16.kmax, *common, precision="tc_fp16")


@gpu
@needs_cuda
def test_gpu_fp8_summaries_real_shapes():
    """fp8 summaries on the tensor cores (the GPU default), Qwen3-8B shapes at block 32."""
    gen = case_generator("gpu-block-scores-fp8")
    pb = make_paged_batch(gen, [32768, 4099, 1], 8, 128, 32, dtype=torch.bfloat16,
                          device="cuda", max_context=32768 + 64, summary_chunks=2,
                          summary_dtype=torch.float8_e4m3fn)
    q = random_values(gen, 3, 32, 128, dtype=torch.bfloat16, device="cuda")
    _check(pb, q, sink=16, window=64, rtol=1e-5, atol=1e-3 * math.sqrt(128),
           summary_dtype="fp8_e4m3")
    # the bf16-operand tensor-core path: the same scores up to fp32 summation order
    _check(pb, q, sink=16, window=64, rtol=1e-5, atol=1e-3 * math.sqrt(128),
           summary_dtype="fp8_e4m3", precision="tc")


@gpu
@needs_cuda
@pytest.mark.parametrize("precision", ["fma", "ieee", "tf32x3", "tc"])
def test_gpu_real_shapes(precision):
    gen = case_generator("gpu-block-scores", precision)
    lens = [32768, 32768 - 7, 4099, 1]
    pb = make_paged_batch(gen, lens, 8, 128, 16, dtype=torch.bfloat16, device="cuda",
                          max_context=32768 + 64, summary_chunks=2)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    # fp32 sums of 128 products of magnitude ~O(1..10): tolerate fp32 reassociation
    _check(pb, q, sink=16, window=64, rtol=1e-5, atol=1e-3 * math.sqrt(128), precision=precision)


def _layouts_agree(pb, q, common, precision):
    want = quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, precision=precision)
    hkv = pb.kmin.shape[1]
    for heads in [h for h in (1, 2, 4, 8) if hkv % h == 0]:
        for fastest in (False, True):
            got = quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, precision=precision,
                                             heads_per_program=heads, heads_fastest=fastest)
            assert torch.equal(got, want), (heads, fastest)
    # a loop over consecutive tiles, the last one partly past max_blocks (one tile width: the
    # tile's GEMM shape may change the summation order)
    one_tile = quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, precision=precision,
                                          block_nb=16, tiles_per_program=1)
    for tiles in (2, 3):
        got = quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, precision=precision,
                                         block_nb=16, tiles_per_program=tiles)
        assert torch.equal(got, one_tile), tiles
    # computing the whole static grid (no early stop at each request's last block) on the GPU
    for tiles in (1, 2, 3):
        got = quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, precision=precision,
                                         block_nb=16, tiles_per_program=tiles,
                                         skip_dead_tiles=False)
        assert torch.equal(got, one_tile), ("whole grid", tiles)
    return want


@pytest.mark.parametrize("precision", ["fma", "tc", "tc_fp16"])
def test_launch_layouts_give_the_same_scores(precision):
    """Several kv heads per program, the heads as the grid's fastest dimension, or several tiles
    per program change where each (request, kv head, tile) runs, not what it computes: the
    scores are bit-identical."""
    gen = case_generator("block_scores_layouts", precision)
    fp8 = precision == "tc_fp16"  # fp16 operands take fp8 (or fp16) summaries
    pb = make_paged_batch(gen, [45, 77, 9], 4, 32, 4, dtype=torch.bfloat16, device=DEVICE,
                          **({"summary_dtype": torch.float8_e4m3fn} if fp8 else {}))
    q = random_values(gen, 3, 8, 32, dtype=torch.bfloat16, device=DEVICE)
    common = (pb.req_to_token, pb.req_pool_indices, pb.seq_lens, 4, 3, 5, pb.max_blocks)
    _layouts_agree(pb, q, common, precision)
    _check(pb, q, 3, 5, precision=precision, summary_dtype="fp8_e4m3" if fp8 else "auto")
    with pytest.raises(ValueError, match="must divide"):
        quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, heads_per_program=3)
    with pytest.raises(ValueError, match="tiles_per_program"):
        quest_block_scores_batched(q, pb.kmin, pb.kmax, *common, tiles_per_program=0)


def test_default_tiles_per_program_keeps_the_gpu_busy():
    """Long rows of a large batch walk up to MAX_TILES_PER_PROGRAM tiles per program; a grid
    that would then leave fewer than MIN_PROGRAMS_PER_SM programs per SM walks fewer."""
    from sglang_ext.kernels import block_scores as bsc

    sms = 4  # what the helper assumes without a GPU
    floor = bsc.MIN_PROGRAMS_PER_SM * sms
    assert bsc.default_tiles_per_program(19, 8, 1024, "cpu") == bsc.MAX_TILES_PER_PROGRAM
    assert bsc.default_tiles_per_program(1, 1, 1, "cpu") == 1
    for batch, heads, tiles in ((1, 2, 16), (2, 8, 3), (3, 4, 40), (1, 1, 7)):
        got = bsc.default_tiles_per_program(batch, heads, tiles, "cpu")
        assert got & (got - 1) == 0 and 1 <= got <= bsc.MAX_TILES_PER_PROGRAM
        programs = batch * heads * -(-tiles // got)
        assert got == 1 or programs >= floor, (batch, heads, tiles, got)
        if got < bsc.MAX_TILES_PER_PROGRAM:  # one more doubling would starve the SMs
            assert batch * heads * -(-tiles // (2 * got)) < floor, (batch, heads, tiles, got)


@gpu
@needs_cuda
def test_gpu_launch_layouts_give_the_same_scores():
    gen = case_generator("gpu-block-scores-layouts")
    lens = [32768, 20000, 4099, 1]
    # the static grid with a server's context headroom (1.25x): most tiles of the shorter
    # requests are dead, and the tile loops stop early
    pb = make_paged_batch(gen, lens, 8, 128, 32, dtype=torch.bfloat16, device="cuda",
                          max_context=40960, summary_chunks=2)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    common = (pb.req_to_token, pb.req_pool_indices, pb.seq_lens, 32, 16, 64, pb.max_blocks)
    assert _layouts_agree(pb, q, common, "tc").isfinite().any()
    _check(pb, q, 16, 64, rtol=1e-5, atol=1e-3 * math.sqrt(128), precision="tc")
