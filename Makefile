# The two commands a new user runs: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SAMPLES ?= samples
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-slow test-all bench bench-scale lint samples browser clean gpu-wheels gpu-check

setup: $(STAMP)

# Reinstall only when the dependency list changes. torch comes from pip's own index (PyPI: the
# CUDA build on Linux) unless TORCH_INDEX names PyTorch's index of one build, e.g.
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu      (CPU only, a smaller download)
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu126    (CUDA 12.6)
TORCH_INDEX ?=
TORCH_SPEC := $(shell sed -n 's/^ *"\(torch[<>=][^"]*\)",*$$/\1/p' pyproject.toml)
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(if $(TORCH_INDEX),$(BIN)/pip install -q --index-url $(TORCH_INDEX) '$(TORCH_SPEC)')
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

samples: $(STAMP)
	$(BIN)/bertpipe samples fetch $(SAMPLES)

demo: $(STAMP) samples
	$(BIN)/python -m flows.demo --samples $(SAMPLES)

# `make test`: every test not marked slow, within 8 minutes on 2 cores. `make test-slow`: the
# end-to-end and stress tests marked slow, which CI runs after it. `make test-all`: both at once.
PYTEST := $(BIN)/python -m pytest -q -ra --durations=15 -n 2 --dist loadgroup
test: $(STAMP)
	$(PYTEST) -m "not slow"

test-slow: $(STAMP)
	$(PYTEST) -m slow

test-all: $(STAMP)
	$(PYTEST)

# Every benchmark, each at a bounded setting (benchmarks/run_all.py says which run shortened).
bench: $(STAMP) samples
	$(BIN)/python -m benchmarks.run_all --samples $(SAMPLES)

# The scale benchmark at x1, x10 and x30 of the sample (hours; `make bench` runs x1 only).
bench-scale: $(STAMP) samples
	BERTPIPE_SAMPLES=$(SAMPLES) $(BIN)/python -m benchmarks.speed.bench_scale --sizes 1,10,30

# Headless Chromium (Debian package) and playwright-core (npm) for tests/test_ui_browser.py.
# Each is installed only when missing, so a second run costs nothing.
CHROMIUM := /usr/bin/chromium
NODE_DIR := $(VENV)/node
PLAYWRIGHT := playwright-core@1.65.1
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

browser: $(STAMP)
	test -x $(CHROMIUM) || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }
	test -d $(NODE_DIR)/node_modules/playwright-core || \
		npm install -s --prefix $(NODE_DIR) --no-audit --no-fund --no-save $(PLAYWRIGHT)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

clean:
	rm -rf bertpipe-data .pytest_cache

# The GPU check (benchmarks/gpu/gpu_check.py) for a bare GPU machine with no internet whose
# Python 3.12 has torch, transformers, tokenizers, pyarrow and numpy: `make gpu-wheels` here puts
# everything else in .whl/ (DeepSpeed as a pure-Python wheel built here, its JIT ops left to run time), and
# `make gpu-check CALL=n GPU_LEFT=s` there installs them into a private folder and runs the slot's
# call n into $(OUT), s being the GPU time left (docs/benchmarks.md, "The slot's plan").
GPU_WHEELS := .whl
GPU_SITE := /tmp/bertpipe-site
GPU_PY ?= python3
OUT ?= gpu-check-out
PIN = $$($(BIN)/python -c "import importlib.metadata as m; print(m.version('$(1)'))")
gpu-wheels: $(STAMP)
	mkdir -p $(GPU_WHEELS)
	DS_BUILD_OPS=0 $(BIN)/pip wheel -q --no-deps --no-build-isolation -w $(GPU_WHEELS) deepspeed==$(call PIN,deepspeed)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) pydantic==$(call PIN,pydantic) pydantic-core==$(call PIN,pydantic-core) \
		annotated-types==$(call PIN,annotated-types) typing-inspection==$(call PIN,typing-inspection) \
		typing-extensions==$(call PIN,typing-extensions) hjson==$(call PIN,hjson)
	du -sh $(GPU_WHEELS)

GPU_INSTALL = $(GPU_PY) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
	--target $(GPU_SITE) $(GPU_WHEELS)/*.whl
GPU_ENV = PYTHONPATH=$(GPU_SITE):$(CURDIR) PATH=$(GPU_SITE)/bin:$$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
CALL ?= 1
gpu-check:
	$(GPU_INSTALL)
	$(GPU_ENV) $(GPU_PY) -m benchmarks.gpu.gpu_check --out $(OUT) --call $(CALL) \
		$(if $(GPU_LEFT),--gpu-left-s $(GPU_LEFT)) $(GPU_CHECK_ARGS)

# Quality protocol version 3 on this machine's CPU (docs/quality-protocol-v3.md), each step resumed from
# what is on disk. 1. `make quality-v3-choice`: the candidates' corpora, instances and step counts, the six
# runs side by side, then every setting on dev, and the choice in bench-results/quality-v3-choice.json
# (commit it, with its line in docs/quality.md, before step 2). 2. `make quality-v3`: the chosen recipe's three runs, two side by side, and beside them
# the test phase, which scores B and each run as it is there (a run it reaches first, it waits for).
# Finished, the results go to docs/quality-v3.json, which the demo's summary then reads, and the finished jobs
# to docs/results/quality-v3-cache.tar.xz. 3. `make quality-v3-reproduce`: the test phase again from that file
# alone in a new work folder (the corpus is prepared again; no job runs), its numbers checked against the JSON.
.PHONY: quality-v3-choice quality-v3 quality-v3-reproduce
QUALITY_V3_WORK ?= $(or $(BERTPIPE_CACHE),$(HOME)/.cache/bertpipe)/quality-v3
QUALITY_V3 = nice -n 19 $(BIN)/python -m benchmarks.quality $(1) --protocol v3 --work $(or $(2),$(QUALITY_V3_WORK)) \
	--reuse --recipe $$($(BIN)/python -c 'import json; print(json.load(open("bench-results/quality-v3-choice.json"))["name"])') \
	--budgets 60 --jobs 2
quality-v3-choice: $(STAMP)
	nice -n 19 $(BIN)/python -m benchmarks.quality prepare --protocol v3 --work $(QUALITY_V3_WORK)
	nice -n 19 $(BIN)/python -m benchmarks.quality pretrain --protocol v3 --candidates --work $(QUALITY_V3_WORK) \
		--seeds 42 --scale 0.25 --keep $(QUALITY_V3_WORK)/v3-choice-runs
	nice -n 19 $(BIN)/python -m benchmarks.quality choose --protocol v3 --work $(QUALITY_V3_WORK) \
		--checkpoints $(QUALITY_V3_WORK)/v3-choice-runs --jobs 2 --sizes 300,1000 --subsamples 2 \
		--output bench-results/quality-v3-search.json --choose bench-results/quality-v3-choice.json

quality-v3: $(STAMP)
	$(call QUALITY_V3,pretrain) & pretraining=$$!; \
	$(call QUALITY_V3,score) --every-setting --heldout-genres --output bench-results/quality-v3.json --plot docs/quality-v3.png; \
	scored=$$?; wait $$pretraining || exit $$?; [ $$scored -eq 0 ] || exit $$scored; \
	cp bench-results/quality-v3.json docs/quality-v3.json
	$(call QUALITY_V3,score) --pack-cache

quality-v3-reproduce: $(STAMP)
	rm -rf $(QUALITY_V3_WORK)-reproduced
	$(call QUALITY_V3,score,$(QUALITY_V3_WORK)-reproduced) --cache-only --every-setting --heldout-genres \
		--output bench-results/quality-v3-reproduced.json --plot ''
	$(BIN)/python -m benchmarks.quality report --output bench-results/quality-v3-reproduced.json --expect docs/quality-v3.json
