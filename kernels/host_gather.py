"""Host -> GPU gather of KV blocks for the CPU KV tier (zero-copy, UVA).

The CPU tier keeps each layer's K (and V) on the host in pinned memory, **head-major**:
``host[h, t, :]`` is token ``t`` of kv head ``h``, so one (page, kv head) is one contiguous run
of ``page_size * head_dim`` elements (16 tokens x 128 dims x bf16 = 4 KiB). The GPU keeps
SGLang's token-major pool layout ``dev[slot, h, :]`` (NHD), where the same page's rows are
``num_kv_heads * head_dim`` elements apart.

``gather_host_blocks`` copies, for each entry ``i`` (``i < count``, ``src_pages[i] >= 0``)::

    dev[dst_pages[i]*P : (dst_pages[i]+1)*P, heads[i], :] = host[heads[i], src_pages[i]*P : +P, :]

The GPU kernel reads the pinned host memory directly (zero-copy): with unified addressing a
pinned tensor's ``data_ptr`` is also a device address, and Triton's launcher turns it into one
(``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)``), so the host tensor is passed
to the kernel as is. Each program moves ``runs_per_program`` units of at most 4 KiB (a whole
run for 16 x 128 bf16; longer runs are cut into 4 KiB units) with 16-byte vector loads, so many
PCIe reads are in flight per SM; with ``max_programs`` the grid is persistent (each program
loops over units), which bounds how many SMs the copy takes from concurrent kernels. Entries
with ``src_pages < 0`` are skipped. Shapes are static, ``count`` is read on the device (no
``.item()``, no allocation), so a call can be captured in a CUDA graph. With ``host_v`` and
``dev_v`` the same entries of V are copied in the same launch.

Under ``TRITON_INTERPRET=1`` (no CUDA) the same kernel runs on plain CPU tensors.
"""

from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

UNIT_BYTES = 4096  # bytes one unit (a contiguous piece of one run) moves at most
# Launch defaults measured on an H200 (PCIe 5 x16, 55.6 GB/s contiguous; bench_transfer.py, on
# a work-in-progress tree whose results file was not kept: to re-measure): with a full grid every runs/warps choice
# moves ~51 GB/s of random 4 KiB blocks but slows a concurrent decode attention 2.7x. 16
# persistent programs x 4 runs keep ~51 GB/s alone and ~50.7 GB/s beside attention, which
# slows ~8% (2 runs: 50.3 GB/s, ~6%); 1 run x 16 programs keeps too few reads in flight
# (45 GB/s), more programs or runs
# slow the attention more (2 runs x 32 programs: 20%, 4 x 32: 57%).
DEFAULT_RUNS_PER_PROGRAM = 4
DEFAULT_NUM_WARPS = 4
DEFAULT_MAX_PROGRAMS = 16

# the copy is dtype-agnostic: elements are moved as integers of the same width
_COPY_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pinned_empty(shape: Sequence[int] | int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """An uninitialised CPU tensor, page-locked (pinned) when CUDA is available (then the GPU
    can read it directly, see :func:`gather_host_blocks`), plain otherwise.

    The memory is an ordinary allocation registered with ``cudaHostRegister`` (unregistered
    when the tensor is freed), not ``torch.empty(pin_memory=True)``: torch's pinned caching
    allocator rounds every block up to a power of two, which for the CPU tier's per-layer
    buffers (1.1 GB -> 2 GB) nearly doubles the host memory pinned."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if torch.cuda.is_available() and nbytes:
        cudart = torch.cuda.cudart()
        ptr = t.data_ptr()
        err = cudart.cudaHostRegister(ptr, nbytes, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes / 1e9:.2f} GB failed ({err})")
        weakref.finalize(t, cudart.cudaHostUnregister, ptr)
    return t


@triton.jit
def _gather_host_blocks_kernel(
    HOST_K,
    DEV_K,
    HOST_V,
    DEV_V,
    HEADS,
    SRC,
    DST,
    COUNT,
    n,
    stride_kh,  # host K: head, token (the dim stride is 1)
    stride_kt,
    stride_ks,  # device K: slot, head
    stride_kd,
    stride_vh,
    stride_vt,
    stride_vs,
    stride_vd,
    PAGE: tl.constexpr,
    CHUNK: tl.constexpr,  # tokens per unit; PAGE % CHUNK == 0
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    RUNS: tl.constexpr,  # units per program per iteration
    ITERS: tl.constexpr,  # tiles per program (> 1 only with a persistent grid)
    HAS_COUNT: tl.constexpr,
    HAS_V: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    if HAS_COUNT:
        cnt = tl.minimum(tl.load(COUNT).to(tl.int32), n)
    else:
        cnt = n
    UNITS_PER_PAGE: tl.constexpr = PAGE // CHUNK
    num_units = cnt * UNITS_PER_PAGE

    r = tl.arange(0, RUNS)
    t = tl.arange(0, CHUNK)
    d = tl.arange(0, BLOCK_D)
    tok_d = t[:, None]  # [CHUNK, 1]
    dim = d[None, :]  # [1, BLOCK_D]
    # a constexpr trip count (a loop bound read at run time does not run in the interpreter);
    # tiles past ``count`` are skipped
    for i in range(ITERS):
        # past the last unit (entries past ``count`` included) an iteration issues no loads
        if (pid + i * nprog) * RUNS < num_units:
            u = (pid + i * nprog) * RUNS + r
            live = u < num_units
            e = u // UNITS_PER_PAGE
            tok0 = ((u % UNITS_PER_PAGE) * CHUNK).to(tl.int64)
            head = tl.load(HEADS + e, mask=live, other=0).to(tl.int64)
            src = tl.load(SRC + e, mask=live, other=-1).to(tl.int64)
            dst = tl.load(DST + e, mask=live, other=0).to(tl.int64)
            ok = live & (src >= 0)
            mask = ok[:, None, None]
            if BLOCK_D != HEAD_DIM:
                mask = mask & (dim < HEAD_DIM)[None, :, :]
            src_tok = src * PAGE + tok0  # [RUNS] first host token of the unit
            dst_tok = dst * PAGE + tok0  # [RUNS] first device slot of the unit

            k_src = HOST_K + (head * stride_kh + src_tok * stride_kt)[:, None, None] \
                + (tok_d * stride_kt + dim)[None, :, :]
            k_dst = DEV_K + (dst_tok * stride_ks + head * stride_kd)[:, None, None] \
                + (tok_d * stride_ks + dim)[None, :, :]
            k = tl.load(k_src, mask=mask, cache_modifier=".cg")
            if HAS_V:
                v_src = HOST_V + (head * stride_vh + src_tok * stride_vt)[:, None, None] \
                    + (tok_d * stride_vt + dim)[None, :, :]
                v = tl.load(v_src, mask=mask, cache_modifier=".cg")
            tl.store(k_dst, k, mask=mask)
            if HAS_V:
                v_dst = DEV_V + (dst_tok * stride_vs + head * stride_vd)[:, None, None] \
                    + (tok_d * stride_vs + dim)[None, :, :]
                tl.store(v_dst, v, mask=mask)


def _unit_tokens(page_size: int, head_dim: int, elem_bytes: int, unit_bytes: int) -> int:
    """Tokens per unit: the largest power of two dividing ``page_size`` whose rows fit in
    ``unit_bytes`` (at least one token)."""
    limit = max(1, unit_bytes // (head_dim * elem_bytes))
    chunk = page_size & -page_size  # largest power of two dividing page_size
    while chunk > limit:
        chunk //= 2
    return chunk


def _as_copy_dtype(x: Tensor) -> Tensor:
    return x.view(_COPY_DTYPE[x.element_size()])


def _check_pair(host: Tensor, dev: Tensor, name: str) -> None:
    if host.dim() != 3 or dev.dim() != 3:
        raise ValueError(f"{name}: host must be [H, N, D] and dev [S, H, D]")
    if host.shape[0] != dev.shape[1] or host.shape[2] != dev.shape[2]:
        raise ValueError(f"{name}: host {tuple(host.shape)} and dev {tuple(dev.shape)} differ in "
                         "heads or head_dim")
    if host.dtype != dev.dtype:
        raise ValueError(f"{name}: host {host.dtype} != dev {dev.dtype}")
    if host.stride(2) != 1 or dev.stride(2) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")
    if host.element_size() not in _COPY_DTYPE:
        raise ValueError(f"{name}: unsupported element size {host.element_size()}")
    if dev.is_cuda and not host.is_cuda:
        capturing = torch.cuda.is_current_stream_capturing()
        if not capturing and not host.is_pinned():
            raise ValueError(f"{name}: a CPU source must be pinned to be read by the GPU "
                             "(see pinned_empty)")


def check_transfer_list(heads: Tensor, src_pages: Tensor, dst_pages: Tensor) -> None:
    """The kernel reads entry ``i`` of each list at ``base + i``: each must be int32 with
    consecutive elements (a strided view, such as one kv head column of a page map, would be
    read at the wrong entries and could send a copy to page -1), all of one length."""
    n = heads.numel()
    for name, t in (("heads", heads), ("src_pages", src_pages), ("dst_pages", dst_pages)):
        if t.numel() != n:
            raise ValueError("heads, src_pages and dst_pages must have the same length")
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if n > 1 and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")


def gather_host_blocks(
    host: Tensor,
    dev: Tensor,
    heads: Tensor,
    src_pages: Tensor,
    dst_pages: Tensor,
    page_size: int,
    count: Optional[Tensor] = None,
    *,
    host_v: Optional[Tensor] = None,
    dev_v: Optional[Tensor] = None,
    runs_per_program: int = DEFAULT_RUNS_PER_PROGRAM,
    num_warps: int = DEFAULT_NUM_WARPS,
    max_programs: Optional[int] = DEFAULT_MAX_PROGRAMS,
    unit_bytes: int = UNIT_BYTES,
) -> None:
    """Copy host blocks into the device pool, in place (see the module docstring).

    ``host`` ``[H, N, D]`` (pinned CPU on CUDA; any CPU tensor under the interpreter; a device
    tensor works too), ``dev`` ``[S, H, D]`` on the device, ``heads`` / ``src_pages`` /
    ``dst_pages`` int32 ``[n]`` on the device, ``page_size`` tokens per block, ``count``
    (optional int32 ``[1]`` on the device): only entries ``i < count`` are copied; entries
    with ``src_pages[i] < 0`` are skipped. ``host_v`` / ``dev_v``: V, copied for the same
    entries in the same launch. ``runs_per_program`` (power of two) units of <= 4 KiB per
    program and iteration; ``max_programs`` caps the grid (persistent programs looping over
    the units) to leave SMs to concurrent kernels (``None``: one program per tile);
    ``unit_bytes`` bounds the bytes of one unit (longer runs are cut into several units).
    No host sync, no allocation: CUDA-graph safe."""
    if (host_v is None) != (dev_v is None):
        raise ValueError("host_v and dev_v go together")
    _check_pair(host, dev, "K")
    if host_v is not None:
        _check_pair(host_v, dev_v, "V")
        if host_v.shape != host.shape or dev_v.shape != dev.shape or host_v.dtype != host.dtype:
            raise ValueError("K and V must have the same shapes and dtype")
    check_transfer_list(heads, src_pages, dst_pages)
    n = heads.numel()
    if page_size < 1 or runs_per_program < 1 or runs_per_program & (runs_per_program - 1):
        raise ValueError("page_size >= 1 and a power-of-two runs_per_program are required")
    if n == 0:
        return
    head_dim = host.shape[2]
    chunk = _unit_tokens(page_size, head_dim, host.element_size(), unit_bytes)
    units = n * (page_size // chunk)
    tiles = triton.cdiv(units, runs_per_program)
    grid = tiles if max_programs is None else max(1, min(tiles, max_programs))
    hk, dk = _as_copy_dtype(host), _as_copy_dtype(dev)
    hv, dv = (hk, dk) if host_v is None else (_as_copy_dtype(host_v), _as_copy_dtype(dev_v))
    _gather_host_blocks_kernel[(grid,)](
        hk,
        dk,
        hv,
        dv,
        heads,
        src_pages,
        dst_pages,
        heads if count is None else count,
        n,
        hk.stride(0),
        hk.stride(1),
        dk.stride(0),
        dk.stride(1),
        hv.stride(0),
        hv.stride(1),
        dv.stride(0),
        dv.stride(1),
        PAGE=page_size,
        CHUNK=chunk,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        RUNS=runs_per_program,
        # a power of two: a few compiled variants whatever n is (extra iterations are masked)
        ITERS=triton.next_power_of_2(triton.cdiv(tiles, grid)),
        HAS_COUNT=count is not None,
        HAS_V=host_v is not None,
        num_warps=num_warps,
    )


class LiveEntries:
    """A gather's live entries (``src_pages >= 0``) moved to the front, in their order, and
    their number, for :func:`gather_host_blocks`'s ``count``.

    The CPU tier's fetch lists every working-set slot of its batch (batch x kv heads x slots),
    and at a high hit rate most of them are hits (``-1``). Compacting such a list first was
    meant to keep more PCIe reads in flight, but it does not pay: with 10% of 1.3 M listed
    entries live, the gather moved 44.9 GB/s as listed and 44.7 GB/s compacted
    (``bench_transfer.py``'s fetch-list rows, on a work-in-progress tree), so the tier
    gathers its lists as they are and this stays for gathers of mostly skipped entries
    elsewhere. The buffers are allocated once for ``capacity`` entries; :meth:`compact` is a
    few static-shape device ops (no host sync: CUDA-graph safe)."""

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        i32 = dict(dtype=torch.int32, device=device)
        # one entry more than the most listed: where the skipped ones are scattered to
        self.heads, self.src_pages, self.dst_pages = (torch.zeros(capacity + 1, **i32)
                                                      for _ in range(3))
        self.count = torch.zeros(1, **i32)
        # scratch of the compaction itself (written in place: no allocation under a graph)
        self._live = torch.zeros(capacity, dtype=torch.bool, device=device)
        self._place = torch.zeros(capacity, dtype=torch.int64, device=device)

    def compact(self, heads: Tensor, src_pages: Tensor, dst_pages: Tensor
                ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(heads, src_pages, dst_pages, count)``: the live entries first, in order; what
        lies past ``count`` is stale and must not be read."""
        n = src_pages.numel()
        if n + 1 > self.heads.numel():
            raise ValueError(f"{n} entries exceed the {self.heads.numel() - 1} compacted ones")
        live, place = self._live[:n], self._place[:n]
        torch.ge(src_pages, 0, out=live)
        torch.cumsum(live, 0, out=place)  # a live entry's place, plus one
        place.sub_(1).masked_fill_(~live, n)  # skipped ones: the spare entry n
        for out, x in ((self.heads, heads), (self.src_pages, src_pages),
                       (self.dst_pages, dst_pages)):
            out[:n + 1].scatter_(0, place, x)
        torch.sum(live, 0, keepdim=True, dtype=torch.int32, out=self.count)
        return self.heads[:n], self.src_pages[:n], self.dst_pages[:n], self.count


def gather_host_blocks_ref(
    host: Tensor,
    dev: Tensor,
    heads: Tensor,
    src_pages: Tensor,
    dst_pages: Tensor,
    page_size: int,
    count: Optional[Tensor] = None,
    *,
    host_v: Optional[Tensor] = None,
    dev_v: Optional[Tensor] = None,
) -> None:
    """Plain-torch reference of :func:`gather_host_blocks` (in place; syncs on ``count``)."""
    n = heads.numel()
    m = n if count is None else min(int(count.reshape(-1)[0]), n)
    h = heads[:m].long().cpu()
    s = src_pages[:m].long().cpu()
    d = dst_pages[:m].long().cpu()
    keep = s >= 0
    h, s, d = h[keep], s[keep], d[keep]
    offs = torch.arange(page_size)
    src_tok = s[:, None] * page_size + offs  # [m, P]
    dst_tok = d[:, None] * page_size + offs
    pairs = [(host, dev)] + ([] if host_v is None else [(host_v, dev_v)])
    for src, dst in pairs:
        rows = src[h[:, None].to(src.device), src_tok.to(src.device)]  # [m, P, D]
        dst[dst_tok.to(dst.device), h[:, None].to(dst.device)] = rows.to(dst.device)
