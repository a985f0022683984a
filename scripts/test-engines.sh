#!/usr/bin/env bash
# The serving-engine tests: build the engine environments (scripts/setup-engines.sh; a finished one is kept) and the
# main job's release (scripts/main.sh; cached), then run tests/test_engines.py (caches injected into vLLM and
# llama.cpp) and tests/test_vllm_plugin.py (the fill inside vLLM) in ridgefill's .venv, which drives each engine in
# its own environment. Figures: bench/out/engines_<engine>.json. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# The vLLM environment is mostly downloads and llama.cpp's mostly compiling: they are built side by side. The main
# job's set-up (`pip install -e .` into .venv) waits for both: the vLLM one installs this checkout too.
bash scripts/setup-engines.sh vllm &
vllm_setup=$!
trap 'kill "$vllm_setup" 2>/dev/null || true' EXIT
bash scripts/setup-engines.sh llamacpp
wait "$vllm_setup"
trap - EXIT
bash scripts/main.sh >/dev/null
export RIDGEFILL_ENGINE_REPORT_DIR=${RIDGEFILL_ENGINE_REPORT_DIR:-bench/out}
# Two workers, one core each (tests/conftest.py): much of an engine test is one thread (start-up, scheduling, small
# models), so two side by side finish sooner than one on both cores.
exec .venv/bin/python -m pytest -q -rs -n 2 \
  tests/test_engines.py tests/test_vllm_plugin.py tests/test_engines_layout.py "$@"
