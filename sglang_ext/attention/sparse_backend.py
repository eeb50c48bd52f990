"""``sglang_ext``: SGLang attention backend with two-level sparse decode.

An adapter between SGLang's ``AttentionBackend`` interface and our decoders. Prefill/extend is
dense and delegated to one of SGLang's own backends (the "dense delegate"); decode runs as
plan + run (attention/decode_plan.py): ``init_forward_metadata`` builds the step's plan once,
each layer's ``forward_decode`` calls ``plan.run``.

Two decoders (``--sparse-impl``), chosen once at start-up:

* ``reference`` (the CPU default, attention/reference_decode.py): plain torch, one request at a
  time; honours every per-request override. Not capturable in a CUDA graph.
* ``triton`` (the CUDA default, attention/kernel_decode.py): the batched, static-shape kernels
  of ``sglang_ext.kernels``, with page summaries and labels kept per KV page as KV is written;
  captured in SGLang's decode CUDA graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_ext import runtime
from sglang_ext.attention import request_overrides
from sglang_ext.attention.decode_plan import DecodeContext, DecodePlan, batch_kind
from sglang_ext.attention.qk_basis import QKBasis
from sglang_ext.attention.side_buffers import ModelFiles
from sglang_ext.config import SparseConfig
from sglang_ext.memory_tier.tiered_pool import TieredPool
from sglang_ext.selection.mla import mla_config, mla_unsupported, pool_kv_lora_rank

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_ext.attention.kernel_decode import KernelDecoder
    from sglang_ext.attention.reference_decode import ReferenceDecoder


def resolve_impl(config: SparseConfig, device: Any) -> str:
    if config.impl != "auto":
        return config.impl
    return "reference" if str(device) == "cpu" else "triton"


class SparseDecodeBackend(AttentionBackend):
    """Dense extend via a delegate backend; sparse decode via the configured decoder."""

    def __init__(self, model_runner: ModelRunner, config: SparseConfig) -> None:
        super().__init__()
        self.model_runner = model_runner
        self.device = model_runner.device
        # SGLang reads the pools from the active backend (forward_context), so expose them.
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        # MLA pools (selection/mla.py): one latent row [R + P] per token, V its [:R] view.
        kv_lora_rank = pool_kv_lora_rank(self.token_to_kv_pool)
        if kv_lora_rank is not None:
            config = mla_config(config)
            if mla_unsupported(config):
                raise ValueError(f"sglang_ext: {mla_unsupported(config)[0][1]} does not support "
                                 "MLA models (latent KV pool) yet")
        self.config = config
        self.impl = resolve_impl(config, self.device)
        server_args = getattr(model_runner, "server_args", None)
        pool = self.token_to_kv_pool
        self.ctx = DecodeContext(
            config=config, model_runner=model_runner, device=self.device,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=pool,
            tiered=pool if isinstance(pool, TieredPool) else None, kv_lora_rank=kv_lora_rank,
            page_size=getattr(server_args, "page_size", config.block_size),
            default_params=request_overrides.selection_params(config),
            files=ModelFiles.load(model_runner, config),
            enable_metrics=bool(getattr(server_args, "enable_metrics", False)),
        )
        # --sparse-label-config with a basis: q and k change basis before anything sees them
        basis = self.ctx.files.label_basis
        if basis is not None and kv_lora_rank is not None:
            raise ValueError("sglang_ext: a label basis does not support MLA models (latent KV "
                             "pool) yet")
        self.basis = QKBasis(*basis, self.device) if basis is not None else None
        self.decoder: Union[KernelDecoder, ReferenceDecoder]
        if self.impl == "triton":
            from sglang_ext.attention.kernel_decode import KernelDecoder

            self.decoder = KernelDecoder(self.ctx)
        else:
            from sglang_ext.attention.reference_decode import ReferenceDecoder

            self.decoder = ReferenceDecoder(self.ctx)
        # Host-side lengths: the reference decode loops over requests on the host, and the
        # tier starts a request's decoding from them; the kernels read them on the device,
        # which keeps the overlap scheduler free of a per-step device->host copy.
        self.needs_cpu_seq_lens = self.decoder.needs_cpu_seq_lens or self.ctx.tiered is not None
        self.plan: Optional[DecodePlan] = None
        self._dense: Optional[AttentionBackend] = None
        runtime.state().backend_built(self)

    @property
    def default_params(self) -> Any:
        return self.ctx.default_params

    def _dense_backend(self) -> AttentionBackend:
        """The SGLang backend that runs prefill/extend (built lazily: under HybridAttnBackend
        SGLang sends extend elsewhere and this one is never needed)."""
        if self._dense is None:
            from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

            name = self.config.dense_backend
            if name == "auto":
                name = "torch_native" if self.device == "cpu" else "triton"
            runner = self.model_runner
            if self.ctx.tiered is not None:
                # The dense backend reads prefixes through req_to_token: give it the table of
                # device rows (writes are translated by the pool itself).
                runner = _WithReqToToken(runner, self.ctx.tiered.dev_req_to_token)
            self._dense = ATTENTION_BACKENDS[name](runner)
        return self._dense

    # --------------------------------------------------------------- metadata

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.decoder.before_batch(forward_batch)
        kind = batch_kind(forward_batch)
        self.plan = self.decoder.plan(forward_batch) if kind == "decode" else None
        if kind == "extend":
            self._dense_backend().init_forward_metadata(forward_batch)

    # ------------------------------------------------------------ CUDA graphs

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.impl != "triton":
            raise RuntimeError("the reference sparse decode cannot run under CUDA graphs")
        self.decoder.workspace(max_bs)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch,
                                        in_capture: bool = False) -> None:
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
        if self.basis is not None:
            q, k = self.basis.rotate(layer.layer_id, q, k)
        dense = self._dense_backend()
        out = self.decoder.extend_shortcut(layer, q, k, v, forward_batch, save_kv_cache, dense)
        if out is None:
            out = dense.forward_extend(q, k, v, layer, forward_batch,
                                       save_kv_cache=save_kv_cache, **kwargs)
        self.decoder.after_extend_layer(layer, q, k, v, forward_batch, save_kv_cache)
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
        assert self.plan is not None, "init_forward_metadata was not called for this decode batch"
        if self.basis is not None:
            q, k = self.basis.rotate(layer.layer_id, q, k)
        return self.plan.run(layer, q, k, v, save_kv_cache)

    def support_triton(self) -> bool:
        return self.device != "cpu"


class _WithReqToToken:
    """A model runner whose ``req_to_token_pool.req_to_token`` is another table (the tier's
    device-row translation); everything else is the runner's."""

    def __init__(self, runner: Any, table: torch.Tensor) -> None:
        self._runner = runner
        self.req_to_token_pool = _ReqPoolView(runner.req_to_token_pool, table)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


class _ReqPoolView:
    def __init__(self, pool: Any, table: torch.Tensor) -> None:
        self._pool = pool
        self.req_to_token = table

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)
