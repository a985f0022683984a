#!/usr/bin/env bash
# The main job on the embedded default: install, then capture -> solve -> quantize -> export -> verify on
# builtin:smollm2-135m with the built-in calibration corpus. Writes the release to ./release/smollm2-135m
# (or $1). Every stage is cached in ./ridgefill-artifacts, so a re-run finishes in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
out=${1:-release/smollm2-135m}
rf() { .venv/bin/ridgefill "$@"; }
cap=$(rf capture builtin:smollm2-135m --data builtin:default)
maps=$(rf solve "$cap")
quant=$(rf quantize "$maps")
rf export "$quant" --out "$out" --force >/dev/null
rf verify "$out"
echo "release: $out"
