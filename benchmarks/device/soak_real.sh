#!/usr/bin/env bash
# Issue 43: the soak on real weights (SmolLM2-135M, converted to /tmp/smollm2 by run.sh's
# smollm2 step, context 8192) through the GPU path (Triton impl, CUDA graphs), and the fault
# table, in one device call of at most ~8.5 minutes. Called by run.sh's step soak-real with the
# repo as cwd, $OUT set and PYTHONPATH set; writes $OUT/soak_real_h200.json (merged),
# $OUT/faults_h200.json and $OUT/soak_real_parts.tar.xz (each phase's report and server log).
#
# Per-request settings (custom_params.sparse) are refused on --sparse-impl triton next to
# --sparse-tier or --sparse-guard-every, and the guard does not combine with the tier
# (sglang_ext/config.py), so the soak runs on servers one after the other, the same model,
# block 32 (= page size) and budget 256:
#   A "load":   the CPU tier (async, every page but one homed on the host:
#               --sparse-tier-gpu-tokens 32, one page),
#               tier timing and metrics on: most of the requests, ~10 % aborted, shared
#               prefixes, streaming and not
#   B "twins":  the recommended setting (the kpca label basis, --sparse-rerank 4), no tier, no
#               guard: a smaller load, then the dense twins (beyond the budget: top-1
#               agreement; within it: identical outputs), the sweep
#   G "guard":  the accuracy guard (--sparse-guard-every 8): a short load
#               (skipped when too little time is left)
# The bad-input sweep (~40 s) goes to phase B's server only; the live faults send their own.
# then the live faults on a fresh tier server (skipped when too little time is left) and the
# start-up refusals, which run in the background from the start.
# Environment: SOAK_REAL_SECONDS (total budget, default 510), SOAK_REAL_A / _B / _G (requests),
# SOAK_REAL_A_RESERVE (what phase A leaves to the rest, 150 s), SOAK_REAL_A_SECONDS / _B_SECONDS
# (how long each phase sends requests: one not started by then
# counts as a failure),
# SOAK_REAL_TWINS=0 (no phase B), SOAK_REAL_GUARD=0 (no phase G), FAULTS_LIVE=0 (no live faults), FAULTS_REFUSALS=0 (none).
set -uo pipefail
OUT=${OUT:?OUT}
MODEL=${SOAK_REAL_MODEL:-/tmp/smollm2}
WORK=/tmp/soak_real; rm -rf "$WORK"; mkdir -p "$WORK"
T0=$(date +%s)
BUDGET=${SOAK_REAL_SECONDS:-510}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
status=0
[ -f "$MODEL/config.json" ] && [ -f "$MODEL/sparse_labels.json" ] \
  && [ -f "$MODEL/sparse_labels_kpca.json" ] \
  || { echo "soak-real: no $MODEL (run the smollm2 step first)"; exit 1; }

COMMON="--model-path $MODEL --context-length 8192 --mem-fraction-static 0.5 \
  --sampling-backend pytorch --grammar-backend none --cuda-graph-max-bs 32 \
  --max-running-requests 32 --attention-backend sglang_ext --sparse-impl triton \
  --page-size 32 --sparse-block-size 32 --sparse-budget 256 \
  --sparse-label-config $MODEL/sparse_labels.json"
# phase B: the README's recommended setting (the rerank combines with neither tier nor guard)
FAITHFUL="${COMMON/sparse_labels.json/sparse_labels_kpca.json} --sparse-rerank 4"
TIER="--sparse-tier async --sparse-tier-gpu-tokens 32 --sparse-tier-host-gb 8 \
  --sparse-tier-timing ${SGLANG_EXT_TIER_TIMING:-on} --enable-metrics"
# 1k-8k-token prompts (the context is 8192 with 32 new tokens), most of them short
LENGTHS="1024:40 2048:30 4096:20 7000:10"
SOAK=(python3 benchmarks/soak.py --concurrency 32 --max-new-tokens 32
      --abort-frac 0.1 --shared 0.2 --non-stream-frac 0.3 --reference 4 --startup-timeout 240)

# the start-up refusals need no GPU: beside everything else from the start
if [ "${FAULTS_REFUSALS:-1}" != 0 ]; then
  timeout 300 python3 benchmarks/faults.py --faults host_memory_too_big label_file_for_another_model \
    --port 30410 --out "$WORK/faults_refusals.json" --refusal-timeout 240 \
    --launch "$COMMON $TIER" > "$WORK/faults_refusals.out" 2>&1 &
  refusals=$!
fi

echo "soak-real A (tier) $(date +%T), $(left) s left"
SGLANG_EXT_TIER_VERIFY=1 timeout $(( $(left) - ${SOAK_REAL_A_RESERVE:-150} )) "${SOAK[@]}" --lengths $LENGTHS --requests "${SOAK_REAL_A:-850}" \
  --time-limit "${SOAK_REAL_A_SECONDS:-140}" --bad-inputs off --port 30400 --out "$WORK/load.json" --server-log "$WORK/load_server.log" \
  --launch "$COMMON $TIER" > "$WORK/load.out" 2>&1 || status=1
tail -4 "$WORK/load.out"

phases=(load="$WORK/load.json")
if [ "${SOAK_REAL_TWINS:-1}" != 0 ]; then
  echo "soak-real B (twins) $(date +%T), $(left) s left"
  # a few prompts within the budget (prompt + 32 tokens <= 256) for the identical-when-dense twins
  timeout $(( $(left) - 30 )) "${SOAK[@]}" --lengths $LENGTHS 120:8 --requests "${SOAK_REAL_B:-250}" \
    --time-limit "${SOAK_REAL_B_SECONDS:-$(( $(left) > 260 ? 60 : 30 ))}" --port 30401 \
    --dense-twins 12 --dense-twins-within 4 --twin-tokens 32 \
    --out "$WORK/twins.json" --server-log "$WORK/twins_server.log" \
    --launch "$FAITHFUL" > "$WORK/twins.out" 2>&1 || status=1
  tail -4 "$WORK/twins.out"
  phases+=(twins="$WORK/twins.json")
else
  echo "soak-real B (twins) skipped"
fi
# what phase G leaves for the live faults after it (~70 s), and G's own need (~80 s)
G_RESERVE=$([ "${FAULTS_LIVE:-1}" != 0 ] && echo 70 || echo 10)
if [ "${SOAK_REAL_GUARD:-1}" != 0 ] && [ "$(left)" -gt $(( G_RESERVE + 80 )) ]; then
  echo "soak-real G (guard) $(date +%T), $(left) s left"
  timeout $(( $(left) - G_RESERVE )) "${SOAK[@]}" --lengths $LENGTHS --requests "${SOAK_REAL_G:-150}" \
    --time-limit 30 --bad-inputs off \
    --port 30402 --out "$WORK/guard.json" --server-log "$WORK/guard_server.log" \
    --launch "$COMMON --sparse-guard-every 8" > "$WORK/guard.out" 2>&1 || status=1
  tail -4 "$WORK/guard.out"
  phases+=(guard="$WORK/guard.json")
else
  echo "soak-real G (guard) skipped, $(left) s left"
fi

python3 benchmarks/soak.py --merge "${phases[@]}" --out "$OUT/soak_real_h200.json" \
  --model "SmolLM2-135M ($MODEL)" \
  --note "Requests on three servers of one model, block 32, budget 256 (phases, with their \
flags): load on the CPU tier (async, every page but one on the host), dense twins at the \
recommended setting (kpca label basis, rerank 4) on a server without tier or guard because \
per-request settings (custom_params.sparse.method=dense) do not combine \
with --sparse-tier or --sparse-guard-every on the Triton path, and the guard on its own server \
because it does not combine with the tier. Fault table: faults_h200.json." || status=1

# the live faults on a fresh tier server, when the budget allows (~90 s: start, faults, drain)
if [ "${FAULTS_LIVE:-1}" != 0 ] && [ "$(left)" -gt 70 ]; then
  echo "faults (live) $(date +%T), $(left) s left"
  timeout $(( $(left) - 5 )) python3 benchmarks/faults.py --no-startup-refusals --port 30403 \
    --out "$WORK/faults_live.json" --server-log "$WORK/faults_server.log" \
    --abort-prompt-tokens 6000 --sigterm-decode-tokens 512 --exit-timeout 45 --startup-timeout 120 \
    --launch "$COMMON ${TIER/--sparse-tier-host-gb 8/--sparse-tier-host-gb 0.5}" \
    > "$WORK/faults_live.out" 2>&1 || status=1
  cat "$WORK/faults_live.out" | grep -E "^(PASS|FAIL)"
else
  echo "faults (live) skipped, $(left) s left"
fi
if [ -n "${refusals:-}" ]; then
  wait "$refusals" || status=1
  grep -E "^(PASS|FAIL)" "$WORK/faults_refusals.out"
fi
# one table: the live rows, then the refusals' (faults.py --append keeps the other faults' rows)
rm -f "$OUT/faults_h200.json"
for part in faults_live faults_refusals; do
  [ -f "$WORK/$part.json" ] && python3 - "$WORK/$part.json" "$OUT/faults_h200.json" <<'EOF'
import json, os, sys
src, dst = sys.argv[1:]
part = json.load(open(src))
table = json.load(open(dst)) if os.path.exists(dst) else {k: v for k, v in part.items() if k != "rows"}
table["rows"] = [r for r in table.get("rows", []) if r["fault"] not in {p["fault"] for p in part["rows"]}] + part["rows"]
table["failed"] = [r["fault"] for r in table["rows"] if not r["passed"]]
table["passed"] = not table["failed"]
json.dump(table, open(dst, "w"), indent=1)
EOF
done
(cd "$WORK" && tar -cJf "$OUT/soak_real_parts.tar.xz" *.json *.log *.out 2>/dev/null)
echo "soak-real done $(date +%T) after $(( $(date +%s) - T0 )) s"
python3 -c "import json; d = json.load(open('$OUT/soak_real_h200.json')); print({k: d[k] for k in ('requests', 'crashes', 'leaks', 'ok', 'identical_when_dense')})" || status=1
exit $status
