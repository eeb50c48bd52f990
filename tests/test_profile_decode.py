"""benchmarks/profile_decode.py's reading of a profiler trace (the GPU run itself is a device step:
``bash benchmarks/device/run.sh COMMIT profile``)."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks.profile_decode import build_parser, category, read_trace, summarize_trace


def _kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_kernels_fall_into_their_stages() -> None:
    assert category("_quest_block_scores_kernel") == "block_scores"
    assert category("_topk_kernel") == "topk"
    assert category("_sparse_attn_split_kernel") == "sparse_attention"
    assert category("_gather_host_blocks_kernel") == "tier_gather"
    assert category("_admit_kernel") == "locality"
    assert category("_locality_gamma_kernel") == "locality"
    assert category("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>") == "flashinfer"
    assert category("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert category("triton_poi_fused_add_rms_norm_0") == "other"


def test_a_two_step_window_splits_into_busy_idle_and_side_stream_time() -> None:
    # compute stream 7: two steps of 4 ms kernels (one overlap) in a 10 ms window; the side
    # stream 9 gathers for 3 ms in all
    events = [
        _kernel("nvjet_gemm", 0, 2000, 7), _kernel("_sparse_attn_split_kernel", 1500, 2500, 7),
        _kernel("nvjet_gemm", 6000, 4000, 7), _kernel("_gather_host_blocks_kernel", 500, 3000, 9),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50000},  # not a kernel
    ]
    row = summarize_trace(events, steps=2)
    assert row["step_ms"] == 5.0  # (10000 - 0) us over 2 steps
    assert row["compute_busy_ms"] == 4.0  # union of [0, 4000) and [6000, 10000) / 2
    assert row["idle_ms"] == 1.0
    assert row["side_stream_ms"] == 1.5
    assert row["categories"] == {"gemm": 3.0, "tier_gather": 1.5, "sparse_attention": 1.25}
    assert row["steps_in_trace"] == 2
    assert row["top_other_kernels"] == {}
    # uncategorised kernels are named, longest first
    norms = [_kernel("rms_norm_kernel", 4000, 600, 7), _kernel("rope_kernel", 4600, 200, 7),
             _kernel("rms_norm_kernel", 5000, 600, 7)]
    assert summarize_trace(events + norms, steps=2)["top_other_kernels"] == {
        "rms_norm_kernel": 0.6, "rope_kernel": 0.1}
    # under CUDA graphs each step is one cudaGraphLaunch: those count the steps
    launches = [{"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": t, "dur": 5}
                for t in (0, 2500, 6000, 8000)]
    assert summarize_trace(events + launches, steps=2)["step_ms"] == 2.5
    with pytest.raises(ValueError, match="no GPU kernels"):
        summarize_trace(events[-1:], steps=2)


def test_the_newest_trace_is_read(tmp_path) -> None:
    (tmp_path / "sub").mkdir()
    with gzip.open(tmp_path / "sub" / "1-TP-0.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [_kernel("_topk_kernel", 0, 10, 1)]}, f)
    assert read_trace(str(tmp_path))[0]["name"] == "_topk_kernel"
    with pytest.raises(FileNotFoundError):
        read_trace(str(tmp_path / "sub" / "none"))


def test_run_sh_profile_step_parses() -> None:
    args = build_parser().parse_args(["--configs", "sglang_ext_fi", "sglang_ext_tier_locality_fi",
                                      "--input-len", "65536", "--num-prompts", "2"])
    assert args.steps == 8 and args.output_len == 2048


def _decode(running: int, queued: int) -> str:
    return (f"[t] Decode batch, #running-req: {running}, #token: 9, token usage: 0.9, "
            f"cuda graph: True, gen throughput (token/s): 1.0, #queue-req: {queued}\n")


def _prefill(running: int) -> str:
    return (f"[t] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: "
            f"0.5, #running-req: {running}, #queue-req: 0, #pending-token: 0\n")


def test_the_profile_starts_at_the_full_batch_or_at_the_pools_steady_one() -> None:
    from benchmarks.profile_decode import full_batch_reached

    warmup = _decode(1, 0) * 5  # bench_serving's warm-up request decoding alone
    assert full_batch_reached(warmup, 18) is None
    assert full_batch_reached(warmup + _prefill(0) + _decode(18, 0), 18) == 18
    # the pool held 17 of 18 (one queued): steady once three decode lines in a row show 17
    filling = warmup + _prefill(15) + _decode(16, 2) + _prefill(16) + _decode(17, 1) * 2
    assert full_batch_reached(filling, 18) is None
    assert full_batch_reached(filling + _decode(17, 1), 18) == 17
    # the tail of the run: fewer than the most seen
    assert full_batch_reached(filling + _decode(17, 1) + _decode(9, 0) * 3, 18) is None
    assert full_batch_reached("", 4) is None


def test_a_reused_servers_earlier_full_batch_does_not_start_the_next_profile(tmp_path) -> None:
    from benchmarks.profile_decode import wait_all_decoding

    log = tmp_path / "server.log"
    earlier = _decode(21, 0) * 3  # the last benchmark's full batch on the same server
    log.write_text(earlier + _prefill(3))  # this one is still prefilling
    offset = len(earlier.encode())
    assert wait_all_decoding(str(log), 11, timeout=5) == 21  # what the old wait did
    with pytest.raises(TimeoutError):
        wait_all_decoding(str(log), 11, timeout=1.5, log_offset=offset)
    log.write_text(earlier + _prefill(3) + _prefill(10) + _decode(11, 0))
    assert wait_all_decoding(str(log), 11, timeout=5, log_offset=offset) == 11
