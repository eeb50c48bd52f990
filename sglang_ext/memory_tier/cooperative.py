"""Fluxion's CPU-GPU cooperative attention for the CPU KV tier (reference engine, plain torch).

A decode step's selection ``C_t`` is split per (request, kv head) into the blocks already in the
GPU working set and the misses that are still only in host memory. Without cooperation the
misses are gathered to the GPU before attention (``sync``), or attention uses the previous
step's choice while they are fetched (``async``, AsyncTLS). With cooperation the GPU attends the
resident blocks while CPU threads attend the misses straight from host memory; the two partial
results are merged exactly with their log-sum-exps (``merge_attention_states``), so the step attends
exactly ``C_t`` without waiting for a transfer.

:class:`PriorityScheduler` decides, per step, which misses the CPU takes: it hands the GPU its
work largest first and gives the CPU the smallest miss sets, only as many as its threads can
finish before the GPU's estimated finish (the CPU stays off the critical path); the rest are
fetched. Costs are per attended token, measured on the machine (``benchmarks/bench_fluxion.py``).

Shapes: ``q`` ``[B, Hq, D]``; host K/V per layer ``[Hkv, N, D]`` (:class:`HostKVStore`, block
``p`` of head ``h`` is ``[h, p*page_size:(p+1)*page_size]``); block lists ``[B, Hkv, M]`` int,
``-1`` padding. Partial results: ``out`` ``[B, Hq, Dv]`` float32 and ``lse`` ``[B, Hq]`` float32
(natural log; ``-inf`` where a partial attended nothing).
"""

from __future__ import annotations

import heapq
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from sglang_ext.selection.reference import _zero_if_neg_inf, merge_attention_states


def block_token_index(blocks: Tensor, page_size: int) -> tuple[Tensor, Tensor]:
    """``[B, Hkv, M]`` block ids (``-1`` padding) -> token slots ``[B, Hkv, M*page_size]`` and
    their validity mask."""
    offs = torch.arange(page_size, device=blocks.device)
    tok = (blocks.long().clamp(min=0)[..., None] * page_size + offs).flatten(-2)
    valid = (blocks >= 0)[..., None].expand(*blocks.shape, page_size).flatten(-2)
    return tok, valid


class AttendScratch:
    """One CPU thread's reusable buffers for :func:`attend_items`. A task's gathered K/V are
    megabytes; fresh tensors of that size are mapped and page-faulted on every task (a one-off
    diagnosis on a 2-core host, one thread, 16 items of 64 blocks of 16 tokens: 15.5 ms per
    task with fresh tensors, 5.0 ms with reused ones, the same bits)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        numel = math.prod(shape)
        buf = self._buffers.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self._buffers[(name, dtype)] = buf
        return buf[:numel].view(shape)


def attend_items(q: Tensor, k: Tensor, v: Tensor, heads: Tensor, blocks: Tensor, page_size: int,
                 scaling: float, scratch: Optional[AttendScratch] = None) -> tuple[Tensor, Tensor]:
    """Partial attention of independent items, in float32: item ``i`` is one kv head's query
    group ``q[i]`` (``[n, G, D]``) over the tokens of ``blocks[i]`` (``[n, M]``, ``-1`` padding)
    of kv head ``heads[i]`` of a head-major K/V (``[Hkv, N, D]``, host or device). Returns
    ``(out [n, G, Dv], lse [n, G])``, ``lse = -inf`` where an item attends nothing. One gather
    and two batched GEMMs for all items: what a CPU thread runs over its share of a step.
    ``scratch`` (host K/V, contiguous): the gathers and scores go into its reused buffers."""
    tok, valid = block_token_index(blocks.to(k.device), page_size)  # [n, T]
    return attend_token_items(q, k, v, heads, tok, valid, scaling, scratch)


def attend_token_items(q: Tensor, k: Tensor, v: Tensor, heads: Tensor, tok: Tensor,
                       valid: Tensor, scaling: float, scratch: Optional[AttendScratch] = None,
                       ) -> tuple[Tensor, Tensor]:
    """:func:`attend_items` over explicit token slots: item ``i`` attends the tokens
    ``tok[i]`` (``[n, T]`` rows of kv head ``heads[i]``) where ``valid[i]``. A serving step's
    selection can keep part of a block (two_level's token stage, a block that reaches into the
    recent window), so the CPU is handed exactly the tokens it attends."""
    tok, valid = tok.to(k.device).long(), valid.to(k.device)
    heads = heads.to(k.device).long()[:, None]
    qf = q.to(k.device).float()
    if scratch is None or not (k.is_contiguous() and v.is_contiguous()):
        keys = k[heads, tok].float()  # [n, T, D]
        values = v[heads, tok].float()
        scores = torch.matmul(qf, keys.transpose(-1, -2)) * scaling  # [n, G, T]
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is valid
        probs = torch.exp(scores - _zero_if_neg_inf(lse)[..., None])
        return torch.matmul(probs, values), lse
    # The same computation into reused buffers (the same kernels, so the same bits).
    rows = (heads * k.shape[1] + tok).flatten()  # rows of the [Hkv * N, D] view
    n, t = tok.shape
    keys = _gather_float(scratch, "keys", k, rows, (n, t, k.shape[-1]))
    values = _gather_float(scratch, "values", v, rows, (n, t, v.shape[-1]))
    scores = scratch.get("scores", (n, qf.shape[1], t), torch.float32)
    torch.matmul(qf, keys.transpose(-1, -2), out=scores)
    scores.mul_(scaling).masked_fill_(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(_zero_if_neg_inf(lse)[..., None]).exp_()
    return torch.matmul(probs, values), lse


def _gather_float(scratch: AttendScratch, name: str, kv: Tensor, rows: Tensor,
                  shape: tuple[int, int, int]) -> Tensor:
    """``kv`` rows ``rows`` of the ``[Hkv * N, D]`` view, as float32 ``shape``."""
    raw = scratch.get("raw", (rows.numel(), kv.shape[-1]), kv.dtype)
    torch.index_select(kv.view(-1, kv.shape[-1]), 0, rows, out=raw)
    out = scratch.get(name, shape, torch.float32)
    out.view(-1, kv.shape[-1]).copy_(raw)
    return out


def attend_blocks(q: Tensor, k: Tensor, v: Tensor, blocks: Tensor, page_size: int,
                  scaling: float) -> tuple[Tensor, Tensor]:
    """Partial attention of ``q`` (``[B, Hq, D]``) over the tokens of ``blocks`` (``[B, Hkv,
    M]``) of a head-major K/V (``[Hkv, N, D]``), in float32: ``(out [B, Hq, Dv], lse [B, Hq])``.
    Grouped query heads share their kv head's blocks: every (request, kv head) is one item."""
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_q_heads // num_kv_heads
    heads = torch.arange(num_kv_heads, device=blocks.device).repeat(batch)
    out, lse = attend_items(q.reshape(batch * num_kv_heads, group, head_dim), k, v, heads,
                            blocks.reshape(batch * num_kv_heads, -1), page_size, scaling)
    return out.reshape(batch, num_q_heads, -1), lse.reshape(batch, num_q_heads)


# --------------------------------------------------------------------------------------------
# The priority scheduler
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """Seconds per attended token on each side, and per block moved host -> GPU. The CPU side
    is per worker thread: one task per thread and layer costs ``cpu_fixed_s`` (hand-off, batch
    assembly, result copy) plus ``cpu_s_per_token`` per attended token. Measure them on the
    machine (``calibrate_cpu_cost``, ``benchmarks/bench_fluxion.py``); the defaults are only a
    starting point for planning."""

    gpu_s_per_token: float = 2e-9
    cpu_s_per_token: float = 2e-7  # per CPU thread
    fetch_s_per_block: float = 1e-7
    cpu_fixed_s: float = 2e-5  # per CPU task (one per thread that has work in a layer)


@dataclass
class CooperativePlan:
    """Per (request, kv head) item: ``gpu_order`` lists the items largest GPU work first;
    ``cpu_items[t]`` the items CPU thread ``t`` attends (their misses); ``fetched`` the items
    whose misses go to the GPU instead. ``est_gpu_s`` / ``est_cpu_s``: the model's finish times
    (the CPU's with the scheduler's current correction)."""

    gpu_order: list[int]
    cpu_items: list[list[int]]
    fetched: list[int]
    est_gpu_s: float
    est_cpu_s: float
    cpu_mask: Tensor = field(default=None)  # [items] bool: misses attended by the CPU


class PriorityScheduler:
    """Assigns each step's misses to the CPU or to a fetch, keeping the CPU off the critical path.

    Items are (request, kv head) pairs with ``resident`` tokens on the GPU and ``missing`` tokens
    on the host. The GPU's work (its resident tokens, plus the tokens of every fetched miss set
    and their transfer) runs largest item first, so the tail of the GPU's queue is short items.
    Miss sets are offered to the CPU smallest first (they finish soonest and free the GPU of
    the fetch's fixed cost); each goes to the least-loaded CPU thread if that thread still
    finishes before the GPU's estimate with that item removed from the GPU, otherwise it and
    every larger one is fetched.

    The CPU estimate is corrected online: :meth:`observe` compares a plan's estimate with the
    CPU time the workers really took (contention between threads, the interpreter, memory
    bandwidth shared with the transfers are not in a calibration), and scales the CPU costs by
    a moving average of the ratio, so a CPU slower than modelled soon gets less work (or none)."""

    def __init__(self, cost: CostModel, cpu_threads: int, adapt: float = 0.5,
                 reprobe_every: int = 64) -> None:
        if cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0 (got {cpu_threads})")
        if not 0.0 <= adapt <= 1.0:
            raise ValueError(f"adapt must be in [0, 1] (got {adapt})")
        if reprobe_every < 1:
            raise ValueError(f"reprobe_every must be >= 1 (got {reprobe_every})")
        self.cost = cost
        self.cpu_threads = cpu_threads
        self.adapt = adapt
        self.reprobe_every = reprobe_every
        self.cpu_scale = 1.0  # observed / modelled CPU time, moving average
        self.last_gpu_s: Optional[float] = None  # the GPU's whole estimate at the last plan
        self._skipped = 0

    def worth_planning(self) -> bool:
        """Whether to plan this layer at all. A plan needs the step's miss counts on the host
        (a device sync per layer, ~1 ms on the H200, fluxion_h200.json), so it is skipped while
        it cannot give the CPU anything: when one CPU task's fixed cost alone exceeds the GPU's
        whole estimate at the last plan, no miss set can finish on the CPU before the GPU does
        (:meth:`plan` would fetch every one). The GPU's load changes, so every
        ``reprobe_every``-th skipped call plans again; a skipped layer fetches all its misses,
        which is what that plan would have said."""
        if self.cpu_threads == 0:
            return False
        if self.last_gpu_s is None or self.cost.cpu_fixed_s * self.cpu_scale <= self.last_gpu_s:
            return True
        self._skipped += 1
        if self._skipped >= self.reprobe_every:
            self._skipped = 0
            return True
        return False

    def observe(self, plan: CooperativePlan, cpu_seconds: float) -> None:
        """The CPU wall time the workers took for ``plan`` (e.g. ``future.cpu_seconds``)."""
        if plan.est_cpu_s > 0 and cpu_seconds > 0:
            ratio = cpu_seconds / plan.est_cpu_s  # est_cpu_s already includes cpu_scale
            self.cpu_scale *= (1.0 - self.adapt) + self.adapt * ratio

    def plan(self, resident: Tensor, missing: Tensor, page_size: int) -> CooperativePlan:
        """``resident``/``missing``: tokens per item (1-D, equal length)."""
        c = self.cost
        cpu_fixed = c.cpu_fixed_s * self.cpu_scale
        cpu_per_token = c.cpu_s_per_token * self.cpu_scale
        res = resident.tolist()
        miss = missing.tolist()
        n = len(res)

        def gpu_cost_of_miss(m: int) -> float:
            return m * c.gpu_s_per_token + (-(-m // page_size)) * c.fetch_s_per_block

        gpu_total = sum(r * c.gpu_s_per_token for r in res) + sum(gpu_cost_of_miss(m) for m in miss)
        self.last_gpu_s = gpu_total
        # (finish time, thread); a thread's first item also pays the task's fixed cost.
        threads = [(0.0, t) for t in range(self.cpu_threads)]
        heapq.heapify(threads)
        cpu_items: list[list[int]] = [[] for _ in range(self.cpu_threads)]
        on_cpu = [False] * n
        for i in sorted((i for i in range(n) if miss[i] > 0), key=lambda i: (miss[i], i)):
            if not threads:
                break
            load, t = threads[0]
            cpu_time = load + (0.0 if cpu_items[t] else cpu_fixed) + miss[i] * cpu_per_token
            gpu_after = gpu_total - gpu_cost_of_miss(miss[i])
            if cpu_time > gpu_after:
                break  # larger ones would take longer still
            heapq.heapreplace(threads, (cpu_time, t))
            cpu_items[t].append(i)
            on_cpu[i] = True
            gpu_total = gpu_after
        gpu_work = [res[i] + (0 if on_cpu[i] else miss[i]) for i in range(n)]
        order = sorted(range(n), key=lambda i: (-gpu_work[i], i))
        est_cpu = max((load for load, _ in threads), default=0.0)
        return CooperativePlan(
            gpu_order=order, cpu_items=cpu_items,
            fetched=[i for i in range(n) if miss[i] > 0 and not on_cpu[i]],
            est_gpu_s=gpu_total, est_cpu_s=est_cpu,
            cpu_mask=torch.tensor(on_cpu, dtype=torch.bool),
        )


# --------------------------------------------------------------------------------------------
# The CPU side
# --------------------------------------------------------------------------------------------


class HostAttentionWorkers:
    """CPU threads that attend miss sets from host memory while the GPU runs.

    :meth:`submit` takes the step's query (already on the host), the host K/V of the layer and
    the miss blocks per (request, kv head), with the plan's per-thread item lists; it returns a
    future of ``(out, lse)`` for the whole batch (items not given to the CPU: ``lse = -inf``),
    ready for ``merge_attention_states`` with the GPU's partial; once done, its ``cpu_seconds``
    is the wall time until the last thread finished (for :meth:`PriorityScheduler.observe`). Each thread
    attends all its items in one vectorised call (per-item calls cost more in interpreter
    overhead than the attention itself). torch releases the GIL inside its kernels, so the
    threads run in parallel; torch's intra-op thread count is process-wide, so the caller sets
    it (1 when the workers use the cores, as ``bench_fluxion.py`` does)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(threads, 0)
        self._pool = ThreadPoolExecutor(max_workers=max(self.threads, 1),
                                        thread_name_prefix="sglang_ext-coop",
                                        initializer=_one_intra_op_thread)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def submit(self, q: Tensor, host_k: Tensor, host_v: Tensor, miss_blocks: Tensor,
               plan: CooperativePlan, page_size: int, scaling: float) -> Future:
        tok, valid = block_token_index(miss_blocks, page_size)
        return self.submit_tokens(q, host_k, host_v, torch.where(valid, tok, -1), plan, scaling)

    def submit_tokens(self, q: Tensor, host_k: Tensor, host_v: Tensor, tokens: Tensor,
                      plan: CooperativePlan, scaling: float) -> Future:
        """:meth:`submit` with the host token slots each (request, kv head) attends
        (``[B, Hkv, T]``, ``-1`` padding) instead of whole blocks."""
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads = host_k.shape[0]
        group = num_q_heads // num_kv_heads
        out = torch.zeros(batch, num_kv_heads, group, host_v.shape[-1], dtype=torch.float32)
        lse = torch.full((batch, num_kv_heads, group), float("-inf"), dtype=torch.float32)
        q_items = q.reshape(batch * num_kv_heads, group, head_dim)
        tok_items = tokens.reshape(batch * num_kv_heads, -1)
        out_items, lse_items = out.view(batch * num_kv_heads, group, -1), lse.view(-1, group)

        def run(items: list[int]) -> None:
            idx = torch.tensor(items, dtype=torch.long)
            tok = tok_items[idx]
            o, s = attend_token_items(q_items[idx], host_k, host_v, idx % num_kv_heads,
                                      tok.clamp(min=0), tok >= 0, scaling,
                                      scratch=_thread_scratch())
            out_items[idx] = o
            lse_items[idx] = s

        result = (out.view(batch, num_q_heads, -1), lse.view(batch, num_q_heads))
        # One task per CPU thread's item list; the future completes when all have.
        return _Fanout(self._pool, [lambda items=items: run(items) for items in plan.cpu_items
                                    if items], result)


_local = threading.local()


def _thread_scratch() -> AttendScratch:
    """This worker thread's buffers (kept for the thread's life: the next step reuses them)."""
    if not hasattr(_local, "scratch"):
        _local.scratch = AttendScratch()
    return _local.scratch


def _one_intra_op_thread() -> None:
    """Each worker thread runs its ops on itself: the workers are the CPU's parallelism. Under
    OpenMP the intra-op thread count is per native thread, so without this every worker would
    start a full team of its own and oversubscribe the cores (the main thread's count is left
    as it is)."""
    torch.set_num_threads(1)


class _Fanout(Future):
    """A future that completes when every per-thread task is done (no extra thread waiting);
    ``cpu_seconds``: wall time from submission to the last task's end (queueing included)."""

    def __init__(self, pool: ThreadPoolExecutor, tasks: list, result: tuple[Tensor, Tensor]):
        super().__init__()
        self.cpu_seconds = 0.0
        self._t0 = time.perf_counter()
        self._pending = len(tasks)
        self._value = result
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        if not tasks:
            self.set_result(result)
        for task in tasks:
            pool.submit(task).add_done_callback(self._one_done)

    def _one_done(self, f: Future) -> None:
        with self._lock:  # callbacks run on the worker threads
            if f.exception() is not None:
                self._errors.append(f.exception())
            self._pending -= 1
            last = self._pending == 0
        if last:
            self.cpu_seconds = time.perf_counter() - self._t0
            if self._errors:
                self.set_exception(self._errors[0])
            else:
                self.set_result(self._value)


def calibrate_cpu_cost(workers: HostAttentionWorkers, host_k: Tensor, host_v: Tensor,
                       group: int, page_size: int, scaling: float, items_per_thread: int = 4,
                       blocks_per_item: tuple[int, int] = (4, 64), repeats: int = 5,
                       ) -> tuple[float, float]:
    """``(cpu_fixed_s, cpu_s_per_token)`` of the workers on this machine, measured the way a
    step uses them: every thread at once, each attending ``items_per_thread`` items of random
    host blocks; two item sizes give the fixed cost and the slope (medians, after a warm-up)."""
    num_kv_heads, tokens, head_dim = host_k.shape
    num_blocks = tokens // page_size
    threads = max(workers.threads, 1)
    batch = -(-threads * items_per_thread // num_kv_heads)  # item i: request i // Hkv, head i % Hkv
    items = batch * num_kv_heads
    q = torch.randn(batch, num_kv_heads * group, head_dim).to(host_k.dtype)
    gen = torch.Generator().manual_seed(0)
    plan = CooperativePlan(gpu_order=[], fetched=[], est_gpu_s=0.0, est_cpu_s=0.0,
                           cpu_items=[list(range(t, items, threads)) for t in range(threads)])
    seconds = []
    for m in blocks_per_item:
        blocks = torch.randint(0, num_blocks, (batch, num_kv_heads, m), generator=gen)
        times = []
        for _ in range(repeats + 1):  # the first is the warm-up
            fut = workers.submit(q, host_k, host_v, blocks, plan, page_size, scaling)
            fut.result()
            times.append(fut.cpu_seconds)
        seconds.append(sorted(times[1:])[len(times[1:]) // 2])
    items_per_thread = -(-items // threads)
    tok_small, tok_large = (m * page_size * items_per_thread for m in blocks_per_item)
    per_token = max((seconds[1] - seconds[0]) / (tok_large - tok_small), 0.0)
    fixed = max(seconds[0] - per_token * tok_small, 0.0)
    return fixed, per_token


def split_selection(selected: Tensor, resident: Tensor) -> tuple[Tensor, Tensor]:
    """``selected`` ``[B, Hkv, K]`` blocks (``-1`` padding) and a ``[B, Hkv, N]`` bool of the
    blocks resident on the GPU -> (resident part, miss part), each ``[B, Hkv, K]`` with ``-1``
    where the block belongs to the other part."""
    valid = selected >= 0
    here = valid & torch.gather(resident, 2, selected.long().clamp(min=0))
    none = torch.full_like(selected, -1)
    return torch.where(here, selected, none), torch.where(valid & ~here, selected, none)


def plan_split(selected: Tensor, resident: Tensor, scheduler: PriorityScheduler,
               page_size: int) -> tuple[CooperativePlan, Tensor, Tensor, Tensor]:
    """The step's split of ``selected`` (``[B, Hkv, K]``): ``(plan, resident part, the misses
    the CPU attends, the misses to fetch)``, block lists with ``-1`` elsewhere."""
    res_part, miss_part = split_selection(selected, resident)
    per_item = (res_part >= 0).sum(-1).flatten() * page_size
    miss_tokens = (miss_part >= 0).sum(-1).flatten() * page_size
    plan = scheduler.plan(per_item.cpu(), miss_tokens.cpu(), page_size)
    cpu_mask = plan.cpu_mask.to(selected.device).view(selected.shape[:2])[..., None]
    none = torch.full_like(miss_part, -1)
    return (plan, res_part, torch.where(cpu_mask, miss_part, none),
            torch.where(cpu_mask, none, miss_part))


def cooperative_attention(q: Tensor, dev_k: Tensor, dev_v: Tensor, dev_pages: Tensor,
                          host_k: Tensor, host_v: Tensor, selected: Tensor, resident: Tensor,
                          page_size: int, scaling: float, scheduler: PriorityScheduler,
                          workers: HostAttentionWorkers, fetch: Optional[Callable] = None,
                          ) -> tuple[Tensor, Tensor, Optional[CooperativePlan]]:
    """One layer's attention over exactly ``selected``: the GPU part over resident blocks (read
    through ``dev_pages`` ``[B, Hkv, N]``: block -> device page, for ``dev_k``/``dev_v``
    ``[Hkv, P, D]``), the CPU part over the planned misses from host memory, the rest fetched by
    ``fetch(miss_blocks, mask)`` (which must make them resident and map them in ``dev_pages``)
    before the GPU attends them. Returns ``(out, lse, plan)``; ``plan`` is None where the
    scheduler skipped planning (:meth:`PriorityScheduler.worth_planning`: every miss fetched)."""
    if not scheduler.worth_planning():
        res_part, gpu_misses = split_selection(selected, resident)
        if fetch is not None and bool((gpu_misses >= 0).any()):
            fetch(gpu_misses)
        pages = torch.gather(dev_pages, 2, selected.long().clamp(min=0))
        pages = torch.where(selected >= 0, pages, torch.full_like(pages, -1))
        out, lse = attend_blocks(q, dev_k, dev_v, pages, page_size, scaling)
        return out, lse, None
    plan, res_part, cpu_blocks, gpu_misses = plan_split(selected, resident, scheduler, page_size)
    # The CPU starts first (it needs q and its block lists on the host), then the GPU runs.
    future = workers.submit(q.cpu(), host_k, host_v, cpu_blocks.cpu(), plan, page_size, scaling)
    if fetch is not None and bool((gpu_misses >= 0).any()):
        fetch(gpu_misses)
    gpu_blocks = torch.where(gpu_misses >= 0, gpu_misses, res_part)
    pages = torch.gather(dev_pages, 2, gpu_blocks.long().clamp(min=0))
    pages = torch.where(gpu_blocks >= 0, pages, torch.full_like(pages, -1))
    gpu_out, gpu_lse = attend_blocks(q, dev_k, dev_v, pages, page_size, scaling)
    cpu_out, cpu_lse = future.result()
    scheduler.observe(plan, future.cpu_seconds)
    out, lse = merge_attention_states(gpu_out, gpu_lse, cpu_out.to(gpu_out.device),
                                      cpu_lse.to(gpu_lse.device))
    return out, lse, plan
