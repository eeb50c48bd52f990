"""The sparse decode attention stage alone (kernels/sparse_attention.py): its launch variants
side by side at the serving runs' shapes, to pick the defaults.

The e2e profiles put the stage at 2.36 ms per decode step for 17 requests x 36 layers of
Qwen3-8B shapes (32 query / 8 kv heads, 128 dims, 2048 selected tokens per kv head), about 1.1
TB/s of the K/V rows it reads: a quarter of the H200's HBM rate. Each variant is timed on one
layer, with the selection shaped as the two-level selection makes it (whole 32-token blocks
kept, about half of each block's tokens picked), against its bytes floor (the K and V rows read
at 4.8 TB/s). Variants: the programs per SM the split count aims for, V gathered beside K, and
padding tiles branched over or run masked. Every variant's output is checked against the
default's.

    python benchmarks/bench_sparse_attention.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_transfer import gpu_time_ms  # noqa: E402
from benchmarks.results_io import git_commit, gpu_name, write_results  # noqa: E402

HBM_TBPS = 4.8  # H200 HBM3e peak, for the bytes floor


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--batches", default="4,17,30")
    p.add_argument("--selected", type=int, default=2048, help="slots per (request, kv head)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--pool-tokens", type=int, default=640_000, help="one layer's KV slots")
    p.add_argument("--programs-per-sm", default="2,8")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    return p.parse_args(argv)


def two_level_selection(torch, batch: int, num_kv_heads: int, selected: int, block_size: int,
                        pool_tokens: int, gen) -> "torch.Tensor":
    """``[B, Hkv, selected]`` int32 slots: each request owns a disjoint range of the pool; per
    kv head, ``selected / (block_size / 2)`` distinct blocks of it, half of each block's
    tokens, in slot order."""
    per_block = block_size // 2
    blocks = selected // per_block
    pages_per_req = pool_tokens // block_size // batch
    stride = pages_per_req // blocks  # one block from each of `blocks` equal strata: distinct
    strata = torch.arange(blocks) * stride
    page = strata + torch.randint(0, stride, (batch, num_kv_heads, blocks), generator=gen)
    page = page + (torch.arange(batch) * pages_per_req)[:, None, None]
    offs = torch.rand(batch, num_kv_heads, blocks, block_size, generator=gen).argsort(-1)
    offs = offs[..., :per_block].sort(-1).values
    slots = page[..., None] * block_size + offs
    return slots.reshape(batch, num_kv_heads, -1).to(torch.int32)


def run(args: argparse.Namespace) -> dict:
    import torch

    from sglang_ext.kernels import sparse_attention as sa

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = 32, 8, 128
    k = torch.randn(args.pool_tokens, hkv, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    rows = []
    failures = []
    variants = [dict(programs_per_sm=int(p), early_v=e, skip_pad_tiles=s)
                for p, e, s in itertools.product(args.programs_per_sm.split(","),
                                                 (False, True), (True, False))]
    for batch in (int(b) for b in args.batches.split(",")):
        q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
        sel = two_level_selection(torch, batch, hkv, args.selected, args.block_size,
                                  args.pool_tokens, gen).cuda()
        floor_ms = batch * hkv * args.selected * d * 2 * 2 / (HBM_TBPS * 1e12) * 1e3
        want = None
        for var in variants:
            splits = sa.default_num_splits(batch, hkv, args.selected, "cuda",
                                           programs_per_sm=var["programs_per_sm"])

            def call(var=var, splits=splits):
                return sa.sparse_attention_batched(q, k, v, sel, d ** -0.5, num_splits=splits,
                                                   early_v=var["early_v"],
                                                   skip_pad_tiles=var["skip_pad_tiles"])

            got, _ = call()
            if want is None:
                want = got.float()
            err = (got.float() - want).abs().max().item()
            if err > 2e-2:
                failures.append(f"batch {batch} {var}: max |diff| {err:.3g} vs the first variant")
            ms = gpu_time_ms(torch, call, args.iters, args.warmup)
            row = dict(batch=batch, splits=splits, **var, ms=ms, floor_ms=floor_ms,
                       tbps=floor_ms / ms * HBM_TBPS, max_abs_diff=err,
                       is_default=(var["programs_per_sm"] == sa.PROGRAMS_PER_SM
                                   and var["early_v"] == sa.DEFAULT_EARLY_V
                                   and var["skip_pad_tiles"] == sa.DEFAULT_SKIP_PAD_TILES))
            rows.append(row)
            print(f"B={batch:3d} splits {splits:2d} {var}: {ms * 1e3:7.1f} us "
                  f"({row['tbps']:.2f} TB/s, floor {floor_ms * 1e3:.1f} us)", flush=True)
    return dict(rows=rows, failures=failures)


def variant_name(row: dict) -> str:
    return (f"{row['programs_per_sm']}/SM{' earlyV' if row['early_v'] else ''}"
            f"{' branch' if row['skip_pad_tiles'] else ' masked'}")


def plot(rows: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(variant_name(r) for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ys = [next(r["tbps"] for r in rows if r["batch"] == b and variant_name(r) == name)
              for b in batches]
        ax.bar([j + i * width for j in range(len(batches))], ys, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))],
                  [f"batch {b}" for b in batches])
    ax.set_ylabel("K/V bytes read / time (TB/s)")
    ax.axhline(HBM_TBPS, ls="--", color="gray", label="HBM peak")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "sparse_attention_h200.json")
    meta = dict(commit=git_commit(), gpu=gpu_name(),
                config=dict(q_heads=32, kv_heads=8, head_dim=128, dtype="bf16",
                            selected=args.selected, block_size=args.block_size,
                            pool_tokens=args.pool_tokens, iters=args.iters,
                            selection="half the tokens of selected/(block_size/2) blocks"),
                failures=result["failures"])
    write_results(path, result["rows"], meta)
    plot(result["rows"], path[:-5] + ".png",
         f"{meta['gpu']}: sparse decode attention, one layer, Qwen3-8B heads, "
         f"{args.selected} slots per kv head")
    print(f"wrote {path}; {'checks passed' if not result['failures'] else result['failures']}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
