# The two commands a new user runs: `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SAMPLES ?= samples
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export OMP_NUM_THREADS ?= 1

.PHONY: setup demo test test-fast bench lint samples browser clean

setup: $(STAMP)

# Reinstall only when the dependency list changes. pip (not uv) takes the CPU torch wheel on disk.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

samples: $(STAMP)
	$(BIN)/bertpipe samples fetch $(SAMPLES)

demo: $(STAMP) samples
	$(BIN)/python -m flows.demo --samples $(SAMPLES)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not slow"

bench: $(STAMP) samples
	$(BIN)/python -m benchmarks.run_all --samples $(SAMPLES)

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
