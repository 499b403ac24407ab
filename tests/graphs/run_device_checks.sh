#!/usr/bin/env bash
# Device-machine checks of splitgrad.graphs' CUDA backend, as one prepared script:
#   1. the GPU tests (graphed == eager results and gradients, hooks once per wgrad replay, pipeline order);
#   2. the eager-vs-graphed step timing of a small GPT layer stack (benchmarks/bench_graphs.py).
# Needs a CUDA build of torch. Usage (from anywhere): tests/graphs/run_device_checks.sh [OUT_DIR]
# OUT_DIR (default: $OUT, else ./graphs-device-out) receives pytest.txt, bench.txt and bench.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"
DEST="${1:-${OUT:-graphs-device-out}}"
mkdir -p "$DEST"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "import torch, sys; print(torch.__version__, torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 3)" \
  | tee "$DEST/env.txt"
status=0
"$PY" -m pytest -q -p no:cacheprovider tests/graphs/test_cuda_graphs.py 2>&1 | tee "$DEST/pytest.txt" || status=$?
"$PY" benchmarks/bench_graphs.py --device cuda --out "$DEST/bench.json" 2>&1 | tee "$DEST/bench.txt" || status=$?
exit "$status"
