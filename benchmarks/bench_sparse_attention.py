"""Two decode stages alone, their launch variants side by side at the serving runs' shapes, to
pick the defaults: the sparse attention (kernels/sparse_attention.py) and the Quest block scores
(kernels/block_scores.py).

The e2e profiles put the attention at 2.36 ms per decode step for 17 requests x 36 layers of
Qwen3-8B shapes (32 query / 8 kv heads, 128 dims, 2048 selected tokens per kv head) and the
block scores at 2.02 ms (16-token blocks of 32k contexts). Each variant is timed on one layer,
captured in a CUDA graph, L2 flushed before every timed replay (bench_operator's Timer: a
step's next layer reads other memory), against its bytes floor at 4.8 TB/s. The attention's
selection is shaped as the two-level selection makes it (whole blocks kept, about half of each
block's tokens picked); its variants: the programs per SM the split count aims for, slots per
tile, warps, pipeline stages, V gathered beside K. The block scores' variants: blocks per
program, warps, stages, over the pages of contiguous 32k requests. Every variant's output is
checked against the default's.

    python benchmarks/bench_sparse_attention.py --out benchmarks/results/kernels
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_operator import Timer  # noqa: E402
from benchmarks.results_io import git_commit, gpu_name, write_results  # noqa: E402

HBM_TBPS = 4.8  # H200 HBM3e peak, for the bytes floor
HQ, HKV, HEAD_DIM = 32, 8, 128  # Qwen3-8B


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "kernels"))
    p.add_argument("--results-name", default="sparse_attention_h200",
                   help="results file name (.json, .png beside it) in --out")
    p.add_argument("--stages", default="attention,block_scores",
                   help="comma-separated: attention, block_scores, topk (the block and token "
                        "top-k), kv_write (a decode step's KV write, fused or not)")
    p.add_argument("--batches", default="4,17,30")
    p.add_argument("--selected", type=int, default=2048, help="slots per (request, kv head)")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--context", type=int, default=32768, help="block scores: tokens per request")
    p.add_argument("--max-context", type=int, default=None,
                   help="block scores: the static context the grid covers (a server's "
                        "--context-length; default --context)")
    p.add_argument("--pool-tokens", type=int, default=640_000, help="one layer's KV slots")
    p.add_argument("--programs-per-sm", default="2,4,8")
    p.add_argument("--block-n", default="32,64,128", help="attention: slots per tile")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--num-stages", default="2,3")
    p.add_argument("--early-v", default="0,1")
    p.add_argument("--skip-pad-tiles", default="1",
                   help="attention: 1 = branch over padding-only tiles (which keeps Triton from "
                        "pipelining the loop's loads), 0 = masked loads only")
    p.add_argument("--block-nb", default="32,64,128", help="block scores: blocks per program")
    p.add_argument("--score-stages", default="2,3,4")
    p.add_argument("--heads-per-program", default="1",
                   help="block scores: kv heads per program (divisors of 8)")
    p.add_argument("--heads-fastest", default="0",
                   help="block scores: 1 = kv heads the grid's fastest dimension")
    p.add_argument("--skip-dead-tiles", default="1",
                   help="block scores: 1 = stop at each request's last block, 0 = compute the "
                        "whole static grid masked")
    p.add_argument("--summary-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="block scores: the page summaries' storage (fp8: "
                        "--sparse-summary-dtype fp8_e4m3, one byte per value)")
    p.add_argument("--summary-layouts", default="page",
                   help="block scores: how the summaries are stored, comma-separated: page "
                        "([pages, Hkv, D], a page's heads adjacent) and/or head ([Hkv, pages, "
                        "D], a head's consecutive pages adjacent)")
    p.add_argument("--score-precisions", default="auto",
                   help="block scores: how the bound is computed, comma-separated: auto (what "
                        "the kernel picks: tc for bf16, tc_fp16 for fp8 summaries), tc, "
                        "tc_fp16, fma, ieee")
    p.add_argument("--tiles-per-program", default="1",
                   help="block scores: consecutive tiles per program (a pipelined loop)")
    p.add_argument("--topk-radix-bits", default="6,7,8",
                   help="top-k stages: digit widths of the radix select")
    p.add_argument("--topk-warps", default="4,8,16,32", help="top-k stages: warps per row")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
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


def attention_variants(args: argparse.Namespace) -> list[dict]:
    return [dict(programs_per_sm=p, block_n=n, num_warps=w, num_stages=st, early_v=bool(e),
                 skip_pad_tiles=bool(sk))
            for p, n, w, st, e, sk in itertools.product(
                _ints(args.programs_per_sm), _ints(args.block_n), _ints(args.warps),
                _ints(args.num_stages), _ints(args.early_v), _ints(args.skip_pad_tiles))]


def block_score_variants(args: argparse.Namespace) -> list[dict]:
    return [dict(block_nb=n, num_warps=w, num_stages=st, heads_per_program=h,
                 heads_fastest=bool(f), tiles_per_program=t, skip_dead_tiles=bool(sd),
                 summary_layout=lay, precision=None if prec == "auto" else prec)
            for n, w, st, h, f, t, sd, lay, prec in itertools.product(
                _ints(args.block_nb), _ints(args.warps), _ints(args.score_stages),
                _ints(args.heads_per_program), _ints(args.heads_fastest),
                _ints(args.tiles_per_program), _ints(args.skip_dead_tiles),
                args.summary_layouts.split(","), args.score_precisions.split(","))]


def _timed_rows(timer, stage: str, batch: int, variants: list[dict], build, floor_ms: float,
                default: dict, failures: list[str]) -> list[dict]:
    """One row per variant: ``build(variant)`` gives the call; its output is compared with the
    default variant's (run first)."""
    rows = []
    ordered = [default] + [v for v in variants if v != default]
    want = None
    from sglang_ext.progress import progress

    for var in progress(ordered, desc=f"{stage} B={batch}", unit="variant", leave=False):
        fn = build(var)
        try:
            run = timer.capture(fn)
            ms = timer.time_ms(run)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported
            failures.append(f"{stage} batch {batch} {var}: {type(exc).__name__}: {exc}"[:300])
            continue
        got = fn()
        got = (got[0] if isinstance(got, tuple) else got).float()
        if want is None:
            want = got
        finite = want.isfinite()
        err = (got[finite] - want[finite]).abs().max().item() if finite.any() else 0.0
        if err > 2e-2 or not (got.isfinite() == finite).all():
            failures.append(f"{stage} batch {batch} {var}: max |diff| {err:.3g} vs the default")
        row = dict(stage=stage, batch=batch, **var, ms=ms, floor_ms=floor_ms,
                   tbps=floor_ms / ms * HBM_TBPS, max_abs_diff=err, is_default=var == default)
        rows.append(row)
        print(f"{stage} B={batch:3d} {var}: {ms * 1e3:7.1f} us ({row['tbps']:.2f} TB/s, floor "
              f"{floor_ms * 1e3:.1f} us){'  default' if row['is_default'] else ''}", flush=True)
    return rows


def run_attention(torch, args, timer, failures: list[str]) -> list[dict]:
    from sglang_ext.kernels import sparse_attention as sa

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(args.pool_tokens, HKV, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch in _ints(args.batches):
        default = dict(programs_per_sm=sa.default_programs_per_sm(batch * HKV, sms), block_n=64,
                       num_warps=sa.DEFAULT_NUM_WARPS, num_stages=sa.DEFAULT_NUM_STAGES,
                       early_v=sa.DEFAULT_EARLY_V, skip_pad_tiles=sa.DEFAULT_SKIP_PAD_TILES)
        q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        sel = two_level_selection(torch, batch, HKV, args.selected, args.block_size,
                                  args.pool_tokens, gen).cuda()
        floor_ms = batch * HKV * args.selected * HEAD_DIM * 2 * 2 / (HBM_TBPS * 1e12) * 1e3

        def build(var):
            splits = sa.default_num_splits(batch, HKV, args.selected, "cuda",
                                           programs_per_sm=var["programs_per_sm"],
                                           block_n=var["block_n"])
            return lambda: sa.sparse_attention_batched(
                q, k, v, sel, HEAD_DIM ** -0.5, num_splits=splits, early_v=var["early_v"],
                skip_pad_tiles=var["skip_pad_tiles"],
                block_n=var["block_n"], num_warps=var["num_warps"],
                num_stages=var["num_stages"])

        rows += _timed_rows(timer, "attention", batch, attention_variants(args), build,
                            floor_ms, default, failures)
    del k, v
    return rows


def run_block_scores(torch, args, timer, failures: list[str]) -> list[dict]:
    from sglang_ext.kernels import block_scores as bsc

    bs, ctx = args.block_size, args.context
    max_ctx = max(args.max_context or ctx, ctx)
    max_blocks = -(-max_ctx // bs)  # the static grid, as the server's workspace sizes it
    rows = []
    for batch in _ints(args.batches):
        # what quest_block_scores_batched picks by itself for bf16 summaries on tensor cores
        nb = bsc.tc_block_nb(torch.float8_e4m3fn if args.summary_dtype == "fp8"
                             else torch.bfloat16)
        default = dict(block_nb=nb, num_warps=4, num_stages=bsc.TC_NUM_STAGES,
                       heads_per_program=bsc.HEADS_PER_PROGRAM, heads_fastest=bsc.HEADS_FASTEST,
                       tiles_per_program=bsc.default_tiles_per_program(
                           batch, HKV // bsc.HEADS_PER_PROGRAM, -(-max_blocks // nb), "cuda"),
                       skip_dead_tiles=True, summary_layout="page", precision=None)
        pages = batch * -(-ctx // bs)
        kmin = torch.randn(pages, HKV, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        kmax = kmin + torch.rand_like(kmin)
        value_bytes = 2
        if args.summary_dtype == "fp8":
            from sglang_ext.selection.reference import round_summaries

            kmin, kmax = (x.to(torch.float8_e4m3fn) for x in round_summaries(
                kmin.float(), kmax.float(), "fp8_e4m3"))
            value_bytes = 1
        # each request's pages contiguous, as after a fresh prefill; columns past ctx unused
        req_to_token = torch.zeros(batch, max_ctx, dtype=torch.int32, device="cuda")
        req_to_token[:, :ctx] = torch.arange(batch * ctx, dtype=torch.int32,
                                             device="cuda").view(batch, ctx)
        rows_idx = torch.arange(batch, dtype=torch.int64, device="cuda")
        seq_lens = torch.full((batch,), ctx, dtype=torch.int64, device="cuda")
        q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        floor_ms = pages * HKV * HEAD_DIM * 2 * value_bytes / (HBM_TBPS * 1e12) * 1e3

        # the same values stored head-major, seen through [pages, Hkv, D] views
        layouts = {"page": (kmin, kmax)}
        if "head" in args.summary_layouts.split(","):
            layouts["head"] = tuple(x.permute(1, 0, 2).contiguous().permute(1, 0, 2)
                                    for x in (kmin, kmax))

        def build(var):
            lo, hi = layouts[var["summary_layout"]]
            return lambda: bsc.quest_block_scores_batched(
                q, lo, hi, req_to_token, rows_idx, seq_lens, bs, 16, 64, max_blocks,
                block_nb=var["block_nb"], num_warps=var["num_warps"],
                num_stages=var["num_stages"], heads_per_program=var["heads_per_program"],
                heads_fastest=var["heads_fastest"],
                tiles_per_program=var["tiles_per_program"],
                skip_dead_tiles=var["skip_dead_tiles"], precision=var["precision"])

        rows += _timed_rows(timer, "block_scores", batch, block_score_variants(args), build,
                            floor_ms, default, failures)
        del kmin, kmax, req_to_token, layouts
    return rows


def run_topk(torch, args, timer, failures: list[str]) -> list[dict]:
    """The two top-k of the two-level selection at the serving shapes, one row per (request,
    kv head): the block top-k over the static grid's blocks (the request's live, the rest
    -inf), k = the automatic filter's blocks; the token top-k over those blocks' tokens,
    k = the budget's middle. Latency bound (one program per row): the floor printed is the
    rows' bytes at HBM speed."""
    from sglang_ext.config import build_config
    from sglang_ext.kernels.topk import topk_launch_config, topk_masked

    bs, ctx = args.block_size, args.context
    max_blocks = -(-max(args.max_context or ctx, ctx) // bs)
    cfg = build_config(budget=args.selected, block_size=bs, sink=16, window=64)
    k_blocks = cfg.effective_candidate_blocks
    shapes = {"block_topk": (max_blocks, -(-ctx // bs), k_blocks),
              "token_topk": (k_blocks * bs, k_blocks * bs, args.selected - 16 - 64)}
    rows = []
    for stage, (n, live, k) in shapes.items():
        for batch in _ints(args.batches):
            scores = torch.full((batch, HKV, n), float("-inf"), device="cuda")
            scores[..., :live] = torch.randn(batch, HKV, live, device="cuda")
            out = torch.empty(batch, HKV, k, dtype=torch.int32, device="cuda")
            default = dict(radix_bits=8, num_warps=topk_launch_config(n, k)["num_warps"])
            variants = [dict(radix_bits=b, num_warps=w) for b, w in itertools.product(
                _ints(args.topk_radix_bits), _ints(args.topk_warps))]

            def build(var, scores=scores, k=k, out=out):
                return lambda: topk_masked(scores, k, out=out, radix_bits=var["radix_bits"],
                                           num_warps=var["num_warps"])

            floor_ms = batch * HKV * n * 4 / (HBM_TBPS * 1e12) * 1e3
            rows += _timed_rows(timer, stage, batch, variants, build, floor_ms, default, failures)
    return rows


def run_kv_write(torch, args, timer, failures: list[str]) -> list[dict]:
    """A decode step's KV write over all 36 layers, in one CUDA graph: SGLang's
    set_kv_buffer (on an fp8 cache: two casts and the store) + rounding the keys to the cache
    + the summary and label kernels (the unfused path), against kernels/decode_write.py's one
    launch per layer; fp8 cache, fp8 summaries and labels (16 channels), one token per
    request on its own page. Every variant must leave the same cache bytes."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool

    from sglang_ext.kernels.block_summary import allocate_block_summaries, update_block_summaries
    from sglang_ext.kernels.decode_write import FP8_KV, write_decode_kv
    from sglang_ext.kernels.label_cache import allocate_label_cache, update_label_cache
    from sglang_ext.selection.params import FP8_SUMMARIES

    layers, bs, r, slots = 36, args.block_size, 16, 1 << 16
    pool = MHATokenToKVPool(size=slots, page_size=bs, dtype=FP8_KV, head_num=HKV,
                            head_dim=HEAD_DIM, layer_num=layers, device="cuda",
                            enable_memory_saver=False)
    side = [allocate_block_summaries(slots + bs, HKV, HEAD_DIM, bs, "cuda", FP8_SUMMARIES)
            for _ in range(layers)]
    labels = [allocate_label_cache(slots + bs, HKV, r, "cuda", FP8_KV) for _ in range(layers)]
    channels = torch.stack([torch.randperm(HEAD_DIM)[:r] for _ in range(HKV)]).cuda()
    rows = []
    for batch in _ints(args.batches):
        loc = (torch.randperm(slots // bs - 1)[:batch] + 1).cuda() * bs + 3
        keys = [torch.randn(batch, HKV, HEAD_DIM, device="cuda").bfloat16()
                for _ in range(layers)]
        values = [torch.randn_like(k) for k in keys]

        def step(fused: bool):
            for i in range(layers):
                if fused:
                    write_decode_kv(keys[i], values[i], loc, pool.get_key_buffer(i),
                                    pool.get_value_buffer(i), *side[i], bs, labels[i], channels)
                    continue
                pool.set_kv_buffer(SimpleNamespace(layer_id=i), KVWriteLoc(loc, None),
                                   keys[i], values[i])
                rounded = keys[i].to(FP8_KV).to(torch.bfloat16)
                update_block_summaries(*side[i], rounded, loc, bs)
                update_label_cache(labels[i], rounded, loc, channels)
            return pool.get_key_buffer(layers - 1).view(torch.uint8)[loc].float()

        def build(var):
            return lambda: step(var["path"] == "fused")

        rows += _timed_rows(timer, "kv_write", batch,
                            [dict(path="unfused"), dict(path="fused")], build, 0.0,
                            dict(path="unfused"), failures)
    return rows


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.manual_seed(0)
    timer = Timer(torch, args.warmup, args.iters, graphs=True)
    rows: list[dict] = []
    failures: list[str] = []
    runners = {"attention": run_attention, "block_scores": run_block_scores,
               "topk": run_topk, "kv_write": run_kv_write}
    for stage in args.stages.split(","):
        if stage not in runners:
            raise SystemExit(f"unknown stage {stage!r} (one of {', '.join(runners)})")
        rows += runners[stage](torch, args, timer, failures)
        timer.release()
    return dict(rows=rows, failures=failures)


def variant_name(row: dict) -> str:
    if row.get("stage") == "kv_write":
        return row["path"]
    if row.get("stage", "").endswith("_topk"):
        return f"radix{row['radix_bits']} w{row['num_warps']}"
    if row.get("stage", "attention") == "block_scores":
        return (f"nb{row['block_nb']} w{row['num_warps']} s{row['num_stages']} "
                f"h{row.get('heads_per_program', 1)}{' hfast' if row.get('heads_fastest') else ''}"
                f" t{row.get('tiles_per_program', 1)}"
                f"{' head-major' if row.get('summary_layout') == 'head' else ''}"
                f"{' whole-grid' if not row.get('skip_dead_tiles', False) else ''}"
                f"{' ' + row['precision'] if row.get('precision') else ''}")
    return (f"{row['programs_per_sm']}/SM n{row.get('block_n', 64)} w{row.get('num_warps', 4)} "
            f"s{row.get('num_stages', 2)}{' earlyV' if row['early_v'] else ''}"
            f"{' masked' if not row.get('skip_pad_tiles', True) else ''}")


def best_by_case(rows: list[dict]) -> list[dict]:
    """Per (stage, batch): the default's and the fastest variant's time."""
    out = []
    for stage, batch in dict.fromkeys((r["stage"], r["batch"]) for r in rows):
        case = [r for r in rows if r["stage"] == stage and r["batch"] == batch]
        best = min(case, key=lambda r: r["ms"])
        default = next((r for r in case if r["is_default"]), None)
        out.append(dict(stage=stage, batch=batch, best=variant_name(best), best_ms=best["ms"],
                        best_tbps=best["tbps"],
                        default_ms=None if default is None else default["ms"],
                        default_tbps=None if default is None else default["tbps"],
                        gain=None if default is None else default["ms"] / best["ms"]))
    return out


LATENCY_STAGES = ("block_topk", "token_topk", "kv_write")


def plot(rows: list[dict], path: str, title: str) -> None:
    """Per stage: each batch's default and fastest variant (named on its bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = best_by_case(rows)
    stages = list(dict.fromkeys(c["stage"] for c in cases))
    fig, axes = plt.subplots(1, len(stages), figsize=(5.5 * len(stages), 4), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        mine = [c for c in cases if c["stage"] == stage]
        xs = range(len(mine))
        # latency-bound stages (the top-k, the KV write: no bytes floor worth the name) in time
        in_time = stage in LATENCY_STAGES
        key = "ms" if in_time else "tbps"
        scale = 1e3 if in_time else 1.0
        ax.bar([x - 0.2 for x in xs], [(c[f"default_{key}"] or 0) * scale for c in mine], 0.4,
               label="default")
        bars = ax.bar([x + 0.2 for x in xs], [c[f"best_{key}"] * scale for c in mine], 0.4,
                      label="fastest variant")
        for bar, c in zip(bars, mine):
            ax.annotate(c["best"], (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=6, rotation=90)
        ax.set_xticks(list(xs), [f"batch {c['batch']}" for c in mine])
        if in_time:
            ax.set_ylabel("time (µs)")
        else:
            ax.axhline(HBM_TBPS, ls="--", color="gray", label="HBM peak")
            ax.set_ylabel("bytes floor / time (TB/s)")
        ax.set_title(stage, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_title(args: argparse.Namespace, gpu: str) -> str:
    if args.stages == "kv_write":
        return (f"{gpu}: a decode step's KV write, 36 layers of Qwen3-8B heads, fp8 cache, fp8 "
                f"summaries and 16 fp8 labels, {args.block_size}-token pages")
    return (f"{gpu}: one layer, Qwen3-8B heads, {args.selected} slots per kv head, "
            f"{args.block_size}-token blocks of {args.context}-token requests"
            + (f" (grid {args.max_context})" if (args.max_context or 0) > args.context else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, args.results_name + ".json")
    meta = dict(commit=git_commit(), gpu=gpu_name(),
                config=dict(q_heads=32, kv_heads=8, head_dim=128, dtype="bf16",
                            selected=args.selected, block_size=args.block_size,
                            pool_tokens=args.pool_tokens, iters=args.iters,
                            summary_dtype=args.summary_dtype,
                            context=args.context,
                            max_context=max(args.max_context or args.context, args.context),
                            timing="CUDA graph, L2 flushed",
                            selection="half the tokens of selected/(block_size/2) blocks"),
                best=best_by_case(result["rows"]), failures=result["failures"])
    write_results(path, result["rows"], meta)
    plot(result["rows"], path[:-5] + ".png", plot_title(args, meta["gpu"]))
    for case in meta["best"]:
        print(f"{case['stage']} B={case['batch']}: default {case['default_ms']}, fastest "
              f"{case['best']} {case['best_ms']:.4f} ms")
    print(f"wrote {path}; {'checks passed' if not result['failures'] else result['failures']}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
