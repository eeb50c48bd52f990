"""The label cache (kernels/label_cache.py): stored label channels equal the keys' channels (the
Triton write against the torch reference), and token scoring from the cache gives exactly the
scores, and selects exactly the slots, that gathering the channels from the pool does
(kernels/token_scores.py ``keys_are_labels``, kernels/sparse_decode.py ``LayerCache.labels``),
which the oracle tests pin down."""

import pytest
import torch

from sglang_ext.kernels.label_cache import (
    allocate_label_cache,
    update_label_cache,
    update_label_cache_ref,
)
from sglang_ext.kernels.sparse_decode import (
    DecodeRows,
    LayerCache,
    SparseDecodeWorkspace,
    select_slots_batched,
    sparse_decode_batched,
    sparse_decode_batched_ref,
)
from sglang_ext.kernels.testing import case_generator, make_paged_batch, random_values
from sglang_ext.kernels.token_scores import label_token_scores_batched
from sglang_ext.selection.reference import SelectionParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _channels(gen, hkv, head_dim, r, device):
    return torch.stack([torch.randperm(head_dim, generator=gen)[:r] for _ in range(hkv)]).to(device)


def _cache(pb, channels=None, labels=None):
    return LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax, channels=channels,
                      labels=labels)


def _rows(pb):
    return DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_stores_each_keys_channels(dtype):
    gen = case_generator("label-cache-update", str(dtype))
    hkv, d, r, slots = 3, 16, 5, 64
    channels = _channels(gen, hkv, d, r, DEVICE)
    labels = allocate_label_cache(slots, hkv, r, DEVICE, dtype).fill_(float("nan"))
    written = torch.zeros(slots, dtype=torch.bool)
    for n in (7, 1, 12):  # several calls, scattered slots (as prefill chunks / decode steps)
        free = (~written).nonzero().flatten()
        loc = free[torch.randperm(len(free), generator=gen)[:n]]
        k = random_values(gen, n, hkv, d, dtype=dtype, device=DEVICE)
        update_label_cache(labels, k, loc.to(DEVICE), channels)
        for i, slot in enumerate(loc.tolist()):
            for g in range(hkv):
                assert torch.equal(labels[slot, g], k[i, g, channels[g]]), (slot, g)
        written[loc] = True
    assert labels[~written.to(DEVICE)].isnan().all(), "a slot that was not written changed"


@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32], ids=["same", "narrowed"])
def test_update_matches_the_torch_reference(key_dtype):
    """Prefill-sized and decode-sized writes, keys wider than the cache rounded like torch."""
    gen = case_generator("label-cache-ref", str(key_dtype))
    hkv, d, r, slots = 3, 32, 6, 200
    channels = _channels(gen, hkv, d, r, DEVICE)
    got = allocate_label_cache(slots, hkv, r, DEVICE, torch.bfloat16)
    want = allocate_label_cache(slots, hkv, r, DEVICE, torch.bfloat16)
    order = torch.randperm(slots, generator=gen)
    for chunk in (order[:150], order[150:151], order[151:160]):
        k = random_values(gen, len(chunk), hkv, d, dtype=key_dtype, device=DEVICE)
        loc = chunk.to(device=DEVICE, dtype=torch.int32)
        update_label_cache(got, k, loc, channels)
        update_label_cache_ref(want, k, loc, channels)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="do not match the label cache"):
        update_label_cache(got, k, loc, channels[:, :2])


@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_token_scores_from_the_cache_are_the_pools(hq, hkv):
    """keys_are_labels reads the cache whole and the queries at the channels: the very scores
    of reading the channels from the pool's keys (bit for bit: same products, same order)."""
    gen = case_generator("label-cache-scores", hq, hkv)
    d, bs = 16, 4
    pb = make_paged_batch(gen, [9, 40, 77], hkv, d, bs, dtype=torch.bfloat16, device=DEVICE,
                          summary_chunks=0)
    q = random_values(gen, 3, hq, d, dtype=torch.bfloat16, device=DEVICE)
    channels = _channels(gen, hkv, d, 5, DEVICE)
    labels = allocate_label_cache(pb.k_buffer.shape[0], hkv, 5, DEVICE, torch.bfloat16)
    update_label_cache(labels, pb.k_buffer, torch.arange(pb.k_buffer.shape[0], device=DEVICE),
                       channels)
    common = (pb.req_to_token, pb.req_pool_indices, pb.seq_lens, None, bs, 2, 3)
    want, _ = label_token_scores_batched(q, pb.k_buffer, *common, channels=channels,
                                         num_blocks=pb.max_blocks)
    got, _ = label_token_scores_batched(q, labels, *common, channels=channels,
                                        num_blocks=pb.max_blocks, keys_are_labels=True)
    assert torch.equal(got, want) and want.isfinite().any()
    with pytest.raises(ValueError, match="label-cache keys need their channels"):
        label_token_scores_batched(q, labels, *common, num_blocks=pb.max_blocks,
                                   keys_are_labels=True)


@pytest.mark.parametrize("method", ["two_level", "ds"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selection_from_the_cache_is_the_same(method, dtype):
    gen = case_generator("label-cache-select", method, str(dtype))
    hq, hkv, d, bs, budget = 6, 2, 16, 4, 32
    params = SelectionParams(method, budget, bs, 6, 4, 4)
    pb = make_paged_batch(gen, [20, 33, 90, 151], hkv, d, bs, dtype=dtype, device=DEVICE)
    q = random_values(gen, 4, hq, d, dtype=dtype, device=DEVICE)
    channels = _channels(gen, hkv, d, 5, DEVICE)
    labels = allocate_label_cache(pb.k_buffer.shape[0], hkv, 5, DEVICE, dtype)
    update_label_cache(labels, pb.k_buffer, torch.arange(pb.k_buffer.shape[0], device=DEVICE),
                       channels)
    rows = _rows(pb)

    def workspace():
        return SparseDecodeWorkspace(4, hq, hkv, d, params, pb.max_blocks, DEVICE, dtype)

    expected = select_slots_batched(q, _cache(pb, channels), rows, params, workspace()).clone()
    got = select_slots_batched(q, _cache(pb, channels, labels), rows, params, workspace())
    assert torch.equal(got, expected)
    out = sparse_decode_batched(q, _cache(pb, channels, labels), rows, params, d ** -0.5)
    ref = sparse_decode_batched(q, _cache(pb, channels), rows, params, d ** -0.5)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="labels need their channels"):
        select_slots_batched(q, _cache(pb, None, labels), rows, params, workspace())


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["two_level", "ds"])
def test_gpu_real_shapes_same_slots(method):
    """Qwen3-8B layer (Hq 32, Hkv 8, D 128, bf16), 16 label channels, L up to 32k, bs 16."""
    gen = case_generator("gpu-label-cache", method)
    lens = [1000, 4097, 20000, 32768]
    pb = make_paged_batch(gen, lens, 8, 128, 16, dtype=torch.bfloat16, device="cuda",
                          summary_chunks=2)
    q = random_values(gen, 4, 32, 128, dtype=torch.bfloat16, device="cuda")
    params = SelectionParams(method, 2048, 16, 246, 16, 64)
    channels = _channels(gen, 8, 128, 16, "cuda")
    labels = allocate_label_cache(pb.k_buffer.shape[0], 8, 16, "cuda")
    update_label_cache(labels, pb.k_buffer, torch.arange(pb.k_buffer.shape[0], device="cuda"),
                       channels)
    expected = select_slots_batched(q, _cache(pb, channels), _rows(pb), params).clone()
    assert torch.equal(select_slots_batched(q, _cache(pb, channels, labels), _rows(pb), params),
                       expected)


def _fp8_labels_select_what_the_reference_selects(method, device, lens, hq, hkv, d, bs, budget,
                                                  cand, r):
    import dataclasses

    from sglang_ext.selection.reference import label_storage_dtype, to_label_storage

    gen = case_generator("label-cache-fp8", method, device)
    sink, window = (4, 4) if budget < 256 else (16, 64)
    params = SelectionParams(method, budget, bs, cand, sink, window, label_dtype="fp8_e4m3")
    pb = make_paged_batch(gen, lens, hkv, d, bs, dtype=torch.bfloat16, device=device)
    q = random_values(gen, len(lens), hq, d, dtype=torch.bfloat16, device=device)
    channels = _channels(gen, hkv, d, r, device)
    dtype = label_storage_dtype("fp8_e4m3", torch.bfloat16)
    labels = allocate_label_cache(pb.k_buffer.shape[0], hkv, r, device, dtype)
    update_label_cache(labels, pb.k_buffer, torch.arange(pb.k_buffer.shape[0], device=device),
                       channels)
    want = to_label_storage(torch.gather(pb.k_buffer, 2, channels.unsqueeze(0).expand(
        pb.k_buffer.shape[0], -1, -1)), dtype)
    assert torch.equal(labels.float(), want.float())
    assert to_label_storage(torch.tensor([1e4, -1e4]), dtype).float().tolist() == [448, -448]

    _, pos = select_slots_batched(q, _cache(pb, channels, labels), _rows(pb), params,
                                  return_positions=True)
    tail = (pb.req_to_token, pb.req_pool_indices, pb.seq_lens)
    _, _, masks = sparse_decode_batched_ref(q, pb.k_buffer, pb.v_buffer, *tail, params,
                                            d ** -0.5, channels)
    exact = dataclasses.replace(params, label_dtype="auto")
    _, _, exact_masks = sparse_decode_batched_ref(q, pb.k_buffer, pb.v_buffer, *tail, exact,
                                                  d ** -0.5, channels)
    differs = False
    for b in range(len(lens)):
        for g in range(hkv):
            got = pos[b, g][pos[b, g] >= 0].long().sort().values
            assert torch.equal(got, masks[b][g].nonzero().flatten()), (b, g)
            differs |= not torch.equal(masks[b][g], exact_masks[b][g])
    assert differs, "fp8 rounding changed no selection: the test data cannot tell"
    with pytest.raises(ValueError, match="needs the label cache"):
        select_slots_batched(q, _cache(pb, channels), _rows(pb), params)
    with pytest.raises(ValueError, match="the cache holds"):
        select_slots_batched(q, _cache(pb, channels, labels), _rows(pb), exact)


@pytest.mark.parametrize("method", ["two_level", "ds"])
def test_fp8_labels_select_what_the_reference_selects(method):
    """--sparse-label-dtype fp8_e4m3: the cache holds the channels rounded to fp8 (saturating,
    never NaN) and the batched selection picks exactly the reference's positions for the same
    rounded labels; the rounding matters on this data (the bf16 reference picks otherwise)."""
    _fp8_labels_select_what_the_reference_selects(method, DEVICE, [20, 33, 90, 151], 6, 2, 16,
                                                  4, 32, 12, 5)


@gpu
@needs_cuda
@pytest.mark.parametrize("method", ["two_level", "ds"])
def test_gpu_fp8_labels_real_shapes(method):
    """The same at a Qwen3-8B layer's shapes, 16 fp8 label channels, budget 2048, bs 16."""
    _fp8_labels_select_what_the_reference_selects(method, "cuda", [1000, 4097, 20000], 32, 8,
                                                  128, 16, 2048, 246, 16)
