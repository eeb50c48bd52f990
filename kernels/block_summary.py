"""Per-page running key min/max (the Quest block summaries), maintained as KV is written.

Pages coincide with selection blocks (``page_size == block_size``): position ``p`` of a request
lives in slot ``req_to_token[row, p]`` and ``slot % page_size == p % page_size``, so a block's
summary is the summary of its page. The summaries of one layer are two tensors ``kmin``/``kmax``
of shape ``[num_pages, Hkv, D]`` in the KV dtype (bf16 by default; fp16 and float32 work too):
the min/max of bf16 keys are bf16 values, so storing them in bf16 is exact and halves the bytes
the block scoring reads (the dominant read of a long-context decode step) compared to float32.
float8_e4m3fn summaries (``--sparse-summary-dtype fp8_e4m3``) halve them again: each min is
rounded down and each max up to the fp8 grid (:func:`fp8_directed`), so the Quest bound they
give is looser but still an upper bound (keys beyond ±448 saturate there).

``update_block_summaries`` is called with every batch of keys written to the pool (prefill
chunks, decode tokens): a page whose first slot is written in this call starts clean (a freed
page can be handed to a new request, and its old summary must not leak into the new one); all
other writes fold into the page's running min/max, so a chunk boundary inside a page just
continues the page.

The update is exact and atomic-free (bf16 has no atomic min/max), which relies on how SGLang
allocates and writes pages: **within one call, the keys that land in one page are consecutive
entries of** ``loc`` (a request's extend chunk is contiguous in positions and page aligned,
decode writes one token per request, two requests never write the same page; slots are distinct
except for the padding slot 0, see below). A *run* is a maximal stretch of consecutive ``loc``
entries on one page, so it holds at most ``page_size`` tokens and each page has at most one run
per call. One launch: one program per (token, channel tile); the program of a run's first token
(the first token of the call, or one whose page differs from the previous token's) reduces the
run and either overwrites the page's summary (the run contains the page's first slot,
``slot % page_size == 0``) or folds into it; every other program does nothing. Each page is
written by exactly one program, so there are no races and the result is order independent.
No host sync: safe inside a CUDA graph.

If the precondition is broken (one page's writes split into several runs of one call), two
programs may write the same page and the result is undefined. SGLang's CUDA-graph padding writes
slot 0 (the padding page, never read by a real request) several times in a row: that forms one
run (its first ``page_size`` entries are used), which is harmless.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.selection.params import FP8_MAX, FP8_SUMMARIES
from sglang_ext.selection.reference import round_summaries

FP8_LIMIT: tl.constexpr = tl.constexpr(FP8_MAX)

SUMMARY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_SUMMARIES)


@triton.jit
def fp8_directed(x, UP: tl.constexpr):
    """fp32 ``x`` rounded to the float8_e4m3fn grid toward +inf (``UP``) or -inf, saturating at
    ±448: the reference's :func:`~sglang_ext.selection.reference.to_fp8_directed`, bit for bit.
    The fp8 code is built from the fp32 bits with integer arithmetic (no float conversion:
    Triton's CPU interpreter converts to fp8 wrongly, off by more than one fp8 value): the
    truncated code (sign-magnitude), plus one where the magnitude rounds away from zero and
    anything was cut off; the carry out of the 3 mantissa bits is the next binade."""
    x = tl.minimum(tl.maximum(x, -FP8_LIMIT), FP8_LIMIT)
    bits = x.to(tl.int32, bitcast=True)
    neg = bits < 0  # the sign bit: -0.0 stays negative zero, as torch's cast keeps it
    mag = bits & 0x7FFFFFFF
    exp32 = mag >> 23
    normal = exp32 >= 121  # |x| >= 2**-6, fp8's smallest normal
    code_normal = ((exp32 - 120) << 3) | ((mag >> 20) & 7)  # biased exponent (bias 7), 3 bits
    cut_normal = (mag & 0xFFFFF) != 0
    units = tl.abs(x) * 512.0  # subnormals: multiples of 2**-9 (exact scaling)
    code_sub = units.to(tl.int32)
    cut_sub = units != code_sub.to(tl.float32)
    code = tl.where(normal, code_normal, code_sub)
    cut = tl.where(normal, cut_normal, cut_sub)
    if UP:
        away = ~neg  # up: a positive magnitude grows, a negative one shrinks (truncation)
    else:
        away = neg
    code = code + (away & cut).to(tl.int32)
    code = tl.where(neg, code | 0x80, code)
    return code.to(tl.int8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _update_runs_kernel(
    KMIN,
    KMAX,
    K,
    LOC,
    num_tokens,
    stride_page,
    stride_kn,
    stride_kh,
    PAGE_SIZE: tl.constexpr,
    RUN: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HD: tl.constexpr,
    BLOCK: tl.constexpr,
    FP8: tl.constexpr,
):
    n = tl.program_id(0)
    slot = tl.load(LOC + n).to(tl.int64)
    page = slot // PAGE_SIZE
    prev = tl.load(LOC + n - 1, mask=n > 0, other=0).to(tl.int64)
    start = (n == 0) | ((prev // PAGE_SIZE) != page)

    # The run: the entries n, n+1, ... (at most PAGE_SIZE) up to the first one on another page.
    i = tl.arange(0, RUN)
    idx = n + i
    in_call = start & (i < PAGE_SIZE) & (idx < num_tokens)
    slots = tl.load(LOC + idx, mask=in_call, other=0).to(tl.int64)
    same = in_call & ((slots // PAGE_SIZE) == page)
    run_len = tl.min(tl.where(same, RUN, i), axis=0)  # index of the first entry off the page
    run = i < run_len
    reset = tl.max((run & ((slots % PAGE_SIZE) == 0)).to(tl.int32), axis=0) > 0

    # [RUN, BLOCK] tile of the run's keys over a slice of the page's Hkv*D channels.
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = offs < HD
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    kmask = run[:, None] & cmask[None, :]
    k_ptr = K + idx.to(tl.int64)[:, None] * stride_kn + head[None, :] * stride_kh + dim[None, :]
    k = tl.load(k_ptr, mask=kmask, other=0.0)
    # Keys are in the summary dtype, or the summaries are fp32 (the wrapper rounds other keys
    # first): the fp32 reduction is exact and so is the store in the summary dtype.
    k = k.to(tl.float32)
    run_min = tl.min(tl.where(kmask, k, float("inf")), axis=0)
    run_max = tl.max(tl.where(kmask, k, float("-inf")), axis=0)

    wmask = cmask & start
    fold_into_summary(KMIN, KMAX, page * stride_page + offs, wmask,
                      wmask & (reset == 0), run_min, run_max, FP8)


@triton.jit
def fold_into_summary(KMIN, KMAX, dst, wmask, fold, run_min, run_max, FP8: tl.constexpr):
    """Write a page's summary at ``dst`` (where ``wmask``): the fp32 ``run_min`` /
    ``run_max`` folded into the stored min/max where ``fold``, or replacing it (a page's
    first slot written: the stale summary is not read)."""
    # (fp8 has no inf: the masked loads' fill is applied in fp32)
    old_min = tl.where(fold, tl.load(KMIN + dst, mask=fold, other=0.0).to(tl.float32),
                       float("inf"))
    old_max = tl.where(fold, tl.load(KMAX + dst, mask=fold, other=0.0).to(tl.float32),
                       float("-inf"))
    new_min = tl.minimum(old_min, run_min)
    new_max = tl.maximum(old_max, run_max)
    if FP8:
        # min down, max up: the stored bound still bounds every key. Folding into a stored
        # (already rounded) value is exact: round_down(min(a, b)) = min(round_down(a),
        # round_down(b)) and a rounded value rounds to itself.
        tl.store(KMIN + dst, fp8_directed(new_min, False), mask=wmask)
        tl.store(KMAX + dst, fp8_directed(new_max, True), mask=wmask)
    else:
        tl.store(KMIN + dst, new_min.to(KMIN.dtype.element_ty), mask=wmask)
        tl.store(KMAX + dst, new_max.to(KMAX.dtype.element_ty), mask=wmask)


def update_block_summaries(
    kmin: Tensor, kmax: Tensor, k_new: Tensor, loc: Tensor, page_size: int
) -> None:
    """Fold the keys ``k_new`` ``[N, Hkv, D]`` written at slots ``loc`` ``[N]`` into the
    per-page summaries ``kmin``/``kmax`` (``[num_pages, Hkv, D]``, bf16 / fp16 / float32, both
    the same dtype; updated in place). Keys wider than the summaries are first rounded to the
    summaries' dtype (round to nearest even; min/max commute with it).

    A page whose first slot (``slot % page_size == 0``) is in ``loc`` starts clean; other pages
    fold the new keys into their running min/max.

    Precondition (see the module docstring): within the call, the entries of ``loc`` on one page
    are consecutive (as SGLang's ``out_cache_loc`` is: per request, contiguous positions;
    requests never share a page being written). Launch-only: no host sync, safe to call inside a
    CUDA graph.
    """
    if kmin.dtype not in SUMMARY_DTYPES or kmax.dtype != kmin.dtype:
        raise TypeError(f"kmin/kmax must share one of {SUMMARY_DTYPES}, got {kmin.dtype}, "
                        f"{kmax.dtype}")
    if kmin.shape != kmax.shape or kmin.dim() != 3:
        raise ValueError(
            f"kmin/kmax must both be [num_pages, Hkv, D], got {kmin.shape}, {kmax.shape}"
        )
    if not (kmin.is_contiguous() and kmax.is_contiguous()):
        raise ValueError("kmin/kmax must be contiguous")
    num_tokens = k_new.shape[0]
    if num_tokens == 0:
        return
    num_heads, head_dim = kmin.shape[1], kmin.shape[2]
    if tuple(k_new.shape[1:]) != (num_heads, head_dim):
        raise ValueError(f"k_new {tuple(k_new.shape)} does not match summaries {tuple(kmin.shape)}")
    if k_new.dtype != kmin.dtype and kmin.dtype in (torch.bfloat16, torch.float16):
        # Narrowing (e.g. fp32 keys into bf16 summaries): round with torch, so the rounding is
        # torch's round-to-nearest-even everywhere (Triton's CPU interpreter truncates). Not
        # needed when the summaries are in the KV dtype, the normal case.
        k_new = k_new.to(kmin.dtype)
    if k_new.stride(2) != 1:
        k_new = k_new.contiguous()
    loc = loc.reshape(-1)
    if loc.shape[0] != num_tokens:
        raise ValueError(f"loc has {loc.shape[0]} entries for {num_tokens} keys")

    hd = num_heads * head_dim
    run = triton.next_power_of_2(page_size)
    # Keep the key tile around 4K elements per program (e.g. 16 tokens x 256 channels).
    block = min(triton.next_power_of_2(hd), max(16, 4096 // run))
    _update_runs_kernel[(num_tokens, triton.cdiv(hd, block))](
        kmin,
        kmax,
        k_new,
        loc,
        num_tokens,
        kmin.stride(0),
        k_new.stride(0),
        k_new.stride(1),
        PAGE_SIZE=page_size,
        RUN=run,
        HEAD_DIM=head_dim,
        HD=hd,
        BLOCK=block,
        FP8=kmin.dtype == FP8_SUMMARIES,
        num_warps=4,
    )


def update_block_summaries_ref(
    kmin: Tensor, kmax: Tensor, k_new: Tensor, loc: Tensor, page_size: int
) -> None:
    """Plain-torch reference of :func:`update_block_summaries` (same in-place contract; it does
    not need the consecutive-runs precondition)."""
    loc = loc.reshape(-1).long()
    pages = loc // page_size
    first = pages[loc % page_size == 0]
    lo, hi = kmin.float(), kmax.float()  # exact: the summaries' values are representable
    lo[first] = float("inf")
    hi[first] = float("-inf")
    fp8 = kmin.dtype == FP8_SUMMARIES
    flat = (k_new.float() if fp8 else k_new.to(kmin.dtype).float()).reshape(k_new.shape[0], -1)
    lo.view(lo.shape[0], -1).index_reduce_(0, pages, flat, "amin", include_self=True)
    hi.view(hi.shape[0], -1).index_reduce_(0, pages, flat, "amax", include_self=True)
    if fp8:  # (stored values round to themselves)
        lo, hi = round_summaries(lo, hi, "fp8_e4m3")
    kmin.copy_(lo)
    kmax.copy_(hi)


def allocate_block_summaries(
    num_slots: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    device=None,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[Tensor, Tensor]:
    """Empty (+inf / -inf) summaries for a pool of ``num_slots`` slots: ``(kmin, kmax)`` of
    ``dtype`` (use the KV dtype: bf16 / fp16 are exact for keys of that dtype; float32 for
    anything else; float8_e4m3fn, which has no inf, starts at +448 / -448 and rounds outward:
    :func:`update_block_summaries`). A page's first write resets its summary either way."""
    if dtype not in SUMMARY_DTYPES:
        raise TypeError(f"summary dtype must be one of {SUMMARY_DTYPES}, got {dtype}")
    num_pages = -(-num_slots // page_size)
    shape = (num_pages, num_kv_heads, head_dim)
    empty = FP8_MAX if dtype == FP8_SUMMARIES else float("inf")
    kmin = torch.full(shape, empty, dtype=dtype, device=device)
    kmax = torch.full(shape, -empty, dtype=dtype, device=device)
    return kmin, kmax
