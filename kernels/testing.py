"""Helpers shared by the kernel tests and ``benchmarks/bench_operator.py --check``.

Builds random decode batches in SGLang's layouts with the awkward parts real pools have:
request rows and pages scattered in larger tables (never the identity mapping), stale data in
unwritten slots, garbage summaries on pages before they are (re)used, and ``req_to_token``
entries past a request's length pointing at a *trap* page whose keys/values/summaries are huge,
so a kernel that reads past the end of a request shows up as a wrong result.

Import this module only after ``TRITON_INTERPRET`` is settled (it imports the kernels).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

from sglang_ext.kernels.block_summary import update_block_summaries

TRAP = 40.0  # |value| of stale keys/values and of the trap page's summaries
DUMMY_PAGE = 0  # page of slot 0, the padding slot (SGLang never hands slot 0 to a request)
TRAP_PAGE = 1


def case_generator(*case: object) -> torch.Generator:
    """A reproducible CPU generator seeded differently for every test case."""
    return torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))


def random_values(
    gen: torch.Generator, *shape: int, dtype=torch.float32, device="cpu", dyadic: bool = False
) -> Tensor:
    """Standard-normal values, or with ``dyadic`` multiples of 1/32 in [-1, 1] (exact in bf16,
    and every D<=128 dot product of them is exact in fp32 whatever the summation order)."""
    if dyadic:
        x = torch.randint(-32, 33, shape, generator=gen) / 32
    else:
        x = torch.randn(shape, generator=gen)
    return x.to(dtype=dtype, device=device)


@dataclass
class PagedBatch:
    """One layer's paged KV pool plus a decode batch over it."""

    k_buffer: Tensor  # [num_slots, Hkv, D]
    v_buffer: Tensor  # [num_slots, Hkv, Dv]
    req_to_token: Tensor  # int32 [rows, max_context]
    req_pool_indices: Tensor  # int64 [B]
    seq_lens: Tensor  # int32 [B]
    page_size: int
    kmin: Tensor | None = None  # [num_pages, Hkv, D], the KV dtype unless asked otherwise
    kmax: Tensor | None = None
    lens: list[int] = field(default_factory=list)

    @property
    def max_blocks(self) -> int:
        return -(-self.req_to_token.shape[1] // self.page_size)

    def keys(self, b: int) -> Tensor:
        """Request ``b``'s keys in position order, ``[L, Hkv, D]``."""
        row, length = int(self.req_pool_indices[b]), self.lens[b]
        return self.k_buffer[self.req_to_token[row, :length].long()]

    def values(self, b: int) -> Tensor:
        row, length = int(self.req_pool_indices[b]), self.lens[b]
        return self.v_buffer[self.req_to_token[row, :length].long()]


def make_paged_batch(
    gen: torch.Generator,
    lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype=torch.float32,
    device="cpu",
    head_dim_v: int | None = None,
    max_context: int | None = None,
    summary_chunks: int = 3,
    dyadic: bool = False,
    spare_pages: int = 5,
    summary_dtype: torch.dtype | None = None,
    latent_values: int | None = None,
    value_scale: float = 1.0,
) -> PagedBatch:
    """A batch of requests of lengths ``lens`` (``seq_len`` includes the current token, whose
    k/v is written), with block summaries built by :func:`update_block_summaries` from the KV
    written in ``summary_chunks`` rounds (each round writes a random-length chunk of every
    request in one call, so chunk boundaries fall inside pages). ``summary_chunks=0`` skips
    the summaries. The summaries are in ``summary_dtype`` (default: the KV ``dtype``; the
    garbage they start with saturates at fp8's ±448 for float8_e4m3fn). ``value_scale``
    multiplies the requests' keys (not with ``dyadic``).

    ``latent_values=R`` lays the pool out as SGLang's MLA pool: ``v_buffer`` is the view
    ``k_buffer[..., :R]`` (the latent part of each row; ``head_dim_v`` is then ``R``)."""
    bs = page_size
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    batch = len(lens)
    if max_context is None:
        max_context = -(-(max(lens) + bs) // bs) * bs
    if max(lens) > max_context:
        raise ValueError("a length exceeds max_context")
    blocks = [-(-length // bs) for length in lens]
    num_pages = 2 + sum(blocks) + spare_pages
    num_slots = num_pages * bs

    # Pages 2.. are handed out in a random order; rows are scattered among unused ones.
    page_perm = (torch.randperm(num_pages - 2, generator=gen) + 2).tolist()
    num_rows = batch + 3
    rows = (torch.randperm(num_rows - 1, generator=gen)[:batch] + 1).tolist()
    offs = torch.arange(max_context) % bs
    req_to_token = torch.zeros(num_rows, max_context, dtype=torch.int32)
    req_to_token[1:] = (TRAP_PAGE * bs + offs).int()  # past-the-end entries hit the trap page

    k_buffer = torch.full((num_slots, num_kv_heads, head_dim), TRAP, dtype=dtype)
    v_buffer = torch.full((num_slots, num_kv_heads, head_dim_v), -TRAP, dtype=dtype)
    # the padding slot's page holds ordinary values
    k_buffer[:bs] = random_values(gen, bs, num_kv_heads, head_dim, dtype=dtype, dyadic=dyadic)
    v_buffer[:bs] = random_values(gen, bs, num_kv_heads, head_dim_v, dtype=dtype)

    slots_of = []
    start = 0
    for b, length in enumerate(lens):
        pages = torch.tensor(page_perm[start : start + blocks[b]], dtype=torch.int64)
        start += blocks[b]
        slots = (pages[:, None] * bs + torch.arange(bs)).flatten()
        n = min(blocks[b] * bs, max_context)
        req_to_token[rows[b], :n] = slots[:n].int()
        slots = slots[:length]  # the last page's tail stays unwritten (stale TRAP values)
        slots_of.append(slots)
        k_buffer[slots] = (random_values(gen, length, num_kv_heads, head_dim, dyadic=dyadic)
                           * value_scale).to(dtype)
        v_buffer[slots] = random_values(gen, length, num_kv_heads, head_dim_v, dtype=dtype)

    k_buffer = k_buffer.to(device)
    if latent_values is not None:
        if num_kv_heads != 1 or not 0 < latent_values <= head_dim:
            raise ValueError("an MLA pool has one latent head of head_dim >= latent_values")
        v_buffer = k_buffer[..., :latent_values]
    pb = PagedBatch(
        k_buffer=k_buffer,
        v_buffer=v_buffer.to(device),
        req_to_token=req_to_token.to(device),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        page_size=bs,
        lens=list(lens),
    )
    if summary_chunks <= 0:
        return pb

    # Garbage summaries, as pages freed by earlier requests would have.
    kmin = torch.randn(num_pages, num_kv_heads, head_dim, generator=gen) - 5
    kmax = torch.randn(num_pages, num_kv_heads, head_dim, generator=gen) + 5
    kmin[TRAP_PAGE], kmax[TRAP_PAGE] = -TRAP * 4, TRAP * 4
    summary_dtype = dtype if summary_dtype is None else summary_dtype
    if summary_dtype == torch.float8_e4m3fn:
        kmin, kmax = kmin.clamp(-448, 448), kmax.clamp(-448, 448)
    kmin = kmin.to(device=device, dtype=summary_dtype)
    kmax = kmax.to(device=device, dtype=summary_dtype)
    cuts = []
    for length in lens:
        inner = torch.randperm(max(length - 1, 0), generator=gen)[: summary_chunks - 1] + 1
        cuts.append([0] + sorted(inner.tolist()) + [length])
    for i in range(summary_chunks):
        locs = []
        for b in range(batch):
            if i + 1 < len(cuts[b]):
                locs.append(slots_of[b][cuts[b][i] : cuts[b][i + 1]])
        if not locs:
            continue
        loc = torch.cat(locs).to(device)
        update_block_summaries(kmin, kmax, pb.k_buffer[loc], loc, bs)
    pb.kmin, pb.kmax = kmin, kmax
    return pb
