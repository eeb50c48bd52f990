"""SGLang KV pool with a host tier: capacity = GPU + host, sparse decode over working sets.

Logical KV slots (what SGLang's allocator, ``req_to_token`` and the radix tree hold) are
``[0, G + H)``, ``page_size``-aligned, and each logical page has one fixed home:

* pages below ``G`` live on the GPU at the same index (device rows ``[0, G)``): a request whose
  pages are all there decodes like an untiered one (no transfers);
* pages from ``G`` on live on the host, in the :class:`HostKVStore` at ``page - G``.

SGLang's allocator hands out the lowest free pages first after start-up, so the GPU fills
before the host; a request can mix both kinds. Device rows ``[G, G + W)`` are the **working
area** (:class:`WorkArea`), in ``page_size`` pages:

* prefill stays dense on the GPU: every host-homed page a prefill touches (new tokens, and a
  radix-hit or earlier-chunk prefix) gets a *staging* page there, shared by logical page and
  reference counted (two prefills of one prefix share it), loaded from the host when it
  already holds data; SGLang's dense extend backend reads the device through a translated
  ``dev_req_to_token`` and writes through :meth:`TieredKVPool.set_kv_buffer`, which writes
  device rows and, for host-homed pages, the host copy (write-through);
* once a request's prefill is done (its first decode step), its staging pages are dropped:
  it keeps sink pages, a ring of recent-window pages (decode writes land there) and
  ``num_slots`` working-set slots (:class:`WorkingSetTier`), which the sparse decode fills
  from the host by the set difference of consecutive selections. The slots start with the
  middle blocks nearest the window, copied from staging (the first decode step has no previous
  selection to attend), and a selected block still in the ring gets a slot before the ring
  reuses its page: with a budget >= the context the tiered decode is exact from the first step
  under both schedules (tests/test_tier_decode_steps.py).

Per request the decode reads keys through ``WorkingSetTier.page_maps`` (block -> device page,
per layer and kv head): GPU-homed blocks map to themselves, sink/window blocks to their pages,
selected host blocks to working-set slots. The working area is sized at start-up for the
worst case (the longest prompt staged at once plus a working set per running request), and
SGLang admits a prefill only while the working area can stage it on top of what the requests
already admitted will take (:meth:`TieredKVPool.staging_room`, patches/scheduler.py): a second
long prompt whose prefix is a radix hit on host pages waits in the queue until the first one
decodes, instead of exhausting the area. Every exit of a request (finish, abort,
retract) goes through ``ReqToTokenPool.free``, which calls :meth:`TieredKVPool.release_row`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, unwrap_write_loc

from sglang_ext.config import tier_ring_pages
from sglang_ext.memory_tier.host_store import HostKVStore
from sglang_ext.memory_tier.working_set import WorkingSetTier

logger = logging.getLogger(__name__)

_active: Optional["TieredPool"] = None  # this process's tiered pool, once bound


def active_pool() -> Optional["TieredPool"]:
    return _active


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
                f"working area {self.work_tokens} tokens (page {self.page_size})")


def plan_layout(
    *, device_tokens: int, host_tokens: int, page_size: int, max_running_requests: int,
    max_prefill_tokens: int, num_slots: int, sink: int, window: int,
    summary_tokens_per_token: float, gpu_tokens: int = 0,
) -> TierLayout:
    """Split SGLang's profiled device capacity (``device_tokens`` KV slots) into GPU-homed
    slots and the working area, leaving room for the page summaries of the extra logical
    slots. ``summary_tokens_per_token``: device bytes of summaries per logical token, in KV
    slots (1 / page_size for bf16 min/max). ``gpu_tokens`` > 0 forces G (tests)."""
    ps = page_size
    sink_pages = -(-sink // ps)
    ring_pages = tier_ring_pages(window, ps)
    per_request = (sink_pages + ring_pages + num_slots) * ps
    # Staging holds the chunked request's whole prompt plus one prefill batch of others.
    staging = -(-max_prefill_tokens // ps) * ps + max_running_requests * ps
    work = max_running_requests * per_request + staging
    host = host_tokens // ps * ps
    if gpu_tokens <= 0:
        # G + W + (G + H) * r <= device_tokens * (1 + r): the summaries of the logical slots
        # beyond the device capacity come out of the GPU-homed part.
        r = summary_tokens_per_token
        gpu_tokens = int((device_tokens * (1 + r) - work - host * r) / (1 + r))
    gpu = gpu_tokens // ps * ps
    if gpu < ps:
        raise ValueError(
            f"the CPU tier's working area ({work} tokens: {max_running_requests} running "
            f"requests x {per_request} + {staging} prefill staging) and the summaries of "
            f"{host} host tokens leave no GPU KV slots out of {device_tokens}; lower "
            f"--max-running-requests or --sparse-tier-host-gb, or raise --mem-fraction-static"
        )
    return TierLayout(ps, gpu, work, host, sink_pages, ring_pages, num_slots)


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
class RowState:
    """Working-area pages one request row holds."""

    staged: dict[int, int] = field(default_factory=dict)  # block j -> logical page (staged)
    sink: list[int] = field(default_factory=list)  # device pages (sink blocks on the host)
    ring: list[int] = field(default_factory=list)  # device pages, block j -> ring[j % R]
    slots: list[int] = field(default_factory=list)  # working-set pages
    written: int = 0  # tokens whose KV has been written (the prompt, once prefill is done)
    decoding: bool = False


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
    dtype: torch.dtype
    device: Any

    def __init__(self, *args: Any, layout: TierLayout, mode: str,
                 gather_programs: Optional[int] = None, timing: bool = False,
                 **kwargs: Any) -> None:
        # The pool class's own arguments (SGLang's factory passes them), at G + W device rows.
        super().__init__(layout.device_tokens, *args, **kwargs)
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
        self.host = HostKVStore(
            self.layer_num, num_kv_heads, key_dim, value_dim, max(layout.host_tokens, ps), ps,
            self.dtype,
        )
        # Device page of a staged/ring host-homed logical page (-1: none): translates writes.
        self.dev_page_of_lp = torch.full((layout.logical_tokens // ps + 1,), -1,
                                         dtype=torch.int32, device=self.device)
        self.work = WorkArea(layout.gpu_pages, layout.work_tokens // ps)
        self.rows: dict[int, RowState] = {}
        self._staged: dict[int, list[int]] = {}  # logical page -> [device page, refcount]
        self.tier: Optional[WorkingSetTier] = None  # per-row tables: see bind()
        # Prometheus gauges (--enable-metrics; memory_tier/metrics.py), set by the backend.
        self.metrics: Optional[Any] = None
        # SGLANG_EXT_TIER_VERIFY (tests): 1 = check for leaks whenever the last request leaves;
        # 2 = also check every mapped device copy against its home at every decode step (slow).
        self.verify = verify_level()
        logger.info("sglang_ext CPU tier: %s; host store %.2f GB (%s mode)", layout.describe(),
                    self.host.nbytes / 1e9, mode)

    def bind(self, req_to_token: Tensor) -> None:
        """Allocate the per-row tables once the request table exists (the attention backend
        calls this; SGLang builds the KV pool before it knows the rows)."""
        global _active
        if self.tier is not None:
            return
        _active = self
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
            timing=self.timing,
        )
        self.ring_pages_t = torch.zeros((rows, self.layout.ring_pages), **i32)
        self.ring_block_t = torch.full((rows, self.layout.ring_pages), -1, **i32)
        self.sink_pages_t = torch.zeros((rows, max(self.layout.sink_pages, 1)), **i32)
        self.tier.ring_pages, self.tier.ring_blocks = self.ring_pages_t, self.ring_block_t
        # CUDA-graph padding entries decode row 0 at position 0: map it to the padding page.
        self.tier.page_maps[0, :, :, 0] = 0

    # ---------------------------------------------------------------- addressing

    def translate(self, loc: Tensor) -> Tensor:
        """Device row of each logical slot (host-homed slots through their staging/ring page;
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
                      *args: Any, **kwargs: Any) -> None:
        loc, _, _ = unwrap_write_loc(loc_info)
        super().set_kv_buffer(layer, self.translate(loc), cache_k, cache_v, *args, **kwargs)
        layer_id = kwargs.get("layer_id_override") or layer.layer_id
        self._write_through(layer_id, loc, cache_k, cache_v)

    def _write_through(self, layer_id: int, loc: Tensor, cache_k: Tensor,
                       cache_v: Optional[Tensor]) -> None:
        """The host copy of rows just written at logical slots ``loc`` (host-homed ones)."""
        heads = self.tier_heads
        k = cache_k.reshape(-1, heads, self.tier_key_dim).to(self.dtype)
        v = None if not self.tier_value_dim else \
            cache_v.reshape(-1, heads, self.tier_value_dim).to(self.dtype)
        self.host.write(layer_id - self.start_layer, self.host_slots(loc), k, v)

    def gather_tokens(self, layer_id: int, slots: Tensor) -> tuple[Tensor, Tensor]:
        """K and V ``[n, Hkv, D]`` of logical slots, from their homes (the reference decode on
        CPU reads host-homed tokens straight from host memory)."""
        idx = layer_id - self.start_layer
        g = self.layout.gpu_tokens
        slots = slots.long()
        on_gpu = slots < g
        hs = None if bool(on_gpu.all()) else (slots - g).clamp(min=0).cpu()
        out = []
        for dev, host in zip(self.tier_buffers(idx), self.host.buffers(idx)):
            x = dev[slots.clamp(max=g - 1)].clone()
            if hs is not None:
                x = torch.where(on_gpu[:, None, None], x, host[:, hs].transpose(0, 1).to(x.device))
            out.append(x)
        k = out[0]
        return k, out[1] if len(out) > 1 else self.values_of(k)

    # ------------------------------------------------------------- prefill side

    def prepare_extend(self, req_to_token: Tensor, rows: list[int], seq_lens: list[int],
                       prefix_lens: list[int]) -> None:
        """Before a dense extend: stage every host-homed page the batch's requests touch (loading
        pages that already hold data) and translate their ``req_to_token`` rows."""
        ps = self.layout.page_size
        gp = self.layout.gpu_pages
        # SGLang continues a chunked prefill in the very next prefill batch, so a request
        # still prefilling but absent from this batch has finished its prompt: let it drop
        # its staging now rather than at its first decode step (which may come later).
        in_batch = set(rows)
        for row in [r for r, st in self.rows.items() if not st.decoding and r not in in_batch]:
            self.start_decoding(req_to_token, row)
        for row, seq_len, prefix_len in zip(rows, seq_lens, prefix_lens):
            state = self.rows.setdefault(row, RowState())
            state.written = seq_len
            nblocks = -(-seq_len // ps)
            lps = (req_to_token[row, 0:nblocks * ps:ps] // ps).tolist()
            loads: list[tuple[int, int]] = []
            for j, lp in enumerate(lps):
                if state.staged.get(j) == lp:
                    continue  # staged by an earlier chunk
                if j in state.staged:
                    # The radix cache re-pointed this block at an equal page it already held
                    # (cache_unfinished_req dedups chunks): stage that page instead.
                    self._unstage_one(state.staged.pop(j))
                if lp < gp:
                    continue
                # a page before the prefix's end already holds data (on the host)
                self._stage_page(state, j, lp, loads if j * ps < prefix_len else None)
            if loads:
                self._load_pages(loads)
            self._publish_staging(state)
            r2t = req_to_token[row, :nblocks * ps]
            self.dev_req_to_token[row, :nblocks * ps] = self.translate(r2t).to(torch.int32)

    def _stage_page(self, state: RowState, j: int, lp: int,
                    loads: Optional[list[tuple[int, int]]]) -> None:
        """Stage host-homed logical page ``lp`` as block ``j`` of ``state``'s row: one working-area
        page per logical page, shared (reference counted) by every row staging it. A page
        newly taken is to be loaded from the host when ``loads`` is given (appended to it)."""
        entry = self._staged.get(lp)
        if entry is None:
            entry = self._staged[lp] = [self.work.alloc(1)[0], 0]
            if loads is not None:
                loads.append((lp - self.layout.gpu_pages, entry[0]))
        entry[1] += 1
        state.staged[j] = lp

    def _publish_staging(self, state: RowState) -> None:
        if not state.staged:
            return
        lps = torch.tensor(list(state.staged.values()), device=self.device)
        pages = torch.tensor([self._staged[lp][0] for lp in state.staged.values()],
                             dtype=torch.int32, device=self.device)
        self.dev_page_of_lp[lps] = pages

    def _load_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Host pages -> device pages, every layer and kv head."""
        n = len(pairs)
        hn = self.tier_heads
        heads = torch.arange(hn, dtype=torch.int32).repeat(n)
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int32).repeat_interleave(hn)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int32).repeat_interleave(hn)
        heads, src, dst = (t.to(self.device) for t in (heads, src, dst))
        for layer in range(self.layer_num):
            self.host.load(layer, heads, src, dst, *self.tier_buffers(layer))

    def _copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Device page -> device page, every layer."""
        if not src:
            return
        ps = self.layout.page_size
        offs = torch.arange(ps, device=self.device)
        s = (torch.tensor(src, device=self.device)[:, None] * ps + offs).reshape(-1)
        d = (torch.tensor(dst, device=self.device)[:, None] * ps + offs).reshape(-1)
        for layer in range(self.layer_num):
            for buf in self.tier_buffers(layer):
                if buf is not None:
                    buf[d] = buf[s]

    def _unstage_one(self, lp: int) -> None:
        entry = self._staged[lp]
        entry[1] -= 1
        if entry[1] == 0:
            self.work.free([entry[0]])
            del self._staged[lp]
            self.dev_page_of_lp[lp] = -1

    def _unstage(self, state: RowState) -> None:
        for lp in state.staged.values():
            self._unstage_one(lp)
        state.staged.clear()

    # ------------------------------------------------------------- admission

    @property
    def pages_per_request(self) -> int:
        """Working-area pages a decoding request holds: sink, ring and working-set slots."""
        lay = self.layout
        return lay.sink_pages + lay.ring_pages + lay.num_slots

    def staging_room(self, chunked_remaining_tokens: int = 0) -> int:
        """Working-area pages a new prefill may still claim: the free ones less what requests
        already admitted will take: a working set for each row whose prefill has not turned
        into decoding yet (:meth:`start_decoding` allocates it) and staging pages for the rest
        of the prompt being chunk-prefilled (``chunked_remaining_tokens``)."""
        ps = self.layout.page_size
        pending = sum(1 for st in self.rows.values() if not st.decoding)
        return (self.work.available - pending * self.pages_per_request
                - (-(-chunked_remaining_tokens // ps) + 1 if chunked_remaining_tokens else 0))

    def staging_need(self, prefix_slots: Tensor, extend_tokens: int) -> int:
        """Working-area pages a request about to be admitted will take: staging for its
        host-homed prefix (a radix hit, loaded at once by :meth:`prepare_extend`) and for the
        tokens it will prefill, then its working set."""
        ps, gp = self.layout.page_size, self.layout.gpu_pages
        prefix_pages = set((prefix_slots[::ps] // ps).tolist()) if len(prefix_slots) else set()
        host_prefix = sum(1 for lp in prefix_pages if lp >= gp and lp not in self._staged)
        return host_prefix + -(-extend_tokens // ps) + 1 + self.pages_per_request

    # -------------------------------------------------------------- decode side

    def start_decoding(self, req_to_token: Tensor, row: int) -> None:
        """A request's prefill is done: keep sink and recent-window pages, take working-set
        slots, drop the staging pages (the prompt's KV is on its homes: GPU rows or host)."""
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
        blocks, pages, copy_src, copy_dst = [], [], [], []
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
            copy_src.append(self._staged[lp][0])
            copy_dst.append(dst)
            blocks.append(j)
            pages.append(dst)
        # A prompt that ends on a page boundary has its first decode token open a new block,
        # whose ring page is the oldest ring block's: that block leaves the ring before the
        # first step, which under async has no previous selection to have given it a slot.
        leaving = nblocks - lay.ring_pages
        if prompt_len % ps == 0 and leaving >= n_sink and lps and lps[leaving] >= gp:
            middle.append(leaving)
        # The working set starts with the middle blocks nearest the window (and the one leaving
        # the ring), copied from their staging pages (no host transfer): all of them when they
        # fit, which makes the first step exact at a budget >= the context under either schedule.
        preload = middle[-lay.num_slots:] if lay.num_slots else []
        copy_src += [self._staged[lps[j]][0] for j in preload]
        copy_dst += state.slots[:len(preload)]
        self._copy_pages(copy_src, copy_dst)
        self._unstage(state)
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
        for j, old_lp, new_lp in changed:
            if state.decoding:
                self._repoint_decoding_block(row, state, j, old_lp, new_lp)
            else:
                self._repoint_staged_block(state, j, old_lp, new_lp)
        if changed and not state.decoding:
            self._publish_staging(state)
            self.dev_req_to_token[row, start:start + n] = self.translate(
                new_slots.reshape(-1).to(self.device)).to(torch.int32)

    def _repoint_staged_block(self, state: RowState, j: int, old_lp: int, new_lp: int) -> None:
        """A block of a row still prefilling (or not yet decoding): stage the held page in place
        of the freed one, loaded from its home (it holds data)."""
        if state.staged.get(j) == old_lp:
            self._unstage_one(state.staged.pop(j))
        if new_lp < self.layout.gpu_pages:
            return  # a GPU-homed page is read where it is
        loads: list[tuple[int, int]] = []
        self._stage_page(state, j, new_lp, loads)
        if loads:
            self._load_pages(loads)

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
        for layer in range(pm.shape[0]):
            dst = pm[layer].to(torch.int32)
            src = torch.where(dst >= 0, new_lp - gp, -1).to(torch.int32)
            self.host.load(layer, heads, src, dst, *self.tier_buffers(layer))
        if own is not None:
            self.dev_page_of_lp[new_lp] = own

    def pending_rows(self) -> set[int]:
        """Rows that went through prefill and have not decoded yet."""
        return {row for row, st in self.rows.items() if not st.decoding}

    def map_decode_tokens(self, req_to_token: Tensor, req_pool_indices: Tensor,
                          seq_lens: Tensor, out_cache_loc: Tensor) -> None:
        """Before a decode step: map the block of each new token (GPU-homed: itself;
        host-homed: its ring page, unmapping the block that used the ring page before).
        Eager GPU ops, no host sync."""
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

    def release_row(self, row: int, req_to_token: Tensor) -> None:
        """Free everything a request row holds (finish, abort, retract)."""
        state = self.rows.pop(row, None)
        if state is None:
            return
        self._unstage(state)
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
        """With no request left, every working-area page is free and nothing is staged."""
        if self.work.available != self.work.num_pages or self._staged:
            raise AssertionError(
                f"sglang_ext tier leak: {self.work.num_pages - self.work.available} working-area "
                f"pages and {len(self._staged)} staged pages held with no request"
            )
        if bool((self.dev_page_of_lp >= 0).any()) or bool((self.tier.tiered != 0).any()):
            raise AssertionError("sglang_ext tier leak: mappings left with no request")

    def verify_mappings(self, req_to_token: Tensor, rows: list[int], seq_lens: list[int]) -> None:
        """Debug check (SGLANG_EXT_TIER_VERIFY=2, slow): every mapped block's device copy equals
        its home copy for the tokens already written, every layer and kv head."""
        ps = self.layout.page_size
        pm = self.tier.page_maps
        for row, seq_len in zip(rows, seq_lens):
            written = seq_len - 1
            for j in range(-(-written // ps)):
                n = min(ps, written - j * ps)
                slots = req_to_token[row, j * ps:j * ps + n]
                for layer in range(self.layer_num):
                    home = self.gather_tokens(layer + self.start_layer, slots)
                    k_dev, v_dev = self.tier_buffers(layer)
                    device = (k_dev, self.values_of(k_dev) if v_dev is None else v_dev)
                    for h in range(self.tier_heads):
                        page = int(pm[row, layer, h, j])
                        if page < 0:
                            continue
                        if not all(torch.equal(dev[page * ps:page * ps + n, h], x[:, h])
                                   for dev, x in zip(device, home)):
                            raise AssertionError(
                                f"sglang_ext tier: row {row} block {j} layer {layer} head {h} "
                                f"(device page {page}) differs from its home copy")

    # -------------------------------------------------------------- telemetry

    def occupancy(self) -> dict[str, float]:
        st = self.tier.read_stats()
        st.update(work_pages_free=self.work.available, work_pages=self.work.num_pages,
                  requests_tiered=len(self.rows))
        return st


class TieredKVPool(TieredPool, MHATokenToKVPool):
    """``MHATokenToKVPool`` with the tier (``_build_mha_kv_pool`` hook): per layer K and V
    buffers of ``head_num`` kv heads."""

    def tier_shape(self) -> tuple[int, int, int]:
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
        super().set_mla_kv_buffer(layer, self.translate(loc), cache_k_nope, cache_k_rope)
        self._write_through(layer.layer_id, loc, torch.cat([cache_k_nope, cache_k_rope], -1),
                            None)
