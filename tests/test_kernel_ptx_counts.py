"""benchmarks/kernel_ptx_counts.py: the block-score loop's sm90 PTX, compiled without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_fp16_operands_drop_the_per_value_bf16_conversions(tmp_path: Path):
    """fp8 summaries widened to fp16 ("tc_fp16") take one e4m3x2 -> f16x2 cvt per two values
    and no f16 -> bf16 cvt, so the tile loop is shorter than the bf16-operand one ("tc");
    both loops hold the same number of tensor-core MMAs. (A process of its own: the tests'
    TRITON_INTERPRET=1 would hand Triton's compiler interpreted functions.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "counts.json"
    subprocess.run([sys.executable, "benchmarks/kernel_ptx_counts.py", "--json", str(out)],
                   cwd=REPO, env=env, check=True, timeout=300)
    counts = json.loads(out.read_text())["precisions"]
    tc, fp16 = (dict(counts[p]["ops"]) for p in ("tc", "tc_fp16"))
    assert tc.get("cvt.bf16.f16", 0) > 0 and "cvt.bf16.f16" not in fp16
    assert fp16["cvt.rn.f16x2.e4m3x2"] == tc["cvt.rn.f16x2.e4m3x2"] > 0
    mma = lambda ops: sum(n for op, n in ops.items() if op.startswith("mma"))
    assert mma(tc) == mma(fp16) > 0
    assert counts["tc_fp16"]["loop_instructions"] < counts["tc"]["loop_instructions"]


# the H200's (sm_90) shared memory per block, opt-in maximum
SM90_SHARED_BYTES = 232448


def test_tensor_core_block_scores_fit_shared_memory_at_large_groups(tmp_path: Path):
    """The tensor-core bound's launch fits sm_90's shared memory at every group the server may
    meet: GQA groups of 4 and 128 at 128 dims, MLA's 576-dim latent head at 16 (DeepSeek-V2-Lite),
    64 and 128 query heads (DeepSeek-V3 at TP 2 and 1). At 128 x 576 with three pipeline
    stages it asked for 305 KB and failed to launch on the H200 (tc_num_stages)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "shared.json"
    shapes = ["4x128", "128x128", "16x576", "64x576", "128x576"]
    subprocess.run([sys.executable, "benchmarks/kernel_ptx_counts.py", "--shared", *shapes,
                    "--json", str(out)], cwd=REPO, env=env, check=True, timeout=600)
    shared = json.loads(out.read_text())["shared_bytes"]
    assert set(shared) == set(shapes)
    assert all(0 < b <= SM90_SHARED_BYTES for b in shared.values()), shared
