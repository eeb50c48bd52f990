"""What the sparse decode keeps beside SGLang's KV pool, and the model files it reads.

* :class:`PageSummaries`: every KV page's key min/max per layer (the Quest block summaries),
  updated as KV is written (prefill and decode).
* :func:`allocate_label_cache`: the label channels of every key, stored contiguously
  (kernels/label_cache.py), for methods that score tokens by label channels.
* :class:`ModelFiles`: the per-model files given by flags (label channels, Fluxion's head
  policy, NOSA's eviction heads), loaded once and cut to this rank's kv heads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from sglang_ext.config import SparseConfig
from sglang_ext.selection.calibrate import load_label_basis, load_label_config
from sglang_ext.selection.label_basis import EVICTION_HEAD_CONFLICT
from sglang_ext.selection.mla import kv_layout
from sglang_ext.selection.params import label_storage_dtype, summary_storage_dtype
from sglang_ext.tensor_parallel import attn_tp, rank_kv_heads

logger = logging.getLogger(__name__)


def logical_slots(pool: Any, page_size: int) -> int:
    """Slots addressed by logical page: with the CPU tier that is more than the device holds."""
    k0 = pool.get_key_buffer(pool.start_layer)
    return getattr(pool, "logical_size", k0.shape[0] - page_size) + page_size


@dataclass
class PageSummaries:
    """Per-layer running key min/max of every KV page (the Quest block summaries).

    Kept in the KV dtype when it is bf16/fp16 (exact for keys of that dtype, half the bytes of
    float32 for the decode step to read), float32 otherwise (e.g. an fp8 KV cache), or in fp8
    rounded outward with --sparse-summary-dtype fp8_e4m3 (``summary_storage_dtype``)."""

    kmin: list[torch.Tensor]  # per layer: [num_pages, Hkv, D], see summary_dtype
    kmax: list[torch.Tensor]
    page_size: int

    @classmethod
    def allocate(cls, pool: Any, page_size: int, device: Any,
                 summary_dtype: str = "auto") -> "PageSummaries":
        from sglang_ext.kernels.block_summary import allocate_block_summaries

        k0 = pool.get_key_buffer(pool.start_layer)
        dtype = summary_storage_dtype(summary_dtype, k0.dtype)
        num_slots = logical_slots(pool, page_size)
        kmin, kmax = [], []
        for _ in range(pool.layer_num):
            lo, hi = allocate_block_summaries(
                num_slots, k0.shape[1], k0.shape[2], page_size, device, dtype=dtype
            )
            kmin.append(lo)
            kmax.append(hi)
        return cls(kmin, kmax, page_size)

    def update(self, layer_index: int, k: torch.Tensor, loc: torch.Tensor) -> None:
        from sglang_ext.kernels.block_summary import update_block_summaries

        update_block_summaries(self.kmin[layer_index], self.kmax[layer_index], k, loc,
                               self.page_size)


def allocate_label_cache(pool: Any, label_channels: torch.Tensor, label_dtype: str,
                         page_size: int, device: Any) -> list[torch.Tensor]:
    """Per layer ``[num_slots, Hkv, r]``: the label channels of every key (r/D of the key
    cache's memory), so that token scoring reads r contiguous values per key instead of
    gathering them from the key rows. Indexed by logical slot, as the page summaries: under
    the CPU tier the host-homed keys' labels stay on the GPU."""
    from sglang_ext.kernels.label_cache import allocate_label_cache as allocate

    k0 = pool.get_key_buffer(pool.start_layer)
    r = label_channels.shape[-1]
    dtype = label_storage_dtype(label_dtype, k0.dtype)
    num_slots = logical_slots(pool, page_size)
    labels = [allocate(num_slots, k0.shape[1], r, device, dtype) for _ in range(pool.layer_num)]
    logger.info("sglang_ext label cache: %d channels of %d in %s, %.2f GiB", r, k0.shape[2],
                str(dtype).removeprefix("torch."),
                sum(t.numel() * t.element_size() for t in labels) / 2**30)
    return labels


@dataclass
class ModelFiles:
    """The model files given by flags, cut to this rank's kv heads (all of them without --tp).

    ``label_channels``: ``[num_layers, kv heads, r]`` channel ids for token scores, or None (all
    channels); ``streaming_heads``: ``[num_layers, kv heads]`` True where a kv head streams
    (Fluxion's head policy); ``eviction_heads``: NOSA's trained eviction heads;
    ``label_basis``: the label config's basis ``(Bq, Bk)`` ``[num_layers, kv heads, D, D]``
    (attention/qk_basis.py), or None."""

    label_channels: Optional[torch.Tensor] = None
    streaming_heads: Optional[torch.Tensor] = None
    eviction_heads: Optional[Any] = None
    label_basis: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def load(cls, model_runner: Any, config: SparseConfig) -> "ModelFiles":
        return cls(_label_channels(model_runner, config), _head_policy(model_runner, config),
                   _eviction_heads(model_runner, config), _label_basis(model_runner, config))


def _rank_heads(total_heads: int) -> slice:
    tp = attn_tp()
    heads = rank_kv_heads(total_heads, tp.size, tp.rank)
    return slice(heads.start, heads.stop)


def _label_file_shape(model_runner: Any) -> dict[str, int]:
    """The model shape a label file must have been calibrated for (all kv heads)."""
    mc = model_runner.model_config
    layout = kv_layout(mc)
    return dict(num_layers=mc.num_hidden_layers, num_kv_heads=layout.num_kv_heads,
                head_dim=layout.head_dim)


def _label_channels(model_runner: Any, config: SparseConfig) -> Optional[torch.Tensor]:
    if config.label_config is None:
        return None
    shape = _label_file_shape(model_runner)
    channels = load_label_config(config.label_config, **shape)
    if config.label_channels > channels.shape[-1]:
        raise ValueError(
            f"--sparse-label-channels {config.label_channels} exceeds the "
            f"{channels.shape[-1]} channels calibrated in {config.label_config}"
        )
    mine = _rank_heads(shape["num_kv_heads"])
    return channels[:, mine, : config.label_channels].to(model_runner.device)


def _label_basis(model_runner: Any,
                 config: SparseConfig) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    if config.label_config is None:
        return None
    shape = _label_file_shape(model_runner)
    basis = load_label_basis(config.label_config, **shape)
    if basis is None:
        return None
    if config.eviction_head is not None:
        raise ValueError(f"sglang_ext: {EVICTION_HEAD_CONFLICT}")
    mine = _rank_heads(shape["num_kv_heads"])
    logger.info("sglang_ext label basis: labels are the leading %d coordinates of a calibrated "
                "basis of q/k (%s)", config.label_channels, config.label_config)
    return basis[0][:, mine], basis[1][:, mine]


def _head_policy(model_runner: Any, config: SparseConfig) -> Optional[torch.Tensor]:
    if config.head_policy is None:
        return None
    from sglang_ext.selection.head_policy import load_head_policy

    mc = model_runner.model_config
    total_heads = mc.get_total_num_kv_heads()
    policy = load_head_policy(config.head_policy, num_layers=mc.num_hidden_layers,
                              num_kv_heads=total_heads)
    logger.info("sglang_ext head policy: %d of %d kv heads stream (sink + window only)",
                int(policy.sum()), policy.numel())
    return policy[:, _rank_heads(total_heads)]


def _eviction_heads(model_runner: Any, config: SparseConfig) -> Optional[Any]:
    if config.eviction_head is None:
        return None
    from sglang_ext.selection.eviction_head import load_eviction_heads

    mc = model_runner.model_config
    total_heads = mc.get_total_num_kv_heads()
    heads = load_eviction_heads(config.eviction_head, num_layers=mc.num_hidden_layers,
                                num_kv_heads=total_heads, head_dim=mc.head_dim)
    mine = _rank_heads(total_heads)
    return heads.kv_heads(mine.start, mine.stop).to(model_runner.device)
