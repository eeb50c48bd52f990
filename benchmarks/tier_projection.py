#!/usr/bin/env python
"""Project the CPU tier's decode throughput beyond the measured host: one 141 GiB GPU (or two,
TP=2) with 128 GiB, 256 GiB, 1 TB and 2 TB hosts, from per-request costs and the PCIe rate.

A model, not a measurement (docs/tier-projection.md): every input is a parameter with a default
taken from the H200 results, or read from a serving results file with ``--from-results``. Per host
size and tensor-parallel degree it reports

* **requests held**: (GPU fp8 KV + pinned host fp8 KV) / (per-request KV at the context + its GPU
  working set), the physical limit the tier's capacity is measured against;
* **requests decoding**: all GPU-homed requests, plus the host-homed ones the admission's PCIe
  term lets in: their transfers per step must fit in the step they overlap
  (``n_host x bytes_per_request / pcie <= step``; the rest wait in the queue);
* **step time** = max(GEMMs + attention, transfers), the attention being the measured time per
  request but never below what HBM can read (the budget's KV rows and the block summaries of
  the whole context, per request); **bytes per step**, **decode tok/s**, and **which bound
  applies**: ``pcie`` (the transfers set the step, or the term keeps host-homed requests
  waiting), ``gemm`` (the weights' GEMMs are the larger part of the compute), ``hbm`` (the
  attention at HBM's rate is) or ``attention`` (the attention at its measured rate, above the
  HBM floor, is);
* the untiered fp8 server on the same GPUs for comparison.

Writes ``--out`` (JSON) and, with matplotlib installed, a PNG beside it; prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo

GIB = 1024 ** 3
DEFAULT_OUT = os.path.join("bench-out", "tier_projection.json")
DEFAULT_HOSTS = "128GiB,256GiB,1TB,2TB"
_UNITS = {"gib": GIB, "gb": 1e9, "tib": 1024 ** 4, "tb": 1e12}


@dataclass(frozen=True)
class Model:
    """The projection's inputs (defaults: Qwen3-8B shape on one H200, fp8 KV, 128k context)."""

    # the model's KV: per token, K and V of every layer and kv head
    layers: int = 36
    kv_heads: int = 8
    head_dim: int = 128
    kv_bytes: float = 1.0  # fp8
    context: int = 131072
    # the GPU: KV = gpu_gib x mem_fraction - weights / tp - overhead (summaries, labels,
    # activations, CUDA graphs). 141 GiB x 0.88 - 16.4 - 11.8 = 105.0 GB: the fp8 server's
    # measured device KV at 128k (e2e_h200.json, --mem-fraction-static 0.88).
    gpu_gib: float = 141.0
    mem_fraction: float = 0.88
    weights_gb: float = 16.4
    gpu_overhead_gb: float = 11.8
    # the host: the share of its memory pinned for the tier (96 GB of the H200 machine's
    # 128 GiB in the capacity run, capacity_h200.json)
    host_pin_fraction: float = 0.70
    # the GPU working set of a host-homed request (sink, window ring and working-set slots:
    # 246 candidate + 30 locality blocks of 16 tokens + 5 sink/ring pages at budget 2048)
    working_set_tokens: int = 4496
    # a decode step: the GEMMs (weights) once, the attention per request (fp8 server at 128k,
    # 10 requests: 9.34 ms step, 4.23 ms of GEMMs; e2e_h200.json decode_profile)
    gemm_ms: float = 4.23
    attn_ms_per_request: float = 0.511
    # per host-homed request and step, bytes moved over PCIe: measured 135.5 MB in bf16 at 128k
    # with the locality limit (locality_h200.json: 2 host-homed requests, 270.9 MB per step),
    # halved for an fp8 host copy (one byte per value; not measured yet)
    pcie_bytes_per_request: float = 67.7e6
    # the admission's bound on the same (memory_tier/transfer_budget.py): locality_new_blocks + 1
    # blocks per (layer, kv head) of page_tokens tokens, at most the working set's num_slots
    # (246 candidate + 30 locality blocks); 73.1 MB in fp8 at the defaults
    locality_new_blocks: int = 61
    page_tokens: int = 16
    num_slots: int = 276
    pcie_gbps: float = 45.0  # --sparse-tier-pcie-gbps's default (H200: ~51 measured)
    hbm_tbps: float = 4.8  # H200
    # the HBM bytes one request's attention reads per step: the budget's KV rows plus the block
    # summaries (fp8 min/max of every 32-token block) of the whole context
    budget: int = 2048
    summary_block: int = 32
    summary_bytes: float = 1.0
    # TP=2: the GEMMs split over the GPUs plus two all-reduces per layer
    allreduce_ms: float = 0.7
    provenance: dict[str, str] = field(default_factory=dict, compare=False)

    @property
    def kv_bytes_per_token(self) -> float:
        return self.layers * self.kv_heads * self.head_dim * 2 * self.kv_bytes

    @property
    def request_kv_bytes(self) -> float:
        return self.kv_bytes_per_token * self.context

    @property
    def working_set_bytes(self) -> float:
        return self.kv_bytes_per_token * self.working_set_tokens

    @property
    def pcie_bound_bytes_per_request(self) -> int:
        """The admission's prediction (transfer_budget.py) for one host-homed request."""
        from sglang_ext.memory_tier.transfer_budget import blocks_per_step, request_bytes_per_step

        page_bytes = int(self.page_tokens * self.head_dim * 2 * self.kv_bytes)
        return request_bytes_per_step(blocks_per_step(self.num_slots, self.locality_new_blocks),
                                      self.kv_heads, page_bytes, self.layers)

    @property
    def hbm_bytes_per_request(self) -> float:
        summaries = (self.context / self.summary_block * self.layers * self.kv_heads
                     * self.head_dim * 2 * self.summary_bytes)
        return self.budget * self.kv_bytes_per_token + summaries

    def gpu_kv_bytes(self, tp: int) -> float:
        per_gpu = (self.gpu_gib * GIB * self.mem_fraction - self.weights_gb * 1e9 / tp
                   - self.gpu_overhead_gb * 1e9)
        return tp * max(per_gpu, 0.0)


def parse_size(text: str) -> float:
    """``128GiB``, ``1TB``, ``2TiB`` -> bytes."""
    t = text.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if t.endswith(unit):
            return float(t[: -len(unit)]) * _UNITS[unit]
    raise ValueError(f"not a size: {text!r} (e.g. 128GiB, 1TB)")


def gemm_ms(m: Model, tp: int) -> float:
    """The GEMMs of a step: split over the TP ranks, plus the all-reduces."""
    return m.gemm_ms / tp + (m.allreduce_ms if tp > 1 else 0.0)


def attention_ms(m: Model, requests: int, tp: int) -> tuple[float, float]:
    """``(measured-rate, HBM floor)`` attention time of ``requests`` requests (each rank
    attends its share of the kv heads)."""
    measured = requests * m.attn_ms_per_request / tp
    floor = requests * m.hbm_bytes_per_request / tp / (m.hbm_tbps * 1e12) * 1e3
    return measured, floor


def compute_ms(m: Model, requests: int, tp: int) -> float:
    """Compute time of a decode step with ``requests`` requests: the GEMMs and the attention
    (never below what HBM can read)."""
    return gemm_ms(m, tp) + max(attention_ms(m, requests, tp))


def transfer_ms(m: Model, host_requests: int, tp: int) -> float:
    """PCIe time of a step: each rank moves its kv heads' share over its own link."""
    return host_requests * m.pcie_bytes_per_request / tp / (m.pcie_gbps * 1e9) * 1e3


def untiered(m: Model, tp: int) -> dict[str, Any]:
    n = int(m.gpu_kv_bytes(tp) // m.request_kv_bytes)
    step = compute_ms(m, n, tp)
    return {"tp": tp, "requests": n, "step_ms": round(step, 3),
            "tok_s": round(n / step * 1e3, 1) if step else 0.0}


def split(m: Model, gpu: float, host_requests: int) -> int:
    """GPU-homed requests beside ``host_requests`` host-homed ones: each request, wherever its
    KV lives, also holds a working set on the GPU (the tier's working area)."""
    return max(0, int((gpu - host_requests * m.working_set_bytes)
                      // (m.request_kv_bytes + m.working_set_bytes)))


def project(m: Model, host_bytes: float, tp: int = 1, term: bool = True) -> dict[str, Any]:
    """One host size: requests held (decoding), step time, bytes per step, tok/s, bound.

    ``term``: the admission's PCIe term, sized to the step's compute: host-homed requests are
    admitted while their transfers fit in the step (a lone one always); the others wait in the
    queue, unprefilled. Without it every request the memory holds decodes and the step
    stretches to the transfers."""
    gpu, pinned = m.gpu_kv_bytes(tp), host_bytes * m.host_pin_fraction
    per_req = m.request_kv_bytes
    host_fit = int(pinned // per_req)  # host-homed requests the pinned memory holds
    limit = (gpu + pinned) / per_req  # the physical limit (working sets not counted)
    h = host_fit
    if term:
        h = 0
        while h < host_fit and transfer_ms(m, h + 1, tp) <= compute_ms(
                m, split(m, gpu, h + 1) + h + 1, tp):
            h += 1
        h = max(h, min(1, host_fit))  # a lone host-homed request always runs
    g = split(m, gpu, h)
    running = g + h
    comp, xfer = compute_ms(m, running, tp), transfer_ms(m, h, tp)
    step = max(comp, xfer)
    gemm = gemm_ms(m, tp)
    attention, hbm = attention_ms(m, running, tp)
    if xfer >= comp or h < host_fit:
        bound = "pcie"
    elif gemm >= max(attention, hbm):
        bound = "gemm"
    else:
        bound = "hbm" if hbm >= attention else "attention"
    base = untiered(m, tp)
    tok_s = running / step * 1e3 if step else 0.0
    return {
        "host_gb": round(host_bytes / 1e9, 1), "tp": tp,
        "admission": "pcie_term" if term else "no_term",
        "gpu_kv_gb": round(gpu / 1e9, 1), "pinned_host_gb": round(pinned / 1e9, 1),
        "physical_limit": round(limit, 2),
        "requests_decoding": running, "gpu_homed": g, "host_homed": h,
        "host_homed_waiting": host_fit - h,
        "decoding_vs_limit": round(running / limit, 3) if limit else None,
        "decoding_vs_untiered": round(running / base["requests"], 2) if base["requests"] else None,
        "step_ms": round(step, 3), "compute_ms": round(comp, 3), "transfer_ms": round(xfer, 3),
        "bytes_per_step": round(h * m.pcie_bytes_per_request),
        "gemm_ms": round(gemm, 3), "attention_ms": round(attention, 3), "hbm_ms": round(hbm, 3),
        "tok_s": round(tok_s, 1),
        "tok_s_vs_untiered": round(tok_s / base["tok_s"], 2) if base["tok_s"] else None,
        "bound": bound,
    }


# --------------------------------------------------------------------------- results files

def _flag(config: str, flag: str) -> Optional[str]:
    words = config.split()
    return words[words.index(flag) + 1] if flag in words[:-1] else None


def from_results(m: Model, paths: Sequence[str]) -> Model:
    """The inputs a serving results file measured (``rows`` with ``tier_stats`` and
    ``decode_profile``): PCIe bytes per host-homed request and step from a tier row at the
    context (rows whose KV was all on the host first, then rows with the locality limit), GEMM
    and attention time per request from a decode profile at the context (fp8 KV first), and
    the GPU's KV bytes from that row."""
    rows: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += [dict(r, _file=os.path.basename(path)) for r in data.get("rows", [])]
    prov = dict(m.provenance)
    updates: dict[str, Any] = {}

    def at_context(candidates: list[dict[str, Any]]) -> list[dict[str, Any]]:
        same = [r for r in candidates if r.get("input_len") == m.context]
        return same or sorted(candidates, key=lambda r: r.get("input_len") or 0)[-1:]

    tier = [r for r in rows if (r.get("tier_stats") or {}).get("decode_steps")
            and (r["tier_stats"].get("transferred_bytes") or 0) > 0]
    if tier:
        def rank(r: dict[str, Any]) -> tuple[int, int]:
            cfg = r.get("config", "")
            on_host = int(_flag(cfg, "--sparse-tier-gpu-tokens") or 0)
            return (0 < on_host <= 64, "--sparse-locality-new-blocks" in cfg)

        row = max(at_context(tier), key=rank)
        ts, cfg = row["tier_stats"], row.get("config", "")
        all_on_host = 0 < int(_flag(cfg, "--sparse-tier-gpu-tokens") or 0) <= 64
        n = (row.get("concurrency") if all_on_host else ts.get("requests_tiered")) or 1
        per_request = ts["transferred_bytes"] / ts["decode_steps"] / n
        fp8_row = (_flag(cfg, "--kv-cache-dtype") or "").startswith("fp8")
        if not fp8_row and m.kv_bytes == 1.0:
            per_request /= 2  # a 16-bit row projected to an fp8 host copy
        updates["pcie_bytes_per_request"] = per_request
        prov["pcie_bytes_per_request"] = (
            f"{row['_file']}: {row.get('backend')} at {row.get('input_len')}, "
            f"{ts['transferred_bytes'] / ts['decode_steps'] / 1e6:.1f} MB per step over {n} "
            f"{'host-homed' if all_on_host else 'tiered (some may be GPU-homed)'} requests"
            + ("" if fp8_row or m.kv_bytes != 1.0 else ", halved for fp8"))
    profiled = [r for r in rows if (r.get("decode_profile") or {}).get("step_ms")
                and (r["decode_profile"].get("categories") or {}).get("gemm")
                and r.get("backend", "").startswith("sglang_ext")]
    if profiled:
        fp8 = [r for r in profiled if "fp8" in (_flag(r.get("config", ""), "--kv-cache-dtype")
                                                or "")]
        row = at_context(fp8 or profiled)[-1]
        prof = row["decode_profile"]
        running = prof.get("running") or row.get("server_max_running") or 1
        gemm = prof["categories"]["gemm"]
        updates.update(gemm_ms=gemm, attn_ms_per_request=(prof["step_ms"] - gemm) / running)
        prov["gemm_ms"] = prov["attn_ms_per_request"] = (
            f"{row['_file']}: {row.get('backend')} at {row.get('input_len')}, step "
            f"{prof['step_ms']:.2f} ms with {running} requests, GEMMs {gemm:.2f} ms")
        if row.get("device_kv_gb"):
            # the overhead that reproduces the measured device KV at TP=1
            overhead = (m.gpu_gib * GIB * m.mem_fraction - m.weights_gb * 1e9) / 1e9 \
                - row["device_kv_gb"]
            updates["gpu_overhead_gb"] = overhead
            prov["gpu_overhead_gb"] = (f"{row['_file']}: device KV {row['device_kv_gb']} GB "
                                       f"at TP=1")
    return replace(m, provenance=prov, **updates)


# --------------------------------------------------------------------------- CLI

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Every model parameter's default and where it comes from: "
               "docs/tier-projection.md.")
    p.add_argument("--hosts", default=DEFAULT_HOSTS,
                   help=f"host memory sizes, comma separated (default {DEFAULT_HOSTS})")
    p.add_argument("--tp", default="1,2", help="tensor-parallel degrees to project (default 1,2)")
    p.add_argument("--from-results", action="append", default=[], metavar="FILE",
                   help="a serving results JSON (benchmarks/results/serving/, locality/) whose "
                        "rows carry tier_stats / decode_profile: their measured per-request "
                        "costs replace the defaults (repeatable)")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON to write (a PNG beside it)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--use-bound", action="store_true",
                   help="project with the admission's bound on the PCIe bytes per request "
                        "(--locality-new-blocks + 1 blocks per layer and kv head) instead of the "
                        "measured figure")
    defaults = Model()
    for f in Model.__dataclass_fields__.values():
        if f.name == "provenance":
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                       default=None, help=f"model parameter (default {getattr(defaults, f.name)})")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace) -> Model:
    m = Model()
    if args.from_results:
        m = from_results(m, args.from_results)
    given = {name: getattr(args, name) for name in Model.__dataclass_fields__
             if name != "provenance" and getattr(args, name, None) is not None}
    prov = dict(m.provenance, **{k: "command line" for k in given})
    m = replace(m, provenance=prov, **given)
    if args.use_bound:
        prov = dict(m.provenance, pcie_bytes_per_request="the admission's bound (--use-bound)")
        m = replace(m, provenance=prov, pcie_bytes_per_request=m.pcie_bound_bytes_per_request)
    return m


def run(m: Model, hosts: Sequence[float], tps: Sequence[int]) -> dict[str, Any]:
    return {
        "note": "a model, not a measurement: docs/tier-projection.md",
        "model": {k: v for k, v in asdict(m).items() if k != "provenance"},
        "provenance": m.provenance,
        "derived": {"request_kv_gb": round(m.request_kv_bytes / 1e9, 3),
                    "working_set_gb": round(m.working_set_bytes / 1e9, 3),
                    "pcie_bound_mb_per_request_step": round(m.pcie_bound_bytes_per_request / 1e6,
                                                            1),
                    "hbm_mb_per_request_step": round(m.hbm_bytes_per_request / 1e6, 1)},
        "untiered": [untiered(m, tp) for tp in tps],
        "rows": [project(m, h, tp, term) for term in (True, False) for tp in tps
                 for h in hosts],
    }


def plot(result: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for tp in sorted({r["tp"] for r in result["rows"]}):
        for admission, style in (("pcie_term", "o-"), ("no_term", "x--")):
            rows = [r for r in result["rows"] if r["tp"] == tp and r["admission"] == admission]
            x = [r["host_gb"] for r in rows]
            label = f"TP={tp}, " + ("PCIe term" if admission == "pcie_term" else "no term")
            ax1.plot(x, [r["requests_decoding"] for r in rows], style, label=label)
            ax2.plot(x, [r["tok_s"] for r in rows], style, label=label)
            if admission == "pcie_term":
                for r in rows:
                    ax2.annotate(r["bound"], (r["host_gb"], r["tok_s"]), xytext=(0, 6),
                                 textcoords="offset points", ha="center", fontsize=8)
        base = next(u for u in result["untiered"] if u["tp"] == tp)
        ax2.axhline(base["tok_s"], ls=":", color=ax2.lines[-1].get_color(),
                    label=f"TP={tp}, untiered fp8")
    hosts = sorted({r["host_gb"] for r in result["rows"]})
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xticks(hosts, [f"{h:g}" for h in hosts])
        ax.minorticks_off()
        ax.set_xlabel("host memory (GB)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax1.set_ylabel(f"requests decoding at {result['model']['context'] // 1024}k")
    ax2.set_ylabel("decode tok/s (projected)")
    fig.suptitle("CPU tier projection (a model, not a measurement)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        hosts = [parse_size(h) for h in args.hosts.split(",") if h.strip()]
        tps = [int(t) for t in args.tp.split(",") if t.strip()]
    except ValueError as e:
        print(f"tier_projection: {e}", file=sys.stderr)
        return 2
    result = run(build_model(args), hosts, tps)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plotted = not args.no_plot and plot(result, png)
    head = ("admission", "host_gb", "tp", "physical_limit", "requests_decoding", "host_homed",
            "step_ms", "bytes_per_step", "tok_s", "tok_s_vs_untiered", "bound")
    print(" ".join(f"{h[:12]:>12}" for h in head))
    for r in result["rows"]:
        print(" ".join(f"{r[h]!s:>12}" for h in head))
    for u in result["untiered"]:
        print(f"untiered fp8 TP={u['tp']}: {u['requests']} requests, {u['step_ms']} ms, "
              f"{u['tok_s']} tok/s")
    print(f"wrote {args.out}" + (f" and {png}" if plotted else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
