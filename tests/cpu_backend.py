"""Our backend built on the CPU over SGLang's own MHA pool, without a server: a model runner
reduced to what SparseDecodeBackend reads, and a label config written for it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch
from fake_backend import FakeReqToTokenPool


def cpu_mha_pool(kv_dtype: torch.dtype, num_kv_heads: int, head_dim: int, layers: int,
                 page: int, num_pages: int) -> Any:
    """SGLang's MHATokenToKVPool on the CPU, ``num_pages`` pages of ``page`` slots."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=num_pages * page, page_size=page, dtype=kv_dtype,
                            head_num=num_kv_heads, head_dim=head_dim, layer_num=layers,
                            device="cpu", enable_memory_saver=False)


def cpu_sparse_backend(tmp_path, pool: Any, req_to_token: torch.Tensor, num_q_heads: int,
                       channels: list[list[list[int]]], side_dtype: str, budget: int = 16,
                       sink: int = 2, window: int = 4, **config: Any) -> Any:
    """SparseDecodeBackend (two_level, triton impl) over ``pool``; ``channels``: each layer's
    label channels per kv head; ``side_dtype``: the labels' and summaries' dtype flag;
    ``config``: more SparseConfig fields."""
    from sglang_ext.attention.sparse_backend import SparseDecodeBackend
    from sglang_ext.config import build_config
    from sglang_ext.selection.calibrate import FORMAT as LABELS_FORMAT

    k0 = pool.get_key_buffer(0)
    layers, hkv, d, page = pool.layer_num, k0.shape[1], k0.shape[2], pool.page_size
    r = len(channels[0][0])
    (tmp_path / "labels.json").write_text(json.dumps({
        "format": LABELS_FORMAT, "model": {"num_layers": layers, "num_kv_heads": hkv,
                                           "head_dim": d},
        "label_channels": r, "channels": channels}))
    cfg = build_config(method="two_level", budget=budget, block_size=page, sink=sink,
                       window=window, impl="triton", label_channels=r,
                       label_config=str(tmp_path / "labels.json"),
                       label_dtype=side_dtype, summary_dtype=side_dtype, **config)
    runner = SimpleNamespace(
        device="cpu", req_to_token_pool=FakeReqToTokenPool(req_to_token),
        token_to_kv_pool=pool, model_config=SimpleNamespace(
            num_attention_heads=num_q_heads, num_hidden_layers=layers, head_dim=d, v_head_dim=d,
            attention_arch=None, get_total_num_kv_heads=lambda: hkv),
        server_args=SimpleNamespace(page_size=page, enable_metrics=False), dtype=torch.bfloat16)
    return SparseDecodeBackend(runner, cfg)


def decode_batch(table: torch.Tensor, rows: list[int], lens: list[int]) -> Any:
    """A decode ForwardBatch as the backend reads it: requests ``rows`` at lengths ``lens``
    (this step's token included), each writing its next slot from ``table``."""
    from fake_backend import DecodeMode

    seq = torch.tensor(lens)
    return SimpleNamespace(
        forward_mode=DecodeMode(), batch_size=len(rows), req_pool_indices=torch.tensor(rows),
        seq_lens=seq, seq_lens_cpu=seq,
        out_cache_loc=torch.stack([table[r, n - 1] for r, n in zip(rows, lens)]).long())


def attention_layer(layer_id: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> Any:
    """A RadixAttention layer as the backend reads it."""
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=num_q_heads,
                           tp_k_head_num=num_kv_heads, tp_v_head_num=num_kv_heads,
                           qk_head_dim=head_dim, v_head_dim=head_dim, scaling=head_dim ** -0.5)


def decode_bf16_steps(backend: Any, table: torch.Tensor, rows: list[int], lens: list[int],
                      steps: int, gen: torch.Generator, num_q_heads: int) -> list[torch.Tensor]:
    """``steps`` decode steps of the requests in ``rows`` (each at its length in ``lens``,
    its next slot from ``table``) through the backend, random bf16 q/k/v per layer; every
    layer's output, in order."""
    pool = backend.token_to_kv_pool
    hkv, d = pool.get_key_buffer(0).shape[1:]
    lens, outs = list(lens), []
    for _ in range(steps):
        lens = [n + 1 for n in lens]
        batch = decode_batch(table, rows, lens)
        backend.init_forward_metadata(batch)
        for layer_id in range(pool.layer_num):
            layer = attention_layer(layer_id, num_q_heads, hkv, d)
            q, k, v = (torch.randn(len(rows), n * d, generator=gen).to(torch.bfloat16)
                       for n in (num_q_heads, hkv, hkv))
            outs.append(backend.forward_decode(q, k.view(-1, hkv, d), v.view(-1, hkv, d),
                                               layer, batch))
    return outs
