#!/usr/bin/env python
"""Operator benchmark of one MLA (multi-head latent attention) layer's decode step (GPU only).

For DeepSeek-V2-Lite's attention layer (16 query heads on one latent kv head of
``kv_lora_rank`` 512 + RoPE 64 = 576 dims, bf16, ``layer.scaling`` from the model config) and
every (context, batch) of ``--contexts`` x ``--batches`` it times, in one run:

* ``ours``: ``sparse_decode_batched`` on SGLang's MLA pool layout (rows ``[N, 1, R + P]``,
  V the view ``k_buffer[..., :R]``), as tests/test_kernels_mla.py calls it; the page summaries
  are built beforehand (their maintenance is part of the KV write, not of this step);
  ``ours_select`` is its selection alone;
* ``triton``: SGLang's Triton MLA decode as its triton backend runs an MLA model:
  ``decode_attention_fwd(..., has_mla=True)`` with ``k_buffer [N, 1, 576]``, ``v_buffer =
  k_buffer[..., :512]``, page size 1, ``max_kv_splits`` raised by SGLang's
  ``_mla_decode_kv_splits_cap`` and per-request ``num_kv_splits`` from
  ``get_num_kv_splits_triton`` with the arguments ``TritonAttnBackend`` passes, PDL where
  SGLang enables it;
* ``flashinfer_mla``: FlashInfer's ``BatchMLAPagedAttentionWrapper`` as SGLang's
  flashinfer_mla backend uses it (backend "auto", page size 1, ``plan`` once, ``run`` timed
  with the pool split into ``ckv = k_buffer[..., :512]`` and ``kpe = k_buffer[..., 512:]``);
  if FlashInfer cannot be imported or fails, the rows carry a note instead;
* ``floor``: the bytes our path must read divided by the measured HBM bandwidth
  (bench_operator.floor_bytes with the MLA head shape: a selected row is read once, V being
  its latent part).

Timing, L2 flush, CUDA graphs and the bandwidth measurement are bench_operator.py's. Rows
(``"model": "deepseek-v2-lite-shape"``, one per context, batch and operator) are merged into
``<out>/operator_h200.json`` next to the MHA rows already there (the rows of this model's cases
measured again are replaced; every other row is kept); the plot is
``<out>/operator_mla_h200.png``.

``--check`` first compares ours with the MLA torch reference (sglang_ext.selection.mla) and the
baselines with dense MLA attention on small cases and exits non-zero on a mismatch.
:func:`run_check` also runs on the CPU at tiny shapes in Triton's interpreter
(tests/test_bench_operator_mla.py, :func:`tiny_check_setup`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.bench_operator import (
    Timer,
    add_case_args,
    operator_figure,
    style_context_axis,
    _time_operator,
    _versions,
    build_page_summaries,
    floor_bytes,
    measure_bandwidth,
    random_request_slots,
    selection_config,
    selection_params,
)
from benchmarks.results_io import git_commit, gpu_name, merge_rows, write_results

MODEL = "deepseek-v2-lite-shape"
DEFAULT_CONFIG = os.path.join(REPO, "benchmarks", "models", MODEL, "config.json")
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "operator")
RESULTS_NAME = "operator_h200.json"  # shared with bench_operator.py's MHA rows
PLOT_NAME = "operator_mla_h200.png"
BASELINES = ("triton", "flashinfer_mla")
# One layer's pool is capped at 2M rows (2.4 GB): SGLang's Triton kernel forms slot x 576 in
# 32 bits (overflow past 3.7M rows); larger cases share pages between requests, each request
# still streaming its own context from HBM (far more than the 50 MB L2).
POOL_TOKEN_CAP = 1 << 21
FLASHINFER_WORKSPACE_BYTES = 384 << 20  # SGLang's SGLANG_FLASHINFER_WORKSPACE_SIZE default


@dataclass(frozen=True)
class MLAShape:
    """An MLA layer as its decode sees it (one tensor-parallel rank)."""

    num_q_heads: int
    kv_lora_rank: int  # R: the latent part of a pool row, also the value width
    rope_dim: int  # P: the RoPE'd shared key part after it
    scaling: float  # layer.scaling: (qk_nope + qk_rope)^-0.5 times YaRN's mscale^2
    # What SGLang's ModelConfig.get_num_kv_heads reports for the model (num_key_value_heads:
    # 16 for DeepSeek-V2-Lite, although its pool has one latent head); TritonAttnBackend feeds
    # it to get_num_kv_splits_triton, so the baseline's splits depend on it.
    config_kv_heads: int
    context_len: int  # the model's context length: SGLang sizes MLA kv splits by it

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


def model_shape(config_path: str = DEFAULT_CONFIG) -> MLAShape:
    """The MLA shape of a HuggingFace DeepSeek-V2-style config, ``scaling`` and the context
    length computed as SGLang's ModelConfig does (its own ``compute_mla_mscale_scaling`` for
    YaRN rope scaling, its ``get_context_length``)."""
    from sglang.srt.utils.hf_transformers.common import get_context_length

    with open(config_path) as f:
        cfg = json.load(f)
    scaling = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope_scaling = cfg.get("rope_scaling") or {}
    if (rope_scaling.get("rope_type") or rope_scaling.get("type") or "default") != "default":
        from sglang.srt.configs.model_config import compute_mla_mscale_scaling

        scaling = compute_mla_mscale_scaling(rope_scaling, scaling)
    return MLAShape(
        num_q_heads=cfg["num_attention_heads"],
        kv_lora_rank=cfg["kv_lora_rank"],
        rope_dim=cfg["qk_rope_head_dim"],
        scaling=scaling,
        config_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        context_len=get_context_length(SimpleNamespace(**cfg)),
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory (default: %(default)s)")
    p.add_argument("--model-config", default=DEFAULT_CONFIG,
                   help="HF config of the MLA model shape (default: DeepSeek-V2-Lite)")
    add_case_args(p)
    p.add_argument("--label-channels", type=int, default=0,
                   help="random label channels of the R + P dims (0 = exact q.k token scores, "
                        "the server's MLA default: no MLA calibration exists yet)")
    p.add_argument("--triton-max-kv-splits", type=int, default=8,
                   help="SGLang --triton-attention-num-kv-splits (default 8; SGLang raises it "
                        "for MLA, see _mla_decode_kv_splits_cap)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-graphs", action="store_true", help="time eager calls, no CUDA graphs")
    p.add_argument("--skip-triton", action="store_true")
    p.add_argument("--skip-flashinfer", action="store_true")
    p.add_argument("--check", action="store_true",
                   help="run the correctness checks first; exit non-zero if they fail")
    p.add_argument("--check-only", action="store_true",
                   help="run the checks and exit (on a CPU host: the tiny interpreter check, "
                        "with TRITON_INTERPRET=1 set)")
    p.add_argument("--time-limit", type=float, default=330.0,
                   help="seconds; remaining cases are skipped past it (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- operators


def flat_kv_indices(torch, req_to_token, lens: Sequence[int]):
    """``(kv_indptr, kv_indices)`` int32 of page-size-1 decode kernels: the slots of request
    ``b``'s ``lens[b]`` positions (row ``b`` of ``req_to_token``), concatenated."""
    dev = req_to_token.device
    kv_indices = torch.cat([req_to_token[b, :n] for b, n in enumerate(lens)]).to(torch.int32)
    kv_indptr = torch.tensor([0, *lens], device=dev).cumsum(0).to(torch.int32)
    return kv_indptr, kv_indices.contiguous()


def sglang_mla_max_kv_splits(base_max_kv_splits: int, sm_count: int, context_len: int) -> int:
    """TritonAttnBackend's ``max_kv_splits`` for an MLA model (CUDA): SGLang's own cap."""
    from sglang.srt.layers.attention.triton_backend import _mla_decode_kv_splits_cap

    return _mla_decode_kv_splits_cap(base_max_kv_splits, sm_count, context_len)


def sglang_num_kv_splits(torch, seq_lens, num_q_heads: int, config_kv_heads: int,
                         max_kv_splits: int, sm_count: int):
    """``num_kv_splits`` int32 ``[B]`` as ``TritonAttnBackend.get_num_kv_splits`` computes it
    for a plain decode batch (one token per request): every request at ``max_kv_splits`` on a
    device without a core count, else SGLang's ``get_num_kv_splits_triton``."""
    import triton
    from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

    num_seq = seq_lens.shape[0]
    out = torch.empty(num_seq, dtype=torch.int32, device=seq_lens.device)
    if sm_count <= 0:
        return out.fill_(max_kv_splits)
    get_num_kv_splits_triton[(1,)](
        out, seq_lens.to(torch.int32), num_seq, 1, num_q_heads, config_kv_heads, max_kv_splits,
        sm_count, MAX_NUM_SEQ=256 if num_seq < 256 else triton.next_power_of_2(num_seq))
    return out


def _sglang_uses_pdl(device) -> bool:
    """TritonAttnBackend.use_pdl: programmatic dependent launch where sgl_kernel says the
    architecture supports it (CUDA only)."""
    if getattr(device, "type", str(device)) != "cuda":
        return False
    try:
        from sgl_kernel.utils import is_arch_support_pdl
    except Exception:  # noqa: BLE001 - without sgl_kernel SGLang has no PDL either
        return False
    return bool(is_arch_support_pdl())


class TritonMLADecode:
    """SGLang's triton backend decode on an MLA pool (``TritonAttnBackend.forward_decode`` with
    ``use_mla``): one ``decode_attention_fwd(..., has_mla=True)`` over page-size-1 indices,
    V the latent view of the key rows; stage-1 logits ``[B, Hq, max_kv_splits, R]`` fp32 as the
    backend allocates them. SGLang's kernel reuses each K tile as V only when the latent width
    fills the kernel's key tile: DeepSeek's 512 + 64 (or 256 + 32), nothing smaller."""

    def __init__(self, torch, q, k_buffer, shape: MLAShape, kv_indptr, kv_indices,
                 max_kv_splits: int, sm_count: int, use_pdl: bool = False) -> None:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

        batch, num_q_heads, _ = q.shape
        rank = shape.kv_lora_rank
        self.fwd = decode_attention_fwd
        self.q, self.k_buffer, self.v_buffer = q, k_buffer, k_buffer[..., :rank]
        self.kv_indptr, self.kv_indices = kv_indptr, kv_indices
        self.attn_logits = torch.empty(batch, num_q_heads, max_kv_splits, rank,
                                       dtype=torch.float32, device=q.device)
        self.attn_lse = torch.empty(batch, num_q_heads, max_kv_splits, dtype=torch.float32,
                                    device=q.device)
        seq_lens = kv_indptr[1:] - kv_indptr[:-1]
        self.num_kv_splits = sglang_num_kv_splits(torch, seq_lens, num_q_heads,
                                                  shape.config_kv_heads, max_kv_splits, sm_count)
        self.max_kv_splits = max_kv_splits
        self.scaling = shape.scaling
        self.use_pdl = use_pdl
        self.out = q.new_empty(batch, num_q_heads, rank)

    def __call__(self):
        self.fwd(
            self.q, self.k_buffer, self.v_buffer, self.out, self.kv_indptr, self.kv_indices,
            self.attn_logits, self.attn_lse, self.num_kv_splits, self.max_kv_splits,
            self.scaling,
            1.0,  # k_scale (SGLang: layer.k_scale is None for bf16 KV)
            1.0,  # v_scale
            has_mla=True, use_pdl=self.use_pdl, page_size=1)
        return self.out


class FlashInferMLADecode:
    """SGLang's flashinfer_mla backend decode: ``BatchMLAPagedAttentionWrapper`` (backend
    "auto", as ``FlashInferMLAAttnBackend``), CUDA-graph buffers as its graph capture passes
    them, ``plan(qo_indptr, kv_indptr, kv_indices, kv_lens, Hq, R, P, page_size 1, causal
    False, scaling, dtype, dtype)`` once, then ``run(q_nope, q_rope, ckv, kpe)`` with q and the
    pool split at R (views, as ``forward_decode`` passes them)."""

    def __init__(self, torch, q, k_buffer, shape: MLAShape, kv_indptr, kv_indices,
                 workspace) -> None:
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        batch, num_q_heads, _ = q.shape
        rank = shape.kv_lora_rank
        dev = q.device
        qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int32)
        self.wrapper = BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=True, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
            kv_indices=kv_indices, kv_len_arr=kv_lens, backend="auto")
        self.wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_lens, num_q_heads, rank,
                          shape.rope_dim, 1, False, shape.scaling, q.dtype, k_buffer.dtype)
        self.backend = getattr(self.wrapper, "_backend", "auto")
        self.q_nope, self.q_rope = q[..., :rank], q[..., rank:]
        self.ckv, self.kpe = k_buffer[..., :rank], k_buffer[..., rank:]
        self.out = q.new_empty(batch, num_q_heads, rank)

    def __call__(self):
        return self.wrapper.run(self.q_nope, self.q_rope, self.ckv, self.kpe, out=self.out)


def ours_decode(torch, q, k_buffer, shape: MLAShape, req_to_token, seq_lens, kmin, kmax,
                params, channels=None, select_only: bool = False) -> Callable[[], Any]:
    """Our sparse decode on the MLA layout, called as the server's backend calls it: one latent
    kv head, values the view ``k_buffer[..., :R]``, a workspace sized for this batch."""
    from sglang_ext.kernels.sparse_decode import (
        DecodeRows,
        LayerCache,
        SparseDecodeWorkspace,
        select_slots_batched,
        sparse_decode_batched,
    )

    batch, num_q_heads, _ = q.shape
    rank = shape.kv_lora_rank
    v_buffer = k_buffer[..., :rank]
    req_pool_indices = torch.arange(batch, dtype=torch.int64, device=q.device)
    max_blocks = -(-req_to_token.shape[1] // params.block_size)
    ws = SparseDecodeWorkspace(batch, num_q_heads, 1, rank, params, max_blocks, q.device,
                               q.dtype)
    cache = LayerCache(k_buffer, v_buffer, kmin, kmax, channels=channels)
    rows = DecodeRows(req_to_token, req_pool_indices, seq_lens)
    if select_only:
        return lambda: select_slots_batched(q, cache, rows, params, ws)
    return lambda: sparse_decode_batched(q, cache, rows, params, shape.scaling, ws)


# ----------------------------------------------------------------------------- check


@contextlib.contextmanager
def interpreter_runtime_loop_bounds() -> Iterator[None]:
    """Let SGLang's decode kernels run in Triton's CPU interpreter (no-op elsewhere).

    Their loops run over bounds loaded at run time (``tl.range(split_kv_start, split_kv_end)``,
    ``range(num_group)``). The interpreter holds such a scalar as a 1-element array and its
    ``__index__`` calls ``int()`` on it, which NumPy >= 2.4 refuses (our kernels keep loop
    bounds static for this reason, see kernels/topk.py). Inside this block ``__index__`` takes
    the array's single element instead; the interpreter's own patch is restored on exit."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # another Triton: leave it alone, the check will say what failed
        yield
        return

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original


@dataclass
class CheckCase:
    """One part of :func:`run_check`: a shape, a KV dtype and request lengths."""

    shape: MLAShape
    dtype: Any  # torch dtype
    lens: list[int]
    tol: float  # max |difference| allowed on the latent outputs


@dataclass
class CheckReport:
    ok: bool = True
    covered: list[str] = field(default_factory=list)  # "ours <method>", "triton", ...
    notes: list[str] = field(default_factory=list)  # what could not run, and why
    lines: list[str] = field(default_factory=list)

    def record(self, name: str, err: float, tol: float, detail: str = "") -> None:
        good = err <= tol
        self.ok &= good
        self.covered.append(name)
        self._say(f"[check] {name:22s} max|diff|={err:.2e} (tol {tol:.0e}){detail} "
                  f"{'ok' if good else 'FAIL'}")

    def note(self, text: str, failed: bool = False) -> None:
        self.ok &= not failed
        self.notes.append(text)
        self._say(f"[check] {text}{' FAIL' if failed else ''}")

    def _say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)


def run_check(ours: CheckCase, baseline: CheckCase, params, methods: Sequence[str],
              device: str, baselines: Sequence[str] = BASELINES, sm_count: int = 0,
              base_max_kv_splits: int = 8) -> CheckReport:
    """Ours against the MLA torch reference, the baselines against dense MLA attention.

    * ours (each of ``methods``, dyadic q/k so every score and thus every selected set is
      exact): every request's latent output vs ``mla_sparse_decode``, and vs
      ``mla_dense_decode`` for requests within the budget;
    * ``triton`` (and ``flashinfer_mla`` where FlashInfer imports, never on the CPU): the
      operator classes the benchmark times, on ragged requests, vs ``mla_dense_decode``.
      ``sm_count`` 0 gives SGLang's splits on a device without a core count (all at the max).

    In Triton's interpreter (no CUDA) a baseline that cannot run is a note, not a failure;
    on the GPU it fails the check. FlashInfer that cannot be imported is a note everywhere.
    """
    import torch

    from sglang_ext.kernels.testing import (
        case_generator,
        make_paged_batch,
        random_values,
    )
    from sglang_ext.selection.mla import mla_dense_decode, mla_sparse_decode
    from sglang_ext.selection.params import SelectionParams

    report = CheckReport()
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    shape, rank = ours.shape, ours.shape.kv_lora_rank
    for method in methods:
        mparams = SelectionParams(method, params.budget, params.block_size,
                                  params.candidate_blocks, params.sink, params.window)
        gen = case_generator("bench-mla-check", method)
        pb = make_paged_batch(gen, ours.lens, 1, shape.row_dim, params.block_size,
                              dtype=ours.dtype, device=device, dyadic=True,
                              latent_values=rank)
        q = random_values(gen, len(ours.lens), shape.num_q_heads, shape.row_dim,
                          dtype=ours.dtype, device=device, dyadic=True)
        # the benchmark's call, on this batch's rows of req_to_token
        r2t = pb.req_to_token[pb.req_pool_indices]
        out = ours_decode(torch, q, pb.k_buffer, shape, r2t, pb.seq_lens, pb.kmin, pb.kmax,
                          mparams)()
        sparse_err = dense_err = 0.0
        for b in range(len(ours.lens)):
            keys = pb.keys(b)
            ref = mla_sparse_decode(q[b], keys, mparams, shape.scaling, rank)
            sparse_err = max(sparse_err, (out[b].float() - ref.float()).abs().max().item())
            if ours.lens[b] <= mparams.budget:
                dense = mla_dense_decode(q[b], keys, shape.scaling, rank)
                dense_err = max(dense_err, (out[b].float() - dense.float()).abs().max().item())
        report.record(f"ours {method}", max(sparse_err, dense_err), ours.tol,
                      f" (vs mla_sparse_decode {sparse_err:.1e}, within the budget vs "
                      f"mla_dense_decode {dense_err:.1e}; L={ours.lens})")

    bshape = baseline.shape
    gen = case_generator("bench-mla-check-dense")
    pb = make_paged_batch(gen, baseline.lens, 1, bshape.row_dim, params.block_size,
                          dtype=baseline.dtype, device=device, summary_chunks=0,
                          latent_values=bshape.kv_lora_rank)
    q = random_values(gen, len(baseline.lens), bshape.num_q_heads, bshape.row_dim,
                      dtype=baseline.dtype, device=device)
    refs = [mla_dense_decode(q[b], pb.keys(b), bshape.scaling, bshape.kv_lora_rank)
            for b in range(len(baseline.lens))]
    kv_indptr, kv_indices = flat_kv_indices(torch, pb.req_to_token[pb.req_pool_indices],
                                            baseline.lens)

    def triton_op():
        max_splits = sglang_mla_max_kv_splits(base_max_kv_splits, sm_count, bshape.context_len)
        return TritonMLADecode(torch, q, pb.k_buffer, bshape, kv_indptr, kv_indices,
                               max_splits, sm_count, _sglang_uses_pdl(q.device))

    def flashinfer_op():
        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        return FlashInferMLADecode(torch, q, pb.k_buffer, bshape, kv_indptr, kv_indices,
                                   workspace)

    builders = {"triton": triton_op, "flashinfer_mla": flashinfer_op}
    for name in baselines:
        if name == "flashinfer_mla":
            if interpreted or not torch.cuda.is_available():
                report.note("flashinfer_mla: not checked (CUDA only)")
                continue
            try:
                importlib.import_module("flashinfer.mla")
            except Exception as e:  # noqa: BLE001 - optional baseline
                report.note(f"flashinfer_mla: not checked, import failed: {type(e).__name__}: {e}")
                continue
        try:
            with interpreter_runtime_loop_bounds():
                out = builders[name]()()
        except Exception as e:  # noqa: BLE001 - reported; fatal on the GPU only
            traceback.print_exc()
            report.note(f"{name}: did not run{' in the interpreter' if interpreted else ''}: "
                        f"{type(e).__name__}: {e}", failed=not interpreted)
            continue
        err = max((out[b].float() - refs[b].float()).abs().max().item()
                  for b in range(len(baseline.lens)))
        report.record(name, err, baseline.tol,
                      f" (vs mla_dense_decode, {bshape.kv_lora_rank}+{bshape.rope_dim} "
                      f"{str(baseline.dtype).removeprefix('torch.')}, L={baseline.lens})")
    return report


def tiny_check_setup() -> dict[str, Any]:
    """:func:`run_check`'s arguments for the CPU (Triton's interpreter), seconds not minutes.

    Ours: R 32 + P 16, 4 heads, bf16, requests below / at / past a 48-token budget. SGLang's
    Triton kernel needs DeepSeek's layout (the latent width must fill its key tile) and the
    interpreter multiplies 16-bit floats in ``tl.dot`` as raw integer bits, so its case is the
    smallest layout the kernel takes, 256 + 32, in float32; ``sm_count`` 132 (an H200's) runs
    SGLang's split heuristic as on the GPU."""
    import torch

    from sglang_ext.selection.params import SelectionParams

    def shape(rank: int, rope: int) -> MLAShape:
        return MLAShape(num_q_heads=4, kv_lora_rank=rank, rope_dim=rope, scaling=0.125,
                        config_kv_heads=4, context_len=4096)

    return {
        "ours": CheckCase(shape(32, 16), torch.bfloat16, [40, 48, 49, 200, 301], tol=2e-2),
        "baseline": CheckCase(shape(256, 32), torch.float32, [300, 177, 33], tol=1e-4),
        "params": SelectionParams("two_level", 48, 8, 5, 4, 8),
        "methods": ("two_level", "quest"),
        "device": "cpu",
        "baselines": ("triton", "flashinfer_mla"),
        "sm_count": 132,
    }


def gpu_check_setup(args: argparse.Namespace, shape: MLAShape) -> dict[str, Any]:
    """:func:`run_check`'s arguments on the GPU: the benchmark's shape, dtype and selection
    parameters; requests below, just past and well past the budget; ragged dense requests."""
    import torch

    budget = args.budget
    skipped = {"triton": args.skip_triton, "flashinfer_mla": args.skip_flashinfer}
    return {
        "ours": CheckCase(shape, torch.bfloat16, [budget // 2, budget + 1, 3 * budget + 5],
                          tol=2e-2),
        "baseline": CheckCase(shape, torch.bfloat16, [4096, 1500, 77], tol=2e-2),
        "params": selection_params(args),
        "methods": ("two_level", "quest", "ds"),
        "device": "cuda",
        "baselines": tuple(name for name in BASELINES if not skipped[name]),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count,
        "base_max_kv_splits": args.triton_max_kv_splits,
    }


# ----------------------------------------------------------------------------- benchmark


def _noting(build: Callable[[], Any], notes: dict[str, str], name: str) -> Callable[[], Any]:
    """``build`` that leaves its exception's text in ``notes[name]`` (then re-raises: the
    timing helper reports the operator as failed)."""
    def wrapped():
        try:
            return build()
        except Exception as e:
            notes[name] = f"{type(e).__name__}: {e}"
            raise
    return wrapped


def case_builders(torch, q, req_to_token, k_buffer, kmin, kmax, shape: MLAShape, params,
                  channels, triton_splits: tuple[int, int, bool] | None, fi_workspace,
                  fi_backend: dict[str, str]) -> list[tuple[str, Callable[[], Any]]]:
    """``(operator, build)`` of one (context, batch) case: every request at the full context
    (``req_to_token`` ``[B, context]``). ``triton_splits``: SGLang's ``(max_kv_splits,
    sm_count, use_pdl)``, None to skip; ``fi_workspace`` None skips FlashInfer, which leaves
    the backend "auto" resolved to in ``fi_backend``."""
    batch, context = req_to_token.shape
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=q.device)
    kv_indptr, kv_indices = flat_kv_indices(torch, req_to_token, [context] * batch)
    builders: list[tuple[str, Callable[[], Any]]] = [
        ("ours", lambda: ours_decode(torch, q, k_buffer, shape, req_to_token, seq_lens, kmin,
                                     kmax, params, channels)),
        ("ours_select", lambda: ours_decode(torch, q, k_buffer, shape, req_to_token, seq_lens,
                                            kmin, kmax, params, channels, select_only=True)),
    ]
    if triton_splits is not None:
        max_kv_splits, sm_count, use_pdl = triton_splits
        builders.append(("triton", lambda: TritonMLADecode(
            torch, q, k_buffer, shape, kv_indptr, kv_indices, max_kv_splits, sm_count,
            use_pdl)))
    if fi_workspace is not None:
        def flashinfer_op() -> FlashInferMLADecode:
            op = FlashInferMLADecode(torch, q, k_buffer, shape, kv_indptr, kv_indices,
                                     fi_workspace)
            fi_backend["resolved"] = op.backend  # what "auto" picked on this GPU
            return op
        builders.append(("flashinfer_mla", flashinfer_op))
    return builders


def run_benchmark(args: argparse.Namespace, shape: MLAShape,
                  device: str = "cuda") -> dict[str, Any]:
    import torch

    t_start = time.time()
    contexts = [int(x) for x in args.contexts.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    params = selection_params(args)
    bs = params.block_size
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    rank = shape.kv_lora_rank
    notes: dict[str, str] = {}

    bandwidth = measure_bandwidth(torch, device=dev)
    print(f"HBM bandwidth (d2d copy): {bandwidth / 1e9:.0f} GB/s")
    sm_count = torch.cuda.get_device_properties(dev).multi_processor_count
    max_kv_splits = sglang_mla_max_kv_splits(args.triton_max_kv_splits, sm_count,
                                             shape.context_len)
    use_pdl = _sglang_uses_pdl(dev)
    flashinfer_error = None
    if not args.skip_flashinfer:
        try:
            importlib.import_module("flashinfer.mla")
        except Exception as e:  # noqa: BLE001 - optional baseline: a note, not a crash
            flashinfer_error = f"flashinfer unavailable: {type(e).__name__}: {e}"
            print(flashinfer_error)

    # One layer's latent rows, random bf16, summaries of every page.
    max_tokens = min(max(c * b for c in contexts for b in batches), POOL_TOKEN_CAP)
    num_slots = -(-max_tokens // bs) * bs + bs  # + the padding page
    k_buffer = torch.empty(num_slots, 1, shape.row_dim, dtype=torch.bfloat16, device=dev)
    k_buffer.normal_(generator=gen)
    kmin, kmax = build_page_summaries(torch, k_buffer, bs, torch.bfloat16)
    channels = None
    if args.label_channels:
        channels = torch.randperm(shape.row_dim, device=dev, generator=gen)[
            : args.label_channels][None]
    torch.cuda.synchronize()
    print(f"pool: {num_slots} rows of {shape.row_dim}, {k_buffer.numel() * 2 / 2**30:.1f} GiB; "
          f"triton max_kv_splits {max_kv_splits}, pdl {use_pdl}; setup "
          f"{time.time() - t_start:.0f}s")

    timer = Timer(torch, args.warmup, args.iters, graphs=not args.no_graphs, device=dev)
    fi_workspace = None
    if not args.skip_flashinfer and flashinfer_error is None:
        fi_workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    fi_backend: dict[str, str] = {}
    commit, gpu = git_commit(), gpu_name()
    rows: list[dict[str, Any]] = []
    from sglang_ext.progress import counting, progress

    bar = progress(total=len(contexts) * len(batches), desc="MLA operator cases", unit="case")
    for context in contexts:
        for batch in counting(bar, batches):
            if time.time() - t_start > args.time_limit:
                print(f"time limit reached: skipping context={context} batch={batch}")
                continue
            req_to_token = random_request_slots(torch, batch, context, bs, num_slots, gen, dev)
            q = torch.randn(batch, shape.num_q_heads, shape.row_dim, dtype=torch.bfloat16,
                            device=dev, generator=gen)
            case_notes: dict[str, str] = {}
            if fi_workspace is None and not args.skip_flashinfer:
                case_notes["flashinfer_mla"] = flashinfer_error
            builders = case_builders(
                torch, q, req_to_token, k_buffer, kmin, kmax, shape, params, channels,
                triton_splits=None if args.skip_triton else (max_kv_splits, sm_count, use_pdl),
                fi_workspace=fi_workspace, fi_backend=fi_backend)
            timed: dict[str, tuple[float | None, str]] = {}
            outs = {}
            for name, build in builders:
                ms, mode, out = _time_operator(timer, _noting(build, case_notes, name))
                timed[name] = (ms, mode)
                if out is not None and name != "ours_select":
                    outs[name] = out
                timer.release()
            if "flashinfer_mla" in case_notes and "flashinfer_mla" not in timed:
                timed["flashinfer_mla"] = (None, "unavailable")
            nbytes = floor_bytes(params, batch, context, args.label_channels or shape.row_dim,
                                 2, num_q_heads=shape.num_q_heads, num_kv_heads=1,
                                 key_dim=shape.row_dim, value_dim=rank, stored_value_dim=0)
            timed["floor"] = (nbytes / bandwidth * 1e3, "bytes/bandwidth")
            rows += case_rows(context, batch, params.budget, timed, outs, case_notes, commit,
                              gpu, floor_bytes_=nbytes)
            print(_fmt_case(rows, context, batch), flush=True)
            notes.update({f"{name} ctx {context} bs {batch}": text  # an import error: once
                          for name, text in case_notes.items() if text != flashinfer_error})
            del outs, builders
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    config = {
        "model_shape": "DeepSeek-V2-Lite attention layer",
        "model_config": os.path.relpath(args.model_config, REPO),
        "shape": asdict(shape),
        "dtype": "bfloat16",
        **selection_config(params),
        "label_channels": args.label_channels or "none (exact q.k over R + P)",
        "triton": {"page_size": 1, "base_max_kv_splits": args.triton_max_kv_splits,
                   "max_kv_splits": max_kv_splits, "sm_count": sm_count, "use_pdl": use_pdl,
                   "num_kv_heads_for_splits": shape.config_kv_heads},
        "flashinfer_mla": {"page_size": 1, "backend": fi_backend.get("resolved", "auto"),
                           "workspace_bytes": FLASHINFER_WORKSPACE_BYTES,
                           "error": flashinfer_error},
        "pool_rows": num_slots,
        "cuda_graphs": not args.no_graphs,
        "warmup": args.warmup,
        "iters": args.iters,
        "timing": "bench_operator.Timer: median of CUDA-event times, L2 flushed before each "
                  "call; one layer",
        "hbm_bandwidth_gbps": bandwidth / 1e9,
        "floor": "bytes(selected latent rows + bf16 summaries + scored candidate rows + "
                 "indices + q/out) / measured d2d-copy bandwidth",
        "notes": notes,
        "versions": _versions(),
        "wall_s": time.time() - t_start,
    }
    return {"commit": commit, "gpu": gpu, "mla_config": config, "rows": rows}


def case_rows(context: int, batch: int, budget: int,
              timed: dict[str, tuple[float | None, str]], outs: dict[str, Any],
              notes: dict[str, str], commit: str, gpu: str,
              floor_bytes_: int | None = None) -> list[dict[str, Any]]:
    """One row per operator of a (context, batch) case: ``ms`` and how it was timed; ours'
    row carries ``speedup_vs_<baseline>`` (baseline ms / ours ms), each baseline's row the same
    number as ``ours_speedup``, flashinfer_mla's its max difference from triton (both dense)."""
    ours_ms = timed.get("ours", (None, ""))[0]
    rows = []
    for name, (ms, mode) in timed.items():
        row: dict[str, Any] = {"model": MODEL, "context": context, "batch": batch,
                               "budget": budget, "operator": name, "ms": ms, "mode": mode}
        if name == "ours":
            for base in BASELINES:
                base_ms = timed.get(base, (None, ""))[0]
                row[f"speedup_vs_{base}"] = base_ms / ms if base_ms and ms else None
            if "ours" in outs:
                row["finite"] = bool(outs["ours"].isfinite().all().item())
        elif name in BASELINES:
            row["ours_speedup"] = ms / ours_ms if ms and ours_ms else None
        if name == "flashinfer_mla" and "triton" in outs and "flashinfer_mla" in outs:
            row["max_diff_vs_triton"] = (outs["flashinfer_mla"].float()
                                         - outs["triton"].float()).abs().max().item()
        if name == "floor":
            row["bytes"] = floor_bytes_
        if name in notes:
            row["note"] = notes[name]
        rows.append({**row, "commit": commit, "gpu": gpu})
    return rows


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _fmt_case(rows: list[dict[str, Any]], context: int, batch: int) -> str:
    case = {r["operator"]: r for r in rows if r["context"] == context and r["batch"] == batch}
    ours = case.get("ours", {})
    parts = [f"{name} {_fmt(r['ms'])}" for name, r in case.items()]
    speed = " ".join(f"x{_fmt(ours.get(f'speedup_vs_{b}'), '.2f')} vs {b}" for b in BASELINES)
    return f"ctx {context:>6} bs {batch:>3} | " + " | ".join(parts) + f" | {speed}"


# ----------------------------------------------------------------------------- output


def _row_key(row: dict[str, Any]) -> tuple:
    """Which earlier rows a new one replaces: a (model, context, batch) case is replaced as a
    whole, so that all operators of a case come from one run. MHA rows (no model) never
    match."""
    return (row.get("model"), row.get("context"), row.get("batch"))


def write_rows(path: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """Merge ``result``'s rows into the results file at ``path``: rows of other models (the
    MHA benchmark's) and other cases stay, each keeping the commit and GPU it was measured on;
    the file's other top-level fields (the MHA run's ``config``) stay; ``commit``, ``gpu`` and
    ``mla_config`` become this run's. Returns the rows written."""
    top: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            top = {k: v for k, v in json.load(f).items() if k != "rows"}
    rows = merge_rows(path, result["rows"], key=_row_key, inherit=("commit", "gpu"))
    write_results(path, rows, {**top, **{k: v for k, v in result.items() if k != "rows"}})
    return rows


def plot(result: dict[str, Any], path: str) -> None:
    rows = result["rows"]
    plt, fig, axes, batches = operator_figure(rows)
    series = [("ours", "ours (sparse)", "o-"), ("triton", "SGLang Triton MLA (full)", "^-"),
              ("flashinfer_mla", "FlashInfer MLA (full)", "s-"),
              ("floor", "ours: bytes floor", "k--")]
    for ax, batch in zip(axes[0], batches):
        for operator, label, style in series:
            pts = sorted((r["context"], r["ms"]) for r in rows
                         if r["batch"] == batch and r["operator"] == operator and r["ms"])
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        ctx = sorted({r["context"] for r in rows if r["batch"] == batch})
        style_context_axis(ax, ctx, batch)
    axes[0][0].legend(fontsize=8)
    cfg = result["mla_config"]
    shape = cfg["shape"]
    fig.suptitle(f"{result['gpu']}: MLA decode, {shape['num_q_heads']}q on "
                 f"{shape['kv_lora_rank']}+{shape['rope_dim']} latent bf16, budget "
                 f"{cfg['budget']}, {cfg['method']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        if args.check_only and os.environ.get("TRITON_INTERPRET") == "1":
            report = run_check(**tiny_check_setup())
            print(f"[check] {'passed' if report.ok else 'FAILED'} (CPU, tiny shapes)")
            return 0 if report.ok else 1
        print("bench_operator_mla.py needs a CUDA GPU (on a CPU host: --check-only with "
              "TRITON_INTERPRET=1 runs the tiny check)", file=sys.stderr)
        return 2
    shape = model_shape(args.model_config)
    print(f"shape: {shape}")
    if args.check or args.check_only:
        report = run_check(**gpu_check_setup(args, shape))
        if not report.ok:
            print("[check] FAILED", file=sys.stderr)
            return 1
        print("[check] passed")
        if args.check_only:
            return 0
    result = run_benchmark(args, shape)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, RESULTS_NAME)
    write_rows(json_path, result)
    png_path = os.path.join(args.out, PLOT_NAME)
    try:
        plot(result, png_path)
    except Exception:  # noqa: BLE001 - the JSON is the result; the plot is a convenience
        traceback.print_exc()
    print(f"wrote {len(result['rows'])} rows into {json_path} and {png_path} in "
          f"{result['mla_config']['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
