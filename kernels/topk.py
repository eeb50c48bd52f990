"""Batched masked top-k with a fixed k per row (static shapes, no host sync).

``topk_masked(scores, k)``: for every row of ``scores`` (float32 ``[..., N]``, ``-inf`` = masked
out) the column indices of its ``k`` largest finite entries, int32 ``[..., k]``; rows with fewer
than ``k`` finite entries get ``-1`` in the remaining slots. ``-inf`` entries never win.

Two implementations:

* ``impl="triton"`` (default): one program per row runs an exact radix select on the
  order-preserving 32-bit key of each score (4 passes of 8-bit digits, ``tl.histogram``), then
  one compaction pass writes the winners **in ascending index order**, ``-1`` padding at the
  end. Ties at the k-th value go to the lower index, exactly like the reference's
  ``_top_k_mask``, so the selected set matches the oracle bit for bit even with tied scores.
  Rows up to ``_MAX_RESIDENT`` entries are loaded once and kept in registers for all passes;
  longer rows (DS over a whole long context) stream from memory each pass (5 reads per row).
* ``impl="torch"``: ``torch.topk(sorted=False)`` + masking of the ``-inf`` winners. It is
  graph-capturable and needs no host sync, but its tie-breaking is unspecified and its output
  order is arbitrary (``-1`` may sit anywhere).

Only sets matter downstream (the attention is order independent), so the two are
interchangeable; ``benchmarks/bench_operator.py --compare-topk`` times both. The row length and
k are compile-time constants of the Triton kernel (one compile per static shape; this also
keeps every loop bound static, which Triton's CPU interpreter needs with NumPy >= 2.4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_MAX_RESIDENT = 4096  # rows up to this length are kept in registers across the passes
_STREAM_BLOCK = 2048


@triton.jit
def _sortable_key(x):
    """float32 -> int32 whose *unsigned* order is the float order (bit pattern flip)."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))  # -0.0 ties with +0.0
    signed_key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order == float order
    return signed_key ^ -2147483648  # flip the sign bit: unsigned order == float order


@triton.jit
def _pick_bucket(hist, remaining):
    """The largest digit ``d`` with count(digit >= d) >= remaining, and count(digit > d)."""
    bins = tl.arange(0, 256)
    total = tl.sum(hist, axis=0)
    at_least = total - tl.cumsum(hist, axis=0) + hist
    bucket = tl.max(tl.where(at_least >= remaining, bins, 0), axis=0)
    above = tl.sum(tl.where(bins > bucket, hist, 0), axis=0)
    return bucket, above


@triton.jit
def _topk_kernel(
    S,
    OUT,
    stride_s,
    stride_o,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    RESIDENT: tl.constexpr,
):
    rid = tl.program_id(0).to(tl.int64)
    src = S + rid * stride_s
    dst = OUT + rid * stride_o
    offs0 = tl.arange(0, BLOCK)

    if RESIDENT:
        x_res = tl.load(src + offs0, mask=offs0 < N, other=float("-inf"))
        valid_res = x_res > float("-inf")  # NaN is never selected either
        u_res = _sortable_key(x_res)

    # ---- radix select: find the exact key T of the k-th largest finite entry ----------------
    prefix = tl.zeros([], tl.int32)
    remaining = tl.zeros([], tl.int32)
    for d in tl.static_range(4):
        shift = 24 - 8 * d
        prefix_mask = 0 if d == 0 else -(1 << (32 - 8 * d))
        if RESIDENT:
            match = valid_res & ((u_res & prefix_mask) == prefix)
            hist = tl.histogram((u_res >> shift) & 255, 256, mask=match)
        else:
            hist = tl.zeros([256], tl.int32)
            for start in range(0, N, BLOCK):
                offs = start + offs0
                x = tl.load(src + offs, mask=offs < N, other=float("-inf"))
                u = _sortable_key(x)
                match = (x > float("-inf")) & ((u & prefix_mask) == prefix)
                hist += tl.histogram((u >> shift) & 255, 256, mask=match)
        if d == 0:
            remaining = tl.minimum(tl.sum(hist, axis=0), K)  # k_eff = min(k, #finite)
        bucket, above = _pick_bucket(hist, remaining)
        remaining = remaining - above
        prefix = prefix | (bucket << shift)
    # ``remaining`` entries equal to T are taken, the lowest indices first (0 if k_eff == 0:
    # then T is the all-ones key and nothing is strictly above it).
    threshold = prefix ^ -2147483648  # back to signed order for comparisons

    # ---- compaction: winners in ascending index order ---------------------------------------
    taken = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    if RESIDENT:
        key = u_res ^ -2147483648
        gt = valid_res & (key > threshold)
        eq = valid_res & (key == threshold)
        eq_i = eq.to(tl.int32)
        eq_rank = tl.cumsum(eq_i, axis=0) - eq_i
        take = gt | (eq & (eq_rank < remaining))
        take_i = take.to(tl.int32)
        pos = tl.cumsum(take_i, axis=0) - take_i
        tl.store(dst + pos, offs0, mask=take)
        taken = tl.sum(take_i, axis=0)
    else:
        for start in range(0, N, BLOCK):
            offs = start + offs0
            x = tl.load(src + offs, mask=offs < N, other=float("-inf"))
            valid = x > float("-inf")
            key = _sortable_key(x) ^ -2147483648
            gt = valid & (key > threshold)
            eq = valid & (key == threshold)
            eq_i = eq.to(tl.int32)
            eq_rank = ties + tl.cumsum(eq_i, axis=0) - eq_i
            take = gt | (eq & (eq_rank < remaining))
            take_i = take.to(tl.int32)
            pos = taken + tl.cumsum(take_i, axis=0) - take_i
            tl.store(dst + pos, offs, mask=take)
            taken += tl.sum(take_i, axis=0)
            ties += tl.sum(eq_i, axis=0)

    # ---- pad with -1 ---------------------------------------------------------------------------
    for start in range(0, K, OUT_BLOCK):
        o = start + tl.arange(0, OUT_BLOCK)
        tl.store(dst + o, tl.full([OUT_BLOCK], -1, tl.int32), mask=(o >= taken) & (o < K))


def topk_masked(
    scores: Tensor, k: int, out: Tensor | None = None, impl: str = "triton"
) -> Tensor:
    """Indices (int32 ``[..., k]``) of the ``k`` largest finite entries of each row, ``-1``
    padded. See the module docstring for the two implementations."""
    if scores.dtype != torch.float32:
        raise TypeError(f"scores must be float32, got {scores.dtype}")
    lead, n = scores.shape[:-1], scores.shape[-1]
    if out is None:
        out = torch.empty(*lead, k, dtype=torch.int32, device=scores.device)
    elif out.shape != (*lead, k) or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 {(*lead, k)}, got {out.dtype} {tuple(out.shape)}")
    if k == 0 or out.numel() == 0:
        return out
    if impl == "torch":
        return _topk_masked_torch(scores, k, out)
    if impl != "triton":
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")

    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_rows = out.view(-1, k)
    resident = n <= _MAX_RESIDENT
    block = max(16, triton.next_power_of_2(n)) if resident else _STREAM_BLOCK
    out_block = min(1024, max(16, triton.next_power_of_2(k)))
    num_warps = 8 if block >= 4096 else 4
    _topk_kernel[(rows.shape[0],)](
        rows,
        out_rows,
        rows.stride(0),
        out_rows.stride(0),
        N=n,
        K=k,
        BLOCK=block,
        OUT_BLOCK=out_block,
        RESIDENT=resident,
        num_warps=num_warps,
    )
    return out


def _topk_masked_torch(scores: Tensor, k: int, out: Tensor) -> Tensor:
    n = scores.shape[-1]
    kk = min(k, n)
    if kk > 0:
        vals, idx = torch.topk(scores, kk, dim=-1, largest=True, sorted=False)
        out[..., :kk] = torch.where(vals > float("-inf"), idx, -1).to(torch.int32)
    if kk < k:
        out[..., kk:] = -1
    return out


def topk_masked_ref(scores: Tensor, k: int) -> Tensor:
    """Reference: the winners of each row (ties to the lower index, as the selection
    reference's ``_top_k_mask``) in ascending index order, ``-1`` padded: int32 ``[..., k]``."""
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, n)
    out = torch.full((rows.shape[0], k), -1, dtype=torch.int32, device=scores.device)
    for i in range(rows.shape[0]):
        row = rows[i]
        finite = torch.nonzero(row > float("-inf")).flatten()
        kk = min(k, finite.numel())
        if kk == 0:
            continue
        # stable sort by descending score: equal scores keep ascending index order
        order = torch.sort(row[finite], descending=True, stable=True).indices[:kk]
        out[i, :kk] = torch.sort(finite[order]).values.int()
    return out.reshape(*lead, k)
