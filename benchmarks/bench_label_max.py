"""The label-max block scores alone (GPU): launch shapes x label dtypes at one serving shape.

    python benchmarks/bench_label_max.py --out benchmarks/results/operator

One layer of Qwen3-8B heads (32 query / 8 kv heads), every request at ``--context`` tokens in
random pages of ``--block-size``; each (tokens per program, warps, label dtype) is captured in
a CUDA graph and timed over ``--iters`` replays with the L2 flushed before each, median.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.results_io import git_commit, gpu_name  # noqa: E402

HQ, HKV, HEAD_DIM = 32, 8, 128


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--tokens", default="256,512,1024,2048")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "operator"))
    p.add_argument("--name", default="label_max_launch_h200.json")
    args = p.parse_args(argv)

    import torch

    from sglang_ext.kernels.token_scores import label_max_block_scores_batched
    from sglang_ext.progress import progress

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    bs, batch, context = args.block_size, args.batch, args.context
    pages = batch * context // bs + 1
    req_to_token = (torch.randperm(pages - 1, device=dev, generator=gen).view(batch, -1)[:, :, None]
                    * bs + torch.arange(bs, device=dev)).reshape(batch, -1).int()
    rows = torch.arange(batch, device=dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device=dev, generator=gen)
    channels = torch.stack([torch.randperm(HEAD_DIM, device=dev, generator=gen)[:args.channels]
                            for _ in range(HKV)])
    blocks = context // bs
    out = torch.empty(batch, HKV, blocks, device=dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows_out = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        labels = torch.randn(HKV, pages * bs, args.channels, device=dev, generator=gen)
        labels = labels.to(dtype).permute(1, 0, 2)  # the label cache's head-major layout
        launches = list(itertools.product(map(int, args.tokens.split(",")),
                                          map(int, args.warps.split(","))))
        for tokens, warps in progress(launches, desc=f"label_max {dtype}", unit="launch"):
            def run():
                label_max_block_scores_batched(q, labels, req_to_token, rows, lens, bs, 16, 64,
                                               blocks, channels=channels, out=out,
                                               keys_are_labels=True, tokens_per_program=tokens,
                                               num_warps=warps)
            run()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            times = []
            for _ in range(args.iters):
                flush.zero_()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                graph.replay()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            ms = statistics.median(times)
            nbytes = batch * HKV * context * args.channels * labels.element_size()
            rows_out.append({"label_dtype": str(dtype).removeprefix("torch."),
                             "tokens_per_program": tokens, "num_warps": warps, "ms": ms,
                             "label_tb_s": nbytes / ms / 1e9})
            print(f"{rows_out[-1]['label_dtype']:14s} tokens {tokens:5d} warps {warps} "
                  f"{ms * 1e3:7.1f} us  {rows_out[-1]['label_tb_s']:.2f} TB/s", flush=True)
    path = os.path.join(args.out, args.name)
    with open(path, "w") as f:
        json.dump({"commit": git_commit(), "gpu": gpu_name(),
                   "config": {k: v for k, v in vars(args).items() if k != "out"},
                   "timing": "median of CUDA-event times of a captured graph, L2 flushed",
                   "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
