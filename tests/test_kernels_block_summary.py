"""Per-page key min/max maintenance (kernels/block_summary.py) against its torch reference and
against the selection reference's ``block_minmax`` of the keys in position order.

On a machine without CUDA the Triton kernels run in Triton's CPU interpreter, which must be
switched on before any kernel module is imported.
"""

import os

import torch

# Without CUDA the Triton kernels run in Triton's CPU interpreter, which must be switched on
# before triton is first imported in the process (see fresh_process_fallback below for when
# another module imported it first).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from sglang_ext.kernels.block_summary import (  # noqa: E402
    allocate_block_summaries,
    update_block_summaries,
    update_block_summaries_ref,
)
from sglang_ext.kernels.testing import (  # noqa: E402
    fresh_process_fallback,
    TRAP_PAGE,
    case_generator,
    make_paged_batch,
    random_values,
)
from sglang_ext.selection.reference import block_minmax  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_interpreter_guard, _runner = fresh_process_fallback(__file__)
if _runner is not None:
    test_module_in_fresh_interpreter_process = _runner
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _check_against_block_minmax(pb):
    """Every page of every request equals the reference summary of its block."""
    bs = pb.page_size
    for b, length in enumerate(pb.lens):
        row = int(pb.req_pool_indices[b])
        ref_min, ref_max = block_minmax(pb.keys(b), bs)
        pages = pb.req_to_token[row, : length : bs].long() // bs
        assert torch.equal(pb.kmin[pages], ref_min), f"request {b}: kmin"
        assert torch.equal(pb.kmax[pages], ref_max), f"request {b}: kmax"


@pytest.mark.parametrize("num_kv_heads,head_dim", [(4, 16), (2, 32), (1, 32)])
@pytest.mark.parametrize("page_size", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_writes_match_block_minmax(num_kv_heads, head_dim, page_size, dtype):
    """Prefill in several chunks (boundaries inside pages), several requests per call, garbage
    in the pages beforehand: each page ends up as block_minmax of its block."""
    gen = case_generator("chunks", num_kv_heads, head_dim, page_size, dtype)
    lens = [1, page_size, page_size + 1, 3 * page_size - 1, 37]
    pb = make_paged_batch(
        gen, lens, num_kv_heads, head_dim, page_size, dtype=dtype, device=DEVICE, summary_chunks=4
    )
    _check_against_block_minmax(pb)


@pytest.mark.parametrize("page_size", [4, 8])
def test_matches_reference_call_by_call(page_size):
    """Random writes (prefill chunks + decode tokens) into a pool: after every call the kernel's
    summaries equal the torch reference's, untouched pages included (bit for bit)."""
    gen = case_generator("calls", page_size)
    hkv, d, num_pages = 2, 16, 24
    kmin = random_values(gen, num_pages, hkv, d, device=DEVICE)
    kmax = kmin + 1
    kmin_ref, kmax_ref = kmin.clone(), kmax.clone()
    # three requests on scattered pages, written in prefill chunks then decode steps
    pages = torch.randperm(num_pages, generator=gen)[:15].view(3, 5)
    slots = (pages[:, :, None] * page_size + torch.arange(page_size)).view(3, -1)
    written = [0, 0, 0]
    steps = [(0, 7), (1, 3), (2, 2 * page_size), (0, 1), (1, 1), (2, 1), (0, page_size + 2)]
    for req, count in steps + [(r, 1) for r in range(3)] * 3:
        loc = slots[req, written[req] : written[req] + count]
        written[req] += count
        keys = random_values(gen, loc.numel(), hkv, d, dtype=torch.bfloat16, device=DEVICE)
        loc = loc.to(DEVICE)
        update_block_summaries(kmin, kmax, keys, loc, page_size)
        update_block_summaries_ref(kmin_ref, kmax_ref, keys, loc, page_size)
        assert torch.equal(kmin, kmin_ref) and torch.equal(kmax, kmax_ref)


def test_decode_batch_strided_keys_and_page_reuse():
    """One decode token per request in one call, keys as a strided view (like a slice of a
    fused qkv output); a freed page handed to a new request starts clean."""
    gen = case_generator("decode")
    bs, hkv, d = 4, 2, 16
    kmin, kmax = allocate_block_summaries(10 * bs, hkv, d, bs, device=DEVICE)
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
    assert torch.equal(kmin[3], k_new[0].float()) and torch.equal(kmax[3], k_new[0].float())
    # pages 5 and 7 were never started: they fold into the empty (+inf/-inf) summaries
    assert torch.equal(kmax[5], k_new[1].float()) and torch.equal(kmin[7], k_new[2].float())
    # an empty call is a no-op
    update_block_summaries(kmin, kmax, k_new[:0], loc[:0], bs)
    assert torch.equal(kmin, kmin_ref)


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
    _check_against_block_minmax(pb)
    kmin_ref, kmax_ref = pb.kmin.clone(), pb.kmax.clone()
    loc = torch.tensor([TRAP_PAGE * 16 + 3, 2 * 16], device="cuda")
    keys = random_values(gen, 2, 8, 128, dtype=torch.bfloat16, device="cuda")
    update_block_summaries(pb.kmin, pb.kmax, keys, loc, 16)
    update_block_summaries_ref(kmin_ref, kmax_ref, keys, loc, 16)
    torch.cuda.synchronize()
    assert torch.equal(pb.kmin, kmin_ref) and torch.equal(pb.kmax, kmax_ref)
