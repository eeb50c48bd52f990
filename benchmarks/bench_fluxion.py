#!/usr/bin/env python
"""Fluxion's cooperative CPU-GPU attention with the CPU KV tier, at the operator level: decode
step time and GPU idle fraction with cooperation on vs off, every configuration in one run.

Setup (Qwen3-8B attention shapes: 32 q heads, 8 kv heads, dim 128, bf16): ``--batch`` requests
of ``--context`` tokens, ``--layers`` layers; the whole KV in pinned host memory (head-major, as
:class:`HostKVStore` keeps it). Each step selects ``--budget / --block-size`` blocks per
(request, kv head) by the Quest bound of a query that drifts from step to step (``--drift``;
real decoding's locality); the GPU working set holds the previous step's selection (AsyncTLS).
Both configurations attend exactly this step's selection:

* ``off``: the misses are gathered host -> GPU (the zero-copy gather kernel), then the GPU
  attends the whole selection;
* ``on``: the priority scheduler (sglang_ext/memory_tier/cooperative.py) gives CPU threads the
  smallest miss sets it expects them to finish before the GPU; they attend those from host
  memory while the GPU attends the rest (the other misses gathered first); the partials are
  merged by log-sum-exp. A layer where one CPU task's fixed cost alone exceeds the GPU's
  estimate is not planned (``PriorityScheduler.worth_planning``: the plan's device sync would
  buy nothing) and runs as ``off``; ``planned_layer_frac`` says how many were planned.

The scheduler's cost model is measured first on this machine (GPU and CPU seconds per attended
token, seconds per gathered block). GPU idle fraction = 1 - (GPU busy time, CUDA events around
each GPU segment) / step wall time. ``--check`` first verifies on one layer that the
cooperative output equals the plain one. Writes ``<out>/fluxion_h200.json`` + ``.png``.
``--device cpu`` runs the same code at toy sizes (a smoke run; its times mean nothing).

Both configurations attend on the GPU with the same torch gather + GEMM attention
(``cooperative.attend_blocks``), not the Triton sparse decode kernel, so the comparison is of
the two schedules; a faster GPU kernel shrinks the time the CPU has to hide its share in, which
the scheduler's measured cost model accounts for.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fluxion")
HQ, HKV, D = 32, 8, 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--contexts", type=int, nargs="+", default=[65536, 131072])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drift", type=float, default=0.1, help="query drift per step")
    p.add_argument("--steps", type=int, default=12, help="timed steps per configuration")
    p.add_argument("--cpu-threads", type=int, default=8)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--check", action="store_true")
    p.add_argument("--name", default="fluxion_h200")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.results_io import git_commit, gpu_name, write_results
    from sglang_ext.kernels.host_gather import gather_host_blocks, gather_host_blocks_ref, pinned_empty
    from sglang_ext.memory_tier.cooperative import (
        CostModel, HostAttentionWorkers, PriorityScheduler, attend_blocks, calibrate_cpu_cost,
        plan_split, split_selection,
    )
    from sglang_ext.selection.reference import merge_attention_states

    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    bs, B, NL = args.block_size, args.batch, args.layers
    k_sel = args.budget // bs
    gather = gather_host_blocks if cuda else gather_host_blocks_ref
    workers = HostAttentionWorkers(args.cpu_threads)
    rows, meta_costs = [], {}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class GpuTimer:
        """Busy time of GPU segments from CUDA events (wall time on CPU runs)."""

        def __init__(self):
            self.pairs, self.t0 = [], 0.0

        def start(self):
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.pairs.append([e, None])
            else:
                self.t0 = time.perf_counter()

        def stop(self):
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                self.pairs[-1][1] = e
            else:
                self.pairs.append(time.perf_counter() - self.t0)

        def busy_s(self):
            sync()
            if cuda:
                return sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3
            return sum(self.pairs)

    for context in args.contexts:
        nblocks = context // bs
        N = B * nblocks * bs  # request b's block j of every head: page b * nblocks + j
        print(f"context {context}: {NL} layers x {N} tokens, host and GPU ...", flush=True)
        gen = torch.Generator(device=dev).manual_seed(context)
        host_k, host_v, dev_k, dev_v, kmin, kmax = [], [], [], [], [], []
        for _ in tqdm(range(NL), desc="fill layers"):
            k = torch.randn(N, HKV, D, device=dev, generator=gen).bfloat16()
            v = torch.randn(N, HKV, D, device=dev, generator=gen).bfloat16()
            hk, hv = pinned_empty((HKV, N, D)), pinned_empty((HKV, N, D))
            hk.copy_(k.transpose(0, 1))
            hv.copy_(v.transpose(0, 1))
            blocks = k.view(B * nblocks, bs, HKV, D)
            kmin.append(blocks.amin(1).transpose(0, 1).view(HKV, B, nblocks, D).transpose(0, 1))
            kmax.append(blocks.amax(1).transpose(0, 1).view(HKV, B, nblocks, D).transpose(0, 1))
            host_k.append(hk); host_v.append(hv); dev_k.append(k); dev_v.append(v)
        sync()
        page_of = (torch.arange(B, device=dev)[:, None, None] * nblocks
                   + torch.arange(nblocks, device=dev)[None, None, :]).expand(B, HKV, nblocks)

        def queries(n):
            q = torch.randn(NL, B, HQ, D, device=dev, generator=gen)
            out = []
            for _ in range(n):
                out.append(q.bfloat16())
                q = torch.nn.functional.normalize(
                    q + args.drift * torch.randn(q.shape, device=dev, generator=gen), dim=-1) * D ** 0.5
            return out

        def select(q, layer):
            """Quest bound per (request, kv head, block), top k_sel."""
            qg = q.float().view(B, HKV, HQ // HKV, D)
            hi = torch.einsum("bhgd,bhnd->bhgn", qg.clamp(min=0), kmax[layer].float()) \
                + torch.einsum("bhgd,bhnd->bhgn", qg.clamp(max=0), kmin[layer].float())
            return hi.sum(2).topk(k_sel, dim=-1).indices  # [B, HKV, k]

        def fetch(layer, misses):
            """Gather the miss blocks host -> GPU pool (in place: the pool keeps every page, so
            the bytes moved are real and the data stays right)."""
            sel = misses >= 0
            heads = torch.arange(HKV, device=dev)[None, :, None].expand_as(misses)[sel].int()
            pages = torch.gather(page_of, 2, misses.clamp(min=0).long())[sel].int()
            gather(host_k[layer], dev_k[layer], heads, pages, pages, bs,
                   host_v=host_v[layer], dev_v=dev_v[layer])
            return int(sel.sum())

        scaling = D ** -0.5

        def gpu_attend(q, layer, blocks):
            pages = torch.gather(page_of, 2, blocks.clamp(min=0).long())
            pages = torch.where(blocks >= 0, pages, torch.full_like(pages, -1))
            return attend_blocks(q, dev_k[layer].transpose(0, 1), dev_v[layer].transpose(0, 1),
                                 pages, bs, scaling)

        def run_step(q_layers, resident, cooperative, scheduler, timer, gate=True):
            """One decode step over all layers; cooperative layers are planned unless the
            scheduler's gate skips them (``gate=False``: always plan, for the check)."""
            fetched = on_cpu = planned = 0
            outs = []
            for layer in range(NL):
                q = q_layers[layer]
                selected = select(q, layer)
                if cooperative and (not gate or scheduler.worth_planning()):
                    planned += 1
                    plan, res_part, cpu_blocks, gpu_misses = plan_split(
                        selected, resident[layer], scheduler, bs)
                    fut = workers.submit(q.cpu(), host_k[layer], host_v[layer],
                                         torch.gather(page_of, 2, cpu_blocks.clamp(min=0).long())
                                         .where(cpu_blocks >= 0, -1).cpu(), plan, bs, scaling)
                    on_cpu += int((cpu_blocks >= 0).sum())
                    timer.start()
                    fetched += fetch(layer, gpu_misses)
                    g_out, g_lse = gpu_attend(q, layer, torch.where(gpu_misses >= 0, gpu_misses, res_part))
                    timer.stop()
                    c_out, c_lse = fut.result()
                    scheduler.observe(plan, fut.cpu_seconds)
                    timer.start()
                    out, _ = merge_attention_states(g_out, g_lse, c_out.to(dev, non_blocking=True),
                                            c_lse.to(dev, non_blocking=True))
                    timer.stop()
                else:
                    _, miss_part = split_selection(selected, resident[layer])
                    timer.start()
                    fetched += fetch(layer, miss_part)
                    out, _ = gpu_attend(q, layer, selected)
                    timer.stop()
                outs.append(out)
                # The working set now holds this step's selection (AsyncTLS: next step's base).
                resident[layer].zero_()
                resident[layer].scatter_(2, selected, True)
            return outs, fetched, on_cpu, planned

        def fresh_resident(q0):
            res = []
            for layer in range(NL):
                r = torch.zeros(B, HKV, nblocks, dtype=torch.bool, device=dev)
                r.scatter_(2, select(q0[layer], layer), True)
                res.append(r)
            return res

        # The cost model, measured here (after a warm-up: a cold first call is many times slower).
        qs = queries(args.steps + 2)
        sel0 = select(qs[0][0], 0)
        gpu_attend(qs[0][0], 0, sel0)
        sync(); t = time.perf_counter()
        for _ in range(5):
            gpu_attend(qs[0][0], 0, sel0)
        sync(); gpu_s_tok = (time.perf_counter() - t) / 5 / (B * HKV * k_sel * bs)
        # Kept at 1: the worker threads are the CPU's parallelism (intra-op threads would
        # oversubscribe the cores); this thread only launches GPU work.
        torch.set_num_threads(1)
        # The CPU side as a step uses it: every worker thread at once, one task each.
        cpu_fixed, cpu_s_tok = calibrate_cpu_cost(workers, host_k[0], host_v[0], HQ // HKV, bs,
                                                  D ** -0.5)
        miss = torch.randint(0, nblocks, (B, HKV, k_sel), device=dev)
        fetch(0, miss)
        sync(); t = time.perf_counter()
        n = fetch(0, miss)
        sync(); fetch_s_blk = (time.perf_counter() - t) / max(n, 1)
        cost = CostModel(gpu_s_per_token=gpu_s_tok, cpu_s_per_token=cpu_s_tok,
                         fetch_s_per_block=fetch_s_blk, cpu_fixed_s=cpu_fixed)
        meta_costs[context] = cost.__dict__
        print(f"  cost model: {cost}", flush=True)
        scheduler = PriorityScheduler(cost, args.cpu_threads)

        if args.check:
            res = fresh_resident(qs[0])
            want, _, _, _ = run_step(qs[1], [r.clone() for r in res], False, scheduler, GpuTimer())
            got, _, n_cpu, _ = run_step(qs[1], [r.clone() for r in res], True, scheduler,
                                        GpuTimer(), gate=False)
            err = max(float((a - b).abs().max()) for a, b in zip(got, want))
            print(f"  check: cooperative vs plain max |diff| {err:.2e} ({n_cpu} blocks on the CPU)")
            if err > 1e-3:
                print("  CHECK FAILED")
                return 1

        for cooperative in (False, True):
            res = fresh_resident(qs[0])
            run_step(qs[1], res, cooperative, scheduler, GpuTimer())  # warm-up
            times, idles, fetched, cpu_blocks, planned = [], [], [], [], []
            for s in tqdm(range(args.steps), desc=f"{context} coop={'on' if cooperative else 'off'}"):
                timer = GpuTimer()
                sync(); t = time.perf_counter()
                _, f, c, n_planned = run_step(qs[2 + s], res, cooperative, scheduler, timer)
                sync(); wall = time.perf_counter() - t
                times.append(wall)
                idles.append(max(0.0, 1.0 - timer.busy_s() / wall))
                fetched.append(f); cpu_blocks.append(c); planned.append(n_planned)
            rows.append({
                "context": context, "cooperative": "on" if cooperative else "off",
                "batch": B, "layers": NL, "budget": args.budget, "block_size": bs,
                "step_ms": round(1e3 * statistics.median(times), 3),
                "gpu_idle_frac": round(statistics.median(idles), 4),
                "fetched_blocks_per_step": statistics.mean(fetched),
                "cpu_blocks_per_step": statistics.mean(cpu_blocks),
                # layers the scheduler planned (the others it skipped: the CPU could not help)
                "planned_layer_frac": statistics.mean(planned) / NL,
                "selected_blocks_per_step": B * HKV * k_sel * NL,
                # the scheduler's online correction of the CPU cost model (observed / modelled)
                "cpu_cost_scale": round(scheduler.cpu_scale, 3) if cooperative else None,
            })
            print(f"  {rows[-1]}", flush=True)
        del host_k, host_v, dev_k, dev_v, kmin, kmax
    workers.close()

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.name}.json")
    write_results(path, rows, {
        "commit": git_commit(), "gpu": gpu_name() if cuda else "cpu (smoke run)",
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "name")},
        "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16"},
        "cost_model": meta_costs,
        "gpu_idle_frac": "1 - GPU busy time (CUDA events around each GPU segment) / step wall time",
    })
    plot(rows, path[:-5] + ".png")
    print(f"wrote {path}")
    return 0


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.35
    for ax, key, label in ((axes[0], "step_ms", "decode step (ms)"),
                           (axes[1], "gpu_idle_frac", "GPU idle fraction")):
        for i, coop in enumerate(("off", "on")):
            vals = [next((r[key] for r in rows if r["context"] == c and r["cooperative"] == coop), 0)
                    for c in contexts]
            ax.bar([x + (i - 0.5) * width for x in range(len(contexts))], vals, width,
                   label=f"cooperative {coop}")
        ax.set_xticks(range(len(contexts)), [f"{c // 1024}k" for c in contexts])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("Fluxion cooperative attention with the CPU tier (Qwen3-8B shapes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
