"""Tensor parallelism (``--tp N``): which kv heads a rank owns, and the decisions ranks share.

Under ``--tp N`` every rank runs its own scheduler, KV pool and attention backend over its share
of the kv heads (SGLang's ``QKVParallelLinear`` split). Our work splits the same way: a rank
scores, selects and transfers only its own kv heads, so label channels are sliced to them and
each rank's host tier stores only its heads.

What the scheduler sees must be identical on every rank, because each rank's scheduler decides
alone and ranks that disagree (one admits a request the other cannot hold) deadlock in the next
collective. The tier's capacities depend on measured host memory, which differs between ranks
that measure at different moments, so they are agreed on with an all-reduce of the minimum (as
SGLang does for its own profiled GPU capacity). Every other scheduler-visible decision of ours
(working-area pages, placement on the GPU or the host) is a function of the allocator's logical
slots, which SGLang hands out identically on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttnTP:
    size: int
    rank: int


def attn_tp() -> AttnTP:
    """This process's attention-TP size and rank (1, 0 outside a distributed SGLang)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return AttnTP(int(parallel.attn_tp_size), int(parallel.attn_tp_rank))
    except Exception:  # no parallel state (tests, tools): a single rank
        return AttnTP(1, 0)


def world_size() -> int:
    """Processes of this server that each build a KV pool (TP x PP x DP ranks)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def rank_kv_heads(total: int, size: int, rank: int) -> range:
    """The global kv-head indices rank ``rank`` of ``size`` holds: a contiguous slice when the
    heads divide among the ranks, else one head replicated over ``size // total`` ranks (what
    SGLang's QKVParallelLinear does)."""
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} outside 0..{size - 1}")
    if size >= total:
        if size % total:
            raise ValueError(f"--tp {size} does not replicate {total} kv heads evenly")
        head = rank // (size // total)
        return range(head, head + 1)
    if total % size:
        raise ValueError(f"{total} kv heads do not divide among --tp {size} ranks")
    per_rank = total // size
    return range(rank * per_rank, (rank + 1) * per_rank)


def agree_min(values: list[int]) -> list[int]:
    """Element-wise minimum of ``values`` over every rank of the server (unchanged with one
    rank). Uses SGLang's CPU (gloo) world group, so it costs no GPU work."""
    if world_size() <= 1:
        return list(values)
    from sglang.srt.distributed.parallel_state import get_world_group

    t = torch.tensor(values, dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN,
                                 group=get_world_group().cpu_group)
    return [int(x) for x in t.tolist()]
