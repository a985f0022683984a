#!/usr/bin/env bash
# The serving-engine tests: build the engine environments (scripts/setup-engines.sh; a finished one is kept) and the
# main job's release (scripts/main.sh; cached), then run the tests that need an engine in ridgefill's .venv, which
# drives each engine in its own environment: tests/test_engines.py (caches injected into vLLM and llama.cpp),
# tests/test_vllm_connector.py, tests/test_vllm_plugin*.py (the fill inside vLLM), tests/test_engines_layout.py.
# Figures: bench/out/engines_<engine>.json. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# llama.cpp's environment is mostly compiling, vLLM's and .venv mostly downloads: the compile runs beside the other
# two, which install this checkout one after the other. The main job waits for all three.
bash scripts/setup-engines.sh llamacpp &
llamacpp_setup=$!
trap 'kill "$llamacpp_setup" 2>/dev/null || true' EXIT
bash scripts/setup-engines.sh vllm
bash scripts/setup.sh
wait "$llamacpp_setup"
trap - EXIT
bash scripts/main.sh >/dev/null
export RIDGEFILL_ENGINE_REPORT_DIR=${RIDGEFILL_ENGINE_REPORT_DIR:-bench/out}
# Two workers, one core each (tests/conftest.py): much of an engine test is one thread (start-up, scheduling, small
# models), so two side by side finish sooner than one on both cores. Each file goes to one worker whole (its module
# fixtures are built once), the longest first: a worker takes the next file as it finishes one.
exec .venv/bin/python -m pytest -q -rs -n 2 --dist loadfile --no-loadscope-reorder \
  tests/test_vllm_plugin.py tests/test_vllm_plugin_tiny.py tests/test_engines.py tests/test_vllm_plugin_tp.py \
  tests/test_vllm_connector.py tests/test_engines_layout.py "$@"
