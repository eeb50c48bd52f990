"""Tensor parallelism on the CPU: each rank's share of kv heads and label channels, and the
capacities every rank must agree on (two gloo processes stand in for two GPUs' ranks).

The served run with ``--tp 2`` needs two GPUs (benchmarks/e2e_serving.py --tp 2 on the
nvidia-h200-x2 device kind); SmolLM2's 3 kv heads do not divide between 2 ranks.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from benchmarks.ports import free_port
from sglang_ext import tensor_parallel
from sglang_ext.config import build_config
from sglang_ext.selection.calibrate import FORMAT, dumps_label_config
from sglang_ext.tensor_parallel import AttnTP, rank_kv_heads

LAYERS, KV_HEADS, HEAD_DIM, CHANNELS = 2, 8, 16, 4


@pytest.mark.parametrize("total,size,expected", [
    (8, 1, [range(0, 8)]),
    (8, 2, [range(0, 4), range(4, 8)]),
    (8, 8, [range(h, h + 1) for h in range(8)]),
    # fewer kv heads than ranks: SGLang replicates each head over size // total ranks
    (2, 4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),
])
def test_rank_kv_heads_splits_like_sglang(total: int, size: int, expected: list[range]) -> None:
    assert [rank_kv_heads(total, size, r) for r in range(size)] == expected


@pytest.mark.parametrize("total,size,rank", [(8, 3, 0), (3, 4, 0), (8, 2, 2)])
def test_rank_kv_heads_rejects_uneven_splits(total: int, size: int, rank: int) -> None:
    with pytest.raises(ValueError):
        rank_kv_heads(total, size, rank)


def _label_file(tmp_path: Path) -> Path:
    # channel c of (layer l, head h) encodes (l, h) so a slice shows whose channels it holds
    channels = [[[(l * KV_HEADS + h + c) % HEAD_DIM for c in range(CHANNELS)]
                 for h in range(KV_HEADS)] for l in range(LAYERS)]
    payload = {"format": FORMAT, "label_channels": CHANNELS,
               "model": {"num_layers": LAYERS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM},
               "channels": channels}
    path = tmp_path / "labels.json"
    path.write_text(dumps_label_config(payload))
    return path


@pytest.mark.parametrize("size", [1, 2, 4])
def test_each_rank_loads_the_label_channels_of_its_own_kv_heads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    from sglang_ext.attention import side_buffers

    path = _label_file(tmp_path)
    full = torch.tensor(json.loads(path.read_text())["channels"])
    runner = SimpleNamespace(
        device="cpu",
        model_config=SimpleNamespace(num_hidden_layers=LAYERS, head_dim=HEAD_DIM,
                                     v_head_dim=HEAD_DIM, get_total_num_kv_heads=lambda: KV_HEADS))
    cfg = build_config(label_config=str(path), label_channels=CHANNELS)
    pieces = []
    for rank in range(size):
        monkeypatch.setattr(side_buffers, "attn_tp", lambda rank=rank: AttnTP(size, rank))
        got = side_buffers.ModelFiles.load(runner, cfg).label_channels
        assert got.shape == (LAYERS, KV_HEADS // size, CHANNELS)
        pieces.append(got)
    assert torch.equal(torch.cat(pieces, dim=1), full)


def _rank_main(rank: int, port: int, results: "mp.Queue") -> None:
    """One rank: SGLang's world group over gloo, then the decisions that must agree."""
    from sglang.srt.distributed.parallel_state import init_distributed_environment

    init_distributed_environment(backend="gloo", world_size=2, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    import sglang_ext.config as config
    from sglang_ext.patches.kv_cache_configurator import host_tokens_per_rank

    # The ranks measure different free host memory (rank 1 measured after rank 0 pinned).
    config._available_host_gb = lambda: 100.0 if rank == 0 else 60.0
    auto = host_tokens_per_rank(build_config(), bytes_per_token=1000)
    fixed = host_tokens_per_rank(build_config(tier_host_gb=8.0), bytes_per_token=1000)
    results.put((rank, tensor_parallel.world_size(),
                 tensor_parallel.agree_min([10 + rank, 5 - rank]), auto, fixed))
    # leave together: a rank that exits while its peer still holds the gloo connection may
    # abort the peer at exit
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def test_ranks_agree_on_the_tier_capacity() -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (_, ws0, min0, auto0, fixed0), (_, ws1, min1, auto1, fixed1) = got
    assert ws0 == ws1 == 2
    assert min0 == min1 == [10, 4]
    # auto: half of the smaller measurement, split between the two ranks
    assert auto0 == auto1 == int(60.0 * 0.5 * 1e9) // 2 // 1000
    # a fixed size is the server's total: each rank pins half
    assert fixed0 == fixed1 == int(8e9) // 2 // 1000


def test_one_rank_keeps_the_whole_host_tier() -> None:
    from sglang_ext.patches.kv_cache_configurator import host_tokens_per_rank

    assert host_tokens_per_rank(build_config(tier_host_gb=8.0), bytes_per_token=1000) == 8_000_000
