"""Label-channel token scores of candidate blocks (kernels/token_scores.py) against the
per-request reference ``label_token_scores``."""

import pytest
import torch

from sglang_ext.kernels.testing import (
    case_generator,
    make_paged_batch,
    random_values,
)
from sglang_ext.kernels.label_cache import allocate_label_cache, update_label_cache
from sglang_ext.kernels.token_scores import (
    label_max_block_scores_batched,
    label_max_block_scores_batched_ref,
    label_token_scores_batched,
    label_token_scores_batched_ref,
)
from sglang_ext.selection.reference import label_max_block_scores, label_token_scores

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
HEADS = [(4, 4), (6, 2), (4, 1)]


def _random_cand(gen, pb, num_cand):
    """Distinct random block ids per (request, kv head) including some past the end, with -1s."""
    batch, hkv = len(pb.lens), pb.k_buffer.shape[1]
    cand = torch.empty(batch, hkv, num_cand, dtype=torch.int32)
    for b in range(batch):
        for g in range(hkv):
            cand[b, g] = torch.randperm(pb.max_blocks, generator=gen)[:num_cand].int()
    cand[torch.rand(cand.shape, generator=gen) < 0.2] = -1
    return cand.to(pb.k_buffer.device)


def _check(pb, q, cand, channels, sink, window, rtol=1e-5, atol=1e-4):
    bs = pb.page_size
    batch, hkv = q.shape[0], pb.k_buffer.shape[1]
    num_tok = (cand.shape[2] if cand is not None else pb.max_blocks) * bs
    scores = torch.full((batch, hkv, num_tok), float("nan"), device=q.device)
    positions = torch.full((batch, hkv, num_tok), -7, dtype=torch.int32, device=q.device)
    args = (q, pb.k_buffer, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, cand, bs, sink,
            window, channels)
    got_s, got_p = label_token_scores_batched(
        *args, num_blocks=pb.max_blocks, scores_out=scores, positions_out=positions
    )
    assert got_s.data_ptr() == scores.data_ptr() and got_p.data_ptr() == positions.data_ptr()
    assert not got_s.isnan().any() and not (got_p == -7).any(), "unwritten entries"
    ref_s, ref_p = label_token_scores_batched_ref(*args, num_blocks=pb.max_blocks)
    assert torch.equal(got_p, ref_p)
    finite = ref_s.isfinite()
    assert torch.equal(got_s.isfinite(), finite) and (got_s[~finite] == float("-inf")).all()
    torch.testing.assert_close(got_s[finite], ref_s[finite], rtol=rtol, atol=atol)
    # the scores are the selection reference's, read at the positions
    for b in range(batch):
        full = label_token_scores(q[b], pb.keys(b), channels)  # [Hkv, L]
        for g in range(hkv):
            pos = got_p[b, g]
            ok = pos >= 0
            torch.testing.assert_close(
                got_s[b, g][ok], full[g, pos[ok].long()], rtol=rtol, atol=atol
            )


def _bf16_batch(name, hq, hkv, use_channels, lens, bs=4, head_dim=32):
    """(generator, paged bf16 batch, queries, 6 label channels per kv head or None)."""
    gen = case_generator(name, hq, hkv, use_channels)
    pb = make_paged_batch(gen, lens, hkv, head_dim, bs, dtype=torch.bfloat16, device=DEVICE,
                          summary_chunks=0)
    q = random_values(gen, len(lens), hq, head_dim, dtype=torch.bfloat16, device=DEVICE)
    channels = None
    if use_channels:
        channels = torch.stack([torch.randperm(head_dim, generator=gen)[:6] for _ in range(hkv)])
        channels = channels.to(DEVICE)
    return gen, pb, q, channels


@pytest.mark.parametrize("hq,hkv", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("use_channels", [True, False], ids=["labels", "allch"])
def test_candidates_match_reference(hq, hkv, use_channels):
    gen, pb, q, channels = _bf16_batch("token_scores", hq, hkv, use_channels, [9, 9, 70])
    cand = _random_cand(gen, pb, 7)
    _check(pb, q, cand, channels, sink=3, window=5)


@pytest.mark.parametrize("use_channels", [True, False], ids=["labels", "allch"])
def test_all_blocks(use_channels):
    """cand=None: every block is a candidate (the DS whole-middle scoring)."""
    bs, head_dim, hkv, hq = 8, 16, 3, 9
    gen = case_generator("token_scores_all", use_channels)
    lens = [1, 23, 41]
    pb = make_paged_batch(gen, lens, hkv, head_dim, bs, dtype=torch.float32, device=DEVICE,
                          summary_chunks=0)
    q = random_values(gen, len(lens), hq, head_dim, device=DEVICE)
    channels = None
    if use_channels:
        channels = torch.stack([torch.randperm(head_dim, generator=gen)[:5] for _ in range(hkv)])
        channels = channels.to(DEVICE)
    _check(pb, q, None, channels, sink=0, window=1)


@gpu
@needs_cuda
@pytest.mark.parametrize("use_channels", [True, False], ids=["labels", "allch"])
def test_gpu_real_shapes(use_channels):
    gen = case_generator("gpu-token-scores", use_channels)
    lens = [32768, 32768 - 9, 3000, 1]
    pb = make_paged_batch(gen, lens, 8, 128, 16, dtype=torch.bfloat16, device="cuda",
                          summary_chunks=0)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    channels = None
    if use_channels:
        channels = torch.stack([torch.randperm(128, generator=gen)[:16] for _ in range(8)]).cuda()
    cand = _random_cand(gen, pb, 246)
    _check(pb, q, cand, channels, sink=16, window=64, atol=1e-3)


def _check_label_max(pb, q, channels, sink, window, labels=None, rtol=1e-5, atol=1e-4,
                     **launch):
    """label_max_block_scores_batched against its torch reference and, request by request,
    the selection reference's label_max_block_scores over the middle."""
    bs = pb.page_size
    args = (q, pb.k_buffer, pb.req_to_token, pb.req_pool_indices, pb.seq_lens, bs, sink, window,
            pb.max_blocks)
    out = torch.full((q.shape[0], pb.k_buffer.shape[1], pb.max_blocks), float("nan"),
                     device=q.device)
    if labels is None:
        got = label_max_block_scores_batched(*args, channels=channels, out=out, **launch)
    else:
        got = label_max_block_scores_batched(q, labels, *args[2:], channels=channels, out=out,
                                             keys_are_labels=True, **launch)
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any(), "unwritten entries"
    ref = label_max_block_scores_batched_ref(*args, channels=channels)
    finite = ref.isfinite()
    assert torch.equal(got.isfinite(), finite) and (got[~finite] == float("-inf")).all()
    torch.testing.assert_close(got[finite], ref[finite], rtol=rtol, atol=atol)
    for b in range(q.shape[0]):
        length = int(pb.seq_lens[b])
        hi = length - window
        if hi <= sink:
            continue
        blocks = label_max_block_scores(
            label_token_scores(q[b], pb.keys(b)[sink:hi], channels), sink, bs)
        first = sink // bs
        torch.testing.assert_close(got[b, :, first:first + blocks.shape[1]], blocks, rtol=rtol,
                                   atol=atol)


@pytest.mark.parametrize("hq,hkv", HEADS, ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("use_channels", [True, False], ids=["labels", "allch"])
def test_label_max_block_scores(hq, hkv, use_channels):
    """Each block's largest middle label score, read from the pool's keys by page."""
    _, pb, q, channels = _bf16_batch("label_max", hq, hkv, use_channels, [9, 9, 70, 5])
    _check_label_max(pb, q, channels, sink=3, window=5)


@pytest.mark.parametrize("tokens_per_program", [1024, 16], ids=["one_tile", "two_blocks"])
@pytest.mark.parametrize("label_dtype", [None, torch.float8_e4m3fn], ids=["kv", "fp8"])
def test_label_max_block_scores_from_label_cache(label_dtype, tokens_per_program):
    """The same scores from the label cache (the channels stored contiguously), as the server
    reads them; fp8 labels as stored (the reference scores the rounded keys)."""
    bs, head_dim, hq, hkv, r = 8, 32, 6, 2, 5
    gen = case_generator("label_max_cache", str(label_dtype))
    lens = [40, 77, 100]
    pb = make_paged_batch(gen, lens, hkv, head_dim, bs, dtype=torch.bfloat16, device=DEVICE,
                          summary_chunks=0)
    q = random_values(gen, len(lens), hq, head_dim, dtype=torch.bfloat16, device=DEVICE)
    channels = torch.stack([torch.randperm(head_dim, generator=gen)[:r] for _ in range(hkv)])
    channels = channels.to(DEVICE)
    labels = allocate_label_cache(pb.k_buffer.shape[0], hkv, r, DEVICE,
                                  label_dtype or pb.k_buffer.dtype)
    slots = torch.arange(pb.k_buffer.shape[0], device=DEVICE)
    update_label_cache(labels, pb.k_buffer, slots, channels)
    if label_dtype is not None:  # the keys as the fp8 labels hold them, for the references
        stored = pb.k_buffer.float()
        index = channels[None].expand(stored.shape[0], -1, -1)
        stored.scatter_(2, index, labels.float())
        pb.k_buffer.copy_(stored.to(pb.k_buffer.dtype))
    _check_label_max(pb, q, channels, 2, 6, labels=labels, tokens_per_program=tokens_per_program)


@gpu
@needs_cuda
def test_gpu_label_max_real_shapes():
    gen = case_generator("gpu-label-max")
    lens = [32768, 32768 - 9, 3000, 1]
    pb = make_paged_batch(gen, lens, 8, 128, 32, dtype=torch.bfloat16, device="cuda",
                          summary_chunks=0)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    channels = torch.stack([torch.randperm(128, generator=gen)[:16] for _ in range(8)]).cuda()
    _check_label_max(pb, q, channels, 16, 64, atol=1e-3)

