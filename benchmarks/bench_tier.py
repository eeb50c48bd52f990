#!/usr/bin/env python
"""Decode-step benchmark of the CPU KV tier's engine (GPU only): the AsyncTLS schedule at the
operator level, every configuration in one run.

A batch of ``--batch`` requests of ``--context`` tokens over ``--layers`` layers of Qwen3-8B
attention shapes (32 q heads, 8 kv heads, dim 128, bf16). Decode steps run every layer's
two_level sparse decode (``kernels.sparse_decode``, budget ``--budget``) with queries that
drift slowly from step to step (``q_t = normalize(q_{t-1} + drift * noise)``, the locality that
real decoding has; ``--drift`` sets it), captured in one CUDA graph per step. Configurations:

* ``gpu_resident``: the whole KV on the GPU, no tier (the untiered pipeline);
* ``tier_sync``: the whole KV in pinned host memory (``HostKVStore``), the GPU holding only
  sink/window pages and each (request, layer, kv head)'s working set of ``k`` blocks; the
  misses of each step's selection are gathered (zero-copy) before the token stage;
* ``tier_async``: AsyncTLS: each layer attends the blocks chosen at the previous step and
  fetches this step's choice on a side stream, overlapping the following layers; one fence at
  the end of the step.

For the tiers it records the transferred bytes per step, the hit rate, and the hidden-transfer
fraction ``1 - (t_async - t_resident) / (t_sync - t_resident)`` (the share of the transfer time
that the asynchronous schedule takes off the step, taking the synchronous schedule's added time
as the transfer time). ``--check`` first verifies that a tier_sync step equals the untiered
step bit for bit. Writes ``<out>/tier_h200.json`` + ``.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tier")
HQ, HKV, D = 32, 8, 128


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--drifts", default="0.02,0.1,0.3", help="query drift per step (comma list)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per configuration")
    p.add_argument("--gather-programs", default="0,16,32,64",
                   help="tier_async: caps on the gather's programs (SMs) to try, 0 = no cap")
    p.add_argument("--check", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.results_io import git_commit, gpu_name, write_results
    from sglang_ext.kernels.block_summary import allocate_block_summaries, update_block_summaries
    from sglang_ext.kernels.sparse_decode import (
        DecodeRows,
        LayerCache,
        SelectionInputs,
        SparseDecodeWorkspace,
        sparse_decode_batched,
    )
    from sglang_ext.memory_tier.host_store import HostKVStore
    from sglang_ext.memory_tier.working_set import WorkingSetTier
    from sglang_ext.selection.params import SelectionParams

    dev = torch.device("cuda")
    bs, B, L, NL = args.block_size, args.batch, args.context, args.layers
    sink, window = 16, 64
    n_sel = args.budget - sink - window
    params = SelectionParams("two_level", args.budget, bs, 2 * -(-n_sel // bs), sink, window)
    k_blocks = params.candidate_blocks
    nblocks = L // bs
    rows = B + 1  # row 0 = padding row
    pool_pages = 1 + B * nblocks
    gen = torch.Generator(device=dev).manual_seed(0)

    # Logical pool: request b's block j at page 1 + perm[b*nblocks + j] (scattered).
    perm = torch.randperm(B * nblocks, device=dev, generator=gen).int() + 1
    req_to_token = torch.zeros(rows, L, dtype=torch.int32, device=dev)
    offs = torch.arange(bs, device=dev, dtype=torch.int32)
    for b in range(B):
        pages = perm[b * nblocks:(b + 1) * nblocks]
        req_to_token[b + 1] = (pages[:, None] * bs + offs).reshape(-1)
    rpi = torch.arange(1, B + 1, device=dev)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device=dev)
    channels = torch.stack([torch.randperm(D, device=dev, generator=gen)[:16] for _ in range(HKV)])

    print(f"allocating {NL} layers x {pool_pages * bs} tokens on GPU and host ...", flush=True)
    host = HostKVStore(NL, HKV, D, D, pool_pages * bs, bs, torch.bfloat16)
    k_full, v_full, kmin, kmax = [], [], [], []
    for layer in tqdm(range(NL), desc="fill layers"):
        k = torch.randn(pool_pages * bs, HKV, D, device=dev, generator=gen).bfloat16()
        v = torch.randn(pool_pages * bs, HKV, D, device=dev, generator=gen).bfloat16()
        lo, hi = allocate_block_summaries(k.shape[0], HKV, D, bs, dev, dtype=torch.bfloat16)
        loc = torch.arange(k.shape[0], device=dev, dtype=torch.int64)
        update_block_summaries(lo, hi, k, loc, bs)
        host.k[layer].copy_(k.transpose(0, 1))
        host.v[layer].copy_(v.transpose(0, 1))
        k_full.append(k); v_full.append(v); kmin.append(lo); kmax.append(hi)
    torch.cuda.synchronize()

    def make_tier(mode, gather_programs=None):
        """Device pool of the tier: padding page, per request sink + window pages and k slots."""
        keep = sorted(set(range(-(-sink // bs))) | set(range((L - window) // bs, nblocks)))
        per_req = len(keep) + k_blocks
        npages = 1 + B * per_req
        tier = WorkingSetTier(num_layers=NL, num_kv_heads=HKV, max_rows=rows, max_blocks=nblocks,
                              num_slots=k_blocks, page_size=bs, max_batch=B, host=host,
                              device=dev, mode=mode, gather_programs=gather_programs)
        dk = [torch.zeros(npages * bs, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(NL)]
        dv = [torch.zeros(npages * bs, HKV, D, device=dev, dtype=torch.bfloat16) for _ in range(NL)]
        nxt = 1
        for b in range(B):
            row = b + 1
            pages = torch.arange(nxt, nxt + len(keep), device=dev)
            nxt += len(keep)
            kb = torch.tensor(keep, device=dev)
            src = (req_to_token[row, kb * bs].long() // bs)
            for layer in range(NL):
                for i in range(len(keep)):
                    s, t = int(src[i]), int(pages[i])
                    dk[layer][t * bs:(t + 1) * bs] = k_full[layer][s * bs:(s + 1) * bs]
                    dv[layer][t * bs:(t + 1) * bs] = v_full[layer][s * bs:(s + 1) * bs]
            tier.map_resident(row, kb, pages)
            tier.attach(row, torch.arange(nxt, nxt + k_blocks, device=dev))
            nxt += k_blocks
        return tier, dk, dv

    q_static = torch.empty(NL, B, HQ, D, device=dev, dtype=torch.bfloat16)
    workspaces = [SparseDecodeWorkspace(B, HQ, HKV, D, params, nblocks, dev, torch.bfloat16)
                  for _ in range(NL)]

    decode_rows = DecodeRows(req_to_token, rpi, seq_lens)

    def step(config, tier=None, dk=None, dv=None):
        outs = []
        for layer in range(NL):
            if tier is None:
                out = sparse_decode_batched(
                    q_static[layer],
                    LayerCache(k_full[layer], v_full[layer], kmin[layer], kmax[layer],
                               channels=channels),
                    decode_rows, params, D ** -0.5, workspaces[layer])
            else:
                on_blocks, attend = tier.decode_hooks(layer, rpi, req_to_token, dk[layer], dv[layer])
                out = sparse_decode_batched(
                    q_static[layer],
                    LayerCache(dk[layer], dv[layer], kmin[layer], kmax[layer], channels=channels),
                    decode_rows, params, D ** -0.5, workspaces[layer],
                    SelectionInputs(page_map=tier.page_map(layer), on_blocks=on_blocks,
                                    attend_blocks=attend))
                tier.after_layer(layer, rpi, req_to_token, dk[layer], dv[layer])
            outs.append(out)
        if tier is not None:
            tier.finish_step()
        return outs

    def capture(fn):
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm-up (compiles kernels) outside the graph
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g

    def query_sequence(drift, n):
        g2 = torch.Generator(device=dev).manual_seed(1)
        q = torch.randn(NL, B, HQ, D, device=dev, generator=g2)
        seq = []
        for _ in range(n):
            q = q + drift * torch.randn(q.shape, device=dev, generator=g2) * q.norm(dim=-1, keepdim=True) / D ** 0.5
            seq.append(q.bfloat16())
        return seq

    status = 0
    if args.check:
        tier, dk, dv = make_tier("sync")
        seq = query_sequence(0.1, 3)
        for qs in seq:
            q_static.copy_(qs)
            ref = [o.clone() for o in step("gpu_resident")]
            got = [o.clone() for o in step("tier_sync", tier, dk, dv)]
            ok = all(torch.equal(a, b) for a, b in zip(ref, got))
            print(f"check tier_sync == gpu_resident: {ok}")
            status |= 0 if ok else 1
        del tier, dk, dv

    rows_out = []
    for drift in [float(x) for x in args.drifts.split(",")]:
        seq = query_sequence(drift, args.steps + 5)
        times = {}
        stats = {}
        caps = [int(x) for x in args.gather_programs.split(",")]
        configs = ["gpu_resident", "tier_sync"] + [f"tier_async@{c}" for c in caps]
        for config in configs:
            tier = dk = dv = None
            if config != "gpu_resident":
                mode = config.split("_")[1].split("@")[0]
                cap = int(config.split("@")[1]) if "@" in config else 0
                tier, dk, dv = make_tier(mode, cap or None)
            q_static.copy_(seq[0])
            graph = capture(lambda: step(config, tier, dk, dv))
            # warm the working set with the first steps (not timed)
            for qs in seq[1:5]:
                q_static.copy_(qs)
                graph.replay()
            torch.cuda.synchronize()
            if tier is not None:
                tier.stats.zero_()
            ts = []
            for qs in tqdm(seq[5:], desc=f"drift {drift} {config}", leave=False):
                q_static.copy_(qs)
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                ts.append(s.elapsed_time(e))
            times[config] = statistics.median(ts)
            if tier is not None:
                st = tier.read_stats()
                st["bytes_per_step"] = st["transferred_blocks"] * bs * D * 2 * 2 / len(ts)
                stats[config] = st
            del graph, tier, dk, dv
            torch.cuda.empty_cache()
        base, sync = times["gpu_resident"], times["tier_sync"]
        best = min((c for c in configs if c.startswith("tier_async")), key=times.get)
        asyn = times[best]
        transfer = max(sync - base, 1e-9)
        for config, t in times.items():
            row = dict(context=L, batch=B, layers=NL, budget=args.budget, drift=drift,
                       config=config.split("@")[0], step_ms=t, per_layer_ms=t / NL)
            if "@" in config:
                row["gather_programs"] = int(config.split("@")[1])
                row["best"] = config == best
            if config in stats:
                st = stats[config]
                row.update(hit_rate=st["hit_rate"], bytes_per_step=st["bytes_per_step"],
                           transfer_gbps=st["bytes_per_step"] / transfer / 1e6)
            if config.startswith("tier_async"):
                row["hidden_fraction"] = 1.0 - max(t - base, 0.0) / transfer
                row["slowdown_vs_resident"] = t / base
            rows_out.append(row)
        print(f"drift {drift}: resident {base:.3f} ms, sync {sync:.3f} ms, " + ", ".join(
              f"{c} {times[c]:.3f} ms" for c in configs if c.startswith("tier_async")) +
              f"; hit {stats[best]['hit_rate']:.3f}, "
              f"{stats[best]['bytes_per_step'] / 1e6:.1f} MB/step, "
              f"hidden {1.0 - max(asyn - base, 0.0) / transfer:.1%} ({best})")

    meta = dict(commit=git_commit(), gpu=gpu_name(),
                config=dict(vars(args), method="two_level", sink=sink, window=window,
                            k_blocks=k_blocks, heads=[HQ, HKV, D], dtype="bf16",
                            host_bytes=host.nbytes))
    path = os.path.join(args.out, "tier_h200.json")
    write_results(path, rows_out, meta)
    try:
        plot({**meta, "rows": rows_out}, path.replace(".json", ".png"))
    except Exception as e:  # the JSON is what matters
        print(f"plot failed: {e}")
    print(f"wrote {path}")
    return status


def plot(result: dict, path: str) -> None:
    """Decode step time against query drift per configuration (tier_async: its best cap)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cfg = result["rows"], result["config"]
    fig, ax = plt.subplots(figsize=(6, 4))
    drifts = sorted({r["drift"] for r in rows})
    for config in ("gpu_resident", "tier_sync", "tier_async"):
        ax.plot(drifts, [min(r["step_ms"] for r in rows
                             if r["drift"] == d and r["config"] == config) for d in drifts],
                marker="o", label=config + (" (best cap)" if config == "tier_async" else ""))
    ax.set_xlabel("query drift per step (less locality ->)")
    ax.set_ylabel(f"decode step, {cfg['layers']} layers (ms)")
    ax.set_title(f"CPU tier, {cfg['batch']} x {cfg['context'] // 1024}k, budget {cfg['budget']} "
                 f"({result['gpu']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
