"""The decode step as plan + run, and the protocol every optional feature implements.

``init_forward_metadata`` builds a plan once per decode step (host side, outside CUDA graphs,
FlashInfer's ``plan()``); each layer's ``forward_decode`` calls ``plan.run(layer, q, k, v)``
(captured in the decode CUDA graph, FlashInfer's ``run()``). Two decoders build plans:
``kernel_decode.KernelDecoder`` (the batched Triton pipeline) and
``reference_decode.ReferenceDecoder`` (per request in torch, the CPU oracle); the backend picks
one at start-up.

An optional feature (the accuracy guard, the locality constraint, the asynchronous block filter,
the CPU tier, cooperative attention, ...) is one class in ``attention/features/`` that overrides
the hooks of :class:`DecodeFeature` it needs. The decoder builds the features the configuration
enables; a feature that is off is not built, so it costs nothing and no other code names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

import torch
from torch import Tensor

from sglang_ext.config import SparseConfig
from sglang_ext.kernels.sparse_decode import DecodeRows, LayerCache
from sglang_ext.selection.params import SelectionParams


def batch_kind(forward_batch: Any) -> str:
    """``idle``, ``decode`` or ``extend`` (prefill, with or without a cached prefix)."""
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return "idle"
    return "decode" if mode.is_decode_or_idle() else "extend"


def decode_rows(req_to_token: Tensor, forward_batch: Any) -> DecodeRows:
    return DecodeRows(req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens)


def host_seq_lens(forward_batch: Any) -> list[int]:
    lens = forward_batch.seq_lens_cpu
    return (lens if lens is not None else forward_batch.seq_lens).tolist()


@dataclass
class DecodeContext:
    """What the decoders and features share about this server: its settings, pools and model
    files, fixed at start-up."""

    config: SparseConfig
    model_runner: Any
    device: Any
    req_to_token_pool: Any
    token_to_kv_pool: Any
    tiered: Optional[Any]  # the CPU tier's pool (memory_tier.TieredPool), or None
    kv_lora_rank: Optional[int]  # MLA latent pools: one latent row per token
    page_size: int
    default_params: SelectionParams  # the server's selection
    files: Any  # side_buffers.ModelFiles
    enable_metrics: bool = False

    @property
    def dtype(self) -> torch.dtype:
        """The model's."""
        return self.model_runner.dtype

    @property
    def num_q_heads(self) -> int:
        """Query heads this rank computes (all of them without --tp)."""
        from sglang_ext.tensor_parallel import attn_tp

        return self.model_runner.model_config.num_attention_heads // attn_tp().size

    @property
    def req_to_token(self) -> Tensor:
        return self.req_to_token_pool.req_to_token

    @property
    def num_layers(self) -> int:
        return self.token_to_kv_pool.layer_num

    @property
    def max_blocks(self) -> int:
        return -(-self.req_to_token.shape[1] // self.config.block_size)

    def layer_index(self, layer: Any) -> int:
        """The layer's index among this pool's (pipeline parallelism starts past 0)."""
        return layer.layer_id - self.token_to_kv_pool.start_layer

    def label_channels(self, layer_id: int) -> Optional[Tensor]:
        channels = self.files.label_channels
        return None if channels is None else channels[layer_id]


class LayerStep(NamedTuple):
    """One layer of a decode step: its index among the pool's layers, the query
    ``[B, Hq, D]``, its KV and side buffers, and the softmax scale."""

    index: int
    q: Tensor
    cache: LayerCache
    scaling: float


class DecodePlan(Protocol):
    def run(self, layer: Any, q: Tensor, k: Optional[Tensor], v: Optional[Tensor],
            save_kv_cache: bool) -> Tensor:
        """One layer's decode: write its KV (``save_kv_cache``), attend, return
        ``[B, Hq * Dv]``."""


class DecodeFeature:
    """An optional feature of the batched decode: override the hooks it needs.

    Host hooks run outside CUDA graphs; the layer hooks run inside the captured decode, so they
    must keep static shapes and never read device values on the host."""

    needs_lse = False  # after_layer reads the attention's log-sum-exp
    # the feature folds something of the keys that the fused KV write does not write
    blocks_fused_write = False

    def before_batch(self, forward_batch: Any) -> None:
        """Host: every batch (extend, decode, idle), before its layers."""

    def after_extend_layer(self, step: LayerStep, forward_batch: Any) -> None:
        """After an extend layer's attention; ``step.q`` is ``[tokens, Hq, D]``."""

    def kv_written(self, index: int, keys: Tensor, values: Optional[Tensor],
                   loc: Tensor) -> None:
        """Keys (as stored) and values just written at ``loc`` (extend and decode)."""

    def start_layers(self, plan: Any) -> None:
        """Device, before the decode step's first layer."""

    def decode_layer(self, plan: Any, step: LayerStep) -> Optional[Tensor]:
        """The layer's ``[B, Hq, Dv]`` output computed another way (cooperative attention), or
        None: the batched pipeline runs, with every feature's layer_inputs."""
        return None

    def layer_inputs(self, plan: Any, step: LayerStep) -> dict[str, Any]:
        """Fields of the layer's ``SelectionInputs`` (kernels/sparse_decode.py)."""
        return {}

    def after_layer(self, plan: Any, step: LayerStep, lse: Optional[Tensor]) -> None:
        """After the layer's attention (``lse`` when ``needs_lse``)."""

    def end_layers(self, plan: Any) -> None:
        """Device, after the decode step's last layer."""


def kv_write_scales(layer: Any) -> tuple[Any, ...]:
    """The layer's (k_scale, v_scale) for ``set_kv_buffer`` where it has any (a checkpoint's
    fp8 KV scales), else nothing: the pool's plain cast."""
    k_scale, v_scale = getattr(layer, "k_scale", None), getattr(layer, "v_scale", None)
    return () if k_scale is None and v_scale is None else (k_scale, v_scale)


def kv_read_scales(layer: Any) -> tuple[float, float]:
    """A layer's (k_scale, v_scale) as floats (``RadixAttention.k_scale_float``), 1.0 where the
    checkpoint has none."""
    scales = (getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None))
    return tuple(1.0 if x is None else float(x) for x in scales)  # type: ignore[return-value]


def write_kv(pool: Any, layer: Any, k: Tensor, v: Tensor, loc: Tensor,
             with_scales: bool = True) -> None:
    """SGLang's own KV write; ``with_scales``: with the layer's KV scales, as SGLang's FlashInfer
    prefill writes them (an fp8 KV cache of a checkpoint that has scales stores k / k_scale),
    else as torch_native's extend does (without)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    scales = kv_write_scales(layer) if with_scales else ()
    pool.set_kv_buffer(layer, KVWriteLoc(loc, None), k, v, *scales)
