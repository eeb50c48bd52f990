"""The reference decode (``--sparse-impl reference``, the CPU default): plain torch, one request
at a time, block summaries recomputed from the keys every step. It is the oracle the kernels are
tested against and it serves every per-request setting (``custom_params.sparse``), including the
reference-only ones (output-aware scoring, head policy, the locality constraint per request).
Not capturable in a CUDA graph. Contexts within the budget decode densely, computed exactly as
SGLang's torch_native backend does, so that a budget >= context reproduces SGLang token for
token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

from sglang_ext.attention import request_overrides
from sglang_ext.attention.async_block_filter import PreviousQueries, last_token_queries
from sglang_ext.attention.decode_plan import (
    DecodeContext,
    DecodeFeature,
    host_seq_lens,
    write_kv,
)
from sglang_ext.attention.features.guard import ReferenceGuard, guard_policy
from sglang_ext.attention.features.locality import ReferenceLocality
from sglang_ext.attention.request_overrides import RequestSparsity
from sglang_ext.selection import select_token_mask, sparse_attention
from sglang_ext.selection.guard import RequestGuard, selection_recall
from sglang_ext.selection.params import SelectionParams
from sglang_ext.selection.reference import BatchedSparseDecode


def _async_filter(params: Optional[SelectionParams]) -> bool:
    return params is not None and params.block_filter == "async"


class ReferenceDecoder:
    needs_cpu_seq_lens = True  # it loops over requests on the host

    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        self.features: list[DecodeFeature] = []
        tier = None
        if ctx.tiered is not None:
            from sglang_ext.attention.features.tier import TierDriver

            tier = TierDriver(ctx)
            self.features.append(tier)
        policy = guard_policy(ctx.config)
        self.guard = None if policy is None else ReferenceGuard(ctx, policy)
        if self.guard is not None:
            self.features.append(self.guard)
        self.locality = ReferenceLocality(ctx)
        # any request may ask for the asynchronous block filter: each row's previous queries
        self.previous_queries = PreviousQueries()
        self.cooperative: Optional[Any] = None
        if ctx.tiered is not None and ctx.config.cooperative == "on":
            from sglang_ext.attention.features.cooperative import build_cooperative_tier

            self.cooperative = build_cooperative_tier(ctx)
            tier.stats_sources.append(self.cooperative.read_stats)

    def before_batch(self, forward_batch: Any) -> None:
        for feature in self.features:
            feature.before_batch(forward_batch)

    def plan(self, forward_batch: Any) -> "ReferenceDecodePlan":
        rows = forward_batch.req_pool_indices.tolist()
        pool = self.ctx.req_to_token_pool
        plan = ReferenceDecodePlan(
            self, forward_batch, rows, host_seq_lens(forward_batch),
            [request_overrides.lookup(pool, row, self.ctx.default_params) for row in rows])
        if self.guard is not None:
            plan.guards = self.guard.plan_rows(plan.rows, plan.seq_lens, plan.sparsity)
        return plan

    # ------------------------------------------------------------------ extend

    def extend_shortcut(self, layer: Any, q: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                        forward_batch: Any, save_kv_cache: bool, dense: Any) -> Optional[Tensor]:
        """torch_native's extend, except that a request extending a cached prefix by one token
        attends like a decode step (None: not such a batch). torch_native runs causal SDPA over
        the whole sequence (the prefix's query rows padded in) and keeps the last row: O(L^2)
        per request, seconds at 4k tokens on a CPU, for one row whose SDPA over all L keys is
        the same computation (the last causal row sees every key: exact attention, rounded
        differently in the last bits)."""
        if not self._has_one_token_extends(layer, forward_batch, dense):
            return None
        return self.one_token_extend_rows(layer, q, k, v, forward_batch, save_kv_cache, dense)

    def one_token_extend_rows(self, layer: Any, q: Tensor, k: Optional[Tensor],
                              v: Optional[Tensor], forward_batch: Any, save_kv_cache: bool,
                              dense: Any) -> Tensor:
        pool = self.ctx.token_to_kv_pool
        if save_kv_cache and k is not None and v is not None:
            write_kv(pool, layer, k, v, forward_batch.out_cache_loc, with_scales=False)
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = q.new_empty((q_.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        req_to_token = self.ctx.req_to_token
        rows = forward_batch.req_pool_indices.tolist()
        seq_lens = forward_batch.seq_lens.tolist()
        computed: list[tuple[int, Tensor]] = []  # (query row, slots) of rows done here
        start = 0
        for i, (ext, pre) in enumerate(
            zip(forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu)
        ):
            if ext == 1 and pre > 0:
                slots = req_to_token[rows[i], : seq_lens[i]]
                twin = _same_last_row(q_, start, slots, computed, k_buf, v_buf)
                if twin is not None:
                    o_[start] = o_[twin]
                else:
                    o_[start] = last_row_attention_fp32(
                        q_[start], k_buf.index_select(0, slots), v_buf.index_select(0, slots),
                        layer.scaling,
                    )
                    computed.append((start, slots))
            else:
                sl = slice(i, i + 1)
                dense._run_sdpa_forward_extend(
                    q_[start : start + ext], o_[start : start + ext], k_buf, v_buf, req_to_token,
                    forward_batch.req_pool_indices[sl], forward_batch.seq_lens[sl],
                    forward_batch.extend_prefix_lens[sl], forward_batch.extend_seq_lens[sl],
                    None, scaling=layer.scaling,
                    enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num, causal=True,
                )
            start += ext
        return o_.view(q_.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def _has_one_token_extends(self, layer: Any, forward_batch: Any, dense: Any) -> bool:
        """Whether this extend batch holds requests that extend a cached prefix by one token
        (a prompt found in the radix cache but for its last token) on the torch_native
        delegate, for plain causal self-attention."""
        if forward_batch.encoder_lens is not None or self.ctx.tiered is not None:
            return False  # (the tier: reads the pool by logical slot)
        if layer.is_cross_attention or getattr(layer, "sliding_window_size", -1) > -1:
            return False
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.layers.radix_attention import AttentionType

        if layer.attn_type != AttentionType.DECODER or \
                not isinstance(dense, TorchNativeAttnBackend):
            return False
        ext, pre = forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu
        return ext is not None and pre is not None and any(
            e == 1 and p > 0 for e, p in zip(ext, pre)
        )

    def after_extend_layer(self, layer: Any, q: Tensor, k: Optional[Tensor],
                           v: Optional[Tensor], forward_batch: Any, save_kv_cache: bool) -> None:
        """The asynchronous block filter's first step: requests that ask for it rank their
        first decode step's blocks with their last prompt token's query."""
        if self.ctx.kv_lora_rank is not None or \
                getattr(forward_batch, "extend_seq_lens", None) is None:
            return
        rows = forward_batch.req_pool_indices.tolist()
        pool = self.ctx.req_to_token_pool
        wanted = [i for i, row in enumerate(rows) if _async_filter(
            request_overrides.lookup(pool, row, self.ctx.default_params))]
        if not wanted:
            return
        q_last = last_token_queries(q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                                    forward_batch.extend_seq_lens)
        seq_lens = host_seq_lens(forward_batch)
        index = self.ctx.layer_index(layer)
        for i in wanted:
            self.previous_queries.put(rows[i], index, seq_lens[i], q_last[i])

    # ------------------------------------------------------------------ decode

    def decode_layer(self, plan: "ReferenceDecodePlan", layer: Any, q: Tensor) -> Tensor:
        ctx = self.ctx
        out = q.new_empty((q.shape[0], layer.tp_q_head_num, layer.v_head_dim))
        pool = ctx.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        req_to_token = ctx.req_to_token
        channels = ctx.label_channels(layer.layer_id)
        index = ctx.layer_index(layer)
        streaming = ctx.files.streaming_heads
        streaming = None if streaming is None else streaming[layer.layer_id]

        batched = []  # plain sparse requests run together (BatchedSparseDecode)
        coop: list[tuple[int, Tensor, Tensor, Tensor]] = []  # cooperative rows
        for i, (row, seq_len, params) in enumerate(zip(plan.rows, plan.seq_lens, plan.sparsity)):
            guard = plan.guards[i] if plan.guards is not None else None
            local = self.locality.applies(params)
            stale = _async_filter(params)
            if ctx.tiered is None and params is not None and seq_len > params.budget \
                    and not local and guard is None and params.scoring == "score" \
                    and not params.head_policy and not stale:
                batched.append(i)
                continue
            slots = req_to_token[row, :seq_len]
            if ctx.tiered is not None:  # host-homed tokens straight from host memory
                keys, values = ctx.tiered.gather_tokens(layer.layer_id, slots)
            else:
                # index_select: the same tensor as k_buf[slots], an order of magnitude faster
                keys = k_buf.index_select(0, slots)  # [L, Hkv, D]
                values = v_buf.index_select(0, slots)
            if params is None or seq_len <= params.budget:
                out[i] = self._dense_row(q[i], keys, values, layer.scaling)
                continue
            if local:
                mask = self.locality.select(row, layer, q[i], keys, values, params, channels)
            else:
                earlier = self.previous_queries.get(row, index) if stale else None
                mask = select_token_mask(
                    q[i], keys, params, channels, values, streaming,
                    block_query=None if earlier is None else earlier[1],
                    block_length=None if earlier is None else earlier[0])
            if self.cooperative is not None:  # attended below, the layer's rows together
                coop.append((i, mask, keys, values))
                continue
            out[i] = sparse_attention(q[i], keys, values, mask, layer.scaling)
            if guard is not None and not local:
                guard.add_recall(selection_recall(q[i], keys, mask, layer.scaling,
                                                  guard.probe_head))
        for row, seq_len, params, q_row in zip(plan.rows, plan.seq_lens, plan.sparsity, q):
            if _async_filter(params):  # this step's query ranks the next step's blocks
                self.previous_queries.put(row, index, seq_len, q_row)
        if coop:
            rows = [i for i, _, _, _ in coop]
            out[rows] = self.cooperative.attend_reference(
                index, q[rows], [plan.rows[i] for i in rows], [m for _, m, _, _ in coop],
                [k for _, _, k, _ in coop], [v for _, _, _, v in coop],
                ctx.tiered.tier.page_map(index), req_to_token, layer.scaling)
        if batched:
            rows, batched_decode = plan.batched(batched)
            out[rows] = batched_decode.decode(q[rows], k_buf, v_buf, layer.scaling, channels)
        return out.view(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)

    def _dense_row(self, q: Tensor, keys: Tensor, values: Tensor, scaling: float) -> Tensor:
        """One request's dense decode (--sparse-dense-decode): SGLang's torch_native call, or
        the same attention in float32 (a CPU runs SDPA with one bf16 query row ~8x slower)."""
        if self.ctx.config.dense_decode == "float32":
            return last_row_attention_fp32(q, keys, values, scaling)
        return dense_decode_like_sglang(q, keys, values, scaling)


@dataclass
class ReferenceDecodePlan:
    """One decode step of the reference decode: per request its row, length and selection
    (None: dense), the guard of each request that probes this step, and the plain sparse
    requests' batched selection (index work shared by all layers, built at the first)."""

    decoder: ReferenceDecoder
    forward_batch: Any
    rows: list[int]
    seq_lens: list[int]
    sparsity: list[RequestSparsity]
    guards: Optional[list[Optional[RequestGuard]]] = None
    _batched: Optional[tuple[Tensor, BatchedSparseDecode]] = field(default=None, repr=False)
    _layers_left: int = -1

    def run(self, layer: Any, q: Tensor, k: Optional[Tensor], v: Optional[Tensor],
            save_kv_cache: bool) -> Tensor:
        ctx = self.decoder.ctx
        if save_kv_cache and k is not None and v is not None:
            write_kv(ctx.token_to_kv_pool, layer, k, v, self.forward_batch.out_cache_loc)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = self.decoder.decode_layer(self, layer, q)
        if self._layers_left < 0:
            self._layers_left = ctx.num_layers
        self._layers_left -= 1
        if self._layers_left == 0:
            self._layers_left = -1  # a second run of the plan's layers is a step of its own
            if self.guards is not None:
                self.decoder.guard.finish(self.rows, self.guards)
        return out

    def batched(self, batched: list[int]) -> tuple[Tensor, BatchedSparseDecode]:
        """The batch indices of the plain sparse requests and their batched selection: the
        same token sets as select_token_mask per request, the key-side work done once per pool
        slot that requests share (a prompt decoded under many settings)."""
        if self._batched is None:
            req_to_token = self.decoder.ctx.req_to_token
            rows = torch.tensor([self.rows[i] for i in batched], device=req_to_token.device)
            self._batched = (
                torch.tensor(batched, device=req_to_token.device),
                BatchedSparseDecode(req_to_token.index_select(0, rows),
                                    [self.seq_lens[i] for i in batched],
                                    [self.sparsity[i] for i in batched]))
        return self._batched


def last_row_attention_fp32(q: Tensor, keys: Tensor, values: Tensor, scaling: float) -> Tensor:
    """One query row's exact attention over all keys, computed in float32: the last causal row
    of a one-token extend (not bit-identical to torch_native's extend anyway, see
    ReferenceDecoder.extend_shortcut) and, with --sparse-dense-decode float32, dense decode rows.
    On a CPU, torch's SDPA with a single bf16 query row is ~8x slower than in float32 (4 ms vs
    0.5 ms per layer at 4k tokens)."""
    out = dense_decode_like_sglang(q.float(), keys.float(), values.float(), scaling)
    return out.to(q.dtype)


def _same_last_row(q: Tensor, row: int, slots: Tensor, computed: list[tuple[int, Tensor]],
                   k_buf: Tensor, v_buf: Tensor) -> Optional[int]:
    """A query row already computed whose inputs equal ``row``'s exactly (the same query, the
    same prefix slots, an equal last key/value), or None. Requests that extend one cached
    prompt by its last token (one prompt decoded under several settings) compute the same
    attention row: it is done once."""
    for done, done_slots in computed:
        if (done_slots.shape == slots.shape and torch.equal(q[done], q[row])
                and torch.equal(done_slots[:-1], slots[:-1])
                and torch.equal(k_buf[done_slots[-1]], k_buf[slots[-1]])
                and torch.equal(v_buf[done_slots[-1]], v_buf[slots[-1]])):
            return done
    return None


def dense_decode_like_sglang(q: Tensor, keys: Tensor, values: Tensor, scaling: float) -> Tensor:
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
