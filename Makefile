# Two entry points for a fresh machine: `make demo` (the main job) and `make test` (lint + tests).
# Each builds .venv by itself; torch is pinned to the CPU build this machine carries (see requirements-dev.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-matrix lint format bench clean

$(STAMP): pyproject.toml requirements-dev.txt requirements-torchtitan.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-torchtitan.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m splitgrad demo

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples
	$(PY) -m ruff format --check src tests benchmarks examples
	$(PY) -m pytest -q

# The suite three times: as CI runs it, on other BLAS/ATen kernels (MKL's AVX2 path on AVX-512 machines, MKL's
# conditional-numerical-reproducibility path elsewhere, ATen's AVX2 kernels), and single-threaded (other
# reduction splits). A bitwise assertion must hold in all three: it compares the same operations in the same
# order, never two kernels that happen to round alike on one CPU. About three times `make test`.
KERNEL_VARIANT := ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 MKL_CBWR=COMPATIBLE

test-matrix: $(STAMP)
	$(PY) -m pytest -q
	$(KERNEL_VARIANT) $(PY) -m pytest -q
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks examples

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks examples
	$(PY) -m ruff check --fix src tests benchmarks examples

bench: $(STAMP)
	$(PY) benchmarks/bench_linear.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
