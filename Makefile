# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (lint + tests).
# Each builds .venv by itself; torch is pinned to the CPU build this machine carries (see requirements-dev.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m splitgrad demo

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks examples
	$(PY) -m ruff check --fix src tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/bench_linear.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
