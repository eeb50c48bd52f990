# sglang_ext: `make serve` and `make test` set the machine up first (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR := .models/smollm2
LABELS := $(MODEL_DIR)/sparse_labels.json
HEAD_POLICY := $(MODEL_DIR)/head_policy.json
EVICTION_HEAD := $(MODEL_DIR)/eviction_head.safetensors
PORT ?= 30000
# Extra flags for `make serve`, e.g. SERVE_ARGS="--sparse-budget 512 --sparse-method quest".
SERVE_ARGS ?=
PYTEST_ARGS ?=

SETUP_STAMP := $(VENV)/.sglang_ext-setup

.PHONY: setup model head-policy eviction-head serve test test-gpu clean

setup: $(SETUP_STAMP) $(MODEL_DIR)/.complete $(LABELS)

$(SETUP_STAMP): requirements/base.txt requirements/nodeps.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/base.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps -r requirements/nodeps.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(PY) -m sglang_ext.cpu_shim.install
	touch $@

model: $(MODEL_DIR)/.complete $(LABELS)

$(MODEL_DIR)/.complete: $(SETUP_STAMP)
	$(PY) -m sglang_ext.models.convert_gguf --out $(MODEL_DIR)

$(LABELS): $(MODEL_DIR)/.complete
	$(PY) -m sglang_ext.selection.calibrate --model-path $(MODEL_DIR) --out $@ --channels 32

# Fluxion's per-head policy (streaming vs retrieval kv heads) for --sparse-head-policy.
head-policy: $(HEAD_POLICY)

$(HEAD_POLICY): $(MODEL_DIR)/.complete
	$(PY) -m sglang_ext.selection.head_policy --model-path $(MODEL_DIR) --out $@

# NOSA's trained eviction heads for --sparse-eviction-head (CPU, a few minutes; the base model
# stays frozen; EVICTION_ARGS="--device cuda --steps 400" for more).
EVICTION_ARGS ?=
eviction-head: $(EVICTION_HEAD)

$(EVICTION_HEAD): $(MODEL_DIR)/.complete
	$(PY) -m sglang_ext.selection.train_eviction --model-path $(MODEL_DIR) --out $@ $(EVICTION_ARGS)

# CPU when no GPU is visible, GPU otherwise.
serve: setup
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  set -x; $(PY) -m sglang.launch_server --model-path $(MODEL_DIR) --port $(PORT) \
	    --attention-backend sglang_ext --sparse-label-config $(LABELS) $(SERVE_ARGS); \
	else \
	  set -x; SGLANG_USE_CPU_ENGINE=1 $(PY) -m sglang.launch_server --model-path $(MODEL_DIR) \
	    --port $(PORT) --device cpu --attention-backend sglang_ext --sparse-budget 256 --sparse-block-size 4 \
	    --sparse-label-config $(LABELS) --max-total-tokens 16384 --sleep-on-idle $(SERVE_ARGS); \
	fi

test: setup
	SGLANG_EXT_MODEL_DIR=$(MODEL_DIR) $(PY) -m pytest -ra $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .models
