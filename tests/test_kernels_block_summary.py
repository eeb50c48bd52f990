"""Per-page key min/max maintenance (kernels/block_summary.py) against its torch reference and
against the selection reference's ``block_minmax`` of the keys in position order.

On a machine without CUDA the Triton kernels run in Triton's CPU interpreter, which must be
switched on before any kernel module is imported.
"""

import pytest
import torch

from sglang_ext.kernels.block_summary import (
    allocate_block_summaries,
    update_block_summaries,
    update_block_summaries_ref,
)
from sglang_ext.kernels.testing import (
    TRAP_PAGE,
    case_generator,
    make_paged_batch,
    random_values,
)
from sglang_ext.selection.reference import block_minmax, round_summaries

FP8 = torch.float8_e4m3fn

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check_against_block_minmax(pb):
    """Every page of every request equals the reference summary of its block (fp8 summaries:
    rounded outward, as the reference rounds them)."""
    bs = pb.page_size
    for b, length in enumerate(pb.lens):
        row = int(pb.req_pool_indices[b])
        ref_min, ref_max = round_summaries(*block_minmax(pb.keys(b), bs),
                                           "fp8_e4m3" if pb.kmin.dtype == FP8 else "auto")
        pages = pb.req_to_token[row, : length : bs].long() // bs
        assert torch.equal(pb.kmin[pages].float(), ref_min), f"request {b}: kmin"
        assert torch.equal(pb.kmax[pages].float(), ref_max), f"request {b}: kmax"


@pytest.mark.parametrize("num_kv_heads,head_dim", [(4, 16), (2, 32), (1, 32)])
@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_writes_match_block_minmax(num_kv_heads, head_dim, page_size, dtype):
    """Prefill in several chunks (boundaries inside pages), several requests per call, garbage
    in the pages beforehand: each page ends up as block_minmax of its block (summaries in the
    KV dtype, as the backend keeps them)."""
    gen = case_generator("chunks", num_kv_heads, head_dim, page_size, dtype)
    lens = [1, page_size, page_size + 1, 3 * page_size - 1, 37]
    pb = make_paged_batch(
        gen, lens, num_kv_heads, head_dim, page_size, dtype=dtype, device=DEVICE, summary_chunks=4
    )
    assert pb.kmin.dtype == pb.kmax.dtype == dtype
    _check_against_block_minmax(pb)


def _sglang_like_calls(gen, page_size, num_pages, num_reqs=4, num_calls=9):
    """Calls as SGLang's scheduler makes them: each call writes, for a random subset of the
    requests (in a random order), either an extend chunk (a random number of tokens, possibly
    starting and ending inside a page) or one decode token; the ``loc`` of a call is the
    concatenation of the requests' slots. Requests own disjoint scattered pages."""
    pages = torch.randperm(num_pages, generator=gen)[: num_reqs * 6].view(num_reqs, 6)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)).view(num_reqs, -1)
    written = [0] * num_reqs
    calls = []
    for c in range(num_calls):
        order = torch.randperm(num_reqs, generator=gen)[: int(torch.randint(1, num_reqs + 1, (1,),
                                                                              generator=gen))]
        locs = []
        for r in order.tolist():
            room = slots.shape[1] - written[r]
            if room == 0:
                continue
            decode = c >= 3 and bool(torch.rand(1, generator=gen) < 0.6)
            count = 1 if decode else int(torch.randint(1, 2 * page_size + 2, (1,), generator=gen))
            count = min(count, room)
            locs.append(slots[r, written[r] : written[r] + count])
            written[r] += count
        if locs:
            calls.append(torch.cat(locs))
    return calls


@pytest.mark.parametrize("page_size", [1, 4, 8])
@pytest.mark.parametrize("summary_dtype", [torch.bfloat16, torch.float32, FP8])
def test_matches_reference_call_by_call(page_size, summary_dtype):
    """Prefill chunks (chunk boundaries inside pages), decode steps and several requests per
    call, written into a pool with stale summaries: after every call the kernel's summaries
    equal the torch reference's, untouched pages included (bit for bit)."""
    gen = case_generator("calls", page_size, summary_dtype)
    hkv, d, num_pages = 2, 16, 40
    kmin = random_values(gen, num_pages, hkv, d, device=DEVICE)
    kmin, kmax = kmin.to(summary_dtype), (kmin + 1).to(summary_dtype)
    calls = _calls_match_reference(gen, kmin, kmax, page_size, DEVICE)
    assert any(loc.numel() > page_size for loc in calls)  # multi-page chunks were written


def _same_bits(a, b) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _calls_match_reference(gen, kmin, kmax, page_size, device, **calls_kw):
    """Replays SGLang-like calls (``_sglang_like_calls`` over the summaries' pages) on
    ``kmin``/``kmax`` and on copies through the torch reference: bit for bit equal after every
    call. Returns the calls."""
    kmin_ref, kmax_ref = kmin.clone(), kmax.clone()
    hkv, d = kmin.shape[1:]
    calls = _sglang_like_calls(gen, page_size, kmin.shape[0], **calls_kw)
    for loc in calls:
        keys = random_values(gen, loc.numel(), hkv, d, dtype=torch.bfloat16, device=device)
        loc = loc.to(device)
        update_block_summaries(kmin, kmax, keys, loc, page_size)
        update_block_summaries_ref(kmin_ref, kmax_ref, keys, loc, page_size)
        if kmin.is_cuda:
            torch.cuda.synchronize()
        assert _same_bits(kmin, kmin_ref) and _same_bits(kmax, kmax_ref)
    return calls


@pytest.mark.parametrize("scale", [1e-3, 1.0, 40.0, 1000.0])
def test_fp8_summaries_bound_every_key(scale):
    """fp8 summaries (--sparse-summary-dtype fp8_e4m3) over chunked writes: each page's min is
    the largest fp8 value <= its keys' min and its max the smallest >= their max (subnormals
    at 1e-3; keys beyond ±448 saturate there at 1000), bit for bit what the reference gives."""
    gen = case_generator("fp8-bound", scale)
    lens = [1, 4, 5, 11, 37]
    pb = make_paged_batch(gen, lens, 2, 16, 4, dtype=torch.bfloat16, device=DEVICE,
                          summary_chunks=4, summary_dtype=FP8, value_scale=scale)
    assert pb.kmin.dtype == FP8
    _check_against_block_minmax(pb)
    for b, length in enumerate(lens):
        pages = pb.req_to_token[int(pb.req_pool_indices[b]), :length:4].long() // 4
        lo, hi = block_minmax(pb.keys(b), 4)
        assert (pb.kmin[pages].float() <= lo.clamp(-448, 448)).all()
        assert (pb.kmax[pages].float() >= hi.clamp(-448, 448)).all()
    empty_lo, empty_hi = allocate_block_summaries(8, 2, 16, 4, DEVICE, dtype=FP8)
    assert (empty_lo.float() == 448).all() and (empty_hi.float() == -448).all()


def test_cuda_graph_padding_writes_slot_zero():
    """SGLang's CUDA-graph padding writes slot 0 once per padded entry (one run on the padding
    page); the real requests' pages are unaffected, and with at most a page of padding entries
    page 0 equals the reference too."""
    gen = case_generator("padding-slot0")
    bs, hkv, d = 4, 2, 16
    for num_pad in (3, 11):
        kmin, kmax = allocate_block_summaries(8 * bs, hkv, d, bs, device=DEVICE)
        kmin_ref, kmax_ref = kmin.clone(), kmax.clone()
        loc = torch.tensor([5 * bs + 1, 2 * bs, 6 * bs + 3] + [0] * num_pad, device=DEVICE)
        keys = random_values(gen, loc.numel(), hkv, d, dtype=torch.bfloat16, device=DEVICE)
        update_block_summaries(kmin, kmax, keys, loc, bs)
        update_block_summaries_ref(kmin_ref, kmax_ref, keys, loc, bs)
        real = slice(1, None) if num_pad > bs else slice(None)
        assert torch.equal(kmin[real], kmin_ref[real]) and torch.equal(kmax[real], kmax_ref[real])


@pytest.mark.parametrize("summary_dtype", [torch.bfloat16, torch.float32])
def test_decode_batch_strided_keys_and_page_reuse(summary_dtype):
    """One decode token per request in one call, keys as a strided view (like a slice of a
    fused qkv output, here float32: rounded to bf16 summaries); a freed page handed to a new
    request starts clean."""
    gen = case_generator("decode")
    bs, hkv, d = 4, 2, 16
    kmin, kmax = allocate_block_summaries(10 * bs, hkv, d, bs, device=DEVICE, dtype=summary_dtype)
    assert kmin.dtype == kmax.dtype == summary_dtype
    kmin_ref, kmax_ref = kmin.clone(), kmax.clone()
    # request A fills page 3 with large keys, then the page is freed and reused by request B
    big = torch.full((bs, hkv, d), 9.0, device=DEVICE)
    loc_a = torch.arange(3 * bs, 4 * bs, device=DEVICE)
    for mins, maxs, fn in ((kmin, kmax, update_block_summaries),
                           (kmin_ref, kmax_ref, update_block_summaries_ref)):
        fn(mins, maxs, big, loc_a, bs)
    fused = random_values(gen, 3, 3 * hkv * d, device=DEVICE)  # [N, (q|k|v) heads]
    k_new = fused[:, hkv * d : 2 * hkv * d].view(3, hkv, d)  # strided rows
    loc = torch.tensor([3 * bs, 5 * bs + 2, 7 * bs + 1], device=DEVICE)  # B's first token
    update_block_summaries(kmin, kmax, k_new, loc, bs)
    update_block_summaries_ref(kmin_ref, kmax_ref, k_new, loc, bs)
    assert torch.equal(kmin, kmin_ref) and torch.equal(kmax, kmax_ref)
    k_new = k_new.to(summary_dtype)
    assert torch.equal(kmin[3], k_new[0]) and torch.equal(kmax[3], k_new[0])
    # pages 5 and 7 were never started: they fold into the empty (+inf/-inf) summaries
    assert torch.equal(kmax[5], k_new[1]) and torch.equal(kmin[7], k_new[2])
    # an empty call is a no-op
    update_block_summaries(kmin, kmax, k_new[:0], loc[:0], bs)
    assert torch.equal(kmin, kmin_ref)


def test_allocate_and_dtype_checks():
    kmin, kmax = allocate_block_summaries(10, 2, 8, 4, device=DEVICE)
    assert kmin.dtype == kmax.dtype == torch.bfloat16 and kmin.shape == (3, 2, 8)
    assert (kmin == float("inf")).all() and (kmax == float("-inf")).all()
    with pytest.raises(TypeError):
        allocate_block_summaries(10, 2, 8, 4, device=DEVICE, dtype=torch.int32)
    keys = torch.zeros(1, 2, 8, device=DEVICE)
    with pytest.raises(TypeError):
        update_block_summaries(kmin, kmax.float(), keys, torch.zeros(1, device=DEVICE), 4)


@gpu
@needs_cuda
def test_gpu_real_shapes():
    """Qwen3-8B layer shapes (Hkv=8, D=128, bf16, bs=16), 4 requests of ~32k tokens prefilled
    in 4 chunks: pages equal block_minmax; one more decode call equals the reference."""
    gen = case_generator("gpu-summary")
    lens = [32768, 32768 - 5, 20001, 16]
    pb = make_paged_batch(
        gen, lens, 8, 128, 16, dtype=torch.bfloat16, device="cuda", summary_chunks=4
    )
    assert pb.kmin.dtype == torch.bfloat16
    _check_against_block_minmax(pb)
    kmin_ref, kmax_ref = pb.kmin.clone(), pb.kmax.clone()
    loc = torch.tensor([TRAP_PAGE * 16 + 3, 2 * 16], device="cuda")
    keys = random_values(gen, 2, 8, 128, dtype=torch.bfloat16, device="cuda")
    update_block_summaries(pb.kmin, pb.kmax, keys, loc, 16)
    update_block_summaries_ref(kmin_ref, kmax_ref, keys, loc, 16)
    torch.cuda.synchronize()
    assert torch.equal(pb.kmin, kmin_ref) and torch.equal(pb.kmax, kmax_ref)


@gpu
@needs_cuda
def test_gpu_fp8_summaries_real_shapes():
    """fp8 summaries compiled on the GPU (Qwen3-8B shapes, page 32, chunked prefills of ~32k):
    every page equals the reference's outward rounding of its block, and SGLang-like calls
    equal the torch reference bit for bit after every call."""
    gen = case_generator("gpu-fp8-summary")
    pb = make_paged_batch(gen, [32768, 20001, 33], 8, 128, 32, dtype=torch.bfloat16,
                          device="cuda", summary_chunks=4, summary_dtype=FP8)
    _check_against_block_minmax(pb)
    kmin = random_values(gen, 64, 8, 128, device="cuda").to(FP8)
    kmax = (kmin.float() + 1).to(FP8)
    _calls_match_reference(gen, kmin, kmax, 32, "cuda", num_reqs=8, num_calls=12)


@gpu
@needs_cuda
def test_gpu_sglang_like_calls_real_shapes():
    """The atomic-free run update under real GPU concurrency: SGLang-like calls (extend chunks
    across pages, decode tokens, several requests per call) at Hkv=8, D=128, page 16 equal the
    reference after every call."""
    gen = case_generator("gpu-calls")
    kmin = random_values(gen, 64, 8, 128, dtype=torch.bfloat16, device="cuda")
    _calls_match_reference(gen, kmin, kmin + 1, 16, "cuda", num_reqs=8, num_calls=20)
