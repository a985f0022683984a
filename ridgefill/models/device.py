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
from dataclasses import dataclass

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


def recipe_fields(device: str, dtype: str, dtype_key: str = "dtype") -> dict:
    """What a stage's recipe records about where its numbers were computed.

    Nothing for a CPU run in float32: every artifact made before devices were an option was made exactly so,
    and keeping those recipes as they were keeps their ids (a store's cache stays valid). Any other run records
    the device kind and the model dtype, so its id differs. `dtype_key` names the dtype field where a stage's
    recipe already uses `dtype` for something else (compact: the cache dtype; quantize: int8)."""
    kind = device_kind(device)
    if (kind, dtype) == ("cpu", "float32"):
        return {}
    return {"device": kind, dtype_key: dtype}


def recorded(recipe: dict, dtype_key: str = "dtype") -> tuple[str, str]:
    """(device kind, model dtype) an upstream artifact was made with; absent fields mean cpu / float32."""
    return recipe.get("device", "cpu"), recipe.get(dtype_key, "float32")


def check_device_map(device_map, max_memory, device: str) -> tuple[str | dict | None, dict | None]:
    """Check `--device-map` / `--max-memory` against the resolved device; returns (device_map, max_memory dict).

    device_map: None, "auto" (accelerate spreads the model over the GPUs, CPU memory and disk) or, from Python, an
    explicit {module name: device} dict. max_memory: accelerate's {GPU index | "cpu" | "disk": size} or the CLI's
    DEVICE=SIZE strings; "disk" is ridgefill's own limit (accelerate has none): the part of the model placed on
    disk must fit in it, so `disk=0` forbids disk offload. With `--device cpu` no GPU is used, so naming one is
    refused."""
    if isinstance(max_memory, (list, tuple)):
        max_memory = parse_max_memory(list(max_memory))
    if max_memory is not None and not isinstance(max_memory, dict):
        raise BadInput(f"--max-memory: expected DEVICE=SIZE items, got {max_memory!r}")
    if device_map is None:
        if max_memory:
            raise BadInput("--max-memory only applies with --device-map auto")
        return None, None
    if isinstance(device_map, str):
        if device_map.strip().lower() != "auto":
            raise BadInput(f"unknown device map '{device_map}' (only 'auto' is supported: accelerate places the "
                           "model over the GPUs, CPU memory and disk)")
        device_map = "auto"
    elif not isinstance(device_map, dict) or not device_map:
        raise BadInput(f"a device map is 'auto' or a non-empty {{module: device}} dict, got {device_map!r}")
    memory: dict | None = None
    if max_memory:
        from accelerate.utils import convert_file_size_to_int

        memory = {}
        for key, size in max_memory.items():
            if isinstance(key, str) and key.startswith("cuda:") and key[5:].isdigit():
                key = int(key[5:])
            if isinstance(key, int):
                _check_gpu(key, device, "--max-memory")
            elif key not in ("cpu", "disk"):
                raise BadInput(f"--max-memory: unknown device '{key}' (use a GPU index, cpu or disk)")
            try:
                plain = isinstance(size, str) and size.strip().isdigit()  # a number of bytes
                memory[key] = int(size) if plain else convert_file_size_to_int(size)
            except (ValueError, TypeError):
                raise BadInput(f"--max-memory {key}={size}: not a size (e.g. 20GiB, 500MB or a number of bytes)") from None
    if isinstance(device_map, dict):
        for name, where in device_map.items():
            if isinstance(where, int) or (isinstance(where, str) and _CUDA.match(where)):
                _check_gpu(where if isinstance(where, int) else int(where.partition(":")[2] or 0), device,
                           f"device map entry '{name}'")
            elif str(where) not in ("cpu", "disk"):
                raise BadInput(f"device map entry '{name}': unknown device '{where}' (a GPU index, cuda:N, cpu or disk)")
    return device_map, memory


def _check_gpu(index: int, device: str, what: str) -> None:
    import torch

    if device_kind(device) != "cuda":
        raise BadInput(f"{what} names GPU {index} but the model runs on the CPU (--device {device})")
    count = torch.cuda.device_count()
    if index >= count:
        raise BadInput(f"{what} names GPU {index}: this machine has {count} CUDA device(s)")


@dataclass(frozen=True)
class Where:
    """A resolved place to run a model: device (`cpu` / `cuda:N`), dtype, and an optional accelerate placement."""

    device: str = "cpu"
    dtype: str = "float32"
    device_map: str | dict | None = None
    max_memory: dict | None = None

    @property
    def kind(self) -> str:
        return device_kind(self.device)

    def recipe(self, dtype_key: str = "dtype") -> dict:
        return recipe_fields(self.device, self.dtype, dtype_key)

    def load_args(self) -> dict:
        """Keyword arguments of `load_model`."""
        return {"device": self.device, "dtype": self.dtype, "device_map": self.device_map, "max_memory": self.max_memory}

    def describe(self) -> str:
        text = f"{self.device}, {self.dtype}"
        return text + (f", device map {self.device_map if isinstance(self.device_map, str) else 'given'}"
                       if self.device_map is not None else "")


def where(device: str = "auto", dtype: str = "auto", device_map=None, max_memory=None) -> Where:
    """Resolve and check `--device`, `--dtype`, `--device-map`, `--max-memory` together (BadInput, one line)."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    dm, mm = check_device_map(device_map, max_memory, dev)
    return Where(device=dev, dtype=dt, device_map=dm, max_memory=mm)


def mixed_warning(what: str, made: tuple[str, str], now: Where) -> str | None:
    """One warning line when a stage computes on another device kind or dtype than its upstream artifact."""
    if made == (now.kind, now.dtype):
        return None
    return (f"{what} was made on {made[0]} in {made[1]}; this run computes on {now.kind} in {now.dtype}: "
            f"its figures mix the two (pass --device {made[0]} --dtype {made[1]} to match)")


# x86 instructions that give a CPU native matrix products in that dtype; without them torch emulates it.
NATIVE_CPU = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def cpu_flags() -> frozenset[str] | None:
    """The x86 feature flags of this machine's CPU from /proc/cpuinfo (Linux); None where there are none to read
    (another system; an ARM CPU lists "Features", whose bfloat16 support this does not judge)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return None


def slow_dtype_warning(now: Where, flags: frozenset[str] | None = None) -> str | None:
    """One warning line when `now` runs a model in bfloat16 or float16 on an x86 CPU without instructions for it:
    torch then emulates the dtype, and a model runs tens of times slower than in float32 (measured here: a
    bfloat16 matrix product at 1 GFLOP/s against 152 in float32). None anywhere else."""
    if now.kind != "cpu" or now.device_map is not None or now.dtype not in NATIVE_CPU:
        return None
    flags = cpu_flags() if flags is None else flags
    native = NATIVE_CPU[now.dtype]
    if flags is None or any(f in flags for f in native):
        return None
    return (f"{now.dtype} on this CPU (no {' or '.join(native)} instructions) runs many times slower than float32: "
            f"pass --dtype float32 (a recipe: dtype = \"float32\")")


def warn_mixed(out, what: str, made: tuple[str, str], now: Where) -> bool:
    """Print `mixed_warning` (if any) as one line on `out` (a ridgefill.output.Output); True when it did."""
    text = mixed_warning(what, made, now)
    if text is None:
        return False
    out.warn(text)
    return True
