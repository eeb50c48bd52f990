#!/usr/bin/env python
"""Operator benchmark of one attention layer's decode step (GPU only).

For Qwen3-8B layer shapes (32 q heads, 8 kv heads, head dim 128, bf16) and every
(context, batch) of ``--contexts`` x ``--batches`` it times, in one run:

* ``ours``: ``sparse_decode_batched`` (summary-based selection + sparse attention over the
  ``--budget`` selected tokens); the page summaries are built beforehand (their maintenance is
  part of the KV write, not of this step);
* ``flashinfer``: SGLang's FlashInfer full decode: ``BatchDecodeWithPagedKVCacheWrapper``,
  NHD layout, page size ``--fi-page-size``, tensor cores when the GQA group is >= 4 (SGLang's
  ``should_use_tensor_core``), fa2 backend, ``plan`` once, ``run`` timed;
* ``triton``: SGLang's Triton full decode ``decode_attention_fwd``
  (sglang.kernels.ops.attention.decode_attention), page size 1, ``num_kv_splits`` from
  SGLang's ``get_num_kv_splits_triton`` with 8 max splits (SGLang's defaults);
* ``floor``: the bytes our path must read (selected K/V + block summaries, 2 bytes per value
  in bf16 (the default ``--summary-dtype``) + label channels + index lookups + q/out) divided
  by the HBM bandwidth measured in the same run with a large device-to-device copy.

Timing: CUDA events around each call, warmup, median of ``--iters``, L2 flushed before every
timed call, each operator captured in a CUDA graph (``--no-graphs`` for eager). One layer's
KV for the largest case (128k x 32 x 8 heads x 128 x 2 B x 2 = 16 GiB) is allocated once and
shared. Writes ``<out>/operator_h200.json`` and ``<out>/operator_h200.png`` and prints a table.

``--check`` first compares ours against the plain-torch reference (and the two baselines
against a dense reference) on small cases and exits non-zero on a mismatch: the page summaries
(kept in ``--summary-dtype``, maintained by the atomic-free update) against the keys' block
min/max, the selected sets against the oracle's, and the selection variants (float32
summaries, unfused top-k + assembly, 6-bit radix, tensor-core block scores) against the default
path. Variants are timed as extra ``ours_*`` columns (``--compare-*`` options).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

HQ, HKV, HEAD_DIM = 32, 8, 128  # Qwen3-8B
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "operator")


POOL_TOKEN_CAP = 1 << 20


def add_case_args(p: argparse.ArgumentParser) -> None:
    """The cases and selection settings every operator benchmark takes (MHA and MLA)."""
    p.add_argument("--contexts", default="32768,65536,131072", help="comma-separated contexts")
    p.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--method", default="two_level", choices=["two_level", "quest", "ds"])
    p.add_argument("--block-score", default="label_max", choices=["bound", "label_max"],
                   help="two_level's block filter (--sparse-block-score; default: %(default)s)")
    p.add_argument("--candidate-blocks", type=int, default=0,
                   help="two_level candidate blocks (0 = the server's automatic value)")
    p.add_argument("--rerank", type=int, default=0,
                   help="--sparse-rerank's factor for ds / two_level (0 = off)")
    p.add_argument("--prefilter", type=int, default=0,
                   help="--sparse-block-prefilter's factor for two_level by label_max (0 = off)")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    p.add_argument("--tag", default="", help="file name suffix: operator_h200_<tag>.json")
    add_case_args(p)
    p.add_argument("--label-channels", type=int, default=16,
                   help="label channels per kv head (0 = all channels)")
    p.add_argument("--topk-impl", default="triton", choices=["triton", "torch"])
    p.add_argument("--compare-topk", action=argparse.BooleanOptionalAction, default=True,
                   help="also time ours with the other top-k implementation (default: on)")
    p.add_argument("--summary-dtype", default="bf16", choices=list(SUMMARY_DTYPES),
                   help="dtype of the per-page key min/max summaries (default: the KV dtype; "
                        "fp8: --sparse-summary-dtype fp8_e4m3, min down / max up)")
    p.add_argument("--compare-summary-dtype", nargs="?", const="other", default=None,
                   choices=["other", *SUMMARY_DTYPES],
                   help="also time ours with summaries in this dtype (alone: the other of "
                        "bf16 / fp32)")
    p.add_argument("--compare-block-score", action=argparse.BooleanOptionalAction, default=True,
                   help="two_level: also time ours with the other block filter (default: on)")
    p.add_argument("--label-dtype", default="auto", choices=["auto", "fp8_e4m3"],
                   help="the label cache's storage (--sparse-label-dtype)")
    p.add_argument("--key-scale", type=float, default=1.0,
                   help="scale of the random keys (SGLang's dummy weights give keys of ~1e-3, "
                        "which fp8 labels round mostly to 0: tied token scores)")
    p.add_argument("--scatter-selected", action=argparse.BooleanOptionalAction, default=True,
                   help="the fused top-k scatters the winners' slots that the token scoring "
                        "left (default: on; off: it assembles them from the winners)")
    p.add_argument("--compare-scatter", action=argparse.BooleanOptionalAction, default=True,
                   help="also time ours with the other --scatter-selected")
    p.add_argument("--topk-radix-bits", type=int, default=None, choices=[5, 6, 7, 8],
                   help="digit width of both Triton radix top-k (see kernels/topk.py; default: "
                        "each its own, BLOCK_TOPK_RADIX_BITS / TOKEN_TOPK_RADIX_BITS in "
                        "kernels/sparse_decode.py)")
    p.add_argument("--assemble-tile", type=int, default=None,
                   help="slots the fused top-k's assembly writes per pass (default: "
                        "kernels/sparse_decode.py's ASSEMBLE_TILE)")
    p.add_argument("--fuse-assemble", action=argparse.BooleanOptionalAction, default=True,
                   help="run the last top-k and the slot assembly as one kernel (default: on)")
    p.add_argument("--block-score-precision", default="auto",
                   choices=["auto", "fma", "ieee", "tf32x3", "tc", "tc_fp16"],
                   help="how Quest block scores are computed (see block_scores.py; tc_fp16: "
                        "fp8 summaries only)")
    p.add_argument("--compare-block-score-precision", default="fma",
                   choices=["none", "fma", "ieee", "tf32x3", "tc", "tc_fp16"],
                   help="also time ours (full and select only) with this block-score precision "
                        "(default: fma, fp32 multiply-adds; auto is tc, the tensor-core GEMMs, "
                        "for bf16 summaries, tc_fp16 for fp8 ones; none: skip)")
    p.add_argument("--fi-page-size", type=int, default=16, choices=[1, 16, 32, 64])
    p.add_argument("--fi-tensor-cores", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--triton-max-kv-splits", type=int, default=8,
                   help="SGLang --triton-attention-num-kv-splits (default 8)")
    p.add_argument("--compare-basis", action=argparse.BooleanOptionalAction, default=True,
                   help="also time ours with a label basis's rotation of q and k in front "
                        "(ours_basis_ms)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-graphs", action="store_true", help="time eager calls, no CUDA graphs")
    p.add_argument("--skip-flashinfer", action="store_true")
    p.add_argument("--skip-triton", action="store_true")
    p.add_argument("--label-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="token scores read the label cache (kernels/label_cache.py) instead of "
                        "gathering the label channels from the keys; with --compare-label-cache "
                        "the other way is timed too")
    p.add_argument("--compare-label-cache", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each stage of ours alone (block scores, block top-k, token "
                        "scores; token top-k + assembly and attention as differences)")
    p.add_argument("--fi-sparse", action=argparse.BooleanOptionalAction, default=True,
                   help="also time our selection + FlashInfer's paged decode over the selected "
                        "slots (the issue's optional second attention implementation)")
    p.add_argument("--check", action="store_true",
                   help="run the correctness checks first; exit non-zero if they fail")
    p.add_argument("--check-only", action="store_true", help="run the checks and exit")
    p.add_argument("--time-limit", type=float, default=330.0,
                   help="seconds; remaining cases are skipped past it (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- utilities


def _commit() -> str:
    if os.environ.get("SGLANG_EXT_COMMIT"):
        return os.environ["SGLANG_EXT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - git missing or not a checkout
        return "unknown"


def _versions() -> dict:
    out = {}
    for name in ("torch", "triton", "flashinfer", "sglang"):
        try:
            mod = __import__(name)
            out[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            out[name] = f"unavailable: {type(e).__name__}"
    return out


class Timer:
    """Median GPU time of a callable (optionally a captured CUDA graph), L2 flushed between
    calls, CUDA events around each call only."""

    def __init__(self, torch, warmup: int, iters: int, graphs: bool, device="cuda"):
        self.torch = torch
        self.warmup, self.iters, self.graphs = warmup, iters, graphs
        self.flush_buf = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)

    @property
    def mode(self) -> str:
        return "graph" if self.graphs else "eager"

    def capture(self, fn, graph: bool = True):
        """fn -> a replay callable (a CUDA graph of fn) or fn itself when eager."""
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()  # compiles / JITs outside the graph
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if not (self.graphs and graph):
            return fn
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fn()
        torch.cuda.synchronize()
        self._keep = getattr(self, "_keep", []) + [cuda_graph]
        return cuda_graph.replay

    def time_ms(self, run) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            run()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for s, e in zip(starts, ends):
            self.flush_buf.zero_()
            s.record()
            run()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))

    def release(self):
        self._keep = []


def _time_operator(timer, build):
    """(median ms or None, "graph"/"eager"/"failed", one output) of the operator ``build()``
    returns; a CUDA-graph capture failure falls back to eager timing."""
    try:
        fn = build()
    except Exception:  # noqa: BLE001 - a baseline that cannot be set up is reported, not fatal
        traceback.print_exc()
        return None, "failed", None
    modes = ["graph", "eager"] if timer.graphs else ["eager"]
    for mode in modes:
        try:
            run = timer.capture(fn, graph=mode == "graph")
            ms = timer.time_ms(run)
            out = fn()
            out = out[0] if isinstance(out, tuple) else out
            return ms, mode, out.clone()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            print(f"  ({mode} timing failed)")
    return None, "failed", None


def measure_bandwidth(torch, gib: float = 2.0, iters: int = 10, device="cuda") -> float:
    """HBM bandwidth in bytes/s from a large device-to-device copy (read + write)."""
    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / statistics.median(times)


def selection_params(args):
    from sglang_ext.selection.params import SelectionParams

    from sglang_ext.config import SparseConfig

    rerank = args.rerank if args.method in ("ds", "two_level") else 0
    cand = args.candidate_blocks or SparseConfig(
        budget=args.budget, sink=args.sink, window=args.window, block_size=args.block_size,
        rerank=rerank).effective_candidate_blocks
    return SelectionParams(args.method, args.budget, args.block_size, cand, args.sink,
                           args.window, label_dtype=args.label_dtype,
                           summary_dtype=SUMMARY_PARAM[args.summary_dtype],
                           block_score=args.block_score if args.method == "two_level"
                           else "bound", rerank=rerank, prefilter=prefilter_factor(args))


def prefilter_factor(args) -> int:
    """--prefilter where the cascade applies (two_level by label_max), else 0."""
    applies = args.method == "two_level" and args.block_score == "label_max"
    return args.prefilter if applies else 0


SUMMARY_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn"}
# --summary-dtype -> SelectionParams.summary_dtype (how the reference rounds the summaries)
SUMMARY_PARAM = {"bf16": "auto", "fp32": "auto", "fp8": "fp8_e4m3"}


def selection_config(params) -> dict:
    """The selection settings a results file records."""
    return {"method": params.method, "budget": params.budget, "block_size": params.block_size,
            "sink": params.sink, "window": params.window,
            "candidate_blocks": params.candidate_blocks, "block_score": params.block_score,
            "rerank": params.rerank, "prefilter": params.prefilter}


def summary_bytes_per_value(name: str) -> int:
    return {"bf16": 2, "fp32": 4, "fp8": 1}[name]


def floor_bytes(params, batch: int, context: int, num_channels: int,
                summary_bytes: int = 2, *, num_q_heads: int = HQ, num_kv_heads: int = HKV,
                key_dim: int = HEAD_DIM, value_dim: int = HEAD_DIM,
                stored_value_dim: int | None = None) -> int:
    """Bytes the sparse path must move for one layer's decode step of this batch
    (``summary_bytes`` per summary value: 2 for bf16 summaries, 4 for float32). The head
    shape defaults to Qwen3-8B's; ``stored_value_dim`` is what a selected row holds beside its
    key (default ``value_dim``; 0 for MLA, whose values are a view of the key rows)."""
    stored_value_dim = value_dim if stored_value_dim is None else stored_value_dim
    bs = params.block_size
    blocks = -(-context // bs)
    sel_kv = batch * num_kv_heads * min(params.budget, context) * (key_dim + stored_value_dim) * 2
    qo = batch * num_q_heads * (key_dim + value_dim) * 2
    summaries = labels = index = 0
    if params.block_score == "label_max":  # every middle token's label channels
        labels = batch * num_kv_heads * context * num_channels * 2
        index += batch * blocks * 4  # page of each block
    elif params.method in ("quest", "two_level"):
        summaries = batch * num_kv_heads * blocks * key_dim * summary_bytes * 2  # kmin + kmax
        index += batch * blocks * 4  # page of each block
    if params.method == "two_level":
        cand_tok = min(params.candidate_blocks, blocks) * bs
        labels += batch * num_kv_heads * cand_tok * num_channels * 2
        index += batch * num_kv_heads * cand_tok * 4  # slot of each candidate token
    elif params.method == "ds":
        labels = batch * num_kv_heads * context * num_channels * 2
        index += batch * context * 4
    index += batch * num_kv_heads * params.budget * 4  # slots of the selected tokens
    return sel_kv + qo + summaries + labels + index


def build_page_summaries(torch, k_buffer, block_size: int, dtype):
    """``(kmin, kmax)`` of every page of a one-layer pool ``[slots, Hkv, D]`` (whole pages)."""
    from sglang_ext.kernels.block_summary import allocate_block_summaries, update_block_summaries

    num_slots, num_kv_heads, head_dim = k_buffer.shape
    dev = k_buffer.device
    kmin, kmax = allocate_block_summaries(num_slots, num_kv_heads, head_dim, block_size,
                                          device=dev, dtype=dtype)
    chunk = 1 << 20
    for s in range(0, num_slots, chunk):  # every page is whole: its first slot resets it
        e = min(s + chunk, num_slots)
        update_block_summaries(kmin, kmax, k_buffer[s:e], torch.arange(s, e, device=dev),
                               block_size)
    return kmin, kmax


def random_request_slots(torch, batch: int, context: int, block_size: int, num_slots: int,
                         gen, device):
    """``req_to_token`` int32 ``[batch, context]``: each request on random whole pages of the
    pool (page 0 is the padding page); disjoint while the pool has room, otherwise distinct
    pages within a request, shared between requests."""
    bs = block_size
    pages_per_req = -(-context // bs)
    num_pages = num_slots // bs - 1
    if batch * pages_per_req <= num_pages:  # disjoint pages
        perm = torch.randperm(num_pages, device=device, generator=gen) + 1
        pages = perm[: batch * pages_per_req].view(batch, pages_per_req)
    else:  # distinct pages within a request, shared between requests
        pages = torch.stack([
            torch.randperm(num_pages, device=device, generator=gen)[:pages_per_req] + 1
            for _ in range(batch)])
    req_to_token = (pages[:, :, None] * bs + torch.arange(bs, device=device)).view(batch, -1)
    return req_to_token[:, :context].to(torch.int32).contiguous()


# ----------------------------------------------------------------------------- baselines


class FlashInferDecode:
    """SGLang's flashinfer backend decode: wrapper, plan once, run."""

    def __init__(self, torch, q, k_buffer, v_buffer, req_to_token, context, page_size,
                 tensor_cores, sm_scale, workspace):
        import flashinfer

        batch = q.shape[0]
        dev = q.device
        if page_size == 1:
            indices = req_to_token[:, :context].reshape(-1).to(torch.int32)
            pages_per_req = context
            last_page_len = torch.ones(batch, dtype=torch.int32, device=dev)
            self.kv_cache = (k_buffer, v_buffer)  # [slots, Hkv, D]: flashinfer adds page dim 1
        else:
            pages_per_req = -(-context // page_size)
            first_slots = req_to_token[:, : pages_per_req * page_size : page_size]
            indices = (first_slots // page_size).reshape(-1).to(torch.int32)
            last = (context - 1) % page_size + 1
            last_page_len = torch.full((batch,), last, dtype=torch.int32, device=dev)
            self.kv_cache = (
                k_buffer.view(-1, page_size, HKV, HEAD_DIM),
                v_buffer.view(-1, page_size, HKV, HEAD_DIM),
            )
        indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * pages_per_req
        self.buffers = (indptr, indices, last_page_len)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len,
            backend="fa2",
        )
        self.wrapper.plan(
            indptr,
            indices,
            last_page_len,
            HQ,
            HKV,
            HEAD_DIM,
            page_size,
            pos_encoding_mode="NONE",
            q_data_type=q.dtype,
            kv_data_type=k_buffer.dtype,
            sm_scale=sm_scale,
        )
        self.q = q
        self.out = torch.empty_like(q)

    def __call__(self):
        return self.wrapper.run(self.q, self.kv_cache, out=self.out)


class TritonDecode:
    """SGLang's triton backend decode (decode_attention_fwd), page size 1."""

    def __init__(self, torch, q, k_buffer, v_buffer, req_to_token, context, max_kv_splits,
                 sm_scale):
        import triton

        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

        batch = q.shape[0]
        dev = q.device
        self.fwd = decode_attention_fwd
        self.kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * context
        self.kv_indices = req_to_token[:, :context].reshape(-1).to(torch.int32).contiguous()
        self.attn_logits = torch.empty(batch, HQ, max_kv_splits, HEAD_DIM, dtype=torch.float32,
                                       device=dev)
        self.attn_lse = torch.empty(batch, HQ, max_kv_splits, dtype=torch.float32, device=dev)
        self.num_kv_splits = torch.empty(batch, dtype=torch.int32, device=dev)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        # as TritonAttnBackend.get_num_kv_splits (num_group = 1 in plain decode)
        get_num_kv_splits_triton[(1,)](
            self.num_kv_splits,
            seq_lens,
            batch,
            1,
            HQ,
            HKV,
            max_kv_splits,
            sms,
            MAX_NUM_SEQ=256 if batch < 256 else triton.next_power_of_2(batch),
        )
        self.max_kv_splits = max_kv_splits
        self.q, self.k_buffer, self.v_buffer = q, k_buffer, v_buffer
        self.out = torch.empty_like(q)
        self.sm_scale = sm_scale

    def __call__(self):
        self.fwd(
            self.q,
            self.k_buffer,
            self.v_buffer,
            self.out,
            self.kv_indptr,
            self.kv_indices,
            self.attn_logits,
            self.attn_lse,
            self.num_kv_splits,
            self.max_kv_splits,
            self.sm_scale,
            1.0,  # k_scale
            1.0,  # v_scale
        )
        return self.out


class FlashInferSparseDecode:
    """FlashInfer's paged decode over our selected slots: each (request, kv head) is one
    FlashInfer request with one kv head and its group of query heads, page size 1, its pages
    being the selected slots (slot * Hkv + kv head in the pool viewed as [slots * Hkv, 1, D]).
    The index pointer is static (budget per row), so plan() runs once and the run replays in a
    CUDA graph after the selection writes the indices. Needs every selected slot valid (rows
    longer than the budget: no -1 padding), which holds for the benchmark's contexts."""

    def __init__(self, torch, select, q, k_buffer, v_buffer, budget, sm_scale, workspace):
        import flashinfer

        batch, dev = q.shape[0], q.device
        rows = batch * HKV
        self.select = select  # () -> int32 [B, Hkv, budget] slots
        self.head = torch.arange(HKV, dtype=torch.int32, device=dev)[None, :, None]
        self.indices = torch.zeros(rows * budget, dtype=torch.int32, device=dev)
        indptr = torch.arange(rows + 1, dtype=torch.int32, device=dev) * budget
        last_page_len = torch.ones(rows, dtype=torch.int32, device=dev)
        self.kv_cache = (k_buffer.view(-1, 1, 1, HEAD_DIM), v_buffer.view(-1, 1, 1, HEAD_DIM))
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=last_page_len, backend="fa2")
        self.wrapper.plan(indptr, self.indices, last_page_len, HQ // HKV, 1, HEAD_DIM, 1,
                          pos_encoding_mode="NONE", q_data_type=q.dtype,
                          kv_data_type=k_buffer.dtype, sm_scale=sm_scale)
        self.q = q.view(rows, HQ // HKV, HEAD_DIM)
        self.out = torch.empty_like(self.q)

    def __call__(self):
        slots = self.select()
        self.indices.copy_((slots * HKV + self.head).view(-1))
        self.wrapper.run(self.q, self.kv_cache, out=self.out)
        return self.out.view(-1, HQ, HEAD_DIM)


def stage_builders(q, k_buffer, req_to_token, req_pool_indices, seq_lens, kmin, kmax, params,
                   channels, ws, select, labels=None):
    """(name, build) of each stage of our selection alone, reading the workspace's
    intermediates that one full ``select()`` call leaves behind (so each stage sees real
    inputs). The token top-k + slot assembly (one fused kernel) and the attention are timed
    as differences: select - stages, ours - select. With a rerank the token stages list the
    shortlist, and its two stages (exact scores, top budget of them) are timed alone too. With
    the cascade (``params.prefilter``) the block filter is four stages: the bound, its top
    pages, their label maximum, its top-k. Each stage returns a tensor (the timer keeps one
    output)."""
    from sglang_ext.kernels.block_scores import quest_block_scores_batched
    from sglang_ext.kernels.token_scores import (
        label_max_block_scores_batched,
        label_token_scores_batched,
    )
    from sglang_ext.kernels.topk import topk_masked

    batch, bs = q.shape[0], params.block_size
    select()  # fills ws.block_scores / ws.top_blocks for the stages below
    out = []

    def bound_scores():
        return quest_block_scores_batched(
            q, kmin, kmax, req_to_token, req_pool_indices, seq_lens, bs, params.sink,
            params.window, ws.max_blocks, out=ws.block_scores[:batch],
            precision=ws.block_score_precision)

    def label_max_scores(cand=None, scores_out=None):
        return label_max_block_scores_batched(
            q, labels if labels is not None else k_buffer, req_to_token, req_pool_indices,
            seq_lens, bs, params.sink, params.window, ws.max_blocks, channels=channels,
            out=ws.block_scores[:batch] if scores_out is None else scores_out,
            keys_are_labels=labels is not None, cand=cand)

    if ws.k_prefilter:  # the cascade: the bound's top pages, their label maximum, its top-k
        pre = ws.prefilter_top[:batch]
        out.append(("block_bound", lambda: bound_scores))
        out.append(("block_prefilter_topk", lambda: lambda: topk_masked(
            ws.block_scores[:batch], ws.k_prefilter, out=pre, impl=ws.topk_impl,
            radix_bits=ws.block_topk_radix_bits)))
        out.append(("block_scores", lambda: lambda: label_max_scores(
            pre, ws.prefilter_scores[:batch])))
        out.append(("block_topk", lambda: lambda: topk_masked(
            ws.prefilter_scores[:batch], ws.k_blocks, out=ws.prefilter_pick[:batch],
            impl=ws.topk_impl, radix_bits=ws.block_topk_radix_bits)))
    elif ws.k_blocks and params.block_score == "label_max":
        out.append(("block_scores", lambda: label_max_scores))
    elif ws.k_blocks:
        out.append(("block_scores", lambda: bound_scores))
    if ws.k_blocks and not ws.k_prefilter:
        if ws.k_tokens:  # otherwise the block top-k is the fused last top-k
            out.append(("block_topk", lambda: lambda: topk_masked(
                ws.block_scores[:batch], ws.k_blocks, out=ws.top_blocks[:batch],
                impl=ws.topk_impl, radix_bits=ws.block_topk_radix_bits)))
    if ws.k_tokens:
        cand = ws.top_blocks[:batch] if ws.k_blocks else None
        # as select_slots_batched: the label cache (queries read at its channels), or the keys'
        # channels gathered from the pool
        tok_keys = labels if labels is not None else k_buffer
        out.append(("token_scores", lambda: lambda: label_token_scores_batched(
            q, tok_keys, req_to_token, req_pool_indices, seq_lens, cand, bs, params.sink,
            params.window, channels=channels, num_blocks=ws.max_blocks,
            scores_out=ws.token_scores[:batch], return_positions=False,
            keys_are_labels=labels is not None,
            cand_slots_out=ws.cand_slots[:batch] if ws.scatter_selected else None)[0]))
    if params.rerank:  # the exact scores of the shortlist, then its top budget entries
        from sglang_ext.kernels.rerank import exact_rerank_scores, take_top

        slots, positions = ws.slots[:batch], ws.positions[:batch]
        out.append(("rerank_scores", lambda: lambda: exact_rerank_scores(
            q, k_buffer, slots, positions, seq_lens, params, ws.rerank_scores[:batch])))

        def take_best():
            take_top(slots, positions, ws.rerank_scores[:batch], params.budget,
                     ws.rerank_top[:batch], ws.reranked_slots[:batch],
                     ws.reranked_positions[:batch], impl=ws.topk_impl)
            return ws.reranked_slots[:batch]  # the timer keeps one output

        out.append(("rerank_take_top", lambda: take_best))
    return out


# ----------------------------------------------------------------------------- check


def run_check(args) -> bool:
    """Ours vs the plain-torch oracle on small cases at the real head shapes, and the two
    baselines vs a dense reference (where ours is dense too: L <= budget)."""
    import torch

    from sglang_ext.kernels.sparse_decode import (
        DecodeRows,
        LayerCache,
        SparseDecodeWorkspace,
        select_slots_batched,
        sparse_decode_batched,
        sparse_decode_batched_ref,
    )
    from sglang_ext.kernels.testing import case_generator, make_paged_batch, random_values
    from sglang_ext.selection.reference import SelectionParams, block_minmax, round_summaries

    ok = True
    bs = args.block_size
    summary_dtype = getattr(torch, SUMMARY_DTYPES[args.summary_dtype])
    sm_scale = HEAD_DIM ** -0.5
    lens = [args.budget // 2, args.budget + 1, 3 * args.budget + 5]
    base = selection_params(args)
    for method in ("quest", "ds", "two_level"):
        params = SelectionParams(method, base.budget, bs, base.candidate_blocks, base.sink,
                                 base.window, summary_dtype=base.summary_dtype,
                                 block_score=base.block_score if method == "two_level"
                                 else "bound", rerank=base.rerank if method != "quest" else 0,
                                 prefilter=base.prefilter if method == "two_level" else 0)
        for use_channels in (False, True):
            gen = case_generator("bench-check", method, use_channels)
            pb = make_paged_batch(gen, lens, HKV, HEAD_DIM, bs, dtype=torch.bfloat16,
                                  device="cuda", dyadic=True, summary_chunks=4,
                                  summary_dtype=summary_dtype)
            bad_pages = 0  # pages whose maintained summary differs from the keys' block min/max
            for b, length in enumerate(lens):
                row = int(pb.req_pool_indices[b])
                pages = pb.req_to_token[row, :length:bs].long() // bs
                ref_min, ref_max = round_summaries(*block_minmax(pb.keys(b), bs),
                                                   params.summary_dtype)
                bad_pages += int(((pb.kmin[pages].float() != ref_min)
                                  | (pb.kmax[pages].float() != ref_max)).flatten(1).any(1).sum())
            q = random_values(gen, len(lens), HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda",
                              dyadic=True)
            channels = None
            if use_channels:
                r = args.label_channels or HEAD_DIM
                channels = torch.stack([torch.randperm(HEAD_DIM, generator=gen)[:r]
                                        for _ in range(HKV)]).cuda()
            cache = LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax, channels=channels)
            rows = DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens)
            out = sparse_decode_batched(q, cache, rows, params, sm_scale)
            ref, _, masks = sparse_decode_batched_ref(
                q, pb.k_buffer, pb.v_buffer, pb.req_to_token, pb.req_pool_indices, pb.seq_lens,
                params, sm_scale, channels)
            _, pos = select_slots_batched(q, cache, rows, params, return_positions=True)
            bad_sets = 0  # (request, kv head) pairs whose selected set differs from the oracle
            for b in range(len(lens)):
                for g in range(HKV):
                    got = pos[b, g][pos[b, g] >= 0].long().sort().values
                    bad_sets += not torch.equal(got, masks[b][g].nonzero().flatten())
            # the selection variants pick the very same slots
            slots = select_slots_batched(q, cache, rows, params).clone()
            variants = {
                "fp32-summaries": dict(kmin=pb.kmin.float(), kmax=pb.kmax.float()),
                "unfused": dict(fuse_assemble=False),
                "radix6": dict(topk_radix_bits=6),
            }
            if channels is not None:  # token scores from the label cache: the same slots
                from sglang_ext.kernels.label_cache import allocate_label_cache, update_label_cache

                labels = allocate_label_cache(pb.k_buffer.shape[0], HKV, channels.shape[1],
                                              "cuda", pb.k_buffer.dtype)
                update_label_cache(labels, pb.k_buffer, torch.arange(pb.k_buffer.shape[0],
                                                                     device="cuda"), channels)
                variants["label-cache"] = dict(labels=labels)
            if method != "ds" and pb.kmin.dtype == torch.bfloat16:
                # tensor-core block scores: dyadic values make every sum exact in any order
                variants["tc-scores"] = dict(block_score_precision="tc")
            bad_variants = []
            for name, kw in variants.items():
                ws = SparseDecodeWorkspace(
                    len(lens), HQ, HKV, HEAD_DIM, params, pb.max_blocks, "cuda", torch.bfloat16,
                    fuse_assemble=kw.get("fuse_assemble", True),
                    topk_radix_bits=kw.get("topk_radix_bits"),
                    block_score_precision=kw.get("block_score_precision"))
                variant = LayerCache(pb.k_buffer, pb.v_buffer, kw.get("kmin", pb.kmin),
                                     kw.get("kmax", pb.kmax), channels=channels,
                                     labels=kw.get("labels"))
                other = select_slots_batched(q, variant, rows, params, workspace=ws)
                if not torch.equal(other, slots):
                    bad_variants.append(name)
            err = (out.float() - ref.float()).abs().max().item()
            good = err <= 2e-2 and bad_sets == 0 and bad_pages == 0 and not bad_variants
            ok &= good
            print(f"[check] ours {method:9s} labels={use_channels!s:5s} max|diff|={err:.2e} "
                  f"set mismatches={bad_sets} summary mismatches={bad_pages} "
                  f"variant mismatches={bad_variants or 0} {'ok' if good else 'FAIL'}")

    # baselines on a dense case: ours (L <= budget is dense) == flashinfer == triton == torch
    gen = case_generator("bench-check-dense")
    ctx = min(args.budget, 1024)
    pb = make_paged_batch(gen, [ctx] * 2, HKV, HEAD_DIM, bs, dtype=torch.bfloat16,
                          device="cuda", max_context=ctx, summary_chunks=1,
                          summary_dtype=summary_dtype)
    q = random_values(gen, 2, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    ref = torch.stack([
        torch.nn.functional.scaled_dot_product_attention(
            q[b, :, None].float(), pb.keys(b).transpose(0, 1).float().repeat_interleave(4, 0),
            pb.values(b).transpose(0, 1).float().repeat_interleave(4, 0), scale=sm_scale,
        )[:, 0]
        for b in range(2)
    ])
    results = {"ours": sparse_decode_batched(
        q, LayerCache(pb.k_buffer, pb.v_buffer, pb.kmin, pb.kmax),
        DecodeRows(pb.req_to_token, pb.req_pool_indices, pb.seq_lens), base, sm_scale)}
    r2t = pb.req_to_token[pb.req_pool_indices]
    if not args.skip_flashinfer:
        try:
            ws = torch.zeros(512 << 20, dtype=torch.uint8, device="cuda")
            tc = _tensor_cores(args)
            for ps in sorted({1, args.fi_page_size}):  # the pool's pages are bs slots
                results[f"flashinfer_ps{ps}"] = FlashInferDecode(
                    torch, q, pb.k_buffer, pb.v_buffer, r2t, ctx, ps, tc, sm_scale, ws)()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            print("[check] flashinfer baseline FAILED to run")
            ok = False
    if not args.skip_triton:
        try:
            results["triton"] = TritonDecode(torch, q, pb.k_buffer, pb.v_buffer, r2t, ctx,
                                              args.triton_max_kv_splits, sm_scale)()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            print("[check] triton baseline FAILED to run")
            ok = False
    torch.cuda.synchronize()
    for name, out in results.items():
        err = (out.float() - ref).abs().max().item()
        good = err <= 2e-2
        ok &= good
        print(f"[check] dense L={ctx}: {name:15s} vs torch max|diff|={err:.2e} "
              f"{'ok' if good else 'FAIL'}")
    return ok


def _tensor_cores(args) -> bool:
    if args.fi_tensor_cores == "auto":
        return HQ // HKV >= 4  # SGLang's should_use_tensor_core for bf16 KV
    return args.fi_tensor_cores == "on"


# ----------------------------------------------------------------------------- benchmark


def run_benchmark(args, device: str = "cuda") -> dict:
    import torch

    from sglang_ext.kernels.sparse_decode import (
        ASSEMBLE_TILE,
        DecodeRows,
        LayerCache,
        SparseDecodeWorkspace,
        select_slots_batched,
        sparse_decode_batched,
    )

    t_start = time.time()
    if args.assemble_tile is None:
        args.assemble_tile = ASSEMBLE_TILE
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    params = selection_params(args)
    bs = params.block_size
    sm_scale = 1.0 / math.sqrt(HEAD_DIM)
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(args.seed)

    bandwidth = measure_bandwidth(torch, device=dev)
    print(f"HBM bandwidth (d2d copy): {bandwidth / 1e9:.0f} GB/s")

    # One layer's pool, random bf16 K/V, summaries of every page. Capped: SGLang's Triton and
    # FlashInfer kernels index the pool with 32-bit offsets (slot x 1024 elements), which
    # overflows past 2M slots; a real H200 pool for Qwen3-8B holds ~750k tokens anyway. In the
    # largest cases requests then share pages, but each still streams its whole context from
    # HBM (far more than the 50 MB L2), so the timings stay honest.
    max_tokens = min(max(c * b for c in contexts for b in batches), POOL_TOKEN_CAP)
    num_slots = -(-max_tokens // bs) * bs + bs  # + the padding page
    k_buffer = torch.empty(num_slots, HKV, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    v_buffer = torch.empty_like(k_buffer)
    k_buffer.normal_(generator=gen)
    v_buffer.normal_(generator=gen)
    if args.key_scale != 1.0:
        k_buffer.mul_(args.key_scale)
    summary_names = [args.summary_dtype]
    if args.compare_summary_dtype == "other":
        summary_names.append("fp32" if args.summary_dtype == "bf16" else "bf16")
    elif args.compare_summary_dtype not in (None, args.summary_dtype):
        summary_names.append(args.compare_summary_dtype)
    summaries = {  # dtype name -> (kmin, kmax)
        name: build_page_summaries(torch, k_buffer, bs, getattr(torch, SUMMARY_DTYPES[name]))
        for name in summary_names}
    kmin, kmax = summaries[args.summary_dtype]
    torch.cuda.synchronize()
    r = args.label_channels or HEAD_DIM
    channels = None
    if args.label_channels:
        channels = torch.stack([torch.randperm(HEAD_DIM, device=dev, generator=gen)[:r]
                                for _ in range(HKV)])
    labels = None
    if channels is not None and params.method in ("two_level", "ds"):
        from sglang_ext.kernels.label_cache import allocate_label_cache, update_label_cache

        from sglang_ext.selection.params import label_storage_dtype

        labels = allocate_label_cache(num_slots, HKV, r, dev,
                                      label_storage_dtype(args.label_dtype, torch.bfloat16))
        for s in range(0, num_slots, 1 << 20):
            e = min(s + (1 << 20), num_slots)
            update_label_cache(labels, k_buffer[s:e], torch.arange(s, e, device=dev), channels)
    print(f"pool: {num_slots} slots, {2 * k_buffer.numel() * 2 / 2**30:.1f} GiB K/V, "
          f"{2 * kmin.numel() * kmin.element_size() / 2**30:.2f} GiB {args.summary_dtype} "
          f"summaries; setup {time.time() - t_start:.0f}s")

    timer = Timer(torch, args.warmup, args.iters, graphs=not args.no_graphs, device=dev)
    fi_workspace = torch.zeros(512 << 20, dtype=torch.uint8, device=dev)  # SGLang: 512 MB (Qwen3)
    tensor_cores = _tensor_cores(args)
    other_topk = "torch" if args.topk_impl == "triton" else "triton"
    block_precision = None if args.block_score_precision == "auto" else args.block_score_precision
    rows = []
    from sglang_ext.progress import counting, progress

    bar = progress(total=len(contexts) * len(batches), desc="operator cases", unit="case")
    for context in contexts:
        for batch in counting(bar, batches):
            if time.time() - t_start > args.time_limit:
                print(f"time limit reached: skipping context={context} batch={batch}")
                continue
            row = {"context": context, "batch": batch, "budget": params.budget}
            req_to_token = random_request_slots(torch, batch, context, bs, num_slots, gen, dev)
            req_pool_indices = torch.arange(batch, dtype=torch.int64, device=dev)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
            q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device=dev, generator=gen)
            max_blocks = -(-context // bs)
            decode_rows = DecodeRows(req_to_token, req_pool_indices, seq_lens)

            def ours(impl, select_only=False, summary=args.summary_dtype,
                     precision=block_precision, use_labels=args.label_cache,
                     scatter=args.scatter_selected, block_score=params.block_score):
                lab = labels if use_labels else None
                # the params as the summaries are stored (the workspace checks them)
                prm = dataclasses.replace(params, summary_dtype=SUMMARY_PARAM[summary],
                                          block_score=block_score)
                ws = SparseDecodeWorkspace(batch, HQ, HKV, HEAD_DIM, prm, max_blocks, dev,
                                           torch.bfloat16, topk_impl=impl,
                                           block_score_precision=precision,
                                           topk_radix_bits=args.topk_radix_bits,
                                           fuse_assemble=args.fuse_assemble,
                                           assemble_tile=args.assemble_tile,
                                           scatter_selected=scatter)
                lo, hi = summaries[summary]
                cache = LayerCache(k_buffer, v_buffer, lo, hi, channels=channels, labels=lab)
                if select_only:
                    return lambda: select_slots_batched(q, cache, decode_rows, prm, ws)
                return lambda: sparse_decode_batched(q, cache, decode_rows, prm, sm_scale, ws)

            def ours_in_basis():
                """ours after the label basis's rotation of q and of the step's new keys
                (attention/qk_basis.py: two small GEMMs per layer; random orthonormal here)."""
                from sglang_ext.attention.qk_basis import QKBasis

                rotations = torch.linalg.qr(torch.randn(1, HKV, HEAD_DIM, HEAD_DIM,
                                                        device=dev))[0]
                basis = QKBasis(rotations, rotations, dev)
                new_keys = torch.randn(batch, HKV, HEAD_DIM, device=dev, dtype=torch.bfloat16)
                decode = ours(args.topk_impl)

                def run():
                    basis.rotate(0, q, new_keys)
                    return decode()
                return run

            outs = {}
            builders = [("ours", lambda: ours(args.topk_impl)),
                        ("ours_select", lambda: ours(args.topk_impl, select_only=True))]
            if args.compare_basis:
                builders.append(("ours_basis", ours_in_basis))
            if args.compare_label_cache and labels is not None:
                other = "no_label_cache" if args.label_cache else "label_cache"
                builders.append((f"ours_{other}", lambda: ours(
                    args.topk_impl, use_labels=not args.label_cache)))
            if args.compare_topk:
                builders.append((f"ours_{other_topk}_topk", lambda: ours(other_topk)))
            if args.compare_block_score and params.method == "two_level":
                other_score = "bound" if params.block_score == "label_max" else "label_max"
                builders.append((f"ours_{other_score}", lambda: ours(
                    args.topk_impl, block_score=other_score)))
                builders.append((f"ours_{other_score}_select", lambda: ours(
                    args.topk_impl, select_only=True, block_score=other_score)))
            for name in summary_names[1:]:
                builders.append((f"ours_{name}_summaries",
                                 lambda name=name: ours(args.topk_impl, summary=name)))
                builders.append((f"ours_{name}_summaries_select",
                                 lambda name=name: ours(args.topk_impl, select_only=True,
                                                        summary=name)))
            if args.compare_scatter and params.method == "two_level":
                other = "assembled" if args.scatter_selected else "scattered"
                builders.append((f"ours_{other}", lambda: ours(
                    args.topk_impl, scatter=not args.scatter_selected)))
                builders.append((f"ours_{other}_select", lambda: ours(
                    args.topk_impl, select_only=True, scatter=not args.scatter_selected)))
            other_precision = args.compare_block_score_precision
            if (other_precision not in ("none", args.block_score_precision)
                    and params.method != "ds"
                    and (other_precision != "tc" or args.summary_dtype in ("bf16", "fp8"))
                    and (other_precision != "tc_fp16" or args.summary_dtype == "fp8")):
                builders.append((f"ours_{other_precision}_scores",
                                 lambda: ours(args.topk_impl, precision=other_precision)))
                builders.append((f"ours_{other_precision}_scores_select",
                                 lambda: ours(args.topk_impl, select_only=True,
                                              precision=other_precision)))
            if not args.skip_flashinfer:
                builders.append(("flashinfer", lambda: FlashInferDecode(
                    torch, q, k_buffer, v_buffer, req_to_token, context, args.fi_page_size,
                    tensor_cores, sm_scale, fi_workspace)))
            if not args.skip_triton:
                builders.append(("triton", lambda: TritonDecode(
                    torch, q, k_buffer, v_buffer, req_to_token, context,
                    args.triton_max_kv_splits, sm_scale)))
            if args.fi_sparse and context > params.budget:
                builders.append(("ours_fi_attention", lambda: FlashInferSparseDecode(
                    torch, ours(args.topk_impl, select_only=True), q, k_buffer, v_buffer,
                    params.budget, sm_scale, fi_workspace)))
            if args.breakdown:  # the stages of one selection
                stage_ws = SparseDecodeWorkspace(
                    batch, HQ, HKV, HEAD_DIM, params, max_blocks, dev, torch.bfloat16,
                    topk_impl=args.topk_impl, block_score_precision=block_precision,
                    topk_radix_bits=args.topk_radix_bits, fuse_assemble=args.fuse_assemble,
                    assemble_tile=args.assemble_tile, scatter_selected=args.scatter_selected)
                stage_labels = labels if args.label_cache else None
                stage_cache = LayerCache(k_buffer, v_buffer, kmin, kmax, channels=channels,
                                         labels=stage_labels)
                stage_select = lambda: select_slots_batched(  # noqa: E731
                    q, stage_cache, decode_rows, params, stage_ws)
                builders += [(f"stage_{name}", build) for name, build in stage_builders(
                    q, k_buffer, req_to_token, req_pool_indices, seq_lens, kmin, kmax, params,
                    channels, stage_ws, stage_select, stage_labels)]
            for name, build in builders:
                row[f"{name}_ms"], mode, out = _time_operator(timer, build)
                if mode != timer.mode:
                    row[f"{name}_mode"] = mode
                if out is not None and name in ("ours", "flashinfer", "triton",
                                                "ours_fi_attention"):
                    outs[name] = out
                timer.release()
            if args.breakdown and row.get("ours_select_ms") and row.get("ours_ms"):
                staged = [row.get(f"stage_{n}_ms") for n in (
                    "block_bound", "block_prefilter_topk", "block_scores", "block_topk",
                    "token_scores", "rerank_scores", "rerank_take_top")]
                row["stage_topk_assemble_ms"] = row["ours_select_ms"] - sum(
                    x for x in staged if x)
                row["stage_attention_ms"] = row["ours_ms"] - row["ours_select_ms"]
            row.setdefault("flashinfer_ms", None)
            row.setdefault("triton_ms", None)
            nbytes = floor_bytes(params, batch, context, r,
                                 summary_bytes_per_value(args.summary_dtype))
            row["floor_bytes"] = nbytes
            row["floor_ms"] = nbytes / bandwidth * 1e3
            ours_ms = row["ours_ms"]
            for base in ("flashinfer", "triton"):
                ms = row[f"{base}_ms"]
                row[f"speedup_vs_{base}"] = ms / ours_ms if ms and ours_ms else None
            # sanity: the two dense baselines agree; ours is a (different) finite attention
            if "flashinfer" in outs and "triton" in outs:
                row["fi_vs_triton_max_diff"] = (
                    outs["flashinfer"].float() - outs["triton"].float()
                ).abs().max().item()
            if "ours" in outs and "ours_fi_attention" in outs:  # same slots, two kernels
                row["fi_attention_vs_ours_max_diff"] = (
                    outs["ours_fi_attention"].float() - outs["ours"].float()
                ).abs().max().item()
            if "ours" in outs:
                row["ours_finite"] = bool(outs["ours"].isfinite().all().item())
            rows.append(row)
            print(_fmt_row(row), flush=True)
            del outs, builders  # drop the graphs' inputs before the next case
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    return {
        "commit": _commit(),
        "gpu": torch.cuda.get_device_name(0),
        "config": {
            "model_shape": "Qwen3-8B",
            "num_q_heads": HQ,
            "num_kv_heads": HKV,
            "head_dim": HEAD_DIM,
            "dtype": "bfloat16",
            **selection_config(params),
            "label_channels": args.label_channels or "all",
            "topk_impl": args.topk_impl,
            "block_score_precision": args.block_score_precision,
            "compare_block_score_precision": args.compare_block_score_precision,
            "summary_dtype": args.summary_dtype,
            "compare_summary_dtype": summary_names[1:],
            "label_dtype": args.label_dtype,
            "scatter_selected": args.scatter_selected,
            "key_scale": args.key_scale,
            "topk_radix_bits": args.topk_radix_bits,
            "fuse_assemble": args.fuse_assemble,
            "assemble_tile": args.assemble_tile,
            "label_cache": bool(args.label_cache and labels is not None),
            "flashinfer": {"page_size": args.fi_page_size, "layout": "NHD",
                           "use_tensor_cores": tensor_cores, "backend": "fa2"},
            "triton": {"page_size": 1, "max_kv_splits": args.triton_max_kv_splits},
            "cuda_graphs": not args.no_graphs,
            "warmup": args.warmup,
            "iters": args.iters,
            "timing": "median of CUDA-event times, L2 flushed before each call; one layer",
            "hbm_bandwidth_gbps": bandwidth / 1e9,
            "floor": f"bytes(selected K/V + {args.summary_dtype} summaries + label channels"
                     " + indices + q/out) / measured d2d-copy bandwidth",
            "versions": _versions(),
            "wall_s": time.time() - t_start,
        },
        "rows": rows,
    }


def _fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def _fmt_row(r) -> str:
    variants = " ".join(f"{k[5:-3]} {_fmt(v)}" for k, v in r.items()
                        if k.startswith("ours_") and k.endswith("_ms")
                        and k not in ("ours_ms", "ours_select_ms"))
    stages = " ".join(f"{k[6:-3]} {_fmt(v)}" for k, v in r.items()
                      if k.startswith("stage_") and k.endswith("_ms"))
    return (f"ctx {r['context']:>6} bs {r['batch']:>3} | ours {_fmt(r['ours_ms'])} ms "
            f"(select {_fmt(r.get('ours_select_ms'))}) | flashinfer {_fmt(r['flashinfer_ms'])} | "
            f"triton {_fmt(r['triton_ms'])} | floor {_fmt(r['floor_ms'])} | "
            f"x{_fmt(r['speedup_vs_flashinfer'], '.2f')} vs flashinfer"
            + (f" | variants: {variants}" if variants else "")
            + (f" | stages: {stages}" if stages else ""))


def print_table(result):
    head = (f"{'context':>8} {'batch':>5} {'ours_ms':>9} {'select':>8} {'flashinfer':>10} "
            f"{'triton':>9} {'floor_ms':>9} {'vs_fi':>7} {'vs_tri':>7}")
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        print(f"{r['context']:>8} {r['batch']:>5} {_fmt(r['ours_ms']):>9} "
              f"{_fmt(r.get('ours_select_ms')):>8} {_fmt(r['flashinfer_ms']):>10} "
              f"{_fmt(r['triton_ms']):>9} {_fmt(r['floor_ms']):>9} "
              f"{_fmt(r['speedup_vs_flashinfer'], '.2f'):>7} "
              f"{_fmt(r.get('speedup_vs_triton'), '.2f'):>7}")


def operator_figure(rows: list[dict]):
    """``(pyplot, figure, axes, batches)``: one panel per batch size of the rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, max(1, len(batches)), figsize=(5 * max(1, len(batches)), 4),
                             squeeze=False)
    return plt, fig, axes, batches


def style_context_axis(ax, contexts: list[int], batch: int) -> None:
    """One panel of an operator plot: log-log ms per layer over the contexts, for one batch."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(contexts, [f"{c // 1024}k" if c >= 1024 else str(c) for c in contexts])
    ax.minorticks_off()
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per layer")
    ax.set_title(f"batch {batch}")
    ax.grid(True, which="both", alpha=0.3)


def plot(result, path):
    rows = result["rows"]
    plt, fig, axes, batches = operator_figure(rows)
    series = [("ours_ms", "ours (sparse)", "o-"), ("flashinfer_ms", "FlashInfer full", "s-"),
              ("triton_ms", "SGLang Triton full", "^-"), ("floor_ms", "ours: bytes floor", "k--")]
    for ax, batch in zip(axes[0], batches):
        sub = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["context"])
        ctx = [r["context"] for r in sub]
        for key, label, style in series:
            pts = [(c, r[key]) for c, r in zip(ctx, sub) if r.get(key)]
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        style_context_axis(ax, ctx, batch)
    axes[0][0].legend(fontsize=8)
    cfg = result["config"]
    fig.suptitle(f"{result['gpu']}: decode attention, 32q/8kv x128 bf16, budget {cfg['budget']}, "
                 f"{cfg['method']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_result(path: str, result: dict) -> None:
    """Write this run's result over the file's MHA rows and top-level fields. Rows of other
    models (bench_operator_mla.py merges its MLA rows, which name their "model", into the same
    file) and top-level fields this run does not set (their "mla_config") stay, the rows
    keeping the commit and GPU they were measured on."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.results_io import merge_rows

    top, rows = {}, result["rows"]
    if os.path.exists(path):
        with open(path) as f:
            top = {k: v for k, v in json.load(f).items() if k != "rows"}
        rows = merge_rows(path, rows, key=lambda r: r.get("model"), inherit=("commit", "gpu"))
    with open(path, "w") as f:
        json.dump({**top, **result, "rows": rows}, f, indent=2)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.fi_page_size not in (1, args.block_size):
        print("--fi-page-size must be 1 or --block-size (the pool's page size)", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("bench_operator.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.check or args.check_only:
        if not run_check(args):
            print("[check] FAILED", file=sys.stderr)
            return 1
        print("[check] passed")
        if args.check_only:
            return 0
    result = run_benchmark(args)
    os.makedirs(args.out, exist_ok=True)
    stem = "operator_h200" + (f"_{args.tag}" if args.tag else "")
    json_path = os.path.join(args.out, stem + ".json")
    write_result(json_path, result)
    png_path = os.path.join(args.out, stem + ".png")
    try:
        plot(result, png_path)
    except Exception:  # noqa: BLE001 - the JSON is the result; the plot is a convenience
        traceback.print_exc()
    print_table(result)
    print(f"wrote {json_path} and {png_path} in {result['config']['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
