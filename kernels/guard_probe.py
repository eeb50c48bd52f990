"""The accuracy guard's probe on the GPU (:mod:`sglang_ext.selection.guard`), CUDA-graph safe.

A probe step measures, for one kv head per layer, the recall of the sparse selection:
``exp(lse_selected - lse_dense)`` per query head, where ``lse_selected`` is the sparse
attention's own LSE and ``lse_dense`` the log-sum-exp over the whole context. Two launches per
layer, both of fixed grids, whose programs return at once unless the step is a probe step:

1. ``_dense_lse_split_kernel`` (grid ``B x splits``): the probed kv head's keys of one chunk of
   the context (through ``req_to_token``), scored against the group's query heads, reduced to a
   partial (max, sum of exp);
2. ``_recall_kernel`` (grid ``B``): merges the partials into ``lse_dense``, computes the group's
   mean recall and adds it to the request's accumulator (the backend divides by the layer count
   at the end of the step).

Whether a request probes this step and which kv head come from an int32 device tensor
``ctrl`` ``[B, 2]`` of ``(probe, kv_head)`` per batch entry, which the backend computes on the
device from each request's own step count, so the same captured graph serves probe and ordinary
steps and every request keeps its own cadence. Requests whose context fits the guard's largest
budget decode densely and are skipped (their recall is 1 by construction; CUDA-graph padding
entries have length 1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.kernels.sparse_attention import upcasts_kv

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)  # what the kernels may read (Triton allows constexpr globals only)
_BLOCK_N = 128  # context positions per tile


@triton.jit
def _dense_lse_split_kernel(
    CTRL,
    Q,
    K_BUFFER,
    REQ_TO_TOKEN,
    REQ_POOL_INDICES,
    SEQ_LENS,
    PART_M,
    PART_S,
    qk_scale_log2,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_r2t,
    stride_pb,
    stride_ps,
    MIN_LEN: tl.constexpr,
    SPAN_TILES: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    KV_UPCAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    probe = tl.load(CTRL + 2 * b)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int64)
    if probe != 0 and seq_len > MIN_LEN:
        g = tl.load(CTRL + 2 * b + 1)
        hh = tl.arange(0, GROUP_PAD)
        hmask = hh < GROUP
        d = tl.arange(0, BLOCK_D)
        dmask = d < HEAD_DIM
        q = tl.load(Q + b * stride_qb + (g * GROUP + hh)[:, None] * stride_qh + d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        row = tl.load(REQ_POOL_INDICES + b).to(tl.int64)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        s = tl.zeros([GROUP_PAD], tl.float32)
        # Each split owns a fixed span of positions (static loop bounds: the same code for
        # every length, and Triton's CPU interpreter needs them); tiles past the end are idle.
        for t in range(SPAN_TILES):
            pos = (split * SPAN_TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
            pmask = pos < seq_len
            slot = tl.load(REQ_TO_TOKEN + row * stride_r2t + pos, mask=pmask, other=0).to(tl.int64)
            k = tl.load(K_BUFFER + slot[:, None] * stride_kn + g * stride_kh + d[None, :],
                        mask=pmask[:, None] & dmask[None, :], other=0.0)
            # [GROUP_PAD, N] in log2 units; the group's queries are the M dimension of the dot.
            if DOT_F32:
                x = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif KV_UPCAST:  # an fp8 cache: the keys take q's 16 bits, not q the keys' 8
                x = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
            else:
                x = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=PRECISION)
            x = x * qk_scale_log2
            x = tl.where(pmask[None, :], x, float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp2(m - m_safe) + tl.sum(tl.exp2(x - m_safe[:, None]), axis=1)
            m = m_new
        tl.store(PART_M + b * stride_pb + split * stride_ps + hh, m, mask=hmask)
        tl.store(PART_S + b * stride_pb + split * stride_ps + hh, s, mask=hmask)


@triton.jit
def _recall_kernel(
    CTRL,
    SEQ_LENS,
    PART_M,
    PART_S,
    SPARSE_LSE,
    RECALL_SUM,
    stride_pb,
    stride_ps,
    stride_lb,
    MIN_LEN: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    probe = tl.load(CTRL + 2 * b)
    seq_len = tl.load(SEQ_LENS + b).to(tl.int64)
    if probe != 0 and seq_len > MIN_LEN:
        g = tl.load(CTRL + 2 * b + 1)
        sp = tl.arange(0, SPLITS_PAD)
        hh = tl.arange(0, GROUP_PAD)
        mask = (sp < NUM_SPLITS)[:, None] & (hh < GROUP)[None, :]
        offs = b * stride_pb + sp[:, None] * stride_ps + hh[None, :]
        m = tl.load(PART_M + offs, mask=mask, other=float("-inf"))
        s = tl.load(PART_S + offs, mask=mask, other=0.0)
        m_all = tl.max(m, axis=0)  # [G]
        m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
        total = tl.sum(s * tl.exp2(m - m_safe[None, :]), axis=0)
        total = tl.where(hh < GROUP, total, 1.0)  # padding heads: no log of 0
        lse_dense = (m_safe + tl.log2(total)) / _LOG2E  # natural log, as the attention's LSE
        lse_sparse = tl.load(SPARSE_LSE + b * stride_lb + g * GROUP + hh, mask=hh < GROUP,
                             other=0.0)
        recall = tl.minimum(tl.exp(lse_sparse - lse_dense), 1.0)
        recall = tl.where(hh < GROUP, recall, 0.0)
        acc = tl.load(RECALL_SUM + b)
        tl.store(RECALL_SUM + b, acc + tl.sum(recall, axis=0) / GROUP)


class GuardProbe:
    """Fixed buffers of the probe for batches up to ``max_batch`` (kept for CUDA graphs)."""

    def __init__(self, max_batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 min_len: int, max_context: int, device, num_splits: int = 32) -> None:
        self.group = num_q_heads // num_kv_heads
        self.head_dim = head_dim
        self.min_len = min_len  # contexts up to this decode densely: not probed
        self.num_splits = num_splits
        self.span_tiles = triton.cdiv(triton.cdiv(max_context, num_splits), _BLOCK_N)
        kw = dict(dtype=torch.float32, device=device)
        self.part_m = torch.empty(max_batch, num_splits, self.group, **kw)
        self.part_s = torch.empty(max_batch, num_splits, self.group, **kw)
        self.recall_sum = torch.zeros(max_batch, **kw)
        self.max_batch = max_batch

    def run(self, ctrl: Tensor, q: Tensor, k_buffer: Tensor, req_to_token: Tensor,
            req_pool_indices: Tensor, seq_lens: Tensor, sparse_lse: Tensor, scaling: float) -> None:
        """Add this layer's recall of each probing request's head to ``recall_sum[:B]``;
        ``ctrl``: contiguous int32 ``[B, 2]``, (probe, kv head) per batch entry."""
        batch = q.shape[0]
        if batch > self.max_batch:
            raise ValueError(f"batch {batch} exceeds the probe's max_batch {self.max_batch}")
        if ctrl.shape != (batch, 2) or not ctrl.is_contiguous():
            raise ValueError(f"ctrl must be a contiguous [{batch}, 2] tensor, "
                             f"got {tuple(ctrl.shape)}")
        if batch == 0:
            return
        gp = max(16, triton.next_power_of_2(self.group))  # tl.dot needs M >= 16
        _dense_lse_split_kernel[(batch, self.num_splits)](
            ctrl, q, k_buffer, req_to_token, req_pool_indices, seq_lens, self.part_m,
            self.part_s, scaling * LOG2E, q.stride(0), q.stride(1), k_buffer.stride(0),
            k_buffer.stride(1), req_to_token.stride(0), self.part_m.stride(0),
            self.part_m.stride(1), MIN_LEN=self.min_len, SPAN_TILES=self.span_tiles,
            GROUP=self.group, GROUP_PAD=gp, HEAD_DIM=self.head_dim,
            BLOCK_D=max(16, triton.next_power_of_2(self.head_dim)), BLOCK_N=_BLOCK_N,
            # As the sparse attention: exact fp32 dots for fp32 KV, tensor cores for 16-bit;
            # Triton's CPU interpreter multiplies the raw bits of 16-bit floats in tl.dot, so
            # it gets fp32 copies of the same values.
            PRECISION="ieee" if k_buffer.dtype == torch.float32 else "tf32",
            DOT_F32=bool(triton.knobs.runtime.interpret) and k_buffer.dtype != torch.float32,
            KV_UPCAST=upcasts_kv(q, k_buffer),
            num_warps=4,
        )
        _recall_kernel[(batch,)](
            ctrl, seq_lens, self.part_m, self.part_s, sparse_lse, self.recall_sum,
            self.part_m.stride(0), self.part_m.stride(1), sparse_lse.stride(0),
            MIN_LEN=self.min_len, NUM_SPLITS=self.num_splits,
            SPLITS_PAD=triton.next_power_of_2(max(self.num_splits, 2)), GROUP=self.group,
            GROUP_PAD=gp, num_warps=1,
        )


def probe_recall_ref(ctrl: Tensor, q: Tensor, k_buffer: Tensor, req_to_token: Tensor,
                     req_pool_indices: Tensor, seq_lens: Tensor, sparse_lse: Tensor,
                     scaling: float, min_len: int) -> Tensor:
    """Reference of one layer's contribution: float32 ``[B]`` (0 where not probed)."""
    from sglang_ext.selection.guard import dense_lse

    out = torch.zeros(q.shape[0], dtype=torch.float32)
    group = q.shape[1] // k_buffer.shape[1]
    for b in range(q.shape[0]):
        length = int(seq_lens[b])
        if int(ctrl[b, 0]) == 0 or length <= min_len:
            continue
        g = int(ctrl[b, 1])
        slots = req_to_token[int(req_pool_indices[b]), :length].long()
        lse = dense_lse(q[b].cpu(), k_buffer[slots].cpu(), scaling, g)
        sparse = sparse_lse[b, g * group:(g + 1) * group].float().cpu()
        out[b] = torch.exp(sparse - lse).clamp(max=1.0).mean()
    return out
