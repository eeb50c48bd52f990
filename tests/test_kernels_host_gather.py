"""Host -> GPU block gather of the CPU KV tier (kernels/host_gather.py) against its torch
reference: random entries (fresh inputs for every check), a poisoned destination that must keep
its poison wherever nothing is copied (skipped entries, entries past ``count``), ragged counts,
runs cut into several units, persistent grids, K and V in one launch.

On a machine without CUDA the kernel runs in Triton's CPU interpreter on plain CPU tensors; on
CUDA the host side is pinned memory the kernel reads directly.
"""

import pytest
import torch

from sglang_ext.kernels.host_gather import (
    LiveEntries,
    gather_host_blocks,
    gather_host_blocks_ref,
    pinned_empty,
)
from sglang_ext.kernels.testing import case_generator

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
POISON = -768.0  # exact in bf16


def _host(gen, heads, tokens, head_dim, dtype):
    x = pinned_empty((heads, tokens, head_dim), dtype)
    x.copy_(torch.randn(heads, tokens, head_dim, generator=gen).to(dtype))
    return x


def _entries(gen, n, heads, host_pages, dev_pages, skip=0.25, device=DEVICE):
    """``n`` entries with distinct (head, src page) and distinct (head, dst page) pairs, a
    fraction ``skip`` of them with ``src = -1``."""
    src_pairs = torch.randperm(heads * host_pages, generator=gen)[:n]
    head = src_pairs // host_pages
    src = src_pairs % host_pages
    dst = torch.empty(n, dtype=torch.int64)
    for h in range(heads):  # distinct device pages per head
        sel = (head == h).nonzero().flatten()
        dst[sel] = torch.randperm(dev_pages, generator=gen)[: sel.numel()]
    src[torch.rand(n, generator=gen) < skip] = -1
    return [x.to(torch.int32).to(device) for x in (head, src, dst)]


def _same_bits(a, b):
    int_type = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(int_type), b.view(int_type))


def _check(gen, *, heads=3, head_dim=16, page=4, host_pages=6, dev_pages=6, n=9,
           dtype=torch.float32, count=None, with_v=False, device=DEVICE, **kw):
    host = _host(gen, heads, host_pages * page, head_dim, dtype)
    host_v = _host(gen, heads, host_pages * page, head_dim, dtype) if with_v else None
    dev = torch.full((dev_pages * page, heads, head_dim), POISON, dtype=dtype, device=device)
    dev_v = torch.full_like(dev, -POISON) if with_v else None
    head, src, dst = _entries(gen, n, heads, host_pages, dev_pages, device=device)
    cnt = None if count is None else torch.tensor([count], dtype=torch.int32, device=device)
    want, want_v = dev.clone(), None if dev_v is None else dev_v.clone()
    gather_host_blocks_ref(host, want, head, src, dst, page, cnt, host_v=host_v, dev_v=want_v)
    gather_host_blocks(host, dev, head, src, dst, page, cnt, host_v=host_v, dev_v=dev_v, **kw)
    assert _same_bits(dev, want)
    if with_v:
        assert _same_bits(dev_v, want_v)
    copied = (dev != POISON).any(-1).sum().item()  # the check is not vacuous
    m = n if count is None else min(count, n)
    assert copied == page * int((src[:m] >= 0).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 12])
@pytest.mark.parametrize("runs", [1, 4])
def test_matches_reference(dtype, head_dim, runs):
    gen = case_generator("gather", dtype, head_dim, runs)
    for _ in range(2):  # fresh inputs per check
        _check(gen, head_dim=head_dim, dtype=dtype, runs_per_program=runs)


@pytest.mark.parametrize("count", [0, 1, 4, 9, 13])
def test_ragged_count(count):
    """Only entries i < count are copied (count > n is clamped); K and V in one launch."""
    gen = case_generator("gather-count", count)
    _check(gen, count=count, n=9, with_v=True, runs_per_program=2)


@pytest.mark.parametrize("skip", [0.0, 0.5, 0.9, 1.0])
def test_live_entries_first_copy_the_same_blocks(skip):
    """The tier's fetch lists every slot, most of them skipped at a high hit rate; compacted,
    the live entries come first in their order, ``count`` says how many, and the gather over
    them copies exactly what the listed entries would. A second, smaller list reuses the
    buffers: the stale entries past its count are not copied."""
    gen = case_generator("gather-live", skip)
    heads, head_dim, page, pages = 3, 16, 4, 40
    live = LiveEntries(64, DEVICE)
    for n in (60, 23):  # the second list is shorter than the first
        host = _host(gen, heads, pages * page, head_dim, torch.float32)
        head, src, dst = _entries(gen, n, heads, pages, pages, skip=skip)
        want = torch.full((pages * page, heads, head_dim), POISON, device=DEVICE)
        got = want.clone()
        gather_host_blocks_ref(host, want, head, src, dst, page)
        h, s, d, count = live.compact(head, src, dst)
        keep = src >= 0
        assert count.item() == int(keep.sum())
        m = count.item()
        for a, b in ((h, head), (s, src), (d, dst)):
            assert torch.equal(a[:m], b[keep])
        gather_host_blocks(host, got, h, s, d, page, count, max_programs=4)
        assert _same_bits(got, want)
    with pytest.raises(ValueError, match="exceed"):
        live.compact(*(torch.zeros(65, dtype=torch.int32, device=DEVICE),) * 3)


@pytest.mark.parametrize("unit_bytes,page", [(128, 8), (64, 8), (128, 3)])
def test_runs_cut_into_units(unit_bytes, page):
    """Runs longer than a unit (here 8 tokens x 64 B in units of 128 or 64 B) are copied in
    pieces; a page size that is not a power of two uses its largest power-of-two divisor."""
    gen = case_generator("gather-units", unit_bytes, page)
    _check(gen, page=page, unit_bytes=unit_bytes, count=7, with_v=True)


@pytest.mark.parametrize("max_programs", [None, 1, 2, 4])
def test_persistent_grid(max_programs):
    """Fewer programs than tiles: each program loops over its tiles (a power-of-two trip count,
    the extra iterations masked); ``None``: one program per tile."""
    gen = case_generator("gather-persistent", max_programs)
    _check(gen, n=11, dev_pages=6, max_programs=max_programs, runs_per_program=2, count=10)


def test_all_skipped_and_empty():
    gen = case_generator("gather-skip")
    host = _host(gen, 2, 8, 16, torch.float32)
    dev = torch.full((8, 2, 16), POISON, device=DEVICE)
    head = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    src = torch.tensor([-1, -5], dtype=torch.int32, device=DEVICE)
    dst = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    gather_host_blocks(host, dev, head, src, dst, 4)
    empty = head[:0]
    gather_host_blocks(host, dev, empty, empty, empty, 4)
    assert (dev == POISON).all()


def test_rejects_bad_arguments():
    host = pinned_empty((2, 8, 16), torch.float32)
    dev = torch.zeros(8, 2, 16, device=DEVICE)
    idx = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        gather_host_blocks(host, dev[:, :1], idx, idx, idx, 4)  # heads differ
    with pytest.raises(ValueError):
        gather_host_blocks(host, dev.double(), idx, idx, idx, 4)  # dtypes differ
    with pytest.raises(ValueError):
        gather_host_blocks(host, dev, idx, idx[:0], idx, 4)  # lengths differ
    with pytest.raises(ValueError):
        gather_host_blocks(host, dev, idx, idx, idx, 4, host_v=host)  # V without dev_v
    with pytest.raises(ValueError):
        gather_host_blocks(host, dev, idx, idx, idx, 4, runs_per_program=3)
    # The radix dedup's re-point once passed one kv head column of a page map (a strided view):
    # the kernel read the wrong entries and copied to page -1 (an illegal address on the GPU).
    column = torch.zeros(4, 3, dtype=torch.int32, device=DEVICE)[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        gather_host_blocks(host, dev, column, column, column, 4)
    with pytest.raises(ValueError, match="int32"):
        gather_host_blocks(host, dev, idx, idx.long(), idx, 4)


@gpu
@needs_cuda
def test_gpu_real_shapes():
    """Qwen3-8B kv heads (8 x 128, bf16), pinned host, 16-token (4 KiB) and 64-token blocks,
    K and V, ragged counts and a persistent grid."""
    gen = case_generator("gpu-gather")
    for page, n, count, kw in [(16, 3000, 2500, {}), (64, 700, None, {"max_programs": 16}),
                               (16, 4096, 4096, {"runs_per_program": 1, "num_warps": 8})]:
        _check(gen, heads=8, head_dim=128, page=page, host_pages=4096, dev_pages=1024, n=n,
               dtype=torch.bfloat16, count=count, with_v=True, **kw)


@gpu
@needs_cuda
def test_gpu_cuda_graph_replay():
    """Captured once; new entries and a new count written in place; each replay equals the
    reference."""
    gen = case_generator("gpu-gather-graph")
    heads, d, page, n = 8, 128, 16, 512
    host = _host(gen, heads, 2048 * page, d, torch.bfloat16)
    dev = torch.full((512 * page, heads, d), POISON, dtype=torch.bfloat16, device="cuda")
    head, src, dst = (torch.zeros(n, dtype=torch.int32, device="cuda") for _ in range(3))
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    src.fill_(-1)
    gather_host_blocks(host, dev, head, src, dst, page, cnt)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_host_blocks(host, dev, head, src, dst, page, cnt)
    for count in (n, 100, 0):
        dev.fill_(POISON)
        h, s, t = _entries(gen, n, heads, 2048, 512, device="cuda")
        head.copy_(h), src.copy_(s), dst.copy_(t)
        cnt.fill_(count)
        host.copy_(torch.randn(host.shape, generator=gen).to(host.dtype))  # fresh source too
        want = dev.clone()
        gather_host_blocks_ref(host, want, head, src, dst, page, cnt)
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bits(dev, want)


@gpu
@needs_cuda
def test_gpu_live_entries_under_a_graph_on_a_side_stream():
    """As the tier's async fetch runs it: compaction and gather captured on a side stream
    forked from the capturing one, a list mostly of hits (90 % skipped), new lists written in
    place before each replay."""
    gen = case_generator("gpu-gather-live-graph")
    heads, d, page, n = 8, 128, 16, 4096
    host = _host(gen, heads, 4096 * page, d, torch.bfloat16)
    dev = torch.full((4096 * page, heads, d), POISON, dtype=torch.bfloat16, device="cuda")
    head, src, dst = (torch.zeros(n, dtype=torch.int32, device="cuda") for _ in range(3))
    src.fill_(-1)
    live = LiveEntries(n, "cuda")
    side = torch.cuda.Stream()

    def fetch():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            h, s, t, count = live.compact(head, src, dst)
            gather_host_blocks(host, dev, h, s, t, page, count, max_programs=16)
        torch.cuda.current_stream().wait_stream(side)

    fetch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fetch()
    for skip in (0.9, 0.0, 1.0):
        dev.fill_(POISON)
        h, s, t = _entries(gen, n, heads, 4096, 4096, skip=skip, device="cuda")
        head.copy_(h), src.copy_(s), dst.copy_(t)
        want = dev.clone()
        gather_host_blocks_ref(host, want, head, src, dst, page)
        graph.replay()
        torch.cuda.synchronize()
        assert _same_bits(dev, want)
        assert live.count.item() == int((src >= 0).sum())
