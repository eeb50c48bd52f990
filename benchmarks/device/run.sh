#!/usr/bin/env bash
# One self-contained run on the GPU host (see ../shared/gpu/README.md): unpack the SGLang bundle,
# install this repo, then the named steps. Results land in $OUT (or benchmarks/results).
# Usage: bash benchmarks/device/run.sh COMMIT STEP...   steps: env gputests operator tier transfer server e2e
set -uo pipefail
export SGLANG_EXT_COMMIT=${1:?commit}; shift
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 .gpu/unpack.py >/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . 2>&1 | tail -3
status=0
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    env)
      nvidia-smi --query-gpu=name,memory.total --format=csv
      python3 -c "import torch, triton, sglang, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__)"
      python3 -c "from importlib.metadata import entry_points as e; print(e(group='sglang.srt.plugins'))" ;;
    gputests)
      python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tail -25 || status=1 ;;
    operator)
      python3 benchmarks/bench_operator.py --check --out "$OUT" ${OPERATOR_ARGS:-} || status=1 ;;
    tier)
      python3 benchmarks/bench_tier.py --check --out "$OUT" ${TIER_ARGS:-} || status=1 ;;
    transfer)
      python3 benchmarks/bench_transfer.py --out "$OUT" ${TRANSFER_ARGS:-} || status=1 ;;
    server)
      python3 benchmarks/e2e_serving.py --out "$OUT" --configs sglang_ext --input-len 32768 \
        --output-len 128 --num-prompts 4 --concurrency 4 --extra "--mem-fraction-static 0.75" \
        || status=1
      grep -E "Traceback|Error|memory leak" "$OUT/server_sglang_ext.log" | head -20 ;;
    e2e)
      python3 benchmarks/e2e_serving.py --out "$OUT" --configs flashinfer sglang_ext \
        --input-len "${E2E_INPUT:-32768}" --output-len "${E2E_OUTPUT:-512}" \
        --num-prompts "${E2E_PROMPTS:-16}" --concurrency "${E2E_PROMPTS:-16}" \
        --extra "--mem-fraction-static 0.75" || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
