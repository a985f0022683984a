"""Where a model runs: `--device auto|cpu|cuda|cuda:N`, `--dtype auto|float32|bfloat16|float16`.

The device is data: every path that runs a model is the same code on a CPU and on a GPU, and only these
strings differ. `auto` is the first CUDA device when torch sees one, else the CPU; dtype `auto` is bfloat16 on
a GPU and float32 on a CPU. Artifacts record the device *kind* (`cpu` or `cuda`, never the index: cuda:0 and
cuda:3 compute the same numbers) and the resolved dtype, so a capture made on a GPU has another id than one made
on a CPU.

torch is imported inside the functions: `ridgefill --help` must not pay for it.
"""

from __future__ import annotations

import re

from ridgefill.errors import BadInput

DTYPES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPES)
_CUDA = re.compile(r"^cuda(:(\d+))?$")


def resolve_device(spec: str = "auto") -> str:
    """`auto`, `cpu`, `cuda` or `cuda:N` -> a concrete torch device string (`cpu` or `cuda:N`), checked."""
    import torch

    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if spec == "cpu":
        return "cpu"
    m = _CUDA.match(spec)
    if not m:
        raise BadInput(f"unknown device '{spec}' (choose auto, cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise BadInput(f"--device {spec}: torch sees no CUDA device on this machine (use --device cpu or auto)")
    index = int(m.group(2) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise BadInput(f"--device {spec}: this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return f"cuda:{index}"


def resolve_dtype(spec: str, device: str) -> str:
    """`auto` -> bfloat16 on a GPU, float32 on a CPU; anything else must be one of DTYPES."""
    spec = (spec or "auto").strip().lower()
    if spec == "auto":
        return "bfloat16" if device_kind(device) == "cuda" else "float32"
    if spec not in DTYPES:
        raise BadInput(f"unknown dtype '{spec}' (choose one of: {', '.join(DTYPE_CHOICES)})")
    return spec


def device_kind(device: str) -> str:
    """`cuda:3` -> `cuda`; `cpu` -> `cpu`. What artifacts record."""
    return str(device).split(":")[0]


def parse_max_memory(items: list[str] | None) -> dict | None:
    """`--max-memory 0=20GiB --max-memory cpu=64GiB` -> accelerate's {0: "20GiB", "cpu": "64GiB"}."""
    if not items:
        return None
    out: dict = {}
    for item in items:
        key, sep, size = item.partition("=")
        key, size = key.strip(), size.strip()
        if not sep or not key or not size:
            raise BadInput(f"--max-memory '{item}': expected DEVICE=SIZE (e.g. 0=20GiB, cpu=64GiB, disk=200GiB)")
        if key.startswith("cuda:"):
            key = key.removeprefix("cuda:")
        out[int(key) if key.isdigit() else key] = size
    return out
