"""Quest block scores for a whole decode batch, from the per-page key summaries.

For request ``b`` and kv head ``g``, block ``j`` (positions ``[j*bs, (j+1)*bs)``) lives in page
``req_to_token[row_b, j*bs] // bs``; its score is the Quest bound
``max_{h in group g} (q_h⁺ · kmax[page, g] + q_h⁻ · kmin[page, g])`` (the reference's
``quest_block_scores``). One program handles a tile of blocks of one (request, kv head): it
gathers the tile's summary rows and computes the bound as two small GEMMs
``[G, D] x [D, BLOCK_NB]`` over the group's query heads, then reduces over the group.

The summaries are read in their stored dtype (bf16 by default: 2 bytes per value, half the
bytes of float32 summaries; this read dominates a long-context decode step). The "fma" /
"ieee" / "tf32x3" paths widen them to fp32 in registers; the "tc" path feeds the bf16 values
and q straight to the tensor cores. With bf16 summaries the "fma" path issues about as many
instructions as the bytes take to arrive (at B=32, 8 kv heads, 8192 blocks: ~2.5e8 warp
instructions, ~0.24 ms at H200 issue rates, vs 1.07 GB at ~4.1 TB/s, ~0.26 ms); "tc" issues
~3x fewer, leaving the kernel bandwidth bound.

MLA (one latent head of ``R + P = 576`` dims, all Hq query heads in its group): the GEMM paths
walk head dims above 256 in 64-wide chunks (:func:`~sglang_ext.kernels.sparse_attention.
head_dim_tiling`), accumulating the bound over the chunks, so a program never holds a 576-dim
summary tile padded to 1024; "fma" (one pass per head over the whole dim) is for narrow heads.

Blocks that are not candidates get ``-inf``: blocks at/after ``ceil(L / bs)`` and blocks with no
middle position (all positions inside the sink ``[0, sink)`` or the window ``[L - window, L)``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.kernels.block_summary import SUMMARY_DTYPES as _SUMMARY_DTYPES
from sglang_ext.selection.params import FP8_SUMMARIES
from sglang_ext.kernels.sparse_attention import head_dim_tiling, sm_count
from sglang_ext.selection.reference import quest_block_scores

# Launch layout defaults (benchmarks/bench_sparse_attention.py, stage block_scores): kv heads
# per program and whether the heads are the grid's fastest dimension. Measured on the H200 at
# 19 requests x 32k, block 32 (sparse_attention_h200_block_score_layouts.json, CUDA graphs, L2
# flushed): one head per program 37.0 us, 2 / 4 / 8 heads 42 / 46-48 / 43-54 us, heads fastest
# within 1 us of requests fastest. Reading a page's heads together does not help: the kernel
# is not bound by where in DRAM its rows lie.
HEADS_PER_PROGRAM = 1
HEADS_FASTEST = False
# Tensor-core launch (bf16/fp16 summaries, precision "tc"): 32 blocks per tile, 3 pipeline
# stages, up to 4 consecutive tiles per program while the grid still gives every SM
# MIN_PROGRAMS_PER_SM programs. At 19 requests x 32k, block 32, a grid with no dead tiles:
# 35.2 / 33.2 / 33.0 / 32.2 us at 1 / 2 / 4 / 8 tiles (nb64: 34.5-39.2 us;
# sparse_attention_h200_pipelining_b19.json). At a server's shapes (the grid sized for
# --context-length with 1.25x headroom, programs stopping at each request's last block): 4
# tiles is within 0.6 us of the fastest at 20 and 24 requests x 34k and 5 and 8 x 137k, where
# 8 tiles lose up to 4.6 us (36.7 / 42.5 / 36.6 / 51.1 us;
# sparse_attention_h200_block_score_dead_tiles_*.json).
TC_BLOCK_NB = 32
# fp8 summaries (one byte per value): 64 blocks per tile, the bytes of a bf16 tile of 32. At
# 10 requests x 128k (a 160k grid, 4 tiles per program, 3 stages) 42.1 us against 46.8 us at
# 32 blocks; 128 blocks 45-46 us; storing the summaries head-major changes nothing (41.6-42.0
# us): the kernel runs at ~2.0 TB/s whatever the layout
# (sparse_attention_h200_fp8_summaries_128k.json, _layout_128k.json).
TC_BLOCK_NB_FP8 = 64
TC_NUM_STAGES = 3
# the split query's shared-memory bytes up to which the tensor-core launch is pipelined
TC_PIPELINED_Q_BYTES = 128 * 1024
MAX_TILES_PER_PROGRAM = 4
MIN_PROGRAMS_PER_SM = 4
# the largest finite fp16 value: "tc_fp16" clamps q to it before rounding q to fp16
FP16_MAX = tl.constexpr(65504.0)
# the precisions whose GEMMs run on the tensor cores from 16-bit operands
TENSOR_CORE_PRECISIONS = ("tc", "tc_fp16")


def tc_block_nb(summary_dtype: torch.dtype) -> int:
    """Blocks per tile of the tensor-core launch for summaries of this dtype."""
    return TC_BLOCK_NB_FP8 if summary_dtype == FP8_SUMMARIES else TC_BLOCK_NB


def tc_num_stages(group: int, block_d: int, d_chunks: int) -> int:
    """Pipeline stages of the tensor-core launch. A pipelined loop keeps the group's split
    query (its positive and negative parts, every head-dim chunk, 16-bit) in shared memory
    beside the staged summaries: at 128 query heads on a 576-dim MLA latent head that alone is
    295 KB, over the H200's 227 KB (sm_90 compile: 305 KB at 3 stages, 56 KB at 1). Groups
    whose split query exceeds ``TC_PIPELINED_Q_BYTES`` run unpipelined; every measured
    configuration (GQA groups of 4-8 at 128 dims, MLA at 16 heads) keeps ``TC_NUM_STAGES``."""
    group_pad = max(16, triton.next_power_of_2(group))
    split_q_bytes = 2 * group_pad * block_d * d_chunks * 2
    return TC_NUM_STAGES if split_q_bytes <= TC_PIPELINED_Q_BYTES else 1


def default_tiles_per_program(batch: int, head_programs: int, block_tiles: int,
                              device=None) -> int:
    """Tiles one program walks: the largest power of two up to ``MAX_TILES_PER_PROGRAM`` that
    leaves ``MIN_PROGRAMS_PER_SM`` programs per SM (a short or small batch keeps one tile per
    program, so that it still spreads over the GPU). Depends only on shapes: CUDA-graph safe."""
    sms = sm_count(device)
    tiles = 1
    while (tiles < MAX_TILES_PER_PROGRAM
           and batch * head_programs * triton.cdiv(block_tiles, 2 * tiles)
           >= MIN_PROGRAMS_PER_SM * sms):
        tiles *= 2
    return tiles


@triton.jit
def _q_operands(
    Q, b, g, c, stride_qb, stride_qh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):
    """q+ and q- of kv head g's query heads over head-dim chunk c: ``[GROUP_PAD, BLOCK_D]``
    each (rows past the group zero), in the GEMMs' operand dtype.

    "tc": q's own 16-bit dtype (q+ / q- are exact in it, every product is exact in fp32 and
    the GEMMs accumulate in fp32). "tc_fp16": q rounded to fp16 (exact for |q| in fp16's
    normal range; clamped to its finite range), so that fp8 summaries widen with one cvt per
    two values (e4m3 -> bf16 goes through fp16 and adds a cvt and register moves per value;
    measured 5% faster on the H200 at 10 x 128k: the kernel waits on its loads more than on
    its instruction issue). Under Triton's CPU interpreter, which compares and multiplies
    bf16 as raw integer bit patterns, the same (exact) values widened to fp32. "ieee" /
    "tf32x3": fp32."""
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    hh = tl.arange(0, GROUP_PAD)
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + (g * GROUP + hh[:, None]) * stride_qh + d[None, :],
        mask=(hh[:, None] < GROUP) & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    if PRECISION == "tc_fp16":
        q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)
    if INTERPRET or (PRECISION != "tc" and PRECISION != "tc_fp16"):
        q32 = q.to(tl.float32)
        q_pos, q_neg = tl.maximum(q32, 0.0), tl.minimum(q32, 0.0)
    else:
        zero = tl.zeros_like(q)
        q_pos = tl.where(q > zero, q, zero)  # stays 16-bit, exact
        q_neg = tl.where(q < zero, q, zero)
    return q_pos, q_neg


@triton.jit
def _score_tile(
    Q, KMIN, KMAX, REQ_TO_TOKEN, OUT, tile, b, g0, row, hi, max_blocks, sink, q_pos0, q_neg0,
    stride_qb, stride_qh, stride_sp, stride_sh, stride_r2t, stride_ob, stride_oh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, D_CHUNKS: tl.constexpr,
    BLOCK_NB: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
):
    """The scores of one tile of BLOCK_NB blocks of request b, kv heads g0.. (written to OUT).
    ``q_pos0`` / ``q_neg0``: :func:`_q_operands` of head g0, chunk 0, which the program
    computes once for all its tiles (other heads and chunks are loaded per tile; unused by
    "fma")."""
    j = tile * BLOCK_NB + tl.arange(0, BLOCK_NB)
    # block j overlaps the (non-empty) middle
    valid = ((j < max_blocks) & (j * BLOCK_SIZE < hi) & ((j + 1) * BLOCK_SIZE > sink)
             & (hi > sink))
    first_slot = tl.load(
        REQ_TO_TOKEN + row * stride_r2t + j.to(tl.int64) * BLOCK_SIZE, mask=valid, other=0
    )
    page = first_slot.to(tl.int64) // BLOCK_SIZE

    # A page's summaries of all kv heads are adjacent ([num_pages, Hkv, D]): the heads of
    # one program read them as one run of Hkv * D values per page and share the lookup.
    for gi in tl.static_range(HEADS_PER_PROGRAM):
        g = g0 + gi
        d = tl.arange(0, BLOCK_D)
        hh = tl.arange(0, GROUP_PAD)
        hmask = hh < GROUP

        if PRECISION == "fma":
            q_base = Q + b.to(tl.int64) * stride_qb + (g * GROUP) * stride_qh
            dmask = d < HEAD_DIM
            summary = page[:, None] * stride_sp + g * stride_sh + d[None, :]
            smask = valid[:, None] & dmask[None, :]
            # [NB, D], shared by the group, in the summaries' dtype (one tile: D_CHUNKS == 1)
            kmax = tl.load(KMAX + summary, mask=smask, other=0.0)
            kmin = tl.load(KMIN + summary, mask=smask, other=0.0)
            kmax = kmax.to(tl.float32)  # bf16/fp16 summaries are widened to fp32 in registers
            kmin = kmin.to(tl.float32)
            # small groups: one multiply-add pass per query head (no padding of the group to 16)
            score = tl.full([BLOCK_NB], float("-inf"), tl.float32)
            for hh in tl.static_range(GROUP):
                qh = tl.load(q_base + hh * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
                bound_h = tl.sum(
                    kmax * tl.maximum(qh, 0.0)[None, :] + kmin * tl.minimum(qh, 0.0)[None, :],
                    axis=1,
                )
                score = tl.maximum(score, bound_h)
        else:
            # two GEMMs [G, D] x [D, NB] (G padded to the 16 rows tl.dot needs), over D_CHUNKS
            # chunks of the head dim (one for D <= 256)
            bound = tl.zeros([GROUP_PAD, BLOCK_NB], tl.float32)
            for c in tl.static_range(D_CHUNKS):
                dc = c * BLOCK_D + d
                summary = page[:, None] * stride_sp + g * stride_sh + dc[None, :]
                smask = valid[:, None] & (dc < HEAD_DIM)[None, :]
                # [NB, BLOCK_D], shared by the group, in the summaries' dtype
                kmax = tl.load(KMAX + summary, mask=smask, other=0.0)
                kmin = tl.load(KMIN + summary, mask=smask, other=0.0)
                if gi == 0 and c == 0:
                    q_pos, q_neg = q_pos0, q_neg0
                else:
                    q_pos, q_neg = _q_operands(Q, b, g, c, stride_qb, stride_qh, GROUP,
                                               GROUP_PAD, HEAD_DIM, BLOCK_D, PRECISION,
                                               INTERPRET)
                # the summaries widen to the operands' dtype in registers (fp8 -> bf16 / fp16
                # is exact: half the bytes of 16-bit summaries read)
                kmax = kmax.to(q_pos.dtype)
                kmin = kmin.to(q_pos.dtype)
                if PRECISION == "tc" or PRECISION == "tc_fp16":
                    bound = tl.dot(q_pos, tl.trans(kmax), acc=bound)
                    bound = tl.dot(q_neg, tl.trans(kmin), acc=bound)
                else:
                    bound = tl.dot(q_pos, tl.trans(kmax), acc=bound, input_precision=PRECISION)
                    bound = tl.dot(q_neg, tl.trans(kmin), acc=bound, input_precision=PRECISION)
            bound = tl.where(hmask[:, None], bound, float("-inf"))  # [GP, NB]
            score = tl.max(bound, axis=0)
        score = tl.where(valid, score, float("-inf"))
        tl.store(OUT + b * stride_ob + g * stride_oh + j, score, mask=j < max_blocks)


@triton.jit
def _quest_block_scores_kernel(
    Q,
    KMIN,
    KMAX,
    REQ_TO_TOKEN,
    REQ_POOL_INDICES,
    SEQ_LENS,
    OUT,
    max_blocks,
    sink,
    window,
    stride_qb,
    stride_qh,
    stride_sp,
    stride_sh,
    stride_r2t,
    stride_ob,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    D_CHUNKS: tl.constexpr,
    BLOCK_NB: tl.constexpr,
    PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HEADS_FASTEST: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr,
    SKIP_DEAD_TILES: tl.constexpr,
):
    if HEADS_FASTEST:  # the programs of one request's kv heads launch side by side
        g0 = tl.program_id(0) * HEADS_PER_PROGRAM
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        g0 = tl.program_id(1) * HEADS_PER_PROGRAM
    tile0 = tl.program_id(2) * TILES_PER_PROGRAM

    row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int64)
    hi = seq_len - window  # the middle is [sink, hi)
    # q+ / q- of the first head and chunk, once for all the program's tiles (per tile they
    # cost a load, a shuffle into the MMA layout and the split)
    if PRECISION == "fma":
        q_pos0, q_neg0 = 0.0, 0.0
    else:
        q_pos0, q_neg0 = _q_operands(Q, b, g0, 0, stride_qb, stride_qh, GROUP, GROUP_PAD,
                                     HEAD_DIM, BLOCK_D, PRECISION, INTERPRET)

    # Consecutive tiles of one row per program: a loop the compiler can software-pipeline
    # (the next tile's page lookups and summary loads in flight beside this tile's GEMMs);
    # one tile per program (small grids, see default_tiles_per_program) has only other
    # programs to hide its two dependent loads (a one-trip loop, which MLIR's canonicalizer
    # inlines).
    if SKIP_DEAD_TILES:
        # The grid covers the static max_blocks (the server's context length, with headroom);
        # tiles starting at or past the last block that begins before hi hold no candidate.
        # The loop stops there (a dynamic trip count, still pipelined) and the dead tiles
        # only get their -inf. (The CPU interpreter takes static loop bounds only: the wrapper
        # turns this off there.)
        live_blocks = tl.cdiv(tl.maximum(hi, 0), BLOCK_SIZE)
        live_tiles = tl.minimum(
            tl.maximum(tl.cdiv(live_blocks - tile0 * BLOCK_NB, BLOCK_NB), 0), TILES_PER_PROGRAM)
        for ti in range(0, live_tiles):
            _score_tile(Q, KMIN, KMAX, REQ_TO_TOKEN, OUT, tile0 + ti, b, g0, row, hi,
                        max_blocks, sink, q_pos0, q_neg0, stride_qb, stride_qh, stride_sp,
                        stride_sh, stride_r2t, stride_ob, stride_oh, BLOCK_SIZE, GROUP, GROUP_PAD,
                        HEAD_DIM, BLOCK_D, D_CHUNKS, BLOCK_NB, PRECISION, INTERPRET,
                        HEADS_PER_PROGRAM)
        for ti in range(live_tiles, TILES_PER_PROGRAM):
            j = (tile0 + ti) * BLOCK_NB + tl.arange(0, BLOCK_NB)
            for gi in tl.static_range(HEADS_PER_PROGRAM):
                tl.store(OUT + b * stride_ob + (g0 + gi) * stride_oh + j,
                         tl.full([BLOCK_NB], float("-inf"), tl.float32), mask=j < max_blocks)
    else:
        for ti in range(TILES_PER_PROGRAM):
            _score_tile(Q, KMIN, KMAX, REQ_TO_TOKEN, OUT, tile0 + ti, b, g0, row, hi,
                        max_blocks, sink, q_pos0, q_neg0, stride_qb, stride_qh, stride_sp,
                        stride_sh, stride_r2t, stride_ob, stride_oh, BLOCK_SIZE, GROUP, GROUP_PAD,
                        HEAD_DIM, BLOCK_D, D_CHUNKS, BLOCK_NB, PRECISION, INTERPRET,
                        HEADS_PER_PROGRAM)


def quest_block_scores_batched(
    q: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    block_size: int,
    sink: int,
    window: int,
    max_blocks: int,
    out: Tensor | None = None,
    precision: str | None = None,
    block_nb: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heads_per_program: int = HEADS_PER_PROGRAM,
    heads_fastest: bool = HEADS_FASTEST,
    tiles_per_program: int | None = None,
    skip_dead_tiles: bool = True,
) -> Tensor:
    """Quest block scores of every request of a decode batch: float32 ``[B, Hkv, max_blocks]``.

    ``q`` ``[B, Hq, D]``; ``kmin``/``kmax`` ``[num_pages, Hkv, D]`` (page = slot //
    block_size) in bf16, fp16, float32 or float8_e4m3fn, read in their dtype (2 bytes per value
    for bf16, 1 for fp8);
    ``req_to_token`` int32 ``[rows, max_context]``; ``req_pool_indices`` ``[B]``; ``seq_lens``
    ``[B]`` (the current token included). ``precision`` picks how the bound is computed:
    "ieee" (fp32 GEMMs on FMA units: exact fp32 products, so the top-k agrees with the fp32
    reference), "tf32x3" (GEMMs on tensor cores, near-fp32), "fma" (one multiply-add pass per
    query head, no padding of the group to tl.dot's 16 rows), or "tc" (bf16/fp16 GEMMs on
    tensor cores straight from the stored operands: needs q and the summaries in the same
    16-bit dtype; products are exact, sums are fp32 in the tensor cores' order, and it issues
    several times fewer instructions per summary byte than "fma", whose instruction count
    rivals the bf16 summaries' bytes at large batch), or "tc_fp16" (fp8 or fp16 summaries
    widened to fp16 and q rounded to fp16, clamped to its finite range: fp8 -> fp16 is one
    conversion per two values where fp8 -> bf16 adds one per value and register moves: 402
    against 658 PTX instructions per tile at Qwen3-8B shapes on sm90 (benchmarks/
    kernel_ptx_counts.py), 40.8 against 43.1 us per
    layer on the H200 at 10 x 128k, sparse_attention_h200_fp16_operands_128k.json); None =
    "tc" on a GPU when q and the summaries share a 16-bit dtype, "tc_fp16" for fp8 summaries
    (the block scores as GEMMs: measured 5-15% faster per decode step at 128k, see
    benchmarks/results/operator/operator_h200*.json), otherwise "fma" for groups smaller than 8
    query heads of at most 256 dims and "ieee" for the others. ``block_nb``: blocks per program
    (default: :func:`tc_block_nb` for "tc", 64 for 2-byte summaries with "fma", otherwise 32);
    ``num_warps`` / ``num_stages``: the launch's (default: 4 warps for "tc" or small tiles, else
    8; :func:`tc_num_stages` for "tc", else Triton's default stages). ``heads_per_program`` (a
    divisor of Hkv): kv heads one program scores (sharing its page lookups, reading each
    page's summaries of those heads as one run);
    ``heads_fastest``: the grid's fastest dimension is the kv heads, so the programs of one
    request's heads run side by side (see ``HEADS_PER_PROGRAM`` for the measured defaults);
    ``tiles_per_program``: consecutive tiles of ``block_nb`` blocks one program walks in a loop
    (software-pipelined over ``num_stages``; default :func:`default_tiles_per_program`).
    ``skip_dead_tiles``: on the GPU a program stops computing at the request's last candidate
    block and only writes ``-inf`` past it (False: every tile of the static grid is computed,
    masked; the results are the same).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = kmin.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    if kmin.dtype not in _SUMMARY_DTYPES or kmax.dtype != kmin.dtype:
        raise TypeError(f"kmin/kmax must share one of {_SUMMARY_DTYPES}, got {kmin.dtype}, "
                        f"{kmax.dtype}")
    if kmin.stride(2) != 1 or kmax.stride() != kmin.stride():
        raise ValueError("kmin/kmax must share a layout with contiguous rows")
    if q.stride(2) != 1:
        q = q.contiguous()
    group = num_q_heads // num_kv_heads
    block_d, d_chunks = head_dim_tiling(head_dim)
    # the tensor cores take q and the summaries in one 16-bit dtype (fp8 summaries widen to it)
    tc_operands = (q.dtype in (torch.bfloat16, torch.float16)
                   and kmin.dtype in (q.dtype, FP8_SUMMARIES))
    if precision is None:
        on_tensor_cores = (q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
                           and tc_operands)
        narrow = group < 8 and d_chunks == 1
        precision = ("tc_fp16" if kmin.dtype == FP8_SUMMARIES else "tc") if on_tensor_cores \
            else "fma" if narrow else "ieee"
    if precision not in ("ieee", "tf32x3", "fma", *TENSOR_CORE_PRECISIONS):
        raise ValueError(f"precision must be ieee, tf32x3, fma, tc or tc_fp16, got {precision!r}")
    if precision == "fma" and d_chunks > 1:
        raise ValueError(f"precision 'fma' holds the whole head dim in one tile: D={head_dim} is "
                         f"walked in chunks, use ieee, tf32x3 or tc")
    if precision == "tc" and not tc_operands:
        raise TypeError(f"precision 'tc' needs q and the summaries in one 16-bit dtype (or fp8 "
                        f"summaries), got {q.dtype} and {kmin.dtype}")
    if precision == "tc_fp16" and not (q.dtype in (torch.bfloat16, torch.float16)
                                       and kmin.dtype in (torch.float16, FP8_SUMMARIES)):
        raise TypeError(f"precision 'tc_fp16' needs a 16-bit q and fp8 or fp16 summaries, got "
                        f"{q.dtype} and {kmin.dtype}")
    if out is None:
        out = torch.empty(batch, num_kv_heads, max_blocks, dtype=torch.float32, device=q.device)
    if batch == 0 or max_blocks == 0:
        return out
    if block_nb is None:
        # 16 KB of each summary tensor per program (the measured float32 configuration); for
        # 2-byte summaries with "fma" that also means fewer instructions per block (SASS: 120
        # vs 148 warp-instructions per block at 64 vs 32 blocks). Tensor cores: tc_block_nb.
        block_nb = tc_block_nb(kmin.dtype) if precision in TENSOR_CORE_PRECISIONS else \
            64 if kmin.element_size() == 2 and precision == "fma" else 32
    if num_stages is None and precision in TENSOR_CORE_PRECISIONS:
        num_stages = tc_num_stages(group, block_d, d_chunks)
    block_nb = min(block_nb, max(16, triton.next_power_of_2(max_blocks)))
    if heads_per_program < 1 or num_kv_heads % heads_per_program:
        raise ValueError(f"heads_per_program {heads_per_program} must divide Hkv={num_kv_heads}")
    head_programs = num_kv_heads // heads_per_program
    block_tiles = triton.cdiv(max_blocks, block_nb)
    if tiles_per_program is None:
        tiles_per_program = default_tiles_per_program(batch, head_programs, block_tiles, q.device)
    if tiles_per_program < 1:
        raise ValueError(f"tiles_per_program must be >= 1, got {tiles_per_program}")
    tiles = triton.cdiv(block_tiles, tiles_per_program)
    grid = (head_programs, batch, tiles) if heads_fastest else (batch, head_programs, tiles)
    _quest_block_scores_kernel[grid](
        q,
        kmin,
        kmax,
        req_to_token,
        req_pool_indices,
        seq_lens,
        out,
        max_blocks,
        sink,
        window,
        q.stride(0),
        q.stride(1),
        kmin.stride(0),
        kmin.stride(1),
        req_to_token.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        D_CHUNKS=d_chunks,
        BLOCK_NB=block_nb,
        PRECISION=precision,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        HEADS_PER_PROGRAM=heads_per_program,
        HEADS_FASTEST=heads_fastest,
        TILES_PER_PROGRAM=tiles_per_program,
        SKIP_DEAD_TILES=skip_dead_tiles and os.environ.get("TRITON_INTERPRET") != "1",
        num_warps=num_warps or (
            4 if precision in TENSOR_CORE_PRECISIONS or block_nb * block_d < 4096 else 8),
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out


def quest_block_scores_batched_ref(
    q: Tensor,
    kmin: Tensor,
    kmax: Tensor,
    req_to_token: Tensor,
    req_pool_indices: Tensor,
    seq_lens: Tensor,
    block_size: int,
    sink: int,
    window: int,
    max_blocks: int,
) -> Tensor:
    """Plain-torch reference of :func:`quest_block_scores_batched` (loops over requests)."""
    batch = q.shape[0]
    num_kv_heads = kmin.shape[1]
    out = torch.full(
        (batch, num_kv_heads, max_blocks), float("-inf"), dtype=torch.float32, device=q.device
    )
    for b in range(batch):
        row, length = int(req_pool_indices[b]), int(seq_lens[b])
        num_blocks = min(-(-length // block_size), max_blocks)
        if num_blocks == 0:
            continue
        starts = torch.arange(num_blocks, device=q.device) * block_size
        pages = req_to_token[row, starts].long() // block_size
        scores = quest_block_scores(q[b], kmin[pages], kmax[pages])  # [Hkv, nb]
        lo, hi = sink, length - window
        has_middle = (starts < hi) & (starts + block_size > lo) & (hi > lo)
        out[b, :, :num_blocks] = scores.masked_fill(~has_middle, float("-inf"))
    return out
