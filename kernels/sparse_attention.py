"""Decode attention over per-(request, kv head) selected slots, split-KV with an LSE merge.

``selected_slots`` ``[B, Hkv, K]`` (int32/int64, ``-1`` = padding) lists, for each request and
kv head, the KV-pool slots its query heads attend. Stage 1 (grid ``B x Hkv x splits``): one
program takes one chunk of the K selected slots of one (request, kv head), gathers their K/V
rows once and serves **all** query heads of the group from them (GQA reuse: the group's queries
are the M dimension of the ``tl.dot``), keeping a running (max, sum, acc) online softmax; it
writes the chunk's normalised partial output and its log-sum-exp. Stage 2 (grid ``B x Hq``)
merges the chunks FlashInfer-style: ``out = sum_s exp(lse_s - lse) * o_s`` with
``lse = logsumexp_s lse_s``.

Returns the output ``[B, Hq, Dv]`` in q's dtype and the float32 LSE ``[B, Hq]`` (natural log,
of the ``sm_scale``-scaled logits), so partial attentions can be merged later. A head with no
valid slot gets output 0 and LSE ``-inf`` (as the reference's ``sparse_attention_with_lse``).
The number of splits depends only on static shapes (``B``, ``Hkv``, ``K``), so the two launches
are CUDA-graph safe.

MLA (SGLang's latent pool, :mod:`sglang_ext.selection.mla`) is the case ``Hkv = 1``, ``D = R + P``
(576), ``Dv = R`` (512) with ``v_buffer`` the strided view ``k_buffer[..., :R]``. Two parameters keep
its per-program tiles bounded: head dims above 256 are walked in 64-wide chunks for ``q·k``
(:func:`head_dim_tiling`; a 576-dim row padded to one 1024-wide tile would not fit in registers
or shared memory), and a group wider than the output tile allows (``HEAD_TILE`` query heads, 16 at
``Dv = 512``, e.g. 128 heads of DeepSeek-V3) is served by several programs per kv head. Neither
changes anything for MHA/GQA heads (D <= 256 and groups of at most 64 heads: one chunk, one head
tile, the tile sizes as before).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.selection.reference import sparse_attention_with_lse

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_BLOCK_N = 64  # selected slots per stage-1 tile
# Head dims up to this are one tile; wider ones (MLA's 576) are walked in _D_CHUNK-wide chunks.
_MAX_WHOLE_HEAD_DIM = 256
_D_CHUNK = 64
# fp32 accumulator elements (query heads x Dv) one stage-1 program keeps: 64 registers per
# thread at 4 warps. Dv = 128 allows 64 heads (every GQA group), Dv = 512 (MLA) 16.
_ACC_ELEMENTS = 8192
# Value tiles at least this wide (MLA's 512-dim latent) are gathered 32 slots at a time.
_WIDE_DV = 512
# Launch defaults (benchmarks/bench_sparse_attention.py): programs per SM that the split count
# aims for, V gathered beside K, tiles of padding only skipped by a branch, warps and software
# pipeline stages of a stage-1 program.
PROGRAMS_PER_SM = 2
# A batch with at most FEW_ROWS_PER_SM (request, kv head) rows per SM aims for more splits: at
# 4 and 17 requests x 8 kv heads on 132 SMs, 8 programs per SM took 21.5 / 64.9 us per layer
# against 2's 24.9 / 74.0; at 30 requests 2 stays faster (86.1 against 94.3 us;
# benchmarks/results/kernels/sparse_attention_h200.json, CUDA graphs, L2 flushed). Without the
# padding-tile branch (below), 4 programs per SM beat 8 at 19 requests: 56.4 against 58.8 us
# (sparse_attention_h200_pipelining_b19.json).
FEW_ROWS_PER_SM = 1.5
FEW_ROWS_PROGRAMS_PER_SM = 4
DEFAULT_EARLY_V = False
# Tiles of padding only (a selection shorter than the budget) are computed masked rather than
# skipped by a branch: the branch keeps Triton from pipelining the tile loop, and long
# requests, whose tiles are all full, paid for it: at 19 requests x 32k 56.4 against 79.4 us
# at 4 programs per SM, 58.8 against 61.6 at 8 (sparse_attention_h200_pipelining_b19.json).
DEFAULT_SKIP_PAD_TILES = False
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 2


def upcasts_kv(q: Tensor, k_buffer: Tensor) -> bool:
    """Whether a kernel reads an 8-bit float KV cache as q's 16-bit type tile by tile (the dots
    keep q's precision) instead of rounding q to the cache's type."""
    return k_buffer.element_size() == 1 and q.element_size() > 1


def head_dim_tiling(head_dim: int) -> tuple[int, int]:
    """(tile width, number of tiles) covering a head dim: one power-of-two tile up to 256 dims,
    otherwise 64-wide chunks (576 = 9 x 64, no padding). Static: CUDA-graph safe."""
    whole = max(16, triton.next_power_of_2(head_dim))
    if whole <= _MAX_WHOLE_HEAD_DIM:
        return whole, 1
    return _D_CHUNK, triton.cdiv(head_dim, _D_CHUNK)


@triton.jit
def _attend_tile(
    q,
    q_rows,
    K_BUFFER,
    V_BUFFER,
    slot,
    g,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    hmask,
    m_i,
    l_i,
    acc,
    qk_scale_log2,
    HEAD_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    EARLY_V: tl.constexpr,
    KV_UPCAST: tl.constexpr,
):
    """One tile of BLOCK_N selected slots into the running (max, sum, acc) of a head tile."""
    q_type = q_rows.dtype.element_ty
    valid = slot >= 0
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dvmask = dv < HEAD_DIM_V
    k_rows = K_BUFFER + slot[:, None] * stride_kn + g * stride_kh
    v_ptrs = V_BUFFER + slot[:, None] * stride_vn + g * stride_vh + dv[None, :]
    v_mask = valid[:, None] & dvmask[None, :]
    if D_CHUNKS == 1:
        k = tl.load(k_rows + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        if KV_UPCAST:
            k = k.to(q_type)
        if EARLY_V:
            # V's gather issued beside K's: twice the reads in flight per tile (a decode over
            # scattered slots is bound by how many random reads each SM keeps in flight)
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [HT, BN]
    else:
        if EARLY_V:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)
        # wide heads (MLA's 576): q·k chunk by chunk; the q chunks are re-read (L1)
        s = tl.zeros([HEAD_TILE, BLOCK_N], tl.float32)
        for c in tl.static_range(D_CHUNKS):
            dc = c * BLOCK_D + d
            dcmask = dc < HEAD_DIM
            qc = tl.load(q_rows + dc[None, :], mask=hmask[:, None] & dcmask[None, :], other=0.0)
            kc = tl.load(k_rows + dc[None, :], mask=valid[:, None] & dcmask[None, :], other=0.0)
            if KV_UPCAST:
                kc = kc.to(q_type)
            if DOT_F32:
                qc = qc.to(tl.float32)
                kc = kc.to(tl.float32)
            s = tl.dot(qc, tl.trans(kc), acc=s, input_precision=PRECISION)
    s = s * qk_scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if not EARLY_V:
        v = tl.load(v_ptrs, mask=v_mask, other=0.0)
    if KV_UPCAST:
        v = v.to(q_type)
    p = p.to(v.dtype)  # 16-bit probabilities for the tensor-core PV product
    if DOT_F32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _sparse_attn_split_kernel(
    Q,
    K_BUFFER,
    V_BUFFER,
    SLOTS,
    PART_O,
    PART_LSE,
    qk_scale_log2,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_sb,
    stride_sg,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    NUM_SEL: tl.constexpr,
    CHUNK: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_TILE: tl.constexpr,
    NUM_HEAD_TILES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    EARLY_V: tl.constexpr,
    SKIP_PAD_TILES: tl.constexpr,
    KV_UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) // NUM_HEAD_TILES
    head_tile = tl.program_id(1) % NUM_HEAD_TILES
    split = tl.program_id(2)

    hh = head_tile * HEAD_TILE + tl.arange(0, HEAD_TILE)
    heads = g * GROUP + hh
    hmask = hh < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dvmask = dv < HEAD_DIM_V
    q_rows = Q + b * stride_qb + heads[:, None] * stride_qh

    if D_CHUNKS == 1:  # the whole head is one tile: keep q in registers for every KV tile
        q = tl.load(q_rows + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
    else:  # wide heads re-read their q chunks per tile
        q = 0.0

    m_i = tl.full([HEAD_TILE], float("-inf"), tl.float32)
    l_i = tl.zeros([HEAD_TILE], tl.float32)
    acc = tl.zeros([HEAD_TILE, BLOCK_DV], tl.float32)

    slot_base = SLOTS + b * stride_sb + g * stride_sg
    for i in range(CHUNK // BLOCK_N):
        n = split * CHUNK + i * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_base + n, mask=n < NUM_SEL, other=-1).to(tl.int64)
        if SKIP_PAD_TILES:
            # A tile of padding only (slots are left-packed, so this is the tail of a row whose
            # budget is below the workspace's: the accuracy guard's per-request budgets) adds
            # nothing: skip its loads and dots. The branch keeps Triton from pipelining the
            # loop's loads, which the branch-free variant (masked loads, no traffic) allows.
            if tl.max(slot) >= 0:
                m_i, l_i, acc = _attend_tile(
                    q, q_rows, K_BUFFER, V_BUFFER, slot, g, stride_kn, stride_kh, stride_vn,
                    stride_vh, hmask, m_i, l_i, acc, qk_scale_log2, HEAD_TILE, HEAD_DIM,
                    HEAD_DIM_V, BLOCK_D, D_CHUNKS, BLOCK_DV, BLOCK_N, PRECISION, DOT_F32,
                    EARLY_V, KV_UPCAST)
        else:
            m_i, l_i, acc = _attend_tile(
                q, q_rows, K_BUFFER, V_BUFFER, slot, g, stride_kn, stride_kh, stride_vn,
                stride_vh, hmask, m_i, l_i, acc, qk_scale_log2, HEAD_TILE, HEAD_DIM,
                HEAD_DIM_V, BLOCK_D, D_CHUNKS, BLOCK_DV, BLOCK_N, PRECISION, DOT_F32, EARLY_V,
                KV_UPCAST)

    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(
        PART_O + b * stride_pob + heads[:, None] * stride_poh + split * stride_pos + dv[None, :],
        o,
        mask=hmask[:, None] & dvmask[None, :],
    )
    tl.store(PART_LSE + b * stride_plb + heads * stride_plh + split, lse2, mask=hmask)


@triton.jit
def _sparse_attn_merge_kernel(
    PART_O,
    PART_LSE,
    OUT,
    LSE,
    stride_pob,
    stride_poh,
    stride_pos,
    stride_plb,
    stride_plh,
    stride_ob,
    stride_oh,
    stride_lb,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    LN2: tl.constexpr,
    v_scale,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    smask = s < NUM_SPLITS
    dv = tl.arange(0, BLOCK_DV)
    dvmask = dv < HEAD_DIM_V
    lse2 = tl.load(PART_LSE + b * stride_plb + h * stride_plh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse2, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse2 - m_safe)  # 0 for empty splits
    total = tl.sum(w, axis=0)
    o = tl.load(
        PART_O + b * stride_pob + h * stride_poh + s[:, None] * stride_pos + dv[None, :],
        mask=smask[:, None] & dvmask[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], axis=0) * v_scale / tl.where(total == 0.0, 1.0, total)
    empty = total == 0.0
    lse = tl.where(empty, float("-inf"), (m_safe + tl.log2(tl.where(empty, 1.0, total))) * LN2)
    tl.store(OUT + b * stride_ob + h * stride_oh + dv, out.to(OUT.dtype.element_ty), mask=dvmask)
    tl.store(LSE + b * stride_lb + h, lse)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sm_count(device=None) -> int:
    """SMs of a CUDA ``device`` (cached: launch defaults ask on every call); 4 elsewhere, so
    that CPU runs (TRITON_INTERPRET) still exercise multi-program grids."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        dev = torch.device(device)
        return _cuda_sm_count(dev if dev.index is not None
                              else torch.device("cuda", torch.cuda.current_device()))
    return 4


def default_num_splits(batch: int, num_kv_heads: int, num_selected: int, device=None,
                       programs_per_sm: int | None = None, block_n: int = _BLOCK_N) -> int:
    """Static split count: enough (request, kv head, split) programs to fill the GPU
    ``programs_per_sm`` times (default: :func:`default_programs_per_sm`), each with at least
    one ``block_n`` tile. Depends only on shapes (CUDA-graph safe)."""
    max_splits = max(1, triton.cdiv(num_selected, block_n))
    sms = sm_count(device)
    per_sm = (default_programs_per_sm(batch * num_kv_heads, sms) if programs_per_sm is None
              else programs_per_sm)
    want = triton.cdiv(per_sm * sms, max(1, batch * num_kv_heads))
    return max(1, min(max_splits, want))



def default_programs_per_sm(rows: int, sms: int) -> int:
    """The programs per SM the split count aims for with ``rows`` (request, kv head) rows."""
    return FEW_ROWS_PROGRAMS_PER_SM if rows <= FEW_ROWS_PER_SM * sms else PROGRAMS_PER_SM


def tile_slots(num_selected: int, block_n: int = _BLOCK_N) -> int:
    """Selected slots per stage-1 tile: ``block_n``, or less for a short selection."""
    return min(block_n, max(16, triton.next_power_of_2(num_selected)))


def split_layout(num_selected: int, num_splits: int, block_n: int = _BLOCK_N) -> tuple[int, int]:
    """(chunk, splits actually used): the chunk is a multiple of the tile size and every
    split gets a non-empty range of the K selected slots."""
    block_n = tile_slots(num_selected, block_n)
    chunk = triton.cdiv(triton.cdiv(num_selected, max(1, num_splits)), block_n) * block_n
    return chunk, triton.cdiv(num_selected, chunk)


def sparse_attention_batched(
    q: Tensor,
    k_buffer: Tensor,
    v_buffer: Tensor,
    selected_slots: Tensor,
    sm_scale: float,
    num_splits: int | None = None,
    out: Tensor | None = None,
    lse: Tensor | None = None,
    partial_o: Tensor | None = None,
    partial_lse: Tensor | None = None,
    early_v: bool | None = None,
    skip_pad_tiles: bool | None = None,
    block_n: int = _BLOCK_N,
    num_warps: int = DEFAULT_NUM_WARPS,
    num_stages: int = DEFAULT_NUM_STAGES,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Attention of each query head over its kv head's selected slots.

    ``q`` ``[B, Hq, D]``; ``k_buffer`` ``[num_slots, Hkv, D]``; ``v_buffer``
    ``[num_slots, Hkv, Dv]``; ``selected_slots`` ``[B, Hkv, K]`` (``-1`` = padding, may appear
    anywhere; the valid slots of a row must be distinct, a repeated slot is attended twice).
    Returns ``(out [B, Hq, Dv] q.dtype, lse [B, Hq] float32)``. ``partial_o``
    (float32 ``[>=B, Hq, >=splits, Dv]``) / ``partial_lse`` (``[>=B, Hq, >=splits]``) are
    scratch; pass preallocated ones for CUDA graphs. ``early_v`` (default
    :data:`DEFAULT_EARLY_V`): gather a tile's V rows beside its K rows instead of after the
    softmax; ``skip_pad_tiles`` (default :data:`DEFAULT_SKIP_PAD_TILES`): branch over tiles of
    padding only instead of running them masked; ``block_n`` (slots per tile, a power of two
    >= 16), ``num_warps``, ``num_stages``: stage 1's launch. None of them changes the result.
    An 8-bit float KV cache (``--kv-cache-dtype fp8_e4m3``/``fp8_e5m2``) is read as stored times
    ``k_scale``/``v_scale`` (SGLang's per-layer KV scales, 1.0 without a checkpoint's), each
    tile upcast to q's dtype in registers: the dots keep q's precision.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, head_dim_v = k_buffer.shape[1], v_buffer.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if selected_slots.shape[:2] != (batch, num_kv_heads):
        raise ValueError(f"selected_slots {tuple(selected_slots.shape)} != [B, Hkv, K]")
    num_sel = selected_slots.shape[2]
    group = num_q_heads // num_kv_heads
    out_dtype = q.dtype
    # 8-bit float KV is upcast tile by tile to q's dtype; otherwise tl.dot wants equal operand
    # types (q takes the KV dtype) and the output keeps q's
    kv_upcast = upcasts_kv(q, k_buffer)
    if kv_upcast and v_buffer.dtype != k_buffer.dtype:
        raise ValueError(f"k_buffer {k_buffer.dtype} and v_buffer {v_buffer.dtype} differ")
    if q.dtype != k_buffer.dtype and not kv_upcast:
        q = q.to(k_buffer.dtype)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("k_buffer/v_buffer rows must be contiguous")
    if selected_slots.stride(2) != 1:
        selected_slots = selected_slots.contiguous()
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, num_sel, q.device, block_n=block_n)
    chunk, splits = split_layout(max(num_sel, 1), num_splits, block_n)
    device = q.device
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim_v, dtype=out_dtype, device=device)
    if lse is None:
        lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=device)
    if partial_o is None:
        partial_o = torch.empty(
            batch, num_q_heads, splits, head_dim_v, dtype=torch.float32, device=device
        )
    if partial_lse is None:
        partial_lse = torch.empty(batch, num_q_heads, splits, dtype=torch.float32, device=device)
    if partial_o.shape[2] < splits or partial_lse.shape[2] < splits:
        raise ValueError(f"partial buffers hold {partial_o.shape[2]} splits, need {splits}")
    if batch == 0:
        return out, lse

    block_n = tile_slots(max(num_sel, 1), block_n)
    block_d, d_chunks = head_dim_tiling(head_dim)
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    if block_dv >= _WIDE_DV:
        # a [BLOCK_N, Dv] value tile of 32 rows keeps MLA's 512-wide latent values in registers
        # (split_layout's chunk is a multiple of 64, so of 32 too)
        block_n = min(block_n, 32)
    group_pad = max(16, triton.next_power_of_2(group))
    head_tile = min(group_pad, max(16, _ACC_ELEMENTS // block_dv))
    num_head_tiles = group_pad // head_tile
    # fp32 KV: exact fp32 dots (tf32 would lose ~3 decimal digits); 16-bit KV: the default
    # (tensor cores, fp32 accumulation).
    precision = "ieee" if k_buffer.dtype == torch.float32 else None
    # Triton's CPU interpreter multiplies the raw bits of 16-bit floats in tl.dot: there, feed
    # the dots exact fp32 copies of the same (already rounded) values instead.
    dot_f32 = bool(triton.knobs.runtime.interpret) and k_buffer.dtype != torch.float32
    _sparse_attn_split_kernel[(batch, num_kv_heads * num_head_tiles, splits)](
        q,
        k_buffer,
        v_buffer,
        selected_slots,
        partial_o,
        partial_lse,
        float(sm_scale) * float(k_scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        selected_slots.stride(0),
        selected_slots.stride(1),
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        NUM_SEL=num_sel,
        CHUNK=chunk,
        GROUP=group,
        HEAD_TILE=head_tile,
        NUM_HEAD_TILES=num_head_tiles,
        HEAD_DIM=head_dim,
        HEAD_DIM_V=head_dim_v,
        BLOCK_D=block_d,
        D_CHUNKS=d_chunks,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        PRECISION="ieee" if dot_f32 else precision,
        DOT_F32=dot_f32,
        EARLY_V=DEFAULT_EARLY_V if early_v is None else early_v,
        SKIP_PAD_TILES=DEFAULT_SKIP_PAD_TILES if skip_pad_tiles is None else skip_pad_tiles,
        KV_UPCAST=kv_upcast,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    _sparse_attn_merge_kernel[(batch, num_q_heads)](
        partial_o,
        partial_lse,
        out,
        lse,
        partial_o.stride(0),
        partial_o.stride(1),
        partial_o.stride(2),
        partial_lse.stride(0),
        partial_lse.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0),
        NUM_SPLITS=splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        HEAD_DIM_V=head_dim_v,
        BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
        LN2=_LN2,
        v_scale=float(v_scale),
        num_warps=4,
    )
    return out, lse


def sparse_attention_batched_ref(
    q: Tensor, k_buffer: Tensor, v_buffer: Tensor, selected_slots: Tensor, sm_scale: float,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Plain-torch reference: per request, the reference ``sparse_attention_with_lse`` over
    the distinct selected slots (order and padding do not matter), keys and values read as
    stored times ``k_scale``/``v_scale``."""
    batch, num_q_heads = q.shape[:2]
    out = torch.empty(batch, num_q_heads, v_buffer.shape[2], dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, num_q_heads, dtype=torch.float32, device=q.device)
    for b in range(batch):
        slots = selected_slots[b].long()  # [Hkv, K]
        uniq = torch.unique(slots[slots >= 0])
        if uniq.numel() == 0:
            out[b] = 0
            lse[b] = float("-inf")
            continue
        keys, values = k_buffer[uniq], v_buffer[uniq]  # [U, Hkv, D]
        mask = (slots[:, :, None] == uniq[None, None, :]).any(dim=1)  # [Hkv, U]
        out[b], lse[b] = sparse_attention_with_lse(q[b], keys, values, mask, sm_scale * k_scale,
                                                   v_scale)
    return out, lse

