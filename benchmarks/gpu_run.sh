#!/usr/bin/env bash
# One GPU-machine call: compiled (gpu-marked) tests, then benchmarks; logs under $OUT.
# Usage: bash benchmarks/gpu_run.sh "TEST_PATHS" "BENCH_COMMANDS"
# The GPU machine's copy of the checkout keeps a stale .git (the session's first HEAD):
# prefix the call with PALLAS_ATTN_COMMIT=<`git rev-parse --short HEAD` here> so that
# results files name the commit that ran (bench.git_commit).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
python3 -c "import jax; print(jax.__version__, jax.devices())"
if [ -n "${1:-}" ]; then
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -m gpu -p no:cacheprovider -n 12 $1 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -40
fi
if [ -n "${2:-}" ]; then
  eval "$2" 2>&1 | tee "$OUT/bench.log"
fi
