"""The fused decode KV write (kernels/decode_write.py) against the unfused path in torch:
SGLang's set_kv_buffer arithmetic, then the summaries' and the label cache's references over
the stored keys. Every byte of the KV rows, summaries and labels must match, over several decode
steps (pages started, folded, handed to another request), with and without KV scales, for a
16-bit and an fp8 cache, 16-bit / float32 / fp8 summaries and 16-bit / fp8 labels."""

import pytest
import torch

from sglang_ext.kernels.block_summary import allocate_block_summaries
from sglang_ext.kernels.decode_write import (
    FP8_KV, fused_write_supported, write_decode_kv, write_decode_kv_ref,
)
from sglang_ext.kernels.label_cache import allocate_label_cache
from sglang_ext.kernels.testing import case_generator, random_values
from sglang_ext.selection.reference import FP8_SUMMARIES

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state(kv_dtype, summary_dtype, label_dtype, slots, hkv, d, dv, r, page, gen, device):
    """(k_buffer, v_buffer, kmin, kmax, labels, channels) filled with junk (a slot's old
    contents must not matter: the write replaces them)."""
    junk = lambda *shape: random_values(gen, *shape, dtype=torch.float32, device=device)  # noqa: E731
    k_buffer = junk(slots, hkv, d).to(kv_dtype)
    v_buffer = junk(slots, hkv, dv).to(kv_dtype)
    kmin = kmax = labels = channels = None
    if summary_dtype is not None:
        kmin, kmax = allocate_block_summaries(slots, hkv, d, page, device, summary_dtype)
    if label_dtype is not None:
        labels = allocate_label_cache(slots, hkv, r, device, label_dtype)
        channels = torch.stack([torch.randperm(d, generator=gen)[:r] for _ in range(hkv)])
        channels = channels.to(device)
    return k_buffer, v_buffer, kmin, kmax, labels, channels


def _bytes(t):
    return None if t is None else (t.view(torch.uint8) if t.element_size() == 1 else t)


def _decode_steps(gen, batch, page, slots, steps):
    """Per step, one slot per request: each request walks its own pages position by position
    (a page's first slot starts it); after half the steps request 0 gets a page another
    request used before (a freed page handed on)."""
    pages_per_request = (steps + page - 1) // page + 1
    assert batch * pages_per_request * page <= slots
    order = torch.randperm(slots // page, generator=gen)[: batch * pages_per_request]
    own = order.view(batch, pages_per_request)
    start = torch.randint(0, page, (batch,), generator=gen)
    out = []
    for t in range(steps):
        pos = start + t
        loc = own[torch.arange(batch), pos // page] * page + pos % page
        if t == steps // 2:
            loc[0] = own[1, 0] * page  # request 1's first page, started again by request 0
        out.append(loc)
    return out


@pytest.mark.parametrize("kv_dtype,summary_dtype,label_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, FP8_SUMMARIES, FP8_KV),
    (torch.float16, torch.float16, None),
    (FP8_KV, torch.float32, FP8_KV),
    (FP8_KV, FP8_SUMMARIES, FP8_KV),
    (FP8_KV, None, None),
], ids=["bf16", "bf16-fp8-side", "fp16-no-labels", "fp8-kv", "fp8-all", "fp8-kv-only"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.37, 2.5)], ids=["unscaled", "scaled"])
def test_matches_the_unfused_path(kv_dtype, summary_dtype, label_dtype, scales):
    gen = case_generator("decode-write", str(kv_dtype), str(summary_dtype), str(label_dtype),
                         str(scales))
    hkv, d, dv, r, page, slots, batch = 3, 32, 16, 6, 4, 160, 5
    key_dtype = torch.float16 if kv_dtype == torch.float16 else torch.bfloat16
    got = _state(kv_dtype, summary_dtype, label_dtype, slots, hkv, d, dv, r, page, gen, DEVICE)
    want = tuple(None if t is None else t.clone() for t in got)
    k_scale, v_scale = scales if kv_dtype == FP8_KV else (1.0, 1.0)
    for loc in _decode_steps(gen, batch, page, slots, steps=9):
        # keys of every magnitude: fp8 subnormals, ties, saturation of fp8 labels, and past
        # the fp8 range (NaN in an fp8 cache, as torch's cast gives; kept for the case without
        # summaries, whose min/max of a NaN differ between torch and Triton)
        k = random_values(gen, batch, hkv, d, dtype=torch.float32, device=DEVICE)
        k = k * torch.logspace(-3, 2.7, d, device=DEVICE)
        if kv_dtype == FP8_KV and summary_dtype is not None:
            k = k.clamp(-440 * k_scale, 440 * k_scale)
        k = k.to(key_dtype)
        v = random_values(gen, batch, hkv, dv, dtype=torch.float32, device=DEVICE).to(key_dtype)
        loc = loc.to(DEVICE)
        write_decode_kv(k, v, loc, got[0], got[1], got[2], got[3], page, got[4], got[5],
                        k_scale=k_scale, v_scale=v_scale)
        write_decode_kv_ref(k.clone(), v.clone(), loc, want[0], want[1], want[2], want[3], page,
                            want[4], want[5], k_scale=k_scale, v_scale=v_scale)
        for name, a, b in zip(("k_buffer", "v_buffer", "kmin", "kmax", "labels"), got, want):
            if a is not None:
                assert torch.equal(_bytes(a), _bytes(b)), name
    if kv_dtype == FP8_KV and summary_dtype is None:
        assert got[0].float().isnan().any(), "the keys past the fp8 range were not exercised"


def test_strided_keys_of_a_qkv_split():
    """k and v as the model hands them: views into one fused qkv projection."""
    gen = case_generator("decode-write-strided")
    hkv, d, page, slots, batch = 2, 16, 8, 64, 3
    got = _state(FP8_KV, FP8_SUMMARIES, FP8_KV, slots, hkv, d, d, 4, page, gen, DEVICE)
    want = tuple(None if t is None else t.clone() for t in got)
    qkv = random_values(gen, batch, 4 * hkv * d, dtype=torch.bfloat16, device=DEVICE)
    k = qkv[:, 2 * hkv * d:3 * hkv * d].view(batch, hkv, d)
    v = qkv[:, 3 * hkv * d:].view(batch, hkv, d)
    loc = torch.tensor([8, 17, 42], device=DEVICE)
    write_decode_kv(k, v, loc, got[0], got[1], got[2], got[3], page, got[4], got[5])
    write_decode_kv_ref(k, v, loc, want[0], want[1], want[2], want[3], page, want[4], want[5])
    for a, b in zip(got, want):
        assert torch.equal(_bytes(a), _bytes(b))


def test_supported_combinations_and_checks():
    bf16, fp8 = torch.bfloat16, FP8_KV
    assert fused_write_supported(bf16, bf16, bf16, bf16)
    assert fused_write_supported(fp8, bf16, torch.float32, fp8)
    assert not fused_write_supported(torch.float8_e5m2, bf16, None, None)  # e5m2: unfused
    assert not fused_write_supported(fp8, torch.float16, None, None)  # k / s rounds in fp16
    assert not fused_write_supported(bf16, torch.float32, None, None)  # narrowing keys
    assert not fused_write_supported(bf16, bf16, torch.float16, None)
    k = torch.zeros(2, 1, 8, dtype=bf16)
    with pytest.raises(TypeError, match="no fused decode write"):
        write_decode_kv(k, k, torch.zeros(2, dtype=torch.int64),
                        torch.zeros(4, 1, 8, dtype=torch.float8_e5m2),
                        torch.zeros(4, 1, 8, dtype=torch.float8_e5m2), None, None, 4)
    with pytest.raises(ValueError, match="do not match"):
        write_decode_kv(k, k, torch.zeros(2, dtype=torch.int64), torch.zeros(4, 2, 8, dtype=bf16),
                        torch.zeros(4, 2, 8, dtype=bf16), None, None, 4)


@gpu
@needs_cuda
def test_gpu_real_shapes_inside_a_cuda_graph():
    """Qwen3-8B shapes (8 kv heads of 128, 16 fp8 labels), 16 requests, fp8 cache and side
    buffers, captured in a CUDA graph and replayed over new keys."""
    gen = case_generator("decode-write-gpu")
    hkv, d, r, page, slots, batch = 8, 128, 16, 32, 32 * 4096, 16
    got = _state(FP8_KV, FP8_SUMMARIES, FP8_KV, slots, hkv, d, d, r, page, gen, "cuda")
    want = tuple(None if t is None else t.clone() for t in got)
    k = torch.empty(batch, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    loc = torch.empty(batch, dtype=torch.int64, device="cuda")
    # compile outside the capture, writing slot 0 (the padding slot) on both sides
    k.zero_(), v.zero_(), loc.zero_()
    write_decode_kv(k, v, loc, *got[:4], page, got[4], got[5])
    write_decode_kv_ref(k.clone(), v.clone(), loc, *want[:4], page, want[4], want[5])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_decode_kv(k, v, loc, *got[:4], page, got[4], got[5])
    for step in _decode_steps(gen, batch, page, slots, steps=70):
        k.copy_(torch.randn(batch, hkv, d, generator=gen).to("cuda", torch.bfloat16))
        v.copy_(torch.randn(batch, hkv, d, generator=gen).to("cuda", torch.bfloat16))
        loc.copy_(step)
        graph.replay()
        write_decode_kv_ref(k.clone(), v.clone(), loc, *want[:4], page, want[4], want[5])
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(_bytes(a), _bytes(b))


def _backend_decode(tmp_path, monkeypatch, fused: bool, kv_dtype, side_dtype: str):
    """Decode steps of a batch through the backend on SGLang's own (CPU) MHA pool, the KV
    written by the fused kernel or by set_kv_buffer + the summary and label kernels; returns
    (whether the fused path ran, outputs, the pool's rows, summaries, labels)."""
    from cpu_backend import cpu_mha_pool, cpu_sparse_backend, decode_bf16_steps

    monkeypatch.setenv("SGLANG_EXT_FUSED_KV_WRITE", "1" if fused else "0")
    hq, hkv, d, layers, page = 4, 2, 16, 2, 4
    lens, rows, steps = [30, 45, 17], [3, 1, 6], 6
    gen = torch.Generator().manual_seed(11)
    max_context = max(lens) + steps
    per_req = -(-max_context // page)
    num_pages = 2 + len(rows) * per_req
    pool = cpu_mha_pool(kv_dtype, hkv, d, layers, page, num_pages)
    for i in range(layers):  # a prompt's KV, as the prefill left it
        for buf in (pool.get_key_buffer(i), pool.get_value_buffer(i)):
            buf.view(torch.uint8 if kv_dtype == FP8_KV else kv_dtype).copy_(
                torch.randn(buf.shape, generator=gen).to(kv_dtype).view(buf.dtype))
    table = torch.zeros(8, max_context, dtype=torch.int32)
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1)[: len(rows) * per_req]
    for i, row in enumerate(rows):
        own = pages[i * per_req:(i + 1) * per_req]
        table[row] = (own[:, None] * page + torch.arange(page)).flatten()[:max_context].int()
    backend = cpu_sparse_backend(tmp_path, pool, table, hq,
                                 [[[0, 7, 15], [2, 3, 9]] for _ in range(layers)], side_dtype)
    outs = decode_bf16_steps(backend, table, rows, lens, steps, gen, hq)
    state = [_bytes(pool.get_key_buffer(i)) for i in range(layers)]
    state += [_bytes(pool.get_value_buffer(i)) for i in range(layers)]
    state += [_bytes(t) for t in backend.decoder.summaries.kmin + backend.decoder.summaries.kmax]
    state += [_bytes(t) for t in backend.decoder.labels]
    return backend.decoder._fused_write, outs, state


@pytest.mark.parametrize("kv_dtype,side_dtype", [(torch.bfloat16, "auto"),
                                                 (FP8_KV, "fp8_e4m3")], ids=["bf16", "fp8"])
def test_backend_decode_fused_equals_unfused(tmp_path, monkeypatch, kv_dtype, side_dtype):
    """The same decode steps with the fused write and with set_kv_buffer + the separate
    summary / label kernels: the same pool rows, summaries, labels and outputs, bit for bit."""
    ran_fused, outs, state = _backend_decode(tmp_path, monkeypatch, True, kv_dtype, side_dtype)
    ran_plain, outs_plain, state_plain = _backend_decode(tmp_path, monkeypatch, False, kv_dtype,
                                                         side_dtype)
    assert ran_fused and not ran_plain
    for a, b in zip(state, state_plain):
        assert torch.equal(a, b)
    for a, b in zip(outs, outs_plain):
        assert torch.equal(a, b)
