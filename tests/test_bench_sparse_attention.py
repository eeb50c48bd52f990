"""benchmarks/bench_sparse_attention.py's selection shape and plot (the timing needs a GPU)."""

from pathlib import Path

import torch

from benchmarks.bench_sparse_attention import plot, two_level_selection


def test_selection_is_half_of_each_kept_block_distinct_and_inside_its_request():
    gen = torch.Generator().manual_seed(1)
    batch, hkv, selected, bs, pool = 3, 2, 256, 32, 3 * 64 * 32
    sel = two_level_selection(torch, batch, hkv, selected, bs, pool, gen)
    assert sel.shape == (batch, hkv, selected) and sel.dtype == torch.int32
    per_req = pool // batch
    for b in range(batch):
        for g in range(hkv):
            row = sel[b, g].long()
            assert row.unique().numel() == selected  # distinct slots
            assert (row // per_req == b).all()  # the request's own pages
            pages, counts = (row // bs).unique(return_counts=True)
            assert pages.numel() == selected // (bs // 2) and (counts == bs // 2).all()


def test_plot_writes_one_bar_per_variant(tmp_path: Path):
    rows = [dict(batch=b, programs_per_sm=p, early_v=e, skip_pad_tiles=True, tbps=1.0 + p)
            for b in (4, 17) for p in (2, 8) for e in (False, True)]
    plot(rows, str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").stat().st_size > 0
