"""SGLang KV pool with a host tier: capacity = GPU + host, sparse decode over working sets.

Logical KV slots (what SGLang's allocator, ``req_to_token`` and the radix tree hold) are
``[0, G + H)``, ``page_size``-aligned, and each logical page has one fixed home:

* pages below ``G`` live on the GPU at the same index (device rows ``[0, G)``): a request whose
  pages are all there decodes like an untiered one (no transfers);
* pages from ``G`` on live on the host, in the :class:`HostKVStore` at ``page - G``.

SGLang's allocator hands out the lowest free pages first after start-up, so the GPU fills
before the host; a request can mix both kinds. Device rows ``[G, G + W)`` are the **working
area** (:class:`WorkArea`), in ``page_size`` pages:

* prefill stays dense on the GPU, but a prompt is never staged in the working area: its KV is
  written to its homes (GPU rows, or the host copy: write-through) and an extend batch that
  touches host-homed pages attends through the **extend scratch**, one layer's worth of rows
  (:class:`ExtendScratch`): before each layer's attention the batch's prefix pages are copied
  into it (GPU-homed ones device to device, host-homed ones from the host), and the new tokens
  are written there too. SGLang's dense extend backend reads the scratch through a translated
  ``dev_req_to_token`` (:meth:`TieredPool.get_key_buffer` returns the scratch while such an
  extend runs); a batch with no host-homed page reads the pool in place. The scratch costs one
  layer of rows for the longest prompt plus a prefill batch, against a whole prompt of every
  layer had the prompt been staged, which is what lets the GPU home more KV (issue 4's capacity);
* once a request's prefill is done (its first decode step), it takes sink pages, a ring of
  recent-window pages (decode writes land there) and ``num_slots`` working-set slots
  (:class:`WorkingSetTier`), which the sparse decode fills from the host by the set difference
  of consecutive selections. The slots start with the middle blocks nearest the window, loaded
  from the host with the sink and ring pages (the first decode step has no previous selection
  to attend), and a selected block still in the ring gets a slot before the ring reuses its
  page: with a budget >= the context the tiered decode is exact from the first step under both
  schedules (tests/test_tier_decode_steps.py).

Per request the decode reads keys through ``WorkingSetTier.page_maps`` (block -> device page,
per layer and kv head): GPU-homed blocks map to themselves, sink/window blocks to their pages,
selected host blocks to working-set slots. The working area holds a working set per running
request; the scratch is sized for the longest prompt plus one prefill batch, and SGLang admits a
prefill only while this batch's scratch rows and the working sets fit
(:meth:`TieredPool.admission_room`, patches/scheduler.py): a second long prompt whose prefix is a
radix hit waits in the queue while the first one is still being chunk-prefilled, instead of
overflowing the scratch. Every exit of a request (finish, abort, retract) goes through
``ReqToTokenPool.free``, which calls :meth:`TieredPool.release_row`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, unwrap_write_loc

from sglang_ext import runtime
from sglang_ext.config import tier_ring_pages
from sglang_ext.memory_tier.host_store import HostKVStore, as_stored
from sglang_ext.memory_tier.transfer_budget import (
    TransferBudget,
    blocks_per_step,
    request_bytes_per_step,
    step_budget_bytes,
)
from sglang_ext.memory_tier.working_set import WorkingSetTier

logger = logging.getLogger(__name__)


def active_pool() -> Optional["TieredPool"]:
    """This process's tiered pool, once the backend has bound it."""
    return runtime.state().tier_pool


def verify_level() -> int:
    value = os.environ.get("SGLANG_EXT_TIER_VERIFY", "0")
    return int(value) if value.isdigit() else 0


@dataclass(frozen=True)
class TierLayout:
    """Token counts of the three regions (all multiples of ``page_size``)."""

    page_size: int
    gpu_tokens: int  # G: logical slots homed on the GPU (device rows [0, G))
    work_tokens: int  # W: device rows [G, G + W), the working area
    host_tokens: int  # H: logical slots [G, G + H) homed on the host
    sink_pages: int
    ring_pages: int
    num_slots: int
    scratch_tokens: int = 0  # rows of the extend scratch (one layer's worth)

    @property
    def logical_tokens(self) -> int:
        return self.gpu_tokens + self.host_tokens

    @property
    def device_tokens(self) -> int:
        return self.gpu_tokens + self.work_tokens

    @property
    def gpu_pages(self) -> int:
        return self.gpu_tokens // self.page_size

    def describe(self) -> str:
        return (f"GPU-homed {self.gpu_tokens} tokens, host-homed {self.host_tokens} tokens, "
                f"working area {self.work_tokens} tokens, extend scratch {self.scratch_tokens} "
                f"rows of one layer (page {self.page_size})")


def plan_layout(
    *, device_tokens: int, host_tokens: int, page_size: int, max_running_requests: int,
    max_prefill_tokens: int, num_slots: int, sink: int, window: int,
    side_tokens_per_token: float, gpu_tokens: int = 0, layers: int = 1,
) -> TierLayout:
    """Split SGLang's profiled device capacity (``device_tokens`` KV slots of ``layers``
    layers) into GPU-homed slots, the working area and the extend scratch (one layer of rows:
    ``1 / layers`` KV slot each), leaving room for the side buffers (page summaries, label
    cache) of the extra logical slots. ``side_tokens_per_token``: their device bytes per
    logical token, in KV slots (1 / page_size for bf16 min/max alone). ``gpu_tokens`` > 0
    forces G (tests)."""
    ps = page_size
    sink_pages = -(-sink // ps)
    ring_pages = tier_ring_pages(window, ps)
    per_request = (sink_pages + ring_pages + num_slots) * ps
    work = max_running_requests * per_request
    # The scratch holds one extend batch: the chunked request's whole prompt plus one prefill
    # batch of others, a partial page per request, and the padding page.
    scratch = (-(-max_prefill_tokens // ps) + max_running_requests + 1) * ps
    scratch_slots = -(-scratch // max(layers, 1))
    host = host_tokens // ps * ps
    if gpu_tokens <= 0:
        # G + W + S / L + (G + H) * r <= device_tokens * (1 + r): the side buffers of the
        # logical slots beyond the device capacity come out of the GPU-homed part.
        r = side_tokens_per_token
        gpu_tokens = int((device_tokens * (1 + r) - work - scratch_slots - host * r) / (1 + r))
    gpu = gpu_tokens // ps * ps
    if gpu < ps:
        raise ValueError(
            f"the CPU tier's working area ({work} tokens: {max_running_requests} running "
            f"requests x {per_request}), its extend scratch ({scratch} rows of one layer) and "
            f"the side buffers of {host} host tokens leave no GPU KV slots out of "
            f"{device_tokens}; "
            f"lower --max-running-requests or --sparse-tier-host-gb, or raise "
            f"--mem-fraction-static"
        )
    return TierLayout(ps, gpu, work, host, sink_pages, ring_pages, num_slots, scratch)


class WorkArea:
    """Free list of the working area's device pages (host-side; every use of a page is
    stream-ordered on the GPU, so a page freed here can be handed out again at once)."""

    def __init__(self, first_page: int, num_pages: int) -> None:
        self.first_page = first_page
        self.num_pages = num_pages
        self._free = list(range(first_page + num_pages - 1, first_page - 1, -1))

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(
                f"sglang_ext CPU tier: working area exhausted ({n} pages wanted, "
                f"{len(self._free)} free of {self.num_pages})"
            )
        out = self._free[-n:] if n else []
        del self._free[len(self._free) - n:]
        return out[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    @property
    def available(self) -> int:
        return len(self._free)


@dataclass
class ExtendScratch:
    """One extend batch that touches host-homed pages: where its tokens sit in the scratch and
    what fills it before each layer's attention (built by :meth:`TieredPool.prepare_extend`)."""

    out_rows: Tensor  # scratch row of each token the batch writes, in out_cache_loc order
    copy_src: Tensor  # device rows of the GPU-homed prefix pages' tokens
    copy_dst: Tensor  # their scratch rows
    load_heads: Tensor  # host-homed prefix pages, one entry per (page, kv head):
    load_src: Tensor  # host page
    load_dst: Tensor  # scratch page
    filled: int = -1  # the layer index whose prefix the scratch holds now


@dataclass
class RowState:
    """Working-area pages one request row holds."""

    sink: list[int] = field(default_factory=list)  # device pages (sink blocks on the host)
    ring: list[int] = field(default_factory=list)  # device pages, block j -> ring[j % R]
    slots: list[int] = field(default_factory=list)  # working-set pages
    written: int = 0  # tokens whose KV has been written (the prompt, once prefill is done)
    decoding: bool = False
    on_host: Optional[bool] = None  # a page of its prompt is host-homed (None: none seen yet)


class TieredPool:
    """The tier over one of SGLang's KV pools: ``G + W`` device rows addressed by ``G + H``
    logical slots. Mixed in before the pool class (:class:`TieredKVPool` for MHA/GQA pools,
    :class:`TieredMLAKVPool` for MLA's latent pool); what differs between layouts is only
    which device buffers hold a layer's rows (:meth:`tier_buffers`: K and V, or the one latent
    buffer whose ``[..., :R]`` view is V) and their shapes (:meth:`tier_shape`).

    Built by the ``KVCacheConfigurator`` pool hooks (patches/kv_cache_configurator.py) when
    ``--sparse-tier`` is on; the allocator beside it has ``G + H`` logical slots."""

    # Set by the pool class (SGLang's KVCache).
    layer_num: int
    start_layer: int
    dtype: torch.dtype  # the KV dtype
    store_dtype: torch.dtype  # what the device buffers hold (uint8 for an fp8 KV dtype)
    device: Any

    def __init__(self, *args: Any, layout: TierLayout, mode: str,
                 gather_programs: Optional[int] = None, timing: bool = False,
                 sync_steps: int = 0, attend_resident: bool = False, **kwargs: Any) -> None:
        # The pool class's own arguments (SGLang's factory passes them), at G + W device rows.
        super().__init__(layout.device_tokens, *args, **kwargs)
        self.sync_steps = sync_steps  # async: each request's first steps fetched in line
        self.attend_resident = attend_resident  # async: this step's resident blocks first
        self._init_tier(layout, mode, gather_programs, timing, *self.tier_shape())

    def tier_shape(self) -> tuple[int, int, int]:
        """``(kv heads, key dims, value dims)`` of the rows the tier stores; value dims 0 where
        V is a view of K (nothing of its own to store or copy)."""
        raise NotImplementedError

    def tier_buffers(self, layer: int) -> tuple[Tensor, Optional[Tensor]]:
        """Device K and V buffers ``[rows, heads, dims]`` of layer index ``layer`` that the tier
        fills; V None where it is a view of K (nothing of its own to copy)."""
        raise NotImplementedError

    def values_of(self, keys: Tensor) -> Tensor:
        """The values of key rows, for pools that store no V of their own."""
        raise NotImplementedError

    @property
    def tier_page_bytes(self) -> int:
        """Bytes one (layer, kv head) block the tier moves: K and V rows of a page."""
        return self.layout.page_size * (self.tier_key_dim + self.tier_value_dim) \
            * self.tier_buffers(0)[0].element_size()

    def _init_tier(self, layout: TierLayout, mode: str, gather_programs: Optional[int],
                   timing: bool, num_kv_heads: int, key_dim: int, value_dim: int) -> None:
        """The tier's state, once the pool's device buffers exist."""
        self.tier_heads, self.tier_key_dim, self.tier_value_dim = num_kv_heads, key_dim, value_dim
        self.layout = layout
        self.mode = mode
        self.timing = timing
        self.gather_programs = gather_programs
        ps = layout.page_size
        self.logical_size = layout.logical_tokens
        # The host copy holds rows of the KV dtype (one byte per value for an fp8 cache).
        self.host = HostKVStore(
            self.layer_num, num_kv_heads, key_dim, value_dim, max(layout.host_tokens, ps), ps,
            self.dtype,
        )
        # Device page of a sink/ring host-homed logical page (-1: none): translates writes.
        self.dev_page_of_lp = torch.full((layout.logical_tokens // ps + 1,), -1,
                                         dtype=torch.int32, device=self.device)
        self.work = WorkArea(layout.gpu_pages, layout.work_tokens // ps)
        # One layer of rows shaped like the pool's (K and V, or the one latent buffer). Page 0 is
        # never planned, like the pool's padding page: a table entry left at 0 reads it.
        scratch_rows = max(layout.scratch_tokens, 2 * ps)
        self.scratch = [torch.empty((scratch_rows, *buf.shape[1:]), dtype=buf.dtype,
                                    device=buf.device)
                        for buf in self.tier_buffers(0) if buf is not None]
        self._extend: Optional[ExtendScratch] = None  # the extend batch running, if it uses it
        self.rows: dict[int, RowState] = {}
        self.tier: Optional[WorkingSetTier] = None  # per-row tables: see bind()
        # Prometheus gauges (--enable-metrics; memory_tier/metrics.py), set by the backend.
        self.metrics: Optional[Any] = None
        # SGLANG_EXT_TIER_VERIFY (tests): 1 = check for leaks whenever the last request leaves;
        # 2 = also check every mapped device copy against its home at every decode step (slow).
        self.verify = verify_level()
        # The admission's PCIe term (transfer_budget.py): set from the server's config when
        # first asked (configure_transfers); per row, the admission's prediction.
        self.transfers: Optional[TransferBudget] = None
        self.transfer_new_blocks = 0  # --sparse-locality-new-blocks: bounds a step's fetches
        self._admitted: dict[int, tuple[int, int]] = {}  # row -> (predicted, bound) bytes/step
        self.pcie_holds = 0  # requests the PCIe term kept in the queue (each counted once)
        self.decode_steps = 0
        self.predicted_bytes = 0  # sum over decode steps of the running rows' prediction
        # The stream the last batch ran on (SGLang's overlap scheduler runs forwards on a
        # stream of their own and frees finished requests from its schedule stream while the
        # next forward, which may still hold them, is in flight): see _after_forward.
        self._forward_stream: Optional[Any] = None
        logger.info("sglang_ext CPU tier: %s; host store %.2f GB (%s mode)", layout.describe(),
                    self.host.nbytes / 1e9, mode)

    def bind(self, req_to_token: Tensor) -> None:
        """Allocate the per-row tables once the request table exists (the attention backend
        calls this; SGLang builds the KV pool before it knows the rows)."""
        if self.tier is not None:
            return
        runtime.state().tier_pool = self
        rows, max_context = req_to_token.shape
        ps = self.layout.page_size
        dev = self.device
        i32 = dict(dtype=torch.int32, device=dev)
        # What SGLang's dense extend backend reads instead of req_to_token (device rows).
        self.dev_req_to_token = torch.zeros((rows, max_context), **i32)
        self.max_blocks = -(-max_context // ps)
        self.tier = WorkingSetTier(
            num_layers=self.layer_num, num_kv_heads=self.tier_heads, max_rows=rows,
            max_blocks=self.max_blocks, num_slots=self.layout.num_slots, page_size=ps,
            max_batch=rows, host=self.host, device=dev, mode=self.mode,
            gather_programs=self.gather_programs, host_page_offset=self.layout.gpu_pages,
            timing=self.timing, sync_steps=self.sync_steps,
            attend_resident=self.attend_resident,
        )
        self.ring_pages_t = torch.zeros((rows, self.layout.ring_pages), **i32)
        self.ring_block_t = torch.full((rows, self.layout.ring_pages), -1, **i32)
        self.sink_pages_t = torch.zeros((rows, max(self.layout.sink_pages, 1)), **i32)
        self.tier.ring_pages, self.tier.ring_blocks = self.ring_pages_t, self.ring_block_t
        # CUDA-graph padding entries decode row 0 at position 0: map it to the padding page.
        self.tier.page_maps[0, :, :, 0] = 0

    # ---------------------------------------------------------------- addressing

    def translate(self, loc: Tensor) -> Tensor:
        """Device row of each logical slot (host-homed slots through their sink/ring page;
        0, the padding row, if the page has none)."""
        g = self.layout.gpu_tokens
        ps = self.layout.page_size
        loc = loc.long()
        page = self.dev_page_of_lp[(loc // ps).clamp(max=self.dev_page_of_lp.shape[0] - 1)].long()
        away = torch.where(page >= 0, page * ps + loc % ps, torch.zeros_like(loc))
        return torch.where(loc < g, loc, away)

    def host_slots(self, loc: Tensor) -> Tensor:
        g = self.layout.gpu_tokens
        loc = loc.long()
        return torch.where(loc >= g, loc - g, torch.full_like(loc, -1))

    def set_kv_buffer(self, layer: Any, loc_info: Any, cache_k: Tensor, cache_v: Any,
                      k_scale: Any = None, v_scale: Any = None, *args: Any,
                      **kwargs: Any) -> None:
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = kwargs.get("layer_id_override") or layer.layer_id
        if cache_k.dtype != self.dtype:
            # SGLang's cast (MHATokenToKVPool.set_kv_buffer), once, for every copy: the device
            # rows, the scratch and the host copy hold the same values (an fp8 cache's too).
            if k_scale is not None:
                cache_k.div_(k_scale)
            if v_scale is not None:
                cache_v.div_(v_scale)
            cache_k = cache_k.to(self.dtype)
            cache_v = None if cache_v is None else cache_v.to(self.dtype)
        if self._extend is not None:
            rows = self.written_rows(loc, layer_id)
            for dst, x in zip(self.scratch, (cache_k, cache_v)):
                dst[rows] = as_stored(x.reshape(-1, *dst.shape[1:]), dst.dtype)
        # cast already: no scales (MLA pools take none at all)
        extra = (None, None, *args) if args else ()
        super().set_kv_buffer(layer, self.translate(loc), cache_k, cache_v, *extra, **kwargs)
        self._write_through(layer_id, loc, cache_k, cache_v)

    def get_key_buffer(self, layer_id: int) -> Tensor:
        if self._extend is None:
            return super().get_key_buffer(layer_id)
        self._fill_scratch(layer_id - self.start_layer)
        return as_stored(self.scratch[0], self.dtype)  # as SGLang reads its own rows

    def get_value_buffer(self, layer_id: int) -> Tensor:
        if self._extend is None:
            return super().get_value_buffer(layer_id)
        self._fill_scratch(layer_id - self.start_layer)
        if len(self.scratch) > 1:
            return as_stored(self.scratch[1], self.dtype)
        return self.values_of(as_stored(self.scratch[0], self.dtype))

    def written_rows(self, loc: Tensor, layer_id: int) -> Tensor:
        """Where the extend's dense attention reads the rows just written at logical slots
        ``loc``: their scratch rows while a scratch extend runs (filled for layer ``layer_id``
        first), else their device rows."""
        ext = self._extend
        if ext is None:
            return self.translate(loc)
        if loc.shape[0] != ext.out_rows.shape[0]:
            raise RuntimeError(f"sglang_ext CPU tier: an extend wrote {loc.shape[0]} tokens, its "
                               f"batch has {ext.out_rows.shape[0]} new ones")
        self._fill_scratch(layer_id - self.start_layer)
        return ext.out_rows

    def _write_through(self, layer_id: int, loc: Tensor, cache_k: Tensor,
                       cache_v: Optional[Tensor]) -> None:
        """The host copy of rows just written at logical slots ``loc`` (host-homed ones)."""
        heads = self.tier_heads
        k = as_stored(cache_k.reshape(-1, heads, self.tier_key_dim), self.dtype)
        v = None if not self.tier_value_dim else \
            as_stored(cache_v.reshape(-1, heads, self.tier_value_dim), self.dtype)
        self.host.write(layer_id - self.start_layer, self.host_slots(loc), k, v)

    def gather_tokens(self, layer_id: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """K and V ``[n, Hkv, D]`` of logical slots in the KV dtype, from their homes (the
        reference decode on CPU reads host-homed tokens straight from host memory)."""
        idx = layer_id - self.start_layer
        g = self.layout.gpu_tokens
        slots = slots.long()
        on_gpu = slots < g
        hs = None if bool(on_gpu.all()) else (slots - g).clamp(min=0).cpu()
        out = []
        for dev, host in zip(self.tier_buffers(idx), self.host.buffers(idx)):
            x = dev[slots.clamp(max=g - 1)].clone()  # the stored rows (uint8 for fp8)
            if hs is not None:
                away = as_stored(host[:, hs].transpose(0, 1), x.dtype).to(x.device)
                x = torch.where(on_gpu[:, None, None], x, away)
            out.append(as_stored(x, self.dtype))
        k = out[0]
        return k, out[1] if len(out) > 1 else self.values_of(k)

    # ------------------------------------------------------------- prefill side

    def prepare_extend(self, req_to_token: Tensor, rows: list[int], seq_lens: list[int],
                       prefix_lens: list[int]) -> None:
        """Before a dense extend: the ``dev_req_to_token`` rows its backend reads. A batch whose
        pages are all GPU-homed reads the pool in place; one that touches a host-homed page
        reads the extend scratch: each row's tokens at consecutive scratch rows, filled per
        layer from the prefix pages' homes (:meth:`_fill_scratch`)."""
        ps = self.layout.page_size
        gp = self.layout.gpu_pages
        self.end_extend()
        # SGLang continues a chunked prefill in the very next prefill batch, so a request
        # still prefilling but absent from this batch has finished its prompt: it takes its
        # working set now (its first decode step may come later).
        in_batch = set(rows)
        for row in [r for r, st in self.rows.items() if not st.decoding and r not in in_batch]:
            self.start_decoding(req_to_token, row)
        pages: list[Tensor] = []  # per row: the logical pages of its blocks
        any_host = False
        for row, seq_len in zip(rows, seq_lens):
            state = self.rows.setdefault(row, RowState())
            state.written = seq_len
            nblocks = -(-seq_len // ps)
            pages.append(req_to_token[row, 0:nblocks * ps:ps].long() // ps)
            if bool((pages[-1] >= gp).any()):
                state.on_host = any_host = True
        if not any_host:
            for row, seq_len in zip(rows, seq_lens):
                self.dev_req_to_token[row, :seq_len] = req_to_token[row, :seq_len]
            return
        dev = self.device
        base = 1  # scratch page 0 is the padding page
        out_rows, copy_pages, load_pages = [], [], []
        for row, seq_len, prefix_len, lps in zip(rows, seq_lens, prefix_lens, pages):
            n = lps.shape[0]
            first = base * ps
            width = min(n * ps, self.dev_req_to_token.shape[1])
            self.dev_req_to_token[row, :width] = torch.arange(
                first, first + width, dtype=torch.int32, device=dev)
            out_rows.append(torch.arange(first + prefix_len, first + seq_len, device=dev))
            # prefix pages hold data at their homes (a page the prefix ends inside is loaded
            # whole: its tail is the new tokens, written after the fill)
            prefix = lps[:-(-prefix_len // ps)]
            dst = torch.arange(base, base + prefix.shape[0], device=lps.device)
            on_gpu = prefix < gp
            copy_pages.append((prefix[on_gpu], dst[on_gpu]))
            load_pages.append((prefix[~on_gpu] - gp, dst[~on_gpu]))
            base += n
        if base > self.scratch[0].shape[0] // ps:
            raise RuntimeError(
                f"sglang_ext CPU tier: an extend batch of {sum(seq_lens)} tokens does not fit "
                f"in the extend scratch ({self.scratch[0].shape[0]} rows)")
        offs = torch.arange(ps, device=dev)

        def token_rows(page_list: list[Tensor]) -> Tensor:
            p = torch.cat(page_list).to(dev)
            return (p[:, None] * ps + offs).reshape(-1)

        hn = self.tier_heads
        src = torch.cat([s for s, _ in load_pages]).to(torch.int32)
        self._extend = ExtendScratch(
            out_rows=torch.cat(out_rows),
            copy_src=token_rows([s for s, _ in copy_pages]),
            copy_dst=token_rows([d for _, d in copy_pages]),
            load_heads=torch.arange(hn, dtype=torch.int32).repeat(src.shape[0]).to(dev),
            load_src=src.repeat_interleave(hn).to(dev),
            load_dst=torch.cat([d for _, d in load_pages]).to(torch.int32)
            .repeat_interleave(hn).to(dev),
        )

    def end_extend(self) -> None:
        """A batch that is not an extend: the pool's buffers are read in place again."""
        self._extend = None

    def _fill_scratch(self, layer: int) -> None:
        """The running extend's prefix pages of layer index ``layer`` into the scratch (once per
        layer; every layer's attention runs in order, on one stream, so one scratch serves all
        of them)."""
        ext = self._extend
        if ext is None or ext.filled == layer:
            return
        if ext.copy_src.numel():
            for src, dst in zip(self.tier_buffers(layer), self.scratch):
                dst[ext.copy_dst] = src[ext.copy_src]
        if ext.load_src.numel():
            self.host.load(layer, ext.load_heads, ext.load_src, ext.load_dst, self.scratch[0],
                           self.scratch[1] if len(self.scratch) > 1 else None)
        ext.filled = layer

    def _load_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Host pages -> device pages, every layer and kv head."""
        n = len(pairs)
        if not n:
            return
        hn = self.tier_heads
        heads = torch.arange(hn, dtype=torch.int32).repeat(n)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int32).repeat_interleave(hn)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int32).repeat_interleave(hn)
        heads, src, dst = (t.to(self.device) for t in (heads, src, dst))
        for layer in range(self.layer_num):
            self.host.load(layer, heads, src, dst, *self.tier_buffers(layer))

    # ------------------------------------------------------------- admission

    @property
    def pages_per_request(self) -> int:
        """Working-area pages a decoding request holds: sink, ring and working-set slots."""
        lay = self.layout
        return lay.sink_pages + lay.ring_pages + lay.num_slots

    def scratch_pages_for(self, tokens: int) -> int:
        """Scratch pages a request of ``tokens`` (prefix and new) takes in an extend batch."""
        return -(-tokens // self.layout.page_size) + 1

    def admission_room(self, chunked_tokens: int = 0) -> tuple[int, int]:
        """What new requests of the next prefill batch may still claim: ``(scratch pages,
        working-area pages)``. The scratch holds the whole batch, the chunk-prefilled request
        (``chunked_tokens``, prefix and new) first; the working area, less a working set for
        each row whose prefill has not turned into decoding yet (:meth:`start_decoding`
        allocates it)."""
        pending = sum(1 for st in self.rows.values() if not st.decoding)
        scratch = self.scratch[0].shape[0] // self.layout.page_size - 1
        if chunked_tokens:
            scratch -= self.scratch_pages_for(chunked_tokens)
        return scratch, self.work.available - pending * self.pages_per_request

    def admission_need(self, tokens: int) -> tuple[int, int]:
        """``(scratch pages, working-area pages)`` a request of ``tokens`` takes when admitted:
        its rows in this batch's scratch (its chunks' batches take no more), then a working
        set."""
        return self.scratch_pages_for(tokens), self.pages_per_request

    # ---------------------------------------------------- admission: the PCIe term

    def configure_transfers(self, pcie_gbps: float, step_ms: float,
                            locality_new_blocks: int = 0) -> TransferBudget:
        """The PCIe term (transfer_budget.py): a step may move ``pcie_gbps`` x ``step_ms``; a
        host-homed request of the server's settings moves at most ``request_step_bytes()``."""
        self.transfer_new_blocks = locality_new_blocks
        self.transfers = TransferBudget(
            step_bytes=step_budget_bytes(pcie_gbps, step_ms),
            request_bytes=self.request_step_bytes(locality_new_blocks),
            pcie_gbps=pcie_gbps, step_ms=step_ms)
        t = self.transfers
        if t.enabled:
            logger.info("sglang_ext CPU tier: PCIe term %.1f MB per decode step (%g GB/s x %g ms); "
                        "a host-homed request moves at most %.1f MB per step (%d blocks x %d kv "
                        "heads x %d layers x %d bytes)", t.step_bytes / 1e6, pcie_gbps, step_ms,
                        t.request_bytes / 1e6,
                        blocks_per_step(self.layout.num_slots, locality_new_blocks),
                        self.tier_heads, self.layer_num, self.tier_page_bytes)
            if t.request_bytes > t.step_bytes:
                logger.warning("sglang_ext CPU tier: one host-homed request's transfers (%.1f MB "
                               "per step) exceed the PCIe term's %.1f MB: such requests decode "
                               "one at a time (raise --sparse-tier-step-ms or set "
                               "--sparse-locality-new-blocks)", t.request_bytes / 1e6,
                               t.step_bytes / 1e6)
        return t

    def transfer_budget(self) -> TransferBudget:
        """The PCIe term, from this process's server config the first time it is asked."""
        if self.transfers is None:
            from sglang_ext.patches.server_args import active_config

            cfg = active_config()
            self.configure_transfers(cfg.tier_pcie_gbps, cfg.tier_step_ms,
                                     cfg.locality_new_blocks if cfg.locality_blocks else 0)
        return self.transfers

    def request_step_bytes(self, locality_new_blocks: int) -> int:
        """Most bytes a host-homed request moves per decode step with this limit on new filter
        blocks (0: none): its blocks per (layer, kv head) x kv heads x layers x page bytes."""
        return request_bytes_per_step(
            blocks_per_step(self.layout.num_slots, locality_new_blocks), self.tier_heads,
            self.tier_page_bytes, self.layer_num)

    def note_admitted(self, row: int, predicted: int, bound: int) -> None:
        """The admission's prediction for the request now holding ``row``: ``predicted`` bytes
        per step (0 when its pages were to be GPU-homed) and its ``bound`` if it turns out
        host-homed. Replaced by what its pages are once its prompt is written."""
        self._admitted[row] = (predicted, bound)

    def predicted_row_bytes(self, row: int) -> int:
        """Bytes ``row``'s request is predicted to move per decode step: its bound once a page
        of its prompt is seen on the host, 0 once it decodes with every prompt page on the GPU,
        else (still prefilling) the admission's prediction (the bound without one)."""
        state = self.rows.get(row)
        predicted, bound = self._admitted.get(row, (None, None))
        if bound is None:
            bound = self.transfer_budget().request_bytes
        if state is not None and state.on_host:
            return bound
        if state is not None and state.decoding:
            return 0
        return bound if predicted is None else predicted

    def predicted_load(self, decoding_only: bool = False) -> int:
        """Bytes per step the admitted requests are predicted to move (``decoding_only``: the
        ones decoding now, i.e. this step's prediction)."""
        if decoding_only:
            rows = [r for r, st in self.rows.items() if st.decoding]
        else:
            rows = set(self.rows) | set(self._admitted)
        return sum(self.predicted_row_bytes(r) for r in rows)

    def gpu_pages_free_at_least(self, free_tokens: int) -> int:
        """GPU-homed pages surely free when the allocator has ``free_tokens`` free logical
        slots: at most every host page is among them. SGLang's paged allocator hands out the
        lowest free pages first, so a request that needs no more pages goes to the GPU."""
        ps = self.layout.page_size
        return max(0, free_tokens // ps - self.layout.host_tokens // ps)

    def prefix_on_host(self, prefix_indices: Any) -> bool:
        """Whether a radix prefix (logical slots) has a host-homed page (a device read)."""
        if prefix_indices is None or len(prefix_indices) == 0:
            return False
        return bool((prefix_indices >= self.layout.gpu_tokens).any())

    # -------------------------------------------------------------- decode side

    def start_decoding(self, req_to_token: Tensor, row: int) -> None:
        """A request's prefill is done (its prompt's KV is on its homes: GPU rows or host): it
        takes sink and recent-window pages and working-set slots, loaded from the host."""
        ps = self.layout.page_size
        gp = self.layout.gpu_pages
        lay = self.layout
        state = self.rows.setdefault(row, RowState())
        prompt_len = state.written
        nblocks = -(-prompt_len // ps)
        lps = (req_to_token[row, 0:nblocks * ps:ps] // ps).tolist() if nblocks else []
        state.sink = self.work.alloc(lay.sink_pages)
        state.ring = self.work.alloc(lay.ring_pages)
        state.slots = self.work.alloc(lay.num_slots)
        blocks, pages, loads = [], [], []  # loads: (host page, device page)
        ring_block = [-1] * lay.ring_pages
        ring_lps = []
        middle: list[int] = []  # host-homed blocks between the sink and the ring
        n_sink = min(lay.sink_pages, nblocks)
        for j, lp in enumerate(lps):
            if lp < gp:
                blocks.append(j)
                pages.append(lp)
                continue
            if j < n_sink:
                dst = state.sink[j]
            elif j >= max(n_sink, nblocks - lay.ring_pages):
                dst = state.ring[j % lay.ring_pages]
                ring_block[j % lay.ring_pages] = j
                ring_lps.append((lp, dst))
            else:
                middle.append(j)  # fetched into a slot when selected
                continue
            loads.append((lp - gp, dst))
            blocks.append(j)
            pages.append(dst)
        # A prompt that ends on a page boundary has its first decode token open a new block,
        # whose ring page is the oldest ring block's: that block leaves the ring before the
        # first step, which under async has no previous selection to have given it a slot.
        leaving = nblocks - lay.ring_pages
        if prompt_len % ps == 0 and leaving >= n_sink and lps and lps[leaving] >= gp:
            middle.append(leaving)
        # The working set starts with the middle blocks nearest the window (and the one leaving
        # the ring): all of them when they fit, which makes the first step exact at a budget >=
        # the context under either schedule.
        preload = middle[-lay.num_slots:] if lay.num_slots else []
        loads += [(lps[j] - gp, slot) for j, slot in zip(preload, state.slots)]
        self._load_pages(loads)
        dev = self.device
        self.tier.detach(row)
        if blocks:
            self.tier.map_resident(row, torch.tensor(blocks, device=dev),
                                   torch.tensor(pages, dtype=torch.int32, device=dev))
        if ring_lps:
            self.dev_page_of_lp[torch.tensor([lp for lp, _ in ring_lps], device=dev)] = \
                torch.tensor([p for _, p in ring_lps], dtype=torch.int32, device=dev)
        self.ring_pages_t[row] = torch.tensor(state.ring, dtype=torch.int32)
        self.ring_block_t[row] = torch.tensor(ring_block, dtype=torch.int32)
        if state.sink:
            self.sink_pages_t[row, :len(state.sink)] = torch.tensor(state.sink, dtype=torch.int32)
        self.tier.attach(row, torch.tensor(state.slots, dtype=torch.int32, device=dev))
        self.tier.preload(row, torch.tensor(preload, dtype=torch.int32, device=dev))
        state.on_host = any(lp >= gp for lp in lps)
        state.decoding = True
        self._publish_occupancy()

    def repoint_pages(self, row: int, start: int, req_to_token: Tensor, new_slots: Tensor) -> None:
        """SGLang is about to rewrite ``req_to_token[row, start:start + n]`` to ``new_slots``
        (n of them). The one rewrite of slots the tier has already placed is the radix cache's
        dedup (``cache_unfinished_req`` after a prefill chunk): prompt pages equal to pages it
        already holds are freed and the row re-pointed at the held ones. Each re-pointed block
        must then read its new page's KV (its home: the held copy, computed by another request)
        and nothing may stay translated to the freed page, which the allocator hands out
        again. Blocks of rows the tier does not track, and tokens not yet written (new prompt
        tokens, decode tokens: their old values are stale), are not re-points."""
        state = self.rows.get(row)
        n = new_slots.numel()
        if state is None or n == 0:
            return
        ps = self.layout.page_size
        first = -(-start // ps) * ps  # whole pages only: the cache dedups page-aligned keys
        offs = torch.arange(first - start, min(n, state.written - start), ps)
        if offs.numel() == 0:
            return  # new prompt or decode tokens: nothing placed there yet
        old_slots = req_to_token[row, start:start + n]
        old = (old_slots[offs.to(old_slots.device)].long() // ps).tolist()
        new = (new_slots.reshape(-1)[offs.to(new_slots.device)].long() // ps).tolist()
        changed = [(int(start + o) // ps, a, b) for o, a, b in zip(offs.tolist(), old, new)
                   if a != b]
        if changed and state.decoding:
            self._after_forward()  # the tables a step in flight may still read
        # A row still prefilling holds no device copy: its next extend reads the held pages
        # from their homes (prepare_extend reads req_to_token afresh).
        for j, old_lp, new_lp in changed:
            if state.decoding:
                self._repoint_decoding_block(row, state, j, old_lp, new_lp)

    def _repoint_decoding_block(self, row: int, state: RowState, j: int, old_lp: int,
                                new_lp: int) -> None:
        """A block of a decoding row (start_decoding ran before the dedup, as under the overlap
        scheduler): every device copy of it (sink or ring page, working-set slots) takes the
        held page's KV; a block that was read in place (GPU-homed freed page) gets its sink or
        ring page, or, in the middle, is fetched again when selected."""
        gp, lay = self.layout.gpu_pages, self.layout
        pm = self.tier.page_maps[row, :, :, j]  # [layers, kv heads]
        own = None  # this row's sink / ring page for the block
        r = j % lay.ring_pages if state.ring else 0
        if j < len(state.sink):
            own = state.sink[j]
        elif state.ring and int(self.ring_block_t[row, r]) == j:
            own = state.ring[r]
        elif (state.ring and old_lp < gp and int(self.ring_block_t[row, r]) < 0
              and j >= -(-state.written // self.layout.page_size) - lay.ring_pages):
            # a GPU-homed window block (read in place, no ring page): it takes its ring page
            own = state.ring[r]
            self.ring_block_t[row, r] = j
        if old_lp < gp:
            # read in place until now: the freed page may be reused by anyone
            pm.masked_fill_(pm == old_lp, -1 if own is None else own)
        self.dev_page_of_lp[old_lp] = -1  # the freed page is translated nowhere
        if new_lp < gp:
            # the held copy is on the GPU: read it in place; free the row's copies
            slots = self.tier.slot_block[row]
            slots.masked_fill_(slots == j, -1)
            pm.fill_(new_lp)
            if own is not None and j >= len(state.sink):
                self.ring_block_t[row, r] = -1
            return
        # Every mapped copy, per (layer, kv head), reloads from the held page's home (an
        # unmapped one, -1, is skipped by the gather).
        heads = torch.arange(pm.shape[1], dtype=torch.int32, device=self.device)
        # pm is a column of the page maps (stride max_blocks): the gather wants consecutive entries
        dsts = pm.contiguous()
        srcs = torch.where(dsts >= 0, new_lp - gp, -1).to(torch.int32)
        for layer in range(pm.shape[0]):
            self.host.load(layer, heads, srcs[layer], dsts[layer], *self.tier_buffers(layer))
        if own is not None:
            self.dev_page_of_lp[new_lp] = own

    def pending_rows(self) -> set[int]:
        """Rows that went through prefill and have not decoded yet."""
        return {row for row, st in self.rows.items() if not st.decoding}

    def map_decode_tokens(self, req_to_token: Tensor, req_pool_indices: Tensor,
                          seq_lens: Tensor, out_cache_loc: Tensor) -> None:
        """Before a decode step: map the block of each new token (GPU-homed: itself;
        host-homed: its ring page, unmapping the block that used the ring page before).
        Eager GPU ops, no host sync. A decode step reads and writes the pool in place: the
        extend before it, if any, is over."""
        self.end_extend()
        self.decode_steps += 1
        # host-side: this step's prediction, for the stats
        self.predicted_bytes += self.predicted_load(decoding_only=True)
        if req_pool_indices.numel() == 0:
            return
        ps = self.layout.page_size
        lay = self.layout
        # Under CUDA-graph replay the indices/lengths are padded to the graph's batch size;
        # out_cache_loc holds the real requests only (the padding comes last).
        n = out_cache_loc.shape[0]
        rpi = req_pool_indices[:n].long()
        pos = seq_lens[:n].long() - 1
        j = pos // ps
        lp = out_cache_loc.long() // ps
        on_host = lp >= lay.gpu_pages
        ring_slot = j % lay.ring_pages
        ring_page = self.ring_pages_t[rpi, ring_slot]
        in_sink = j < lay.sink_pages
        sink_page = self.sink_pages_t[rpi, j.clamp(max=self.sink_pages_t.shape[1] - 1)]
        host_page = torch.where(in_sink, sink_page, ring_page)
        page = torch.where(on_host, host_page, lp.to(torch.int32))
        # The ring page's previous block (host-homed, not a sink block) loses its mapping where
        # it still points at the ring page: per (layer, kv head), since the working set may
        # have given the block a slot of its own for some of them (see update_working_set).
        takes_ring = on_host & ~in_sink
        old = self.ring_block_t[rpi, ring_slot].long()
        evict = takes_ring & (old >= 0) & (old != j)
        old_c = old.clamp(min=0)
        pm = self.tier.page_maps
        cur = pm[rpi, :, :, old_c]  # [B, L, H]
        gone = evict[:, None, None] & (cur == ring_page[:, None, None])
        pm[rpi, :, :, old_c] = torch.where(gone, torch.full_like(cur, -1), cur)
        old_lp = (req_to_token[rpi, old_c * ps].long() // ps)
        cur_lp = self.dev_page_of_lp[old_lp]
        self.dev_page_of_lp[old_lp] = torch.where(evict & (cur_lp == ring_page),
                                                  torch.full_like(cur_lp, -1), cur_lp)
        self.ring_block_t[rpi, ring_slot] = torch.where(takes_ring, j.to(torch.int32),
                                                        self.ring_block_t[rpi, ring_slot])
        pm[rpi, :, :, j] = page.to(torch.int32)[:, None, None].expand(-1, pm.shape[1], pm.shape[2])
        cur_new = self.dev_page_of_lp[lp]
        self.dev_page_of_lp[lp] = torch.where(on_host, host_page, cur_new)

    def note_forward_stream(self) -> None:
        """Called as a batch starts (on the stream its forward runs on)."""
        if torch.device(self.device).type == "cuda":  # SGLang's pools keep a str
            self._forward_stream = torch.cuda.current_stream(self.device)

    def _after_forward(self) -> None:
        """Order the device writes that follow after every forward launched so far. Under the
        overlap scheduler a request that finished at step t may still be in step t+1's
        batch, in flight on the forward stream: clearing its tables from the schedule stream
        meanwhile would let that step map a block to page -1 (an illegal address)."""
        forward = self._forward_stream
        if forward is not None and forward != torch.cuda.current_stream(self.device):
            torch.cuda.current_stream(self.device).wait_stream(forward)

    def release_row(self, row: int, req_to_token: Tensor) -> None:
        """Free everything a request row holds (finish, abort, retract)."""
        self._admitted.pop(row, None)
        state = self.rows.pop(row, None)
        if state is None:
            return
        self._after_forward()
        held = state.sink + state.ring + state.slots
        if held:
            # Forget every logical page translated to a page of this row (window and sink
            # blocks on the host), whatever block it came from.
            mine = torch.isin(self.dev_page_of_lp, torch.tensor(held, dtype=torch.int32,
                                                                device=self.device))
            self.dev_page_of_lp.masked_fill_(mine, -1)
        self.work.free(state.sink + state.ring + state.slots)
        self.ring_block_t[row] = -1
        self.tier.detach(row)
        self._publish_occupancy()
        if self.verify >= 1 and not self.rows:
            self.check_idle()

    def _publish_occupancy(self) -> None:
        """Host-side occupancy to the gauges (no device read)."""
        if self.metrics is not None:
            self.metrics.update_occupancy(self.work.available, self.work.num_pages, len(self.rows))

    def check_idle(self) -> None:
        """With no request left, every working-area page is free."""
        if self.work.available != self.work.num_pages:
            raise AssertionError(
                f"sglang_ext tier leak: {self.work.num_pages - self.work.available} working-area "
                f"pages held with no request"
            )
        if bool((self.dev_page_of_lp >= 0).any()) or bool((self.tier.tiered != 0).any()):
            raise AssertionError("sglang_ext tier leak: mappings left with no request")

    def verify_mappings(self, req_to_token: Tensor, rows: list[int], seq_lens: list[int]) -> None:
        """Debug check (SGLANG_EXT_TIER_VERIFY=2): every mapped block's device copy equals its
        home copy for the tokens already written, every layer and kv head (one gather per row
        and layer, so that tests can afford it at every step)."""
        ps = self.layout.page_size
        pm = self.tier.page_maps
        for row, seq_len in zip(rows, seq_lens):
            written = seq_len - 1
            if written <= 0:
                continue
            slots = req_to_token[row, :written]
            token = torch.arange(written, device=pm.device)
            block = token // ps
            for layer in range(self.layer_num):
                home = [as_stored(x, self.store_dtype)
                        for x in self.gather_tokens(layer + self.start_layer, slots)]
                k_dev, v_dev = self.tier_buffers(layer)
                device = (k_dev, self.values_of(k_dev) if v_dev is None else v_dev)
                for h in range(self.tier_heads):
                    page = pm[row, layer, h, block].long()  # each token's block's device page
                    mapped = page >= 0
                    dev_rows = (page * ps + token % ps)[mapped]
                    for dev, x in zip(device, home):
                        same = (dev[dev_rows.to(dev.device), h] == x[mapped.to(x.device), h])
                        same = same.reshape(same.shape[0], -1).all(-1)
                        if not bool(same.all()):
                            bad = int(token[mapped][~same.to(token.device)][0])
                            raise AssertionError(
                                f"sglang_ext tier: row {row} block {bad // ps} layer {layer} "
                                f"head {h} (device page {int(pm[row, layer, h, bad // ps])}) "
                                f"differs from its home copy")

    # -------------------------------------------------------------- telemetry

    def occupancy(self) -> dict[str, float]:
        """The tier's counters (a device read) and host-side state. Transfers per decode step:
        ``bytes_per_step`` measured (transferred bytes over decode steps), beside
        ``predicted_bytes_per_step``, the PCIe term's prediction over the same steps (a bound:
        at least the measured value), ``predicted_bytes_per_step_now`` (the requests decoding
        now) and ``step_budget_bytes`` (0: no PCIe term); ``pcie_holds``: requests the term kept
        in the queue (cumulative)."""
        st = self.tier.read_stats()
        t = self.transfer_budget()
        steps = self.decode_steps
        moved = st["transferred_blocks"] * self.tier_page_bytes
        st.update(work_pages_free=self.work.available, work_pages=self.work.num_pages,
                  requests_tiered=len(self.rows), decode_steps=steps, transferred_bytes=moved,
                  bytes_per_step=moved / steps if steps else 0.0,
                  predicted_bytes=self.predicted_bytes,
                  predicted_bytes_per_step=self.predicted_bytes / steps if steps else 0.0,
                  predicted_bytes_per_step_now=self.predicted_load(decoding_only=True),
                  step_budget_bytes=t.step_bytes, pcie_holds=self.pcie_holds)
        return st


class TieredKVPool(TieredPool, MHATokenToKVPool):
    """``MHATokenToKVPool`` with the tier (``_build_mha_kv_pool`` hook): per layer K and V
    buffers of ``head_num`` kv heads."""

    def tier_shape(self) -> tuple[int, int, int]:
        # An fp8 cache (stored as uint8 bytes) is moved as its bytes: the host copy holds fp8
        # rows, the scratch the pool's stored rows. A quantised (FP4) cache keeps scales aside.
        if getattr(self, "is_quantized_kv_cache", False) or not (
                self.store_dtype == self.dtype or self.dtype.itemsize == 1):
            raise ValueError(f"sglang_ext: --sparse-tier does not support a KV cache stored as "
                             f"{self.store_dtype} yet (--kv-cache-dtype)")
        return self.head_num, self.head_dim, self.v_head_dim

    def tier_buffers(self, layer: int) -> tuple[Tensor, Optional[Tensor]]:
        return self.k_buffer[layer], self.v_buffer[layer]


class TieredMLAKVPool(TieredPool, MLATokenToKVPool):
    """``MLATokenToKVPool`` with the tier (``_build_mla_kv_pool`` hook): per layer one latent
    buffer ``[rows, 1, R + P]``; V is its ``[..., :R]`` view, so the tier stores, writes
    through, gathers and copies that one buffer (one "kv head" of ``R + P`` dims)."""

    def tier_shape(self) -> tuple[int, int, int]:
        if self.store_dtype != self.dtype:  # the host copy holds rows of the KV dtype
            raise ValueError(f"sglang_ext: --sparse-tier does not support an MLA KV cache "
                             f"stored as {self.store_dtype} yet (--kv-cache-dtype)")
        return 1, self.kv_cache_dim, 0

    def tier_buffers(self, layer: int) -> tuple[Tensor, Optional[Tensor]]:
        return self.kv_buffer[layer], None

    def values_of(self, keys: Tensor) -> Tensor:
        return keys[..., :self.kv_lora_rank]

    def set_mla_kv_buffer(self, layer: Any, loc: Tensor, cache_k_nope: Tensor,
                          cache_k_rope: Tensor) -> None:
        """How an MLA model writes a prefill's latent rows (then calls attention with
        ``save_kv_cache=False``): into the translated device rows, and through to the host."""
        if self._extend is not None:
            self._write_mla_kv_buffer(self.scratch[0], self.written_rows(loc, layer.layer_id),
                                      cache_k_nope, cache_k_rope)
        super().set_mla_kv_buffer(layer, self.translate(loc), cache_k_nope, cache_k_rope)
        self._write_through(layer.layer_id, loc, torch.cat([cache_k_nope, cache_k_rope], -1),
                            None)
