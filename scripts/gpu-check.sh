#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): on a lent GPU machine, install the wheels scripts/gpu-wheels.sh fetched
# (carried as .whl) into /tmp/site, put them and this working tree on PYTHONPATH (ridgefill is not installed), and
# run the check; gpu.json and gpu-check.log land in $OUT (default bench/out/gpu). It measures ridgefill's runtime
# (capture, solve, eval, the prefill at an 8B model's shape), not the vLLM plugin: no vLLM GPU build can be installed
# on the lent machines (docs/bench.md, "The GPU check").
#   bash scripts/gpu-check.sh            # on the GPU machine (the image's python3)
#   bash scripts/gpu-check.sh --dry-run  # here: the same steps on the CPU at tiny sizes, with .venv
set -euo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/bench/out/gpu} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ "${1:-}" = "--dry-run" ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  PY=.venv/bin/python
  threads=1
else
  PY=python3
  ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu-check: no .whl/ (run scripts/gpu-wheels.sh here, carry .whl)" >&2; exit 1; }
  rm -rf /tmp/site
  "$PY" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  threads=0  # torch's default: the CPU side (offloaded layers, capture's float64 totals) has 16 cores there
fi
"$PY" bench/gpu_check.py --threads "$threads" "$@" 2>&1 | tee "$OUT/gpu-check.log"
