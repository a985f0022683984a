#!/usr/bin/env bash
# The serving-engine tests: build the engine environments (scripts/setup-engines.sh; a finished one is kept) and the
# main job's release (scripts/main.sh; cached), then run tests/test_engines.py (caches injected into vLLM and
# llama.cpp) and tests/test_vllm_plugin.py (the fill inside vLLM) in ridgefill's .venv, which drives each engine in
# its own environment. Figures: bench/out/engines_<engine>.json. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-engines.sh
bash scripts/main.sh >/dev/null
export RIDGEFILL_ENGINE_REPORT_DIR=${RIDGEFILL_ENGINE_REPORT_DIR:-bench/out}
exec .venv/bin/python -m pytest -q -rs tests/test_engines.py tests/test_vllm_plugin.py tests/test_engines_layout.py "$@"
