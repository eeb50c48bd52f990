"""Batched masked top-k: a static k per row, optionally lowered per request (no host sync).

``topk_masked(scores, k)``: for every row of ``scores`` (float32 ``[..., N]``, ``-inf`` = masked
out) the column indices of its ``k`` largest finite entries, int32 ``[..., k]``; rows with fewer
than ``k`` finite entries get ``-1`` in the remaining slots. ``-inf`` entries never win.

Two implementations:

* ``impl="triton"`` (default): one program per row runs an exact radix select on the
  order-preserving 32-bit key of each score (4 passes of 8-bit digits, ``tl.histogram``; a
  pass is skipped once the k-th value's bucket is taken whole, usually the last one for
  continuous scores; the digit width is selectable), then
  one compaction pass writes the winners **in ascending index order**, ``-1`` padding at the
  end. Ties at the k-th value go to the lower index, exactly like the reference's
  ``_top_k_mask``, so the selected set matches the oracle bit for bit even with tied scores.
  Rows up to ``_MAX_RESIDENT`` (8192: the block top-k of a 128k context at block size 16)
  entries are loaded once and kept in registers for all passes; longer rows (DS over a whole
  long context) stream from memory each pass (5 reads per row). Each pass is one histogram,
  one scan and one reduction; the compaction is one scan (two counts packed in one int32).
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

_MAX_RESIDENT = 8192  # rows up to this length are kept in registers across the passes
_STREAM_BLOCK = 2048


@triton.jit
def _sortable_key(x):
    """float32 -> int32 whose *unsigned* order is the float order (bit pattern flip)."""
    bits = tl.where(x == 0.0, 0, x.to(tl.int32, bitcast=True))  # -0.0 ties with +0.0
    signed_key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order == float order
    return signed_key ^ -2147483648  # flip the sign bit: unsigned order == float order


@triton.jit
def _pick_bucket(hist, remaining, NUM_BINS: tl.constexpr):
    """For the digit histogram ``hist``: the largest digit ``d`` with count(digit >= d) >=
    remaining, count(digit > d) and count(digit == d).

    One scan and one reduction: ``at_least[d] = count(digit >= d)`` does not increase with
    ``d``, so the bucket is the largest ``d`` with ``at_least[d] >= remaining``; a max over
    ``(d << 48) | (at_least[d] << 24) | hist[d]`` where ``at_least[d] >= remaining`` gives all
    three (counts < 2**24, checked by the wrapper)."""
    bins = tl.arange(0, NUM_BINS).to(tl.int64)
    at_least = tl.cumsum(hist, axis=0, reverse=True)
    packed = (bins << 48) | (at_least.to(tl.int64) << 24) | hist.to(tl.int64)
    best = tl.max(tl.where(at_least >= remaining, packed, -1), axis=0)
    bucket = (best >> 48).to(tl.int32)
    in_bucket = (best & 0xFFFFFF).to(tl.int32)
    above = ((best >> 24) & 0xFFFFFF).to(tl.int32) - in_bucket
    return bucket, above, in_bucket


@triton.jit
def _topk_row(
    src,
    dst,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    OUT_BLOCK: tl.constexpr,
    RESIDENT: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    EARLY_EXIT: tl.constexpr,
    k_row=None,
    n_row=None,
    payload=None,
    dst2=None,
    payload2=None,
    write=None,
):
    """The top-k of one row: ``dst[0:K]`` = the winners' indices into ``src[0:N]`` in
    ascending order, ``-1`` padded (the whole program works on this row). ``k_row`` (a runtime
    value <= K, or None for K) lowers this row's k: the accuracy guard's per-request budgets.
    ``n_row`` (runtime, or None for N) says that entries from there on are all ``-inf``: the
    streaming passes skip those blocks.

    ``payload`` (int32 ``[N]``, or None): each winner writes ``payload[i]`` instead of its index
    ``i`` (same order, same ``-1`` padding), so a caller that wants something looked up per
    winner (the selected tokens' KV slots) gets it straight from the compaction, without a
    second pass over the winners. ``dst2`` / ``payload2``: a second such output. ``write``
    (a runtime bool, or None for True): False writes nothing at all."""
    offs0 = tl.arange(0, BLOCK)
    if n_row is not None:
        n_lim = tl.minimum(n_row, N)
    else:
        n_lim = N
    NUM_BINS: tl.constexpr = 1 << RADIX_BITS
    NUM_PASSES: tl.constexpr = (32 + RADIX_BITS - 1) // RADIX_BITS

    if RESIDENT:
        x_res = tl.load(src + offs0, mask=offs0 < N, other=float("-inf"))
        valid_res = x_res > float("-inf")  # NaN is never selected either
        u_res = _sortable_key(x_res)

    # ---- radix select: find the exact key T of the k-th largest finite entry ----------------
    # Digits of RADIX_BITS bits from the top (the last one may be narrower). After each pass,
    # ``prefix`` holds the digits of T found so far and ``remaining`` how many winners share
    # them. If the chosen bucket is taken whole (its count == remaining), T is ``prefix``
    # itself (lower bits 0) with every entry >= T a winner: the remaining passes are skipped.
    prefix = tl.zeros([], tl.int32)
    remaining = tl.zeros([], tl.int32)
    k_eff = tl.zeros([], tl.int32)
    done = tl.zeros([], tl.int32)
    for d in tl.static_range(NUM_PASSES):
        # compile-time per pass: bits >= hi are fixed by ``prefix``; the digit is [shift, hi)
        hi = 32 - RADIX_BITS * d
        shift = hi - RADIX_BITS if hi > RADIX_BITS else 0
        digit_mask = (1 << (hi - shift)) - 1
        prefix_mask = 0 if d == 0 else -(1 << hi)
        if done == 0:
            if RESIDENT:
                match = valid_res & ((u_res & prefix_mask) == prefix)
                hist = tl.histogram((u_res >> shift) & digit_mask, NUM_BINS, mask=match)
            else:
                hist = tl.zeros([NUM_BINS], tl.int32)
                for start in range(0, N, BLOCK):
                    if start < n_lim:
                        offs = start + offs0
                        x = tl.load(src + offs, mask=offs < N, other=float("-inf"))
                        u = _sortable_key(x)
                        match = (x > float("-inf")) & ((u & prefix_mask) == prefix)
                        hist += tl.histogram((u >> shift) & digit_mask, NUM_BINS, mask=match)
            if d == 0:
                remaining = tl.minimum(tl.sum(hist, axis=0), K)  # k_eff = min(k, #finite)
                if k_row is not None:
                    remaining = tl.minimum(remaining, k_row)
                k_eff = remaining
            bucket, above, in_bucket = _pick_bucket(hist, remaining, NUM_BINS)
            remaining = remaining - above
            prefix = prefix | (bucket << shift)
            if EARLY_EXIT and d + 1 < NUM_PASSES:
                if in_bucket == remaining:
                    done = tl.full([], 1, tl.int32)
                    remaining = tl.full([], N + 1, tl.int32)  # all entries equal to T win
    # ``remaining`` entries equal to T are taken, the lowest indices first (0 if k_eff == 0:
    # then T is the all-ones key and nothing is strictly above it).
    threshold = prefix ^ -2147483648  # back to signed order for comparisons

    # ---- compaction: winners in ascending index order ---------------------------------------
    # One scan counts both the entries above T (high 16 bits) and those equal to T (low 16
    # bits; a block holds at most 8192 entries, so the low half never carries). Winner i goes
    # to (#above before i) + min(#equal before i, remaining).
    if RESIDENT:
        key = u_res ^ -2147483648
        gt = valid_res & (key > threshold)
        eq = valid_res & (key == threshold)
        packed = (gt.to(tl.int32) << 16) | eq.to(tl.int32)
        before = tl.cumsum(packed, axis=0) - packed
        eq_before = before & 0xFFFF
        take = gt | (eq & (eq_before < remaining))
        if write is not None:
            take = take & write
        pos = (before >> 16) + tl.minimum(eq_before, remaining)
        if payload is not None:
            # read for the winners only, once the select is done (nothing held through it)
            tl.store(dst + pos, tl.load(payload + offs0, mask=take, other=-1), mask=take)
        else:
            tl.store(dst + pos, offs0, mask=take)
        if payload2 is not None:
            tl.store(dst2 + pos, tl.load(payload2 + offs0, mask=take, other=-1), mask=take)
    else:
        gt_seen = tl.zeros([], tl.int32)
        eq_seen = tl.zeros([], tl.int32)
        for start in range(0, N, BLOCK):
            if start < n_lim:
                offs = start + offs0
                x = tl.load(src + offs, mask=offs < N, other=float("-inf"))
                valid = x > float("-inf")
                key = _sortable_key(x) ^ -2147483648
                gt = valid & (key > threshold)
                eq = valid & (key == threshold)
                packed = (gt.to(tl.int32) << 16) | eq.to(tl.int32)
                before = tl.cumsum(packed, axis=0) - packed
                eq_before = eq_seen + (before & 0xFFFF)
                take = gt | (eq & (eq_before < remaining))
                if write is not None:
                    take = take & write
                pos = gt_seen + (before >> 16) + tl.minimum(eq_before, remaining)
                if payload is not None:
                    tl.store(dst + pos, tl.load(payload + offs, mask=take, other=-1), mask=take)
                else:
                    tl.store(dst + pos, offs, mask=take)
                if payload2 is not None:
                    tl.store(dst2 + pos, tl.load(payload2 + offs, mask=take, other=-1),
                             mask=take)
                block_counts = tl.sum(packed, axis=0)
                gt_seen += block_counts >> 16
                eq_seen += block_counts & 0xFFFF

    # ---- pad with -1: exactly k_eff winners were written -------------------------------------
    for start in range(0, K, OUT_BLOCK):
        o = start + tl.arange(0, OUT_BLOCK)
        pad = (o >= k_eff) & (o < K)
        if write is not None:
            pad = pad & write
        tl.store(dst + o, tl.full([OUT_BLOCK], -1, tl.int32), mask=pad)
        if payload2 is not None:
            tl.store(dst2 + o, tl.full([OUT_BLOCK], -1, tl.int32), mask=pad)


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
    RADIX_BITS: tl.constexpr,
    EARLY_EXIT: tl.constexpr,
    K_ROWS,
    N_ROWS,
    ROWS_PER_K,
    HAS_K_ROWS: tl.constexpr,
    HAS_N_ROWS: tl.constexpr,
    OUT_ROWS,
    HAS_OUT_ROWS: tl.constexpr,
):
    rid = tl.program_id(0).to(tl.int64)
    k_row = None
    n_row = None
    if HAS_K_ROWS:
        k_row = tl.load(K_ROWS + rid // ROWS_PER_K)
    if HAS_N_ROWS:
        n_row = tl.load(N_ROWS + rid // ROWS_PER_K)
    out_rid = rid
    if HAS_OUT_ROWS:  # the leading entry's row of the output table
        out_rid = tl.load(OUT_ROWS + rid // ROWS_PER_K).to(tl.int64) * ROWS_PER_K + rid % ROWS_PER_K
    _topk_row(S + rid * stride_s, OUT + out_rid * stride_o, N, K, BLOCK, OUT_BLOCK, RESIDENT,
              RADIX_BITS, EARLY_EXIT, k_row, n_row)


def topk_launch_config(n: int, k: int, radix_bits: int = 8) -> dict:
    """The compile-time parameters (and num_warps) of :func:`_topk_row` for rows of ``n``
    entries and a given ``k`` (checked against the kernel's limits)."""
    resident = n <= _MAX_RESIDENT
    block = max(16, triton.next_power_of_2(n)) if resident else _STREAM_BLOCK
    if block > 32768:  # the compaction packs two counts of up to BLOCK into one int32
        raise ValueError(f"top-k block {block} too large")
    if n >= 1 << 24:  # _pick_bucket packs counts of up to n in 24 bits
        raise ValueError(f"top-k rows of {n} entries are too long (max {(1 << 24) - 1})")
    if not 5 <= radix_bits <= 8:
        raise ValueError(f"radix_bits must be in 5..8, got {radix_bits}")
    return dict(
        N=n,
        K=k,
        BLOCK=block,
        OUT_BLOCK=min(1024, max(16, triton.next_power_of_2(k))),
        RESIDENT=resident,
        RADIX_BITS=radix_bits,
        num_warps=16 if block >= 8192 else 8 if block >= 4096 else 4,
    )


def topk_masked(
    scores: Tensor,
    k: int,
    out: Tensor | None = None,
    impl: str = "triton",
    radix_bits: int = 8,
    early_exit: bool = True,
    k_rows: Tensor | None = None,
    n_rows: Tensor | None = None,
    out_rows: Tensor | None = None,
    num_warps: int | None = None,
) -> Tensor:
    """Indices (int32 ``[..., k]``) of the ``k`` largest finite entries of each row, ``-1``
    padded. See the module docstring for the two implementations.

    ``out_rows`` (``[scores.shape[0]]`` row ids, Triton only): ``out`` is a table
    ``[R, *scores.shape[1:-1], k]`` and leading entry ``i`` writes its row ``out_rows[i]``
    (a scatter into per-request state without a copy); the other rows are left alone.

    ``k_rows`` (int32 ``[scores.shape[0]]``, values <= ``k``) gives each leading entry (all the
    rows under it, e.g. a request's kv heads) its own k; the output keeps ``k`` columns.
    ``n_rows`` (same shape; Triton only, a hint) promises that those rows are ``-inf`` from
    that column on, so the streaming passes over long rows stop there.

    Triton only: ``radix_bits`` (5..8) is the digit width of the radix select (8: 4 passes of
    a 256-bin histogram; 6: 6 passes of a cheaper 64-bin one), ``early_exit`` skips the
    remaining passes once the k-th value's bucket is taken whole, ``num_warps`` overrides the
    launch's (:func:`topk_launch_config`). Results are identical."""
    if scores.dtype != torch.float32:
        raise TypeError(f"scores must be float32, got {scores.dtype}")
    lead, n = scores.shape[:-1], scores.shape[-1]
    if out_rows is not None:
        if impl != "triton" or out is None or out_rows.shape != lead[:1]:
            raise ValueError("out_rows needs the Triton top-k, an output table and one row id "
                             "per leading entry")
        if out.shape[1:] != (*lead[1:], k) or out.dtype != torch.int32 or not out.is_contiguous():
            raise ValueError(f"the output table must be contiguous int32 [R, "
                             f"{(*lead[1:], k)}], got {out.dtype} {tuple(out.shape)}")
    elif out is None:
        out = torch.empty(*lead, k, dtype=torch.int32, device=scores.device)
    elif out.shape != (*lead, k) or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 {(*lead, k)}, got {out.dtype} {tuple(out.shape)}")
    if k == 0 or out.numel() == 0:
        return out
    if k_rows is not None and (k_rows.dim() != 1 or k_rows.shape[0] != scores.shape[0]):
        raise ValueError(f"k_rows must be [{scores.shape[0]}], got {tuple(k_rows.shape)}")
    if impl == "torch":
        return _topk_masked_torch(scores, k, out, k_rows)
    if impl != "triton":
        raise ValueError(f"impl must be 'triton' or 'torch', got {impl!r}")

    rows = scores.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out_flat = out.view(-1, k)
    _topk_kernel[(rows.shape[0],)](
        rows,
        out_flat,
        rows.stride(0),
        out_flat.stride(0),
        EARLY_EXIT=early_exit,
        K_ROWS=out_flat if k_rows is None else k_rows,
        N_ROWS=out_flat if n_rows is None else n_rows,
        ROWS_PER_K=max(1, rows.shape[0] // max(1, scores.shape[0])),
        HAS_K_ROWS=k_rows is not None,
        HAS_N_ROWS=n_rows is not None,
        OUT_ROWS=out_flat if out_rows is None else out_rows,
        HAS_OUT_ROWS=out_rows is not None,
        **{**topk_launch_config(n, k, radix_bits),
           **({} if num_warps is None else {"num_warps": num_warps})},
    )
    return out


def _topk_masked_torch(scores: Tensor, k: int, out: Tensor, k_rows: Tensor | None = None) -> Tensor:
    n = scores.shape[-1]
    kk = min(k, n)
    if kk > 0:
        # Per-row k keeps the first k_row of the winners sorted by score: sorted=True then.
        vals, idx = torch.topk(scores, kk, dim=-1, largest=True, sorted=k_rows is not None)
        keep = vals > float("-inf")
        if k_rows is not None:
            rank = torch.arange(kk, device=scores.device)
            shape = (k_rows.shape[0],) + (1,) * (scores.dim() - 1)
            keep &= rank < k_rows.to(scores.device).view(shape)
        out[..., :kk] = torch.where(keep, idx, -1).to(torch.int32)
    if kk < k:
        out[..., kk:] = -1
    return out


def topk_masked_ref(scores: Tensor, k: int, k_rows: Tensor | None = None) -> Tensor:
    """Reference: the winners of each row (ties to the lower index, as the selection
    reference's ``_top_k_mask``) in ascending index order, ``-1`` padded: int32 ``[..., k]``
    (``k_rows``: see :func:`topk_masked`)."""
    lead, n = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, n)
    rows_per_k = rows.shape[0] // max(1, scores.shape[0]) if k_rows is not None else 1
    out = torch.full((rows.shape[0], k), -1, dtype=torch.int32, device=scores.device)
    for i in range(rows.shape[0]):
        row = rows[i]
        finite = torch.nonzero(row > float("-inf")).flatten()
        kk = min(k, finite.numel())
        if k_rows is not None:
            kk = min(kk, int(k_rows[i // rows_per_k]))
        if kk == 0:
            continue
        # stable sort by descending score: equal scores keep ascending index order
        order = torch.sort(row[finite], descending=True, stable=True).indices[:kk]
        out[i, :kk] = torch.sort(finite[order]).values.int()
    return out.reshape(*lead, k)
