"""GPU -> host write-through of KV tokens into the CPU tier's head-major layout (zero-copy).

The CPU tier keeps every token's K/V on the host (``host[h, slot, :]``, pinned, see
:mod:`host_gather`). Each KV write of the pool (prefill chunks and decode tokens) is also
written there: ``host[h, loc[i], :] = src[i, h, :]`` for every token ``i`` and kv head ``h``.
The kernel stores straight into pinned host memory through its device address (unified
addressing, like the gather), so the write needs no staging buffer and no host sync and can
be captured in a CUDA graph. Entries with ``loc < 0`` are skipped. Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.kernels.host_gather import _COPY_DTYPE  # elements move as same-width integers


@triton.jit
def _scatter_to_host_kernel(
    SRC,
    HOST,
    LOC,
    num_tokens,
    stride_sn,
    stride_sh,
    stride_hh,
    stride_hn,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TOKENS: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    in_n = i < num_tokens
    loc = tl.load(LOC + i, mask=in_n, other=-1).to(tl.int64)
    ok = in_n & (loc >= 0)
    d = tl.arange(0, BLOCK_D)
    dm = d < HEAD_DIM
    x = tl.load(SRC + i.to(tl.int64)[:, None] * stride_sn + h * stride_sh + d[None, :],
                mask=ok[:, None] & dm[None, :])
    tl.store(HOST + h * stride_hh + loc[:, None] * stride_hn + d[None, :], x,
             mask=ok[:, None] & dm[None, :])


def scatter_to_host(src: Tensor, host: Tensor, loc: Tensor) -> None:
    """``host[h, loc[i], :] = src[i, h, :]`` in place. ``src`` ``[n, H, D]`` (rows contiguous),
    ``host`` ``[H, N, D]`` (pinned when ``src`` is on CUDA), ``loc`` int ``[n]`` on src's
    device (``-1`` skips)."""
    n, num_heads, head_dim = src.shape
    if host.shape[0] != num_heads or host.shape[2] != head_dim or host.dtype != src.dtype:
        raise ValueError(f"host {tuple(host.shape)} {host.dtype} does not fit src "
                         f"{tuple(src.shape)} {src.dtype}")
    if src.stride(2) != 1 or host.stride(2) != 1:
        raise ValueError("rows must be contiguous")
    if src.is_cuda and not host.is_cuda and not torch.cuda.is_current_stream_capturing() \
            and not host.is_pinned():
        raise ValueError("a CPU destination must be pinned to be written by the GPU")
    if n == 0:
        return
    copy = _COPY_DTYPE[src.element_size()]
    s, hst = src.view(copy), host.view(copy)
    tokens = 16
    _scatter_to_host_kernel[(triton.cdiv(n, tokens), num_heads)](
        s, hst, loc, n, s.stride(0), s.stride(1), hst.stride(0), hst.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), TOKENS=tokens,
        num_warps=4,
    )


def scatter_to_host_ref(src: Tensor, host: Tensor, loc: Tensor) -> None:
    """Plain-torch reference of :func:`scatter_to_host` (syncs)."""
    loc = loc.long().cpu()
    keep = loc >= 0
    host[:, loc[keep]] = src.cpu()[keep].transpose(0, 1).to(host.dtype)
