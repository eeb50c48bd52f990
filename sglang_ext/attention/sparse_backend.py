"""``sglang_ext``: SGLang attention backend with two-level sparse decode.

Prefill/extend is dense and delegated to one of SGLang's own backends (the "dense delegate");
decode selects, per request and kv head, the tokens to attend (quest / ds / two_level) and
attends over them only. Contexts within the budget decode densely, computed exactly as SGLang's
torch_native backend does, so that a budget ≥ context reproduces SGLang token for token.

Two decode implementations (``--sparse-impl``):

* ``reference`` (the CPU default): plain torch, one request at a time, block summaries recomputed
  from the keys every step; honours per-request overrides. Not capturable in a CUDA graph.
* ``triton`` (the CUDA default): the batched, static-shape kernels of ``sglang_ext.kernels``;
  block summaries are kept per KV page (page size = block size) and updated as KV is written,
  in prefill and decode; captured in SGLang's decode CUDA graph. Uses the server-wide settings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_ext.attention import request_overrides
from sglang_ext.attention.request_overrides import RequestSparsity
from sglang_ext.config import SparseConfig
from sglang_ext.selection import select_token_mask, sparse_attention
from sglang_ext.selection.calibrate import load_label_config

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class PageSummaries:
    """Per-layer running key min/max of every KV page (the Quest block summaries).

    Kept in the KV dtype when it is bf16/fp16 (exact for keys of that dtype, half the bytes of
    float32 for the decode step to read), float32 otherwise (e.g. an fp8 KV cache)."""

    kmin: list[torch.Tensor]  # per layer: [num_pages, Hkv, D], see summary_dtype
    kmax: list[torch.Tensor]
    page_size: int

    @staticmethod
    def summary_dtype(kv_dtype: torch.dtype) -> torch.dtype:
        if kv_dtype in (torch.bfloat16, torch.float16, torch.float32):
            return kv_dtype
        return torch.float32

    @classmethod
    def allocate(cls, pool: Any, page_size: int, device: Any) -> "PageSummaries":
        from sglang_ext.kernels.block_summary import allocate_block_summaries

        k0 = pool.get_key_buffer(pool.start_layer)
        dtype = cls.summary_dtype(k0.dtype)
        kmin, kmax = [], []
        for _ in range(pool.layer_num):
            lo, hi = allocate_block_summaries(
                k0.shape[0], k0.shape[1], k0.shape[2], page_size, device, dtype=dtype
            )
            kmin.append(lo)
            kmax.append(hi)
        return cls(kmin, kmax, page_size)

    def update(self, layer_index: int, k: torch.Tensor, loc: torch.Tensor) -> None:
        from sglang_ext.kernels.block_summary import update_block_summaries

        update_block_summaries(self.kmin[layer_index], self.kmax[layer_index], k, loc, self.page_size)


@dataclass
class DecodeMetadata:
    """Host-side view of one decode batch, built once per step and shared by all layers."""

    req_pool_indices: list[int]
    seq_lens: list[int]
    sparsity: list[RequestSparsity]  # per request: its selection params, None = dense


class SparseDecodeBackend(AttentionBackend):
    """Dense extend via a delegate backend; sparse decode via the reference selection."""

    def __init__(self, model_runner: ModelRunner, config: SparseConfig) -> None:
        super().__init__()
        self.model_runner = model_runner
        self.config = config
        self.device = model_runner.device
        self.impl = resolve_impl(config, self.device)
        # The reference path loops over requests on the host; the kernels never need host
        # lengths, which keeps the overlap scheduler free of a per-step device->host copy.
        self.needs_cpu_seq_lens = self.impl == "reference"
        # SGLang reads the pools from the active backend (forward_context), so expose them.
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self._dense: Optional[AttentionBackend] = None
        self.decode_metadata: Optional[DecodeMetadata] = None
        self.default_params = request_overrides.selection_params(config)
        self.label_channels = self._load_label_channels(model_runner, config)
        self.summaries: Optional[PageSummaries] = None
        self._workspaces: list[Any] = []
        if self.impl == "triton":
            page_size = model_runner.server_args.page_size
            if page_size != config.block_size:
                raise ValueError(
                    f"--sparse-impl triton needs --page-size == --sparse-block-size "
                    f"(got {page_size} and {config.block_size})"
                )
            self.summaries = PageSummaries.allocate(self.token_to_kv_pool, page_size, self.device)

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _load_label_channels(
        model_runner: ModelRunner, config: SparseConfig
    ) -> Optional[torch.Tensor]:
        """[num_layers, kv_heads, r] channel ids for token scores, or None (all channels)."""
        if config.label_config is None:
            return None
        mc = model_runner.model_config
        channels = load_label_config(
            config.label_config,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.get_total_num_kv_heads(),
            head_dim=mc.head_dim,
        )
        if config.label_channels > channels.shape[-1]:
            raise ValueError(
                f"--sparse-label-channels {config.label_channels} exceeds the "
                f"{channels.shape[-1]} channels calibrated in {config.label_config}"
            )
        return channels[..., : config.label_channels].to(model_runner.device)

    def _dense_backend(self) -> AttentionBackend:
        """The SGLang backend that runs prefill/extend (built lazily: under HybridAttnBackend
        SGLang sends extend elsewhere and this one is never needed)."""
        if self._dense is None:
            from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

            name = self.config.dense_backend
            if name == "auto":
                name = "torch_native" if self.device == "cpu" else "triton"
            self._dense = ATTENTION_BACKENDS[name](self.model_runner)
        return self._dense

    # --------------------------------------------------------------- metadata

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():
            if mode.is_idle() or self.impl == "triton":
                # The kernels read req_pool_indices / seq_lens from the batch on the device.
                self.decode_metadata = None
                return
            seq_lens_cpu = forward_batch.seq_lens_cpu
            if seq_lens_cpu is None:
                seq_lens_cpu = forward_batch.seq_lens.cpu()
            rows = forward_batch.req_pool_indices.tolist()
            self.decode_metadata = DecodeMetadata(
                req_pool_indices=rows,
                seq_lens=seq_lens_cpu.tolist(),
                sparsity=[
                    request_overrides.lookup(self.req_to_token_pool, row, self.default_params)
                    for row in rows
                ],
            )
        else:
            self._dense_backend().init_forward_metadata(forward_batch)

    # ------------------------------------------------------------ CUDA graphs

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.impl != "triton":
            raise RuntimeError("the reference sparse decode cannot run under CUDA graphs")
        self._ensure_workspace(max_bs)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        self.init_forward_metadata(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # padded slots decode densely over position 0 of the padding row

    # ---------------------------------------------------------------- forward

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        out = self._dense_backend().forward_extend(
            q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs
        )
        if self.summaries is not None and save_kv_cache and k is not None:
            self._update_summaries(layer, k, forward_batch)
        return out

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, None), k, v
            )
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if self.impl == "triton":
            return self._forward_decode_kernels(q, k, layer, forward_batch, save_kv_cache)
        return self._forward_decode_reference(q, layer)

    def _forward_decode_kernels(
        self, q: torch.Tensor, k: Optional[torch.Tensor], layer: RadixAttention,
        forward_batch: ForwardBatch, save_kv_cache: bool,
    ) -> torch.Tensor:
        from sglang_ext.kernels.sparse_decode import sparse_decode_batched

        layer_index = self._layer_index(layer)
        if save_kv_cache and k is not None:
            self._update_summaries(layer, k, forward_batch)
        channels = None if self.label_channels is None else self.label_channels[layer.layer_id]
        out = sparse_decode_batched(
            q,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            forward_batch.req_pool_indices,
            forward_batch.seq_lens,
            self.summaries.kmin[layer_index],
            self.summaries.kmax[layer_index],
            self.default_params,
            layer.scaling,
            channels=channels,
            workspace=self._ensure_workspace(q.shape[0]),
        )
        # The workspace's output buffer is shared by all layers: hand back a copy.
        return out.reshape(q.shape[0], layer.tp_q_head_num * layer.v_head_dim).clone()

    def _ensure_workspace(self, batch: int) -> Any:
        """Scratch that fits `batch`. Workspaces are never freed or replaced: captured CUDA
        graphs keep pointing at the one they were captured with, and eager batches larger than
        the graphs' maximum get a larger one of their own."""
        from sglang_ext.kernels.sparse_decode import SparseDecodeWorkspace

        fitting = [ws for ws in self._workspaces if ws.max_batch >= batch]
        if fitting:
            return min(fitting, key=lambda ws: ws.max_batch)
        pool = self.token_to_kv_pool  # per-rank head counts under tensor parallelism
        mc = self.model_runner.model_config
        group = mc.num_attention_heads // mc.get_total_num_kv_heads()
        workspace = SparseDecodeWorkspace(
            max_batch=batch,
            num_q_heads=pool.head_num * group,
            num_kv_heads=pool.head_num,
            head_dim_v=pool.v_head_dim,
            params=self.default_params,
            max_blocks=-(-self.req_to_token_pool.req_to_token.shape[1] // self.config.block_size),
            device=self.device,
            dtype=self.model_runner.dtype,
        )
        self._workspaces.append(workspace)
        return workspace

    def _update_summaries(self, layer: RadixAttention, k: torch.Tensor, forward_batch: ForwardBatch) -> None:
        """Fold the keys just written (prefill or decode) into their pages' min/max."""
        keys = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
        self.summaries.update(self._layer_index(layer), keys, forward_batch.out_cache_loc)

    def _layer_index(self, layer: RadixAttention) -> int:
        return layer.layer_id - self.token_to_kv_pool.start_layer

    def _forward_decode_reference(self, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        meta = self.decode_metadata
        assert meta is not None, "init_forward_metadata was not called for this decode batch"
        out = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        channels = None if self.label_channels is None else self.label_channels[layer.layer_id]

        for i, (row, seq_len, params) in enumerate(
            zip(meta.req_pool_indices, meta.seq_lens, meta.sparsity)
        ):
            slots = req_to_token[row, :seq_len]
            keys = k_buf[slots]  # [L, Hkv, D]
            values = v_buf[slots]
            if params is None or seq_len <= params.budget:
                out[i] = _dense_decode_like_sglang(q[i], keys, values, layer.scaling)
            else:
                mask = select_token_mask(q[i], keys, params, channels)
                out[i] = sparse_attention(q[i], keys, values, mask, layer.scaling)
        return out.view(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def support_triton(self) -> bool:
        return self.device != "cpu"


def resolve_impl(config: SparseConfig, device: Any) -> str:
    if config.impl != "auto":
        return config.impl
    return "reference" if str(device) == "cpu" else "triton"


def _dense_decode_like_sglang(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """One request's dense decode, the same SDPA call (layout, dtype, GQA) as SGLang's
    torch_native backend, so that dense decode through us is bit-identical to it."""
    q_ = q.unsqueeze(1)  # [Hq, 1, D]
    k_ = keys.movedim(0, 1)  # [Hkv, L, D]
    v_ = values.movedim(0, 1)
    if not (q_.dtype == k_.dtype == v_.dtype):
        k_, v_ = k_.to(q_.dtype), v_.to(q_.dtype)
    o = scaled_dot_product_attention(
        q_.unsqueeze(0), k_.unsqueeze(0), v_.unsqueeze(0),
        enable_gqa=q_.shape[0] != k_.shape[0], scale=scaling, is_causal=False,
    )
    return o.squeeze(0).squeeze(1)  # [Hq, Dv]
