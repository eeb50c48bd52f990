"""The Makefile's benchmark targets and benchmarks/run.py behind them: the targets parse
(``make -n``) into one benchmarks.run call each, ``make help`` lists them, run.py holds the
defaults with repo-relative paths, passes extra flags last, and without a CUDA GPU stops with one
line (the GPU machine has no ``make``: benchmarks/device/run.sh calls run.py directly)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH_TARGETS = ("bench-operator", "bench-serving", "bench-accuracy")
BENCHES = ("operator", "serving", "accuracy")

needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")


def _make(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), *words],
                          capture_output=True, text=True, timeout=120)


def _run_py(*words: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.run", *words], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _no_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here")


@needs_make
@pytest.mark.parametrize("target, call", [
    ("bench-operator", "python3 -m benchmarks.run operator --out bench-out/operator"),
    ("bench-serving", "python3 -m benchmarks.run serving --out bench-out/serving "
     "--model benchmarks/models/qwen3-8b-shape --tokenizer .models/smollm2"),
    ("bench-accuracy", "python3 -m benchmarks.run accuracy --out bench-out/accuracy "
     "--model-dir .models/smollm2"),
])
def test_bench_targets_parse(target, call):
    out = _make("-n", target, "BENCH_PY=python3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == call  # one call, nothing of the lab's bundle or machine


@needs_make
def test_bench_target_args_are_passed_last():
    out = _make("-n", "bench-serving", "BENCH_PY=python3", "SERVING_ARGS=--configs sglang_ext",
                "MODEL=benchmarks/models/deepseek-v2-lite-shape", "TOKENIZER=tok")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith(
        "--model benchmarks/models/deepseek-v2-lite-shape --tokenizer tok --configs sglang_ext")


@pytest.mark.parametrize("bench, script", [
    ("operator", "benchmarks/bench_operator.py --check --out bench-out/operator"),
    ("serving", "benchmarks/e2e_serving.py --model benchmarks/models/qwen3-8b-shape "
     "--tokenizer .models/smollm2 --out bench-out/serving --configs flashinfer sglang_ext "
     "--input-len 32768 --output-len 256 --num-prompts 8 --concurrency 8 "
     "--extra '--mem-fraction-static 0.75'"),
    ("accuracy", "-m benchmarks.accuracy.gpu_suite --model-dir .models/smollm2 "
     "--out-dir bench-out/accuracy --combined bench-out/accuracy/accuracy_gpu_smollm2.json"),
])
def test_run_py_defaults(bench, script):
    if bench == "accuracy" and not (ROOT / ".models/smollm2/sparse_labels.json").is_file():
        pytest.skip("no calibrated SmolLM2 here (the dry run would list its conversion)")
    if bench == "serving" and not (ROOT / ".models/smollm2/.complete").is_file():
        pytest.skip("no converted SmolLM2 here (the dry run would list its conversion)")
    out = _run_py(bench, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"{sys.executable} {script}"]
    command = out.stdout.removeprefix(sys.executable)  # the checkout may itself live in /tmp
    assert ".gpu/" not in command and "/tmp/" not in command


def test_run_py_passes_extra_args_last_and_runs_no_smollm2_for_another_tokenizer():
    out = _run_py("serving", "--dry-run", "--configs", "sglang_ext", "--model",
                  "benchmarks/models/deepseek-v2-lite-shape", "--extra",
                  "--mem-fraction-static 0.8", "--tokenizer", "tok", "--out", "o")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines()) == 1  # SmolLM2 is not converted
    assert out.stdout.rstrip().endswith(
        "--model benchmarks/models/deepseek-v2-lite-shape --tokenizer tok --out o "
        "--configs flashinfer sglang_ext --input-len 32768 --output-len 256 --num-prompts 8 "
        "--concurrency 8 --extra '--mem-fraction-static 0.75' --configs sglang_ext "
        "--extra '--mem-fraction-static 0.8'")
    out = _run_py("operator", "--dry-run", "--contexts", "32768", "--out", "o")
    assert out.stdout.rstrip().endswith("benchmarks/bench_operator.py --check --out o "
                                        "--contexts 32768")


def test_run_py_refuses_missing_inputs_in_one_line(tmp_path):
    out = _run_py("serving", "--dry-run", "--model", str(tmp_path))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"benchmarks.run serving: no {tmp_path}/config.json (--model / make's MODEL=: a model "
        "folder; only its config is read)"]
    out = _run_py("accuracy", "--dry-run", "--model-dir", str(tmp_path))
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.splitlines() == [
        f"benchmarks.run accuracy: no {tmp_path}/sparse_labels.json (python -m "
        f"sglang_ext.selection.calibrate --model-path {tmp_path} --out "
        f"{tmp_path}/sparse_labels.json)"]


@pytest.mark.parametrize("bench", BENCHES)
def test_without_a_gpu_run_py_stops_with_one_line(bench):
    _no_gpu()
    out = _run_py(bench)
    assert out.returncode == 1
    assert out.stdout == ""
    assert out.stderr.splitlines() == [f"benchmarks.run {bench}: needs a CUDA GPU and none is "
                                       "visible (torch.cuda.is_available() is False)"]


@needs_make
def test_help_lists_the_user_facing_targets():
    out = _make("help")
    assert out.returncode == 0, out.stderr
    listed = {line.split()[0] for line in out.stdout.splitlines() if line.startswith("  ")}
    assert {*BENCH_TARGETS, "setup", "model", "serve", "test", "head-policy", "eviction-head",
            "clean", "help"} <= listed
    for line in out.stdout.splitlines():
        if line.split() and line.split()[0] in BENCH_TARGETS:
            assert len(line.split()) > 2  # a description beside the name


def test_the_serving_model_shape_is_in_the_repo():
    assert (ROOT / "benchmarks" / "models" / "qwen3-8b-shape" / "config.json").is_file()


@needs_make
@pytest.mark.parametrize("target", BENCH_TARGETS)
def test_without_a_gpu_a_bench_target_stops_with_one_line(target):
    _no_gpu()
    out = _make(target, f"BENCH_PY={sys.executable}")
    assert out.returncode != 0
    ours = [line for line in out.stderr.splitlines() if not line.startswith("make")]
    assert ours == [f"benchmarks.run {target.removeprefix('bench-')}: needs a CUDA GPU and none "
                    "is visible (torch.cuda.is_available() is False)"], out.stderr


def test_run_sh_calls_run_py_without_make():
    text = (ROOT / "benchmarks/device/run.sh").read_text()
    code = [line.strip() for line in text.splitlines() if not line.strip().startswith("#")]
    assert not [line for line in code if "make " in line]  # the GPU machine's image has no make
    for bench in BENCHES:
        assert f"python3 -m benchmarks.run {bench} --out \"$OUT\"" in text
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks/device/run.sh")]).returncode == 0
