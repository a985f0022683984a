#!/usr/bin/env bash
# Download into .whl/ the wheels a lent GPU machine (kind nvidia-h200) lacks to run ridgefill, for
# scripts/gpu-check.sh: `run` carries .whl and installs it with pip --no-index --no-deps.
#
# Which: the requirement closure of ridgefill (pyproject.toml), walked through .venv's installed metadata (markers
# read for CPython 3.12 on x86-64 Linux), against the machine's image as the device notes list it (IMAGE below):
# a package is carried when the image lacks it or holds a version a requirement refuses, at .venv's version (one
# each); what a carried package needs is walked in turn. Versions the notes do not record are assumed to do and
# listed; the GPU check's first phase checks every one there. regex is carried too: transformers refuses to import
# below its floor, and the image's version is not recorded. Idempotent: a wheel already here is not fetched again,
# and wheels no longer wanted are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "gpu-wheels: no .venv (run scripts/setup.sh first)" >&2; exit 1; }
mkdir -p .whl
wanted=$("$PY" - <<'PY'
import re
from importlib import metadata
from packaging.requirements import Requirement

# The image's Python packages (the device notes' list of 2026-11-17); a version only where the notes give one.
IMAGE = {"accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
         "tokenizers": "0.23.2", "torch": "2.11.0", "transformers": "5.17.0"}
PRESENT = """absl-py aiohttp annotated-doc anyio attrs certifi charset-normalizer click cloudpickle contourpy cycler
filelock fonttools frozenlist fsspec h11 h5py hf-xet httpcore httpx idna jinja2 joblib kiwisolver markdown-it-py
markupsafe matplotlib mdurl ml-dtypes mpmath networkx packaging pillow pip protobuf psutil pygments pyparsing
python-dateutil pyyaml regex requests rich sentencepiece setuptools shellingham six sympy tiktoken tqdm triton typer
typing-extensions urllib3 wheel""".split()
FORCE = ["regex"]
NEVER = {"torch", "numpy"}  # the image's CUDA build of torch and the numpy it was built against stay
ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "extra": ""}

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
carry, assumed, todo = {}, {}, ["ridgefill", *FORCE]
while todo:
    dist = todo.pop()
    for text in metadata.requires(dist) or [] if dist == "ridgefill" or dist in carry else []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(ENV):
            continue
        name = norm(req.name)
        if name in carry or name in NEVER and req.specifier.contains(IMAGE[name], prereleases=True):
            continue
        have = IMAGE.get(name)
        if have is not None and req.specifier.contains(have, prereleases=True):
            continue
        if have is None and name in PRESENT and name not in FORCE:
            if str(req.specifier):
                assumed.setdefault(name, set()).add(str(req.specifier))
            continue
        carry[name] = metadata.version(name)
        todo.append(name)
    if dist in FORCE and dist not in carry:
        carry[dist] = metadata.version(dist)
import sys
for name, specs in sorted(assumed.items()):
    print(f"gpu-wheels: assumed on the machine (version not recorded): {name} {', '.join(sorted(specs))}",
          file=sys.stderr)
print("\n".join(f"{n}=={v}" for n, v in sorted(carry.items())))
PY
)
# pip matches manylinux tags exactly: name the usual ones.
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
keep=()
for pin in $wanted; do
  name=${pin%%==*} version=${pin#*==}
  glob=$(echo "$name" | tr -- '-.' '__')
  have=$(find .whl -maxdepth 1 -iname "${glob}-${version}-*.whl" | head -1)
  if [ -z "$have" ]; then
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${plat[@]}" -d .whl "$pin" >&2
    have=$(find .whl -maxdepth 1 -iname "${glob}-${version}-*.whl" | head -1)
    [ -n "$have" ] || { echo "gpu-wheels: pip saved no wheel for $pin" >&2; exit 1; }
  fi
  keep+=("$(basename "$have")")
done
for f in .whl/*.whl; do  # a wheel of an earlier version or package: two versions would stop the install
  case " ${keep[*]} " in *" $(basename "$f") "*) ;; *) rm -f "$f"; echo "gpu-wheels: removed $f" >&2 ;; esac
done
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
whl=$(du -cb .whl/*.whl | tail -1 | cut -f1)
for f in .whl/*.whl; do printf '%8d KiB  %s\n' $(( $(stat -c %s "$f") / 1024 )) "$(basename "$f")"; done
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
echo "gpu-wheels: ${#keep[@]} wheels, $(mib "$whl"); with the tracked tree ($(mib "$tree")): $(mib $((whl + tree))) of the 64 MiB a call carries"
