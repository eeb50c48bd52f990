"""Our backend built on the CPU over SGLang's own MHA pool, without a server: a model runner
reduced to what SparseDecodeBackend reads, and a label config written for it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import torch


def cpu_mha_pool(kv_dtype: torch.dtype, num_kv_heads: int, head_dim: int, layers: int,
                 page: int, num_pages: int) -> Any:
    """SGLang's MHATokenToKVPool on the CPU, ``num_pages`` pages of ``page`` slots."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=num_pages * page, page_size=page, dtype=kv_dtype,
                            head_num=num_kv_heads, head_dim=head_dim, layer_num=layers,
                            device="cpu", enable_memory_saver=False)


def cpu_sparse_backend(tmp_path, pool: Any, req_to_token: torch.Tensor, num_q_heads: int,
                       channels: list[list[list[int]]], side_dtype: str, budget: int = 16,
                       sink: int = 2, window: int = 4) -> Any:
    """SparseDecodeBackend (two_level, triton impl) over ``pool``; ``channels``: each layer's
    label channels per kv head; ``side_dtype``: the labels' and summaries' dtype flag."""
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
                       label_dtype=side_dtype, summary_dtype=side_dtype)
    runner = SimpleNamespace(
        device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        token_to_kv_pool=pool, model_config=SimpleNamespace(
            num_attention_heads=num_q_heads, num_hidden_layers=layers, head_dim=d, v_head_dim=d,
            attention_arch=None, get_total_num_kv_heads=lambda: hkv),
        server_args=SimpleNamespace(page_size=page, enable_metrics=False), dtype=torch.bfloat16)
    return SparseDecodeBackend(runner, cfg)
