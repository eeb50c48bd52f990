"""benchmarks/bench_sparse_attention.py's selection shape and plot (the timing needs a GPU)."""

from pathlib import Path

import torch

from benchmarks.bench_sparse_attention import (
    attention_variants,
    best_by_case,
    block_score_variants,
    parse_args,
    plot,
    two_level_selection,
    variant_name,
)


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


def _rows() -> list[dict]:
    rows = []
    for stage in ("attention", "block_scores"):
        for b in (4, 17):
            for i, ms in enumerate((3.0, 1.0, 2.0)):
                var = (dict(programs_per_sm=2 + i, block_n=64, num_warps=4, num_stages=2,
                            early_v=False) if stage == "attention"
                       else dict(block_nb=32 << i, num_warps=4, num_stages=2))
                rows.append(dict(stage=stage, batch=b, **var, ms=ms * b, tbps=1 / ms,
                                 is_default=i == 0))
    return rows


def test_best_by_case_names_the_fastest_variant_and_its_gain_over_the_default():
    cases = best_by_case(_rows())
    assert [(c["stage"], c["batch"]) for c in cases] == [
        ("attention", 4), ("attention", 17), ("block_scores", 4), ("block_scores", 17)]
    att = cases[0]
    assert att["best"].startswith("3/SM") and att["best_ms"] == 4.0 and att["gain"] == 3.0
    assert cases[2]["best"].startswith("nb64")


def test_variant_grid_is_the_product_of_the_options():
    args = parse_args(["--programs-per-sm", "2,8", "--block-n", "64", "--warps", "4,8",
                       "--num-stages", "2", "--early-v", "0,1", "--skip-pad-tiles", "0,1"])
    grid = attention_variants(args)
    assert len(grid) == 16 and len({tuple(sorted(v.items())) for v in grid}) == 16
    assert {v["skip_pad_tiles"] for v in grid} == {False, True}
    scores = block_score_variants(parse_args(["--block-nb", "32,64", "--warps", "4",
                                              "--score-stages", "3",
                                              "--score-precisions", "auto,tc,tc_fp16"]))
    assert len(scores) == 6 and {v["precision"] for v in scores} == {None, "tc", "tc_fp16"}
    assert variant_name(dict(stage="block_scores", **scores[-1])).endswith(" tc_fp16")


def test_plot_writes_one_panel_per_stage(tmp_path: Path):
    plot(_rows(), str(tmp_path / "p.png"), "t")
    assert (tmp_path / "p.png").stat().st_size > 0


def test_topk_rows_are_named_by_digit_width_and_warps():
    row = dict(stage="block_topk", batch=10, radix_bits=6, num_warps=16, ms=0.02, tbps=0.1,
               is_default=False)
    assert variant_name(row) == "radix6 w16"
    assert best_by_case([row])[0]["best"] == "radix6 w16"


def test_latency_stages_are_plotted_in_time_under_their_own_title(tmp_path: Path):
    from benchmarks.bench_sparse_attention import plot_title

    rows = [dict(stage="kv_write", batch=10, path=p, ms=ms, floor_ms=0.0, tbps=0.0,
                 is_default=p == "unfused") for p, ms in (("unfused", 0.57), ("fused", 0.11))]
    assert best_by_case(rows)[0]["best"] == "fused"
    plot(rows, str(tmp_path / "k.png"), plot_title(parse_args(["--stages", "kv_write"]), "G"))
    assert (tmp_path / "k.png").stat().st_size > 0
    assert "KV write" in plot_title(parse_args(["--stages", "kv_write"]), "G")
    assert "one layer" in plot_title(parse_args([]), "G")
