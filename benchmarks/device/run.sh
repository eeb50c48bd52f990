#!/usr/bin/env bash
# One self-contained run on the GPU host (see ../shared/gpu/README.md): unpack the SGLang bundle,
# install this repo, then the named steps. Results land in $OUT (flat: the device machine's output
# folder) or, without $OUT, in the step's suite folder benchmarks/results/SUITE/ (see suite below).
# Usage: bash benchmarks/device/run.sh COMMIT STEP...
#   steps: env fi-warmup fi-wait fi-pack gputests clock operator rerank-operator cascade-operator
#   mla-operator sparse-attention faithful-operator
#   tier fluxion transfer server e2e soak capacity locality profile tp2-greedy mla-e2e pack-logs
#   gguf-part smollm2 fidelity refactor soak-real
#   (tp2-greedy: on nvidia-h200-x2; real weights: gguf-part in consecutive warm calls, then
#   smollm2 and fidelity, see ../shared/gpu/README.md; refactor: carry .before from
#   benchmarks/device/export_before.sh; soak-real: after smollm2, benchmarks/device/soak_real.sh)
# gputests: GPUTESTS_K (a pytest -k expression), GPUTESTS_ARGS (more pytest words), GPUTESTS_SECONDS,
#   GPUTESTS_SHARD (K/N: the K-th of N slices; the whole suite takes ~8 min on an H100, so two
#   warm calls with 1/2 and 2/2 each fit the 10-minute limit)
# e2e: E2E_CONFIGS, E2E_INPUT, E2E_OUTPUT, E2E_PROMPTS, E2E_BLOCK_SIZE, E2E_EXTRA (server flags),
#   E2E_ARGS (more e2e_serving.py flags, e.g. --label-basis)
# operator, server and fidelity run benchmarks/run.py (what the Makefile's bench-* targets call).
# Wheels in .whl/ (carried, git-ignored; e.g. prometheus_client for --enable-metrics, which the
# bundle lacks) are installed first.
set -uo pipefail
export SGLANG_EXT_COMMIT=${1:?commit}; shift
OUT_GIVEN=${OUT:-}
suite() {  # a step's folder under benchmarks/results/ (benchmarks/results_io.py: SUITES)
  case $1 in
    operator|mla-operator|rerank-operator|cascade-operator|faithful-operator) echo operator ;;
    sparse-attention) echo kernels ;;
    tier|fluxion|transfer|locality) echo "$1" ;;
    fidelity) echo accuracy ;;
    refactor) echo refactor ;;
    gputests|clock) echo gputests ;;
    *) echo serving ;;
  esac
}
export PYTHONUNBUFFERED=1
python3 .gpu/unpack.py >/dev/null && export PYTHONPATH=/tmp/site:$PWD || exit 1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
python3 -m pip install -q --no-deps --no-index --no-build-isolation -e . 2>&1 | tail -3
# FlashInfer's kernels compiled by an earlier call's fi-pack (carried as .fiaot/, git-ignored):
# FlashInfer loads a kernel found in its AOT folder instead of JIT-compiling it (~4 min fresh)
if [ -f .fiaot/fi_aot.tar.xz ]; then
  mkdir -p /tmp/site/flashinfer/data/aot && tar -xJf .fiaot/fi_aot.tar.xz -C /tmp/site/flashinfer/data/aot \
    && echo "flashinfer: $(ls /tmp/site/flashinfer/data/aot | wc -l) prebuilt kernels from .fiaot"
fi
# One operator file at the headline shape (128k x 32, block 32, budget 2048) with its FlashInfer
# baseline from the same call: headline_operator TAG [bench_operator flags...]
headline_operator() {
  local tag=$1; shift
  python3 -m benchmarks.run operator --out "$OUT" --contexts 131072 --batches 32 \
    --block-size 32 --fi-page-size 32 --skip-triton --no-compare-topk --no-compare-block-score \
    --no-compare-scatter --no-compare-label-cache --no-fi-sparse --tag "$tag" "$@"
}
status=0
warmups=()
for step in "$@"; do
  echo "=== $step $(date +%T)"
  OUT=${OUT_GIVEN:-benchmarks/results/$(suite "$step")}; mkdir -p "$OUT"
  case $step in
    env)
      nvidia-smi --query-gpu=name,memory.total --format=csv
      python3 -c "import torch, triton, sglang, flashinfer; print(torch.__version__, triton.__version__, flashinfer.__version__)"
      python3 -c "from importlib.metadata import entry_points as e; print(e(group='sglang.srt.plugins'))" ;;
    gputests)
      # -v names every test's outcome in the log, even one cut short by the time limit
      timeout "${GPUTESTS_SECONDS:-600}" python3 -m pytest -v -rfE -m gpu tests/ -p no:cacheprovider \
        ${GPUTESTS_K:+-k "$GPUTESTS_K"} ${GPUTESTS_SHARD:+--shard "$GPUTESTS_SHARD"} \
        ${GPUTESTS_ARGS:-} 2>&1 \
        | tee "$OUT/gputests.log" | tail -25
      [ "${PIPESTATUS[0]}" = 0 ] || status=1 ;;
    operator)
      python3 -m benchmarks.run operator --out "$OUT" ${OPERATOR_ARGS:-} || status=1 ;;
    rerank-operator)
      # The exact rerank's cost at the headline shape (128k x 32, block 32, budget 2048):
      # two_level by the label maximum and by the bound, rerank off / 2 / 4, each file with
      # its FlashInfer baseline from the same call (RERANK_OPERATOR_ARGS: more flags)
      for score in label_max bound; do
        for factor in 0 2 4; do
          headline_operator "rerank_${score}_$factor" --block-score "$score" --rerank "$factor" \
            ${RERANK_OPERATOR_ARGS:-} || status=1
        done
      done ;;
    cascade-operator)
      # The block filter's cascade (--sparse-block-prefilter) at the same shape: two_level by
      # the label maximum over the bound's FACTOR x candidates, rerank off / 4, each file with
      # its FlashInfer baseline (CASCADE_OPERATOR_ARGS: more flags)
      for factor in 2 4; do
        for rerank in 0 4; do
          headline_operator "cascade_${factor}_rerank_$rerank" --block-score label_max \
            --prefilter "$factor" --rerank "$rerank" ${CASCADE_OPERATOR_ARGS:-} || status=1
        done
      done ;;
    faithful-operator)
      # The faithful setting's operator (two_level by the label maximum, rerank 4, block 32) at
      # the same shape: the rerank alone, the cascade F = 2 / 4 before it, and F = 4 with fp8
      # summaries and labels; each file with its FlashInfer baseline from the same call and the
      # stage breakdown (FAITHFUL_OPERATOR_ARGS: more flags)
      faithful="--block-score label_max --rerank 4 ${FAITHFUL_OPERATOR_ARGS:-}"
      headline_operator faithful_rerank_4 $faithful || status=1
      for factor in 2 4; do
        headline_operator "faithful_cascade_${factor}_rerank_4" $faithful --prefilter "$factor" \
          || status=1
      done
      headline_operator faithful_cascade_4_rerank_4_fp8 $faithful --prefilter 4 \
        --summary-dtype fp8 --label-dtype fp8_e4m3 || status=1 ;;
    mla-operator)
      # DeepSeek-V2-Lite's MLA layer: ours vs SGLang's Triton MLA decode and FlashInfer MLA; its
      # rows go into operator_h200.json beside the MHA rows
      python3 benchmarks/bench_operator_mla.py --check --out "$OUT" ${MLA_OPERATOR_ARGS:-} || status=1 ;;
    tier)
      python3 benchmarks/bench_tier.py --check --out "$OUT" ${TIER_ARGS:-} || status=1 ;;
    fluxion)
      python3 benchmarks/bench_fluxion.py --check --out "$OUT" ${FLUXION_ARGS:-} || status=1 ;;
    sparse-attention)
      python3 benchmarks/bench_sparse_attention.py --out "$OUT" ${SPARSE_ATTENTION_ARGS:-} || status=1 ;;
    transfer)
      python3 benchmarks/bench_transfer.py --out "$OUT" ${TRANSFER_ARGS:-} || status=1 ;;
    server)
      python3 -m benchmarks.run serving --out "$OUT" --model .gpu/models/qwen3-8b-shape \
        --tokenizer .gpu/models/tokenizer \
        --configs sglang_ext --output-len 128 --num-prompts 4 --concurrency 4 || status=1
      grep -E "Traceback|Error|memory leak" "$OUT/server_sglang_ext.log" | head -20 ;;
    e2e)
      python3 benchmarks/e2e_serving.py --out "$OUT" --configs ${E2E_CONFIGS:-flashinfer sglang_ext} \
        --input-len ${E2E_INPUT:-32768} --output-len "${E2E_OUTPUT:-512}" \
        --num-prompts "${E2E_PROMPTS:-16}" --concurrency "${E2E_CONCURRENCY:-${E2E_PROMPTS:-16}}" \
        --warmup-requests "${E2E_WARMUP:-1}" --profile-steps "${E2E_PROFILE_STEPS:-0}" \
        ${E2E_BLOCK_SIZE:+--block-size "$E2E_BLOCK_SIZE"} ${E2E_APPEND:+--append} \
        ${E2E_DECODE_ONLY:+--decode-only} ${E2E_ARGS:-} \
        --extra "${E2E_EXTRA:---mem-fraction-static 0.75}" || status=1 ;;
    soak)
      # >= 200 requests of 1k-128k tokens, ~10 % aborted, CPU tier on, metrics on; decisive dummy
      # weights so that the reference subset's greedy comparison means something. A 128k prompt
      # takes ~40 s to prefill here (8k chunks at 120k positions: ~5 s each), so 128k prompts
      # are a few among many short ones (a uniform mix did not finish in 10 minutes). The dense
      # reference (triton full attention, no CUDA graphs: it starts fastest) runs first, for
      # prompts within our budget of 2048.
      SGLANG_EXT_DUMMY_WEIGHTS=scaled SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 \
      python3 benchmarks/soak.py --server-log "$OUT/soak_server.log" --out "$OUT/soak_h200.json" \
        --requests "${SOAK_REQUESTS:-200}" --concurrency 12 --max-new-tokens 32 \
        --lengths ${SOAK_LENGTHS:-1024:70 2048:50 4096:35 8192:20 16384:12 32768:8 131072:5} \
        --time-limit "${SOAK_SECONDS:-300}" \
        --dense-reference 4 --dense-lengths 1000 1500 \
        --dense-launch "--model-path .gpu/models/qwen3-8b-shape --tokenizer-path .gpu/models/tokenizer \
          --load-format dummy --sampling-backend pytorch --grammar-backend none \
          --context-length 4096 --mem-fraction-static 0.5 --disable-cuda-graph \
          --attention-backend triton" \
        --launch "--model-path .gpu/models/qwen3-8b-shape --tokenizer-path .gpu/models/tokenizer \
          --load-format dummy --sampling-backend pytorch --grammar-backend none \
          --context-length 163840 --mem-fraction-static 0.8 --cuda-graph-backend-prefill disabled \
          --cuda-graph-max-bs 16 --max-running-requests 16 --enable-metrics \
          --attention-backend sglang_ext --sparse-budget 2048 --sparse-block-size 32 \
          --sparse-tier async --sparse-tier-host-gb 64 --sparse-tier-timing ${SGLANG_EXT_TIER_TIMING:-on}" || status=1 ;;
    clock)
      # the device clock behind --sparse-tier-timing; without it the tier runs untimed
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_stream_clock.py \
        tests/test_memory_tier.py -k "clock or timing" 2>&1 | grep -E "^E |passed|failed" | tail -12
      [ "${PIPESTATUS[0]}" = 0 ] || { export SGLANG_EXT_TIER_TIMING=off; status=1; } ;;
    capacity)
      # Issue 4: how many concurrent 128k requests each server admits, full attention (flashinfer)
      # vs ours with the CPU tier, beside the physical limit (device KV + pinned host) / device KV
      # computed from the two servers' logs (capacity_vs_limit in the rows); tier timing on, so
      # the row's tier stats carry the hidden-transfer fraction (a stats line every 8 decode
      # steps: the outputs are short). Prompts: enough for twice
      # what full attention holds; short outputs (admission, not decode speed, is measured).
      # Decisive dummy weights (patches/model_loader.py), as in the soak: SGLang's random ones
      # give almost no step-to-step locality. One server per call on a fresh machine (each takes
      # 5-6 min to start): CAP_CONFIGS=flashinfer, then CAP_CONFIGS=sglang_ext_tier_fi, then
      # e2e_serving.py --collect over both calls' files.
      SGLANG_EXT_DUMMY_WEIGHTS=scaled SGLANG_EXT_TIER_HOST_GB="${CAP_HOST_GB:-96}" \
      SGLANG_EXT_TIER_LOG_EVERY=8 \
      python3 benchmarks/e2e_serving.py --out "$OUT" --configs ${CAP_CONFIGS:-flashinfer sglang_ext_tier_fi} \
        --input-len 131072 --output-len "${CAP_OUTPUT:-32}" --num-prompts "${CAP_PROMPTS:-10}" \
        --concurrency "${CAP_PROMPTS:-10}" --results-name capacity_h200 \
        --extra "--mem-fraction-static 0.8 --max-running-requests 16 --cuda-graph-max-bs 16 \
          --chunked-prefill-size 32768" \
        || status=1 ;;
    locality)
      # NOSA's locality constraint on vs off (sglang_ext_tier_locality: LOCALITY_SHARE of the
      # selected blocks query-agnostic, as in the accuracy suite), CPU tier with every page on
      # the host, same budget: host->GPU bytes per decode step (tier counters, each length's
      # span of the server log) and throughput. Each server serves both lengths (~2 x 4 min on
      # a fresh machine: 2 prompts each, no bench warm-up, whose 128k prefill alone takes
      # ~40 s). Decisive dummy weights as in the soak (SGLang's random ones attend uniformly).
      SGLANG_EXT_DUMMY_WEIGHTS=${SGLANG_EXT_DUMMY_WEIGHTS:-scaled} \
      SGLANG_EXT_TIER_HOST_GB=${LOCALITY_HOST_GB:-64} SGLANG_EXT_TIER_GPU_TOKENS=16 \
      SGLANG_EXT_TIER_LOG_EVERY=16 \
      python3 benchmarks/e2e_serving.py --out "$OUT" \
        --configs sglang_ext_tier sglang_ext_tier_locality \
        --input-len ${LOCALITY_CONTEXTS:-65536 131072} --output-len 192 \
        --num-prompts "${LOCALITY_PROMPTS:-2}" --concurrency "${LOCALITY_PROMPTS:-2}" \
        --warmup-requests 0 --append --results-name locality_h200 \
        --extra "--mem-fraction-static 0.8 --cuda-graph-max-bs 8 --max-running-requests 8" \
        || status=1 ;;
    profile)
      # Issue 8: where a served decode step's time goes (benchmarks/profile_decode.py: SGLang's
      # own profiler over PROFILE_STEPS decode steps once every request decodes; kernel time
      # per stage, compute-stream idle time, side-stream gathers). Every page on the host tier
      # for the tier configs (SGLANG_EXT_TIER_GPU_TOKENS=16); the *_fi configs prefill with
      # FlashInfer (fi-warmup in an earlier call saves its JIT compile).
      SGLANG_EXT_DUMMY_WEIGHTS=scaled SGLANG_EXT_TIER_HOST_GB=${PROFILE_HOST_GB:-64} \
      SGLANG_EXT_TIER_GPU_TOKENS=${PROFILE_GPU_TOKENS:-16} \
      python3 benchmarks/profile_decode.py --out "$OUT" \
        --configs ${PROFILE_CONFIGS:-sglang_ext_fi sglang_ext_tier_locality_fi} \
        --input-len ${PROFILE_INPUT:-65536} --num-prompts ${PROFILE_PROMPTS:-2} \
        --steps ${PROFILE_STEPS:-8} \
        --extra "--mem-fraction-static 0.8 --cuda-graph-max-bs 8 --max-running-requests 8" \
        || status=1 ;;
    tp2-greedy)
      # TP=2 (nvidia-h200-x2): greedy outputs of ours with every page on the host tier, budget >=
      # context, against triton full attention at --tp 2; flashinfer full attention is the
      # control (how far two of SGLang's own full-attention kernels are from each other).
      SGLANG_EXT_DUMMY_WEIGHTS=scaled SGLANG_EXT_TIER_HOST_GB=96 SGLANG_EXT_TIER_GPU_TOKENS=16 \
      python3 benchmarks/e2e_serving.py --out "$OUT" --model .gpu/models/qwen3-14b-shape \
        --configs triton flashinfer sglang_ext_tier --tp 2 --input-len 65536 --num-prompts 0 \
        --greedy-check 8 --greedy-output-len 96 --results-name tp2_greedy_h200 \
        --extra "--mem-fraction-static 0.8 --cuda-graph-max-bs 8 --max-running-requests 8" \
        || status=1 ;;
    mla-e2e)
      # Issue 9: an MLA model (DeepSeek-V2-Lite's shapes, dummy weights; the config is in the
      # repo) at 32k: SGLang's full MLA attention (its flashinfer backend picks FlashInfer's MLA
      # kernels for an MLA model; MLA_E2E_CONFIGS="triton ..." for its Triton MLA decode) vs ours
      # with the CPU tier (TieredMLAKVPool). No label channels: synthetic_label_config writes MHA
      # shapes and MLA has no calibration yet, so token scores use all 576 latent dims. Rows
      # are merged (--append) into e2e_h200.json beside the MHA rows, "model":
      # "deepseek-v2-lite-shape" (tests/test_e2e_serving_results.py parses this call).
      SGLANG_EXT_TIER_HOST_GB=${MLA_E2E_HOST_GB:-64} \
      python3 benchmarks/e2e_serving.py --out "$OUT" \
        --model benchmarks/models/deepseek-v2-lite-shape --tokenizer .gpu/models/tokenizer \
        --configs ${MLA_E2E_CONFIGS:-flashinfer sglang_ext_tier} --label-channels 0 \
        --input-len 32768 --output-len "${MLA_E2E_OUTPUT:-256}" \
        --num-prompts "${MLA_E2E_PROMPTS:-8}" --concurrency "${MLA_E2E_PROMPTS:-8}" --append \
        --extra "--mem-fraction-static 0.8 --cuda-graph-max-bs 8 --max-running-requests 8" \
        || status=1 ;;
    gguf-part)
      # Real weights travel in parts: one call carries at most 64 MiB, the GGUF is 98 MB. Each
      # call that carries a .parts*/ folder (one piece of `split -b 50M` of the GGUF, git-ignored) adds
      # it under /tmp/gguf, which the machine keeps while it stays warm (30 s between calls).
      mkdir -p /tmp/gguf && cp .parts*/gguf.part.* /tmp/gguf/ && ls -l /tmp/gguf || status=1 ;;
    smollm2)
      # The parts joined, checked against the PyPI package's GGUF and converted into
      # /tmp/smollm2, with the label configs calibrated here (carried: .models/smollm2/'s
      # sparse_labels*.json and the basis files they name, *.basis.pt).
      cat /tmp/gguf/gguf.part.* > /tmp/smollm2.gguf \
        && echo "$(cat benchmarks/device/smollm2.sha256)  /tmp/smollm2.gguf" | sha256sum -c \
        && python3 -m sglang_ext.models.convert_gguf --gguf /tmp/smollm2.gguf --out /tmp/smollm2 \
        && cp .models/smollm2/sparse_labels*.json /tmp/smollm2/ \
        && { cp .models/smollm2/*.basis.pt /tmp/smollm2/ 2>/dev/null || true; } || status=1 ;;
    fidelity)
      # The accuracy suite on SmolLM2's real weights through the served GPU path (Triton
      # impl, CUDA graphs), every setting per request on one server per (block, storage):
      # benchmarks/results/accuracy/ (FIDELITY_ARGS: more gpu_suite flags).
      python3 -m benchmarks.run accuracy --out "$OUT" --model-dir /tmp/smollm2 \
        ${FIDELITY_ARGS:-} || status=1 ;;
    refactor)
      # Issue 40: the tree before the refactor (.before/, benchmarks/device/export_before.sh,
      # carried) against this one, same call, each from its own site under /tmp: the operator
      # at 128k x 32 (block 32), then a 32k serving pair whose servers first answer a fixed
      # greedy set (benchmarks/refactor_compare.py). Both parts need about 10 minutes: run
      # REFACTOR_PARTS=operator, then REFACTOR_PARTS=serving in the next (warm) call, whose
      # file then holds both (REFACTOR_ARGS: more flags).
      python3 benchmarks/refactor_compare.py --out "$OUT" --parts ${REFACTOR_PARTS:-operator serving} \
        ${REFACTOR_ARGS:-} || status=1 ;;
    fi-warmup)
      # FlashInfer JIT-compiles its kernels at a server's first start (~5 min on a fresh
      # machine). The cache (~/.cache/flashinfer) outlives the call while the machine is held,
      # so FlashInfer servers of a later call (flashinfer, sglang_ext_*_fi) start in ~1.5 min.
      # A small FlashInfer server of each model in $FI_WARMUP_MODELS (default: the Qwen3-8B
      # shape; add benchmarks/models/deepseek-v2-lite-shape for FlashInfer's MLA kernels, which
      # mla-e2e's baseline uses) starts in the background beside the next steps (0.3 of the
      # GPU's memory each: only beside light steps such as gputests, clock, operator,
      # mla-operator) and stops once healthy; the script waits for them.
      port=30123
      warmups=()
      for model in ${FI_WARMUP_MODELS:-.gpu/models/qwen3-8b-shape}; do
        name=$(basename "$model")
        (
          setsid python3 -m sglang.launch_server --model-path "$model" \
            --tokenizer-path .gpu/models/tokenizer --load-format dummy --sampling-backend pytorch \
            --grammar-backend none --attention-backend flashinfer --context-length 8192 \
            --mem-fraction-static 0.3 --cuda-graph-max-bs 16 --cuda-graph-backend-prefill disabled \
            --host 127.0.0.1 --port $port > "$OUT/fi_warmup_$name.log" 2>&1 &
          server=$!
          for _ in $(seq 160); do
            sleep 3
            python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health_generate', timeout=5)" \
              2>/dev/null && { echo "fi-warmup $name: healthy"; break; }
            kill -0 $server 2>/dev/null || { echo "fi-warmup $name: server exited"; tail -5 "$OUT/fi_warmup_$name.log"; break; }
          done
          kill -- -$server 2>/dev/null; wait $server 2>/dev/null
        ) &
        warmups+=($!)
        port=$((port + 1))
      done ;;
    fi-pack)
      # the kernels FlashInfer compiled in this call (after fi-warmup / fi-wait), for a later
      # call on a fresh machine: copy $OUT/fi_aot.tar.xz to .fiaot/ here and carry .fiaot
      (cd ~/.cache/flashinfer/*/*/cached_ops && tar -cJf "$OUT/fi_aot.tar.xz" */*.so) \
        && ls -l "$OUT/fi_aot.tar.xz" || status=1 ;;
    pack-logs)
      # a call brings back at most 8 files: the servers' logs, bench_serving's outputs and the
      # label configs go into one archive (e2e_serving.py --collect reads them unpacked)
      (cd "$OUT" && files=$(ls *.log *.jsonl labels_*.json 2>/dev/null) \
        && [ -n "$files" ] && tar -cJf logs.tar.xz $files && rm -f $files) ;;
    fi-wait)
      # the warm-up servers hold GPU memory: a heavy step after fi-warmup waits for them
      [ ${#warmups[@]} -gt 0 ] && wait "${warmups[@]}"; warmups=() ;;
    soak-real) bash benchmarks/device/soak_real.sh || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
[ ${#warmups[@]} -gt 0 ] && wait "${warmups[@]}"
# Results files are named for the H200 (operator_h200.json, ...). A call that ran on another card
# (a plain run may get an H100) renames its files in the device's $OUT after that card, so that
# no H100 number lands under an H200 name (each file also records the GPU it ran on).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
card=$(echo "$gpu" | grep -oE 'H[0-9]{3}' | head -1 | tr 'H' 'h')
if [ -n "$OUT_GIVEN" ] && [ -n "$card" ] && [ "$card" != h200 ]; then
  find "$OUT_GIVEN" -name '*_h200*' | while read -r f; do
    mv "$f" "$(dirname "$f")/$(basename "$f" | sed "s/_h200/_$card/g")"
  done
  echo "ran on $gpu: result files renamed _h200 -> _$card"
fi
exit $status
