#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the whole test suite, the slow real-model tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
