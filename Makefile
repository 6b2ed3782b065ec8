# Bootstraps a local .venv on a fresh machine. torch is pinned here (the CPU build on this
# machine's disk); the package itself declares a wider range for users.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH := torch==2.13.0
PROMPT ?= Write a haiku about the sea.

.PHONY: install test lint run generate bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q "$(TORCH)" -e ".[test,bench,cluster]"
	# The nixl transfer backend: UCX on host memory, no CUDA. --no-deps: nixl also requires
	# nixl-cu13, which would pull CUDA libraries.
	$(PIP) install -q --no-deps "nixl==1.5.1" "nixl-cu12==1.5.1"
	$(PY) -m pdserve.model.fused --all  # builds the CPU kernels of every level this CPU runs (g++); falls back if it cannot
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check pdserve tests benchmarks
	$(VENV)/bin/ruff format --check pdserve tests benchmarks
	$(VENV)/bin/mypy pdserve
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest -q -n 2 --dist loadscope --durations=30

run: install
	$(VENV)/bin/pdserve serve --model default

generate: install
	$(VENV)/bin/pdserve generate --model default "$(PROMPT)"

# The quick benchmarks (a few minutes); disagg_vs_colocated.py (~5 min) and soak.py (~15 min)
# run the same way, each writing its JSON under benchmarks/results before any plot.
bench: install
	$(PY) benchmarks/offline_throughput.py
	$(PY) benchmarks/transfer.py

clean:
	rm -rf $(VENV)
