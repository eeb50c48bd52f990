"""A decode step's KV write, in one launch per layer: the new keys and values into the KV pool,
their pages' key min/max (the block summaries) and their label channels (the label cache).

Unfused, a decode step writes each layer through SGLang's ``set_kv_buffer`` (on an fp8 cache:
a cast of k, a cast of v, then the store) and then :func:`~sglang_ext.kernels.block_summary.
update_block_summaries` and :func:`~sglang_ext.kernels.label_cache.update_label_cache` (on an
fp8 cache after casting the keys to fp8 and back, so that both summarise what the attention
reads): up to seven launches of a few microseconds for ten-odd tokens, ≈ 0.5 ms per step of 36
layers at 10 × 128k on the H200 (the e2e profile). Here one program per (token, kv head) does
all of it from the registers it loaded.

What it writes is what the unfused path writes, bit for bit:

* the pool row: the key as given when the cache has its dtype; on a float8_e4m3fn cache
  ``bf16(k / k_scale)`` rounded to nearest even, overflow to NaN (torch's cast, which SGLang's
  ``set_kv_buffer`` applies after dividing in place in the keys' dtype);
* the summaries of the stored key (widened back), folded as ``update_block_summaries`` folds
  them: a page whose first slot is written starts clean (fp8 summaries rounded outward);
* the labels: the stored key's label channels in the label cache's dtype (fp8 labels of a
  16-bit cache clamped to ±448 and rounded to nearest even, as ``update_label_cache``).

The conversions are integer arithmetic on the fp32 bits, so that Triton's CPU interpreter
(which narrows floats by truncation) runs the same code as the GPU and the tests can compare it
with the torch reference. Precondition (a decode batch): at most one token per page per call,
except the CUDA-graph padding slot 0, whose page is never read. Launch-only: no host sync, safe
inside a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from sglang_ext.kernels.block_summary import (
    FP8_LIMIT, SUMMARY_DTYPES, fold_into_summary, update_block_summaries_ref,
)
from sglang_ext.kernels.label_cache import update_label_cache_ref
from sglang_ext.selection.params import FP8_SUMMARIES

# The cache dtypes this kernel writes besides the keys' own (SGLang's fp8_e4m3 KV cache).
FP8_KV = torch.float8_e4m3fn


@triton.jit
def bf16_nearest(x):
    """fp32 ``x`` rounded to the bfloat16 grid, to nearest even (still fp32)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & -65536).to(tl.float32, bitcast=True)


@triton.jit
def fp8_nearest(x):
    """fp32 ``x`` to float8_e4m3fn, to nearest even, as torch casts: a magnitude that rounds
    past 448 (and inf, NaN) becomes NaN; returns the fp8 value."""
    bits = x.to(tl.int32, bitcast=True)
    neg = bits < 0
    mag = bits & 0x7FFFFFFF
    exp32 = mag >> 23
    normal = exp32 >= 121  # |x| >= 2**-6
    # normals: keep 3 mantissa bits, round half to even on the 20 cut bits (a carry moves
    # into the exponent, which is the next binade's code)
    trunc = ((exp32 - 120) << 3) | ((mag >> 20) & 7)
    cut = mag & 0xFFFFF
    up = (cut > 0x80000) | ((cut == 0x80000) & ((trunc & 1) == 1))
    code_normal = trunc + up.to(tl.int32)
    # subnormals: multiples of 2**-9 (the scaling by 512 is exact)
    units = tl.abs(x) * 512.0
    floor = units.to(tl.int32)
    frac = units - floor.to(tl.float32)
    up_sub = (frac > 0.5) | ((frac == 0.5) & ((floor & 1) == 1))
    code_sub = floor + up_sub.to(tl.int32)
    code = tl.where(normal, code_normal, code_sub)
    code = tl.where(mag > 0x43E80000, 0x7F, code)  # |x| > 464 rounds past 448: NaN
    code = tl.where(neg, code | 0x80, code)
    return code.to(tl.int8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _decode_kv_write_kernel(
    K, V, LOC, K_BUF, V_BUF, KMIN, KMAX, LABELS, CHANNELS,
    k_scale, v_scale,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_kbs, stride_kbh, stride_vbs, stride_vbh,
    stride_sp, stride_sh, stride_ls, stride_lg, stride_cg,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, V_HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    KV_FP8: tl.constexpr, SUMMARIES: tl.constexpr, SUMMARY_FP8: tl.constexpr,
    NUM_CH: tl.constexpr, BLOCK_CH: tl.constexpr, LABEL_FP8: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    slot = tl.load(LOC + n).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dvmask = dv < V_HEAD_DIM
    k = tl.load(K + n * stride_kn + g * stride_kh + d, mask=dmask, other=0.0)
    v = tl.load(V + n * stride_vn + g * stride_vh + dv, mask=dvmask, other=0.0)
    if KV_FP8:
        k_stored = fp8_nearest(bf16_nearest(k.to(tl.float32) / k_scale))
        v_stored = fp8_nearest(bf16_nearest(v.to(tl.float32) / v_scale))
    else:
        k_stored = k
        v_stored = v
    tl.store(K_BUF + slot * stride_kbs + g * stride_kbh + d, k_stored, mask=dmask)
    tl.store(V_BUF + slot * stride_vbs + g * stride_vbh + dv, v_stored, mask=dvmask)

    if SUMMARIES:
        key = k_stored.to(tl.float32)  # exact: the summaries hold the stored keys' values
        # one token per page: the run is this key; a page's first slot starts it clean
        fold_into_summary(KMIN, KMAX, (slot // PAGE_SIZE) * stride_sp + g * stride_sh + d,
                          dmask, dmask & (slot % PAGE_SIZE != 0), key, key, SUMMARY_FP8)

    if NUM_CH > 0:
        i = tl.arange(0, BLOCK_CH)
        imask = i < NUM_CH
        ch = tl.load(CHANNELS + g * stride_cg + i, mask=imask, other=0).to(tl.int64)
        # the label channels of the stored key (re-read from the row just loaded: L1 hits)
        val = tl.load(K + n * stride_kn + g * stride_kh + ch, mask=imask, other=0.0)
        if KV_FP8:
            val = fp8_nearest(bf16_nearest(val.to(tl.float32) / k_scale))
        if LABEL_FP8:
            label = fp8_nearest(tl.minimum(tl.maximum(val.to(tl.float32), -FP8_LIMIT),
                                           FP8_LIMIT))
        else:
            label = val.to(LABELS.dtype.element_ty)
        tl.store(LABELS + slot * stride_ls + g * stride_lg + i, label, mask=imask)


def fused_write_supported(kv_dtype: torch.dtype, key_dtype: torch.dtype,
                          summary_dtype: Optional[torch.dtype],
                          label_dtype: Optional[torch.dtype]) -> bool:
    """Whether :func:`write_decode_kv` writes this combination exactly as the unfused path:
    a cache in the keys' own (16-bit) dtype, or float8_e4m3fn under bf16 keys (the kernel
    rounds ``k / k_scale`` to bf16 before fp8, as set_kv_buffer's in-place division does for
    bf16 keys; fp16 keys would be rounded to fp16 there); summaries in the stored keys' dtype,
    float32 or fp8; labels in the stored keys' dtype or fp8."""
    if key_dtype not in (torch.bfloat16, torch.float16):
        return False
    if kv_dtype not in (key_dtype, FP8_KV) or (kv_dtype == FP8_KV and key_dtype != torch.bfloat16):
        return False
    if summary_dtype is not None and summary_dtype not in (kv_dtype, torch.float32,
                                                           FP8_SUMMARIES):
        return False
    return label_dtype is None or label_dtype in (kv_dtype, FP8_KV)


def write_decode_kv(
    k: Tensor, v: Tensor, loc: Tensor, k_buffer: Tensor, v_buffer: Tensor,
    kmin: Optional[Tensor], kmax: Optional[Tensor], page_size: int,
    labels: Optional[Tensor] = None, channels: Optional[Tensor] = None,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write a decode step's keys ``k`` ``[N, Hkv, D]`` and values ``v`` ``[N, Hkv, Dv]`` to
    the slots ``loc`` ``[N]`` of one layer's ``k_buffer`` / ``v_buffer`` (``[slots, Hkv, D]``,
    rows contiguous), fold the stored keys into their pages' ``kmin`` / ``kmax`` (``[pages,
    Hkv, D]``, or None) and store their ``channels`` (``[Hkv, r]``) in ``labels`` (``[slots,
    Hkv, r]``, or None). ``k_scale`` / ``v_scale``: the layer's KV scales (an fp8 cache stores
    ``k / k_scale``). See the module docstring for what is written and the precondition."""
    num_tokens, num_kv_heads, head_dim = k.shape
    v_head_dim = v.shape[2]
    if not fused_write_supported(k_buffer.dtype, k.dtype,
                                 None if kmin is None else kmin.dtype,
                                 None if labels is None else labels.dtype):
        raise TypeError(f"no fused decode write for keys {k.dtype}, cache {k_buffer.dtype}, "
                        f"summaries {None if kmin is None else kmin.dtype}, labels "
                        f"{None if labels is None else labels.dtype}")
    if v_buffer.dtype != k_buffer.dtype or v.dtype != k.dtype:
        raise TypeError("keys and values must share their dtypes")
    if tuple(k_buffer.shape[1:]) != (num_kv_heads, head_dim) or \
            tuple(v_buffer.shape[1:]) != (num_kv_heads, v_head_dim):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the buffers "
                         f"{tuple(k_buffer.shape)} / {tuple(v_buffer.shape)}")
    if k_buffer.stride(2) != 1 or v_buffer.stride(2) != 1:
        raise ValueError("the KV buffers' rows must be contiguous")
    summaries = kmin is not None
    if summaries and (kmax is None or kmax.shape != kmin.shape or kmax.dtype != kmin.dtype
                      or not kmin.is_contiguous() or not kmax.is_contiguous()
                      or tuple(kmin.shape[1:]) != (num_kv_heads, head_dim)):
        raise ValueError("kmin/kmax must be two contiguous [pages, Hkv, D] tensors of one dtype")
    if summaries and kmin.dtype not in SUMMARY_DTYPES:
        raise TypeError(f"summaries must be one of {SUMMARY_DTYPES}, got {kmin.dtype}")
    num_ch = 0
    if labels is not None:
        if channels is None or tuple(channels.shape) != (num_kv_heads, labels.shape[2]):
            raise ValueError(f"labels {tuple(labels.shape)} need their channels [Hkv, r]")
        if labels.stride(2) != 1 or channels.stride(1) != 1:
            raise ValueError("the label cache's rows and the channels must be contiguous")
        num_ch = labels.shape[2]
    if num_tokens == 0:
        return
    if k.stride(2) != 1:
        k = k.contiguous()
    if v.stride(2) != 1:
        v = v.contiguous()
    loc = loc.reshape(-1)
    if loc.shape[0] != num_tokens:
        raise ValueError(f"loc has {loc.shape[0]} entries for {num_tokens} keys")
    kv_fp8 = k_buffer.dtype == FP8_KV
    _decode_kv_write_kernel[(num_tokens, num_kv_heads)](
        k, v, loc, k_buffer, v_buffer,
        kmin if summaries else k_buffer, kmax if summaries else k_buffer,
        labels if num_ch else k_buffer, channels if num_ch else loc,
        float(k_scale), float(v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        kmin.stride(0) if summaries else 0, kmin.stride(1) if summaries else 0,
        labels.stride(0) if num_ch else 0, labels.stride(1) if num_ch else 0,
        channels.stride(0) if num_ch else 0,
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, V_HEAD_DIM=v_head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_DV=triton.next_power_of_2(v_head_dim),
        KV_FP8=kv_fp8, SUMMARIES=summaries,
        SUMMARY_FP8=summaries and kmin.dtype == FP8_SUMMARIES,
        NUM_CH=num_ch, BLOCK_CH=max(2, triton.next_power_of_2(max(num_ch, 1))),
        LABEL_FP8=num_ch > 0 and labels.dtype == FP8_KV and not kv_fp8,
        num_warps=1,
    )


def write_decode_kv_ref(
    k: Tensor, v: Tensor, loc: Tensor, k_buffer: Tensor, v_buffer: Tensor,
    kmin: Optional[Tensor], kmax: Optional[Tensor], page_size: int,
    labels: Optional[Tensor] = None, channels: Optional[Tensor] = None,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """The unfused path in plain torch (same in-place contract as :func:`write_decode_kv`):
    SGLang's ``set_kv_buffer`` arithmetic, then the summaries' and the label cache's
    references over the stored keys."""
    if k_buffer.dtype != k.dtype:  # set_kv_buffer: divide in the keys' dtype, then cast
        k = (k / k_scale).to(k_buffer.dtype)
        v = (v / v_scale).to(v_buffer.dtype)
    slots = loc.reshape(-1).long()
    # (torch has no indexed store of fp8 on the CPU: stored through a byte view, as SGLang does)
    as_stored = (lambda t: t.view(torch.uint8)) if k_buffer.dtype == FP8_KV else (lambda t: t)
    as_stored(k_buffer)[slots] = as_stored(k)
    as_stored(v_buffer)[slots] = as_stored(v)
    keys = k.to(torch.bfloat16) if k.dtype == FP8_KV else k  # the stored keys, exactly
    if kmin is not None:
        update_block_summaries_ref(kmin, kmax, keys, loc, page_size)
    if labels is not None:
        update_label_cache_ref(labels, keys, loc, channels)
