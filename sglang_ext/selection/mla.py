"""Two-level sparse decode for MLA (multi-head latent attention) layers: the torch reference.

The MLA contract of SGLang 0.5.16 (read from ``mem_cache/memory_pool.py::MLATokenToKVPool``,
``models/deepseek_v2.py`` and ``models/deepseek_common/attention_forward_methods/forward_mla.py``):

* **Pool.** ``MLATokenToKVPool.kv_buffer[layer]`` is ``[size + page_size, 1, R + P]`` in the KV
  dtype, with ``R = kv_lora_rank`` (512 for DeepSeek-V2/V3) and ``P = qk_rope_head_dim`` (64):
  one row per token holding the compressed latent ``c_kv`` (after ``kv_a_layernorm``) followed
  by the RoPE'd shared key part ``k_pe``; a single "kv head". ``get_key_buffer(layer)`` is that
  whole buffer; ``get_value_buffer(layer)`` is the **view** ``kv_buffer[..., :R]`` (same storage,
  row stride ``R + P``): V is the latent part of K. ``set_kv_buffer(layer, loc, cache_k, cache_v)``
  stores ``cache_k [T, 1, R + P]`` and ignores ``cache_v``. Slots ``[0, page_size)`` are the
  padding page, as for MHA pools.
* **Layer.** Decode goes through ``attn_mqa = RadixAttention(Hq, R + P, scaling,
  num_kv_heads=1, v_head_dim=R)``. ``scaling`` is ``(qk_nope_head_dim + qk_rope_head_dim)^-0.5``
  (192^-0.5 for DeepSeek-V2; times the YaRN mscale² with rope scaling), **not** ``(R + P)^-0.5``:
  always use ``layer.scaling``.
* **Decode call.** A backend whose name is not in ``FORWARD_ABSORB_CORE_ATTENTION_BACKENDS``
  (ours: ``AttentionBackendRegistry`` falls back to the triton handler, which picks the absorbed
  ``MLA`` method for decode) receives ``forward_decode(q, k, v, layer, forward_batch)`` with
  ``q = cat(q_nope · W_UK, q_pe)`` ``[T, Hq, R + P]`` (the query absorbed into the latent space),
  ``k = cat(c_kv, k_pe)`` ``[T, 1, R + P]`` and ``v = c_kv`` ``[T, 1, R]``. It must store ``k``
  at ``out_cache_loc`` and return the latent output ``[T, Hq * R]``; the model applies ``W_UV``
  afterwards. So decode attention is MQA over the pool's rows:
  ``o_h = softmax(scaling · q_h · K^T) · K[:, :R]``.
* **Extend** of a prompt without a cached prefix uses the MHA path (``attn_mha``: Hq kv heads of
  ``qk_nope + qk_rope`` dims, V of ``v_head_dim``) and with a prefix the absorbed path; both are
  the dense backend's and still write the latent rows into the same pool.

Two-level selection therefore runs unchanged on the ``[L, 1, R + P]`` rows with all ``Hq``
heads forming one group: the functions of :mod:`sglang_ext.selection.reference` already do it,
this module fixes the MLA shapes and documents why each stage applies.

* **Block summaries** are the per-block min/max over all ``R + P`` dims (latent and RoPE alike):
  the Quest bound is a bound on ``q · k`` whatever the coordinates mean, and the absorbed query
  lives in the same space.
* **Block filter:** the bound ``q⁺·kmax + q⁻·kmin`` for all Hq heads is two GEMMs
  ``[Hq, R + P] x [R + P, NB]`` against the single latent head, then **max** over the heads
  (see :func:`mla_block_scores`).
* **Token stage:** label channels apply (a calibrated subset of the ``R + P`` dims carrying the
  most ``|q_d · k_d|``; one set per layer since there is one kv head); without them the scores
  are exact ``q · k`` over all dims (see :func:`mla_token_scores`).
* **Attention** over the selected rows with ``V = K[..., :R]``, returning ``[Hq, R]``.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from sglang_ext.selection.params import SelectionParams
from sglang_ext.selection.reference import (
    label_token_scores,
    quest_block_scores,
    select_token_mask,
    sparse_attention_with_lse,
)

# DeepSeek-V2/V3's latent layout (the defaults of SGLang's MLA pool for those models).
DEEPSEEK_KV_LORA_RANK = 512
DEEPSEEK_QK_ROPE_HEAD_DIM = 64

# Settings whose code has no MLA version yet, as (SparseConfig / SelectionParams attribute,
# its flag, whether a value turns it on). The guard's probe kernel (kernels/guard_probe.py)
# and the eviction heads assume MHA keys; the head policy, output_aware scoring and the
# locality constraint rank or split kv heads, and an MLA layer has one latent head shared by
# all query heads (nothing to split, unmeasured). (The CPU tier has an MLA pool:
# memory_tier/tiered_pool.py's TieredMLAKVPool.)
_MLA_UNSUPPORTED = (
    ("guard_every", "--sparse-guard-every", lambda v: v > 0),
    ("scoring", "--sparse-scoring output_aware", lambda v: v != "score"),
    ("head_policy", "--sparse-head-policy", bool),
    ("eviction_head", "--sparse-eviction-head", lambda v: v is not None),
    ("locality_blocks", "--sparse-locality-blocks", lambda v: v > 0),
    ("cooperative", "--sparse-cooperative", lambda v: v == "on"),
    ("block_filter", "--sparse-block-filter async", lambda v: v == "async"),
    ("summary_dtype", "--sparse-summary-dtype fp8_e4m3", lambda v: v != "auto"),
    ("block_score", "--sparse-block-score label_max", lambda v: v == "label_max"),
    ("rerank", "--sparse-rerank", lambda v: v > 0),
    ("prefilter", "--sparse-block-prefilter", lambda v: v > 0),
)


def mla_config(config: Any) -> Any:
    """``config`` as an MLA model serves it: the block filter's "auto" is the bound there (the
    label maximum has no MLA version yet)."""
    if getattr(config, "block_score", None) == "auto":
        return dataclasses.replace(config, block_score="bound")
    return config


@dataclass(frozen=True)
class KVLayout:
    """What the sparse decode needs to know of a model's KV rows."""

    num_kv_heads: int  # the model's kv heads (all ranks); MLA: the one latent head
    head_dim: int  # dims of a key row: what summaries and label channels index (MLA: R + P)
    stored_v_dims: int  # dims stored per value row beside the key (MLA: 0, V is K's view)


def kv_layout(model_config: Any) -> KVLayout:
    """The KV layout of an SGLang ``ModelConfig``. For MLA models its ``head_dim`` and
    ``get_total_num_kv_heads()`` describe the MHA-path prefill (256 and Hq for DeepSeek-V2),
    not the pool's rows."""
    if is_mla_model(model_config):
        return KVLayout(1, model_config.kv_lora_rank + model_config.qk_rope_head_dim, 0)
    return KVLayout(model_config.get_total_num_kv_heads(), model_config.head_dim,
                    model_config.v_head_dim)


def is_mla_model(model_config: Any) -> bool:
    from sglang.srt.configs.model_config import AttentionArch

    return getattr(model_config, "attention_arch", None) == AttentionArch.MLA


def pool_kv_lora_rank(pool: Any) -> Optional[int]:
    """``R`` of an MLA KV pool (one latent row per token), None for any other pool."""
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    return pool.kv_lora_rank if isinstance(pool, MLATokenToKVPool) else None


def mla_unsupported(settings: Any) -> list[tuple[str, str]]:
    """``(attribute, flag)`` of each setting turned on in ``settings`` (a SparseConfig, or a
    request's SelectionParams: only the attributes it has are checked) that MLA pools do not
    support yet."""
    return [(attr, flag) for attr, flag, on in _MLA_UNSUPPORTED
            if hasattr(settings, attr) and on(getattr(settings, attr))]


def check_mla_shapes(q: Tensor, keys: Tensor, kv_lora_rank: int) -> None:
    """``q`` ``[Hq, R + P]`` and ``keys`` ``[L, 1, R + P]`` (one latent head, RoPE part last)."""
    if keys.dim() != 3 or keys.shape[1] != 1:
        raise ValueError(f"MLA keys must be [L, 1, R + P] (one latent head), got {tuple(keys.shape)}")
    if q.dim() != 2 or q.shape[1] != keys.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} must be [Hq, {keys.shape[2]}] (the absorbed query)")
    if not 0 < kv_lora_rank <= keys.shape[2]:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} outside (0, {keys.shape[2]}]")


def mla_values(keys: Tensor, kv_lora_rank: int) -> Tensor:
    """The values of MLA rows: their latent part, a view (as ``get_value_buffer`` returns)."""
    return keys[..., :kv_lora_rank]


def mla_block_scores(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Quest bound of every block for the absorbed query, aggregated over all Hq heads: ``[1, NB]``.

    ``kmin``/``kmax`` ``[NB, 1, R + P]``. With one kv head the reference's per-group GEMMs are one
    pair ``[Hq, R + P] x [R + P, NB]`` over every query head.

    Max, not sum, over the heads: each head has its own softmax, so a token matters when *some*
    head gives it a large logit relative to that head's others, and the max over heads of the
    per-head bound is an upper bound of ``max_h q_h · k`` for every token of the block (no
    block holding a head's top token can rank below one that holds none). The sum bounds
    ``sum_h q_h · k``, a quantity no softmax sees: with 16-128 heads sharing one selection, the
    few retrieval heads that need a far block would be outvoted by the many whose logits are
    flat, and heads with large query norms would dominate. Max also keeps MLA on exactly the
    GQA rule (a kv head's group), so the kernels serve both.
    """
    if kmin.shape[1] != 1:
        raise ValueError(f"MLA summaries have one latent head, got {tuple(kmin.shape)}")
    return quest_block_scores(q, kmin, kmax)


def mla_token_scores(q: Tensor, keys: Tensor, channels: Tensor | None) -> Tensor:
    """Token scores of the latent rows, max over the Hq heads: ``[1, L]``.

    ``channels`` (long ``[1, r]``, indices into the ``R + P`` dims) are label channels. They
    apply to MLA: ``q · k`` is a sum of per-dim products in the absorbed space as in any head,
    and Double Sparsity's calibration (keep the dims carrying the most ``|q_d · k_d|``) needs
    nothing else; the latent dims mix the per-head key dims, so which ones are heavy has to be
    calibrated on the absorbed query (not transferred from an MHA model). ``None`` gives the
    exact ``q · k`` over all ``R + P`` dims: the right default until a calibration exists, and
    affordable because only the kept blocks' tokens are scored.
    """
    if channels is not None and channels.shape[0] != 1:
        raise ValueError(f"MLA label channels are [1, r] (one latent head), got {tuple(channels.shape)}")
    return label_token_scores(q, keys, channels)


def mla_select_token_mask(q: Tensor, keys: Tensor, params: SelectionParams, kv_lora_rank: int,
                          channels: Tensor | None = None) -> Tensor:
    """Bool ``[1, L]``: the rows every head of the layer attends (sink, window, selected)."""
    check_mla_shapes(q, keys, kv_lora_rank)
    if params.scoring != "score":
        # output_aware shares the budget among kv heads and weights by value norms: with one
        # latent head it degenerates to a value-norm reweighting nobody has measured for MLA.
        raise ValueError(f"MLA supports scoring 'score' only, got {params.scoring!r}")
    return select_token_mask(q, keys, params, channels)


def mla_sparse_decode_with_lse(q: Tensor, keys: Tensor, params: SelectionParams, sm_scale: float,
                               kv_lora_rank: int, channels: Tensor | None = None
                               ) -> tuple[Tensor, Tensor]:
    """One MLA sparse decode step of one request: latent output ``[Hq, R]`` (q's dtype) and the
    float32 LSE ``[Hq]``. ``keys`` ``[L, 1, R + P]`` in position order, current token last."""
    mask = mla_select_token_mask(q, keys, params, kv_lora_rank, channels)
    return sparse_attention_with_lse(q, keys, mla_values(keys, kv_lora_rank), mask, sm_scale)


def mla_sparse_decode(q: Tensor, keys: Tensor, params: SelectionParams, sm_scale: float,
                      kv_lora_rank: int, channels: Tensor | None = None) -> Tensor:
    """:func:`mla_sparse_decode_with_lse` without the LSE."""
    return mla_sparse_decode_with_lse(q, keys, params, sm_scale, kv_lora_rank, channels)[0]


def mla_dense_decode(q: Tensor, keys: Tensor, sm_scale: float, kv_lora_rank: int) -> Tensor:
    """Dense MLA decode attention written out, the oracle of the tests:
    ``softmax(sm_scale · q · K^T) · K[:, :R]`` in float32, ``[Hq, R]`` in q's dtype."""
    check_mla_shapes(q, keys, kv_lora_rank)
    k = keys[:, 0].float()  # [L, R + P]
    probs = torch.softmax(q.float() @ k.T * sm_scale, dim=-1)  # [Hq, L]
    return (probs @ k[:, :kv_lora_rank]).to(q.dtype)
