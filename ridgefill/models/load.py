"""Load a resolved model with transformers: eval mode, no gradients, plus its tokenizer and layer adapter.

Directories and hub snapshots load directly (local files only). A GGUF file is dequantized by transformers
(`from_pretrained(dir, gguf_file=name)`), which is slow -- about 20 s for SmolLM2 and a minute for Gemma 3 270M
on two cores, mostly rebuilding the tokenizer from the GGUF vocabulary -- so the dense float32 result is saved
once as a plain transformers directory (safetensors) under `<store>/models/<fingerprint[:16]>/` and later
loads read that. A model run in bfloat16 reads its own cache, `<fingerprint[:16]>-bfloat16/`, dequantized once to
bfloat16 (half the bytes to read on every load; the weights equal the float32 cache's cast to bfloat16). A cache
directory is written to a temporary sibling and renamed, so it is complete whenever it exists under its final name.

torch and transformers are imported inside the functions: `import ridgefill.models` stays cheap.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import os
import shutil
import time
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ridgefill.artifacts.lock import pid_alive
from ridgefill.errors import BadInput, RidgefillError
from ridgefill.models.spec import LOADED_AS, ModelRef

DTYPES = ("float32", "bfloat16", "float16")
SOURCE_FILE = "ridgefill-source.json"  # provenance of a dequantized GGUF cache directory


@dataclass
class LoadedModel:
    """A model ready for hooks: `model` in eval mode with requires_grad off, its tokenizer and adapter."""

    ref: ModelRef
    model: Any  # transformers *ForCausalLM
    tokenizer: Any  # transformers tokenizer
    adapter: Any  # ridgefill.models.adapters.Adapter
    source: Path | None = None  # the directory transformers read (the GGUF cache for .gguf refs)
    seconds: float = 0.0  # wall time of this load, including building the GGUF cache
    built_cache: bool = False  # True when this load dequantized a GGUF and wrote the cache
    device: str = "cpu"  # the device asked for (with a device map: where the first modules compute)
    dtype: str = "float32"
    device_map: dict | None = None  # accelerate's placement {module: device | "cpu" | "disk"} when dispatched
    offload_dir: Path | None = None  # accelerate's offload folder, removed on release() / garbage collection / exit
    _cleanup: Any = field(default=None, repr=False)

    def context_length(self) -> int | None:
        """The model's context in tokens (its text config's max_position_embeddings), or None when it says none."""
        return int(getattr(self.model.config.get_text_config(), "max_position_embeddings", 0) or 0) or None

    def placement(self) -> dict:
        """What an artifact's info records about where this model ran."""
        info: dict = {"device": self.device, "dtype": self.dtype}
        if self.device_map is not None:
            counts: dict = {}
            for where in self.device_map.values():
                counts[str(where)] = counts.get(str(where), 0) + 1
            info["device_map"] = dict(sorted(counts.items()))  # modules per place
        return info

    def release(self) -> None:
        """Drop the offload folder now (it goes anyway when the model is garbage collected or the process ends)."""
        if self._cleanup is not None:
            self._cleanup()


TRANSFORMERS_FLOOR = (5, 24)  # the first release whose models take `cache=` (pyproject.toml says the same)


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than 5.24: its models swallow the `cache=` keyword without an error, so a
    capture would silently lose every chunk's left context (an install with --no-deps can get there)."""
    import re

    if version is None:
        from importlib.metadata import version as installed

        version = installed("transformers")
    m = re.match(r"(\d+)\.(\d+)", version)
    if m and (int(m.group(1)), int(m.group(2))) < TRANSFORMERS_FLOOR:
        raise BadInput(f"transformers {version} is too old: ridgefill needs >= "
                       f"{'.'.join(map(str, TRANSFORMERS_FLOOR))} (pip install -U 'transformers>=5.24')")


def check_architecture(model_type: str, known=None) -> None:
    """Refuse a model whose architecture the installed transformers does not have (a hybrid such as qwen3_next on
    a transformers from before it). `known`: the model types transformers has (default: its config mapping)."""
    if known is None:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as known
    missing = sorted({model_type, LOADED_AS.get(model_type, model_type)} - set(known))
    if missing:
        import transformers

        raise BadInput(f"transformers {transformers.__version__} has no '{missing[0]}' architecture: "
                       "pip install -U transformers (a release that has it)")


def layer_kinds(ref: ModelRef, *, store_root: Path, trust_remote_code: bool = False) -> list[str]:
    """The kind of each decoder layer of `ref` (`full_attention`, `sliding_attention`, `linear_attention`), read
    from its configuration as transformers loads it, without loading weights: the same list as the loaded model's
    adapter has. A stage that must describe the model reads it here, from the files the fingerprint covers."""
    from ridgefill.models.kinds import kinds_of

    source = _config_dir(ref, Path(store_root)) if ref.is_gguf else ref.path
    listed = _listed_kinds(source / "config.json", ref.num_layers)
    if listed is not None:  # what transformers' config would hold, read without importing it (seconds)
        return listed
    from transformers import AutoConfig

    check_transformers()
    check_architecture(ref.model_type)
    extra = {"trust_remote_code": True} if trust_remote_code else {}
    _quiet_transformers()
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True, **extra)
    except ValueError as exc:
        raise BadInput(f"cannot read the configuration of {source}: {_first_line(exc)}") from exc
    _check_type(config, ref, source)
    kinds = kinds_of(config.get_text_config())
    if len(kinds) != ref.num_layers:
        raise RidgefillError(f"{source}: the configuration has {len(kinds)} layer kinds for {ref.num_layers} layers")
    return kinds


def _listed_kinds(config_path: Path, num_layers: int) -> list[str] | None:
    """The layer kinds a config.json states: its (text part's) `layer_types` when it lists one per layer, or full
    attention for llama, whose configuration has none. None when transformers' config class would compute them."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers and all(isinstance(t, str) for t in types):
        return list(types)
    if config.get("model_type") == "llama" and types is None:
        from ridgefill.models.kinds import FULL

        return [FULL] * num_layers
    return None


_KEPT: list | None = None  # inside `kept_models()`: [(key, LoadedModel)], the last model loaded on one device


@contextlib.contextmanager
def kept_models():
    """Inside it, `load_model` keeps the last model it loaded and gives it again to a later call with the same
    model, dtype, device and trust_remote_code (no device map), instead of reading the weights once more: the
    stages of one `ridgefill release` share one load. At most one model is kept (a call for another one loads it
    and lets the kept one go); stages remove their hooks, so what they share is the model as loaded. Nested uses
    share the outer one's."""
    global _KEPT
    if _KEPT is not None:
        yield
        return
    _KEPT = []
    try:
        yield
    finally:
        _KEPT = None


def load_model(
    ref: ModelRef,
    *,
    store_root: Path,
    dtype: str = "float32",
    device: str = "cpu",
    device_map=None,
    max_memory=None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load `ref` in `dtype` on `device` (resolved strings, see ridgefill.models.device). GGUF refs go through (and
    fill) the dequantized cache in the store.

    device_map="auto" (or, from Python, an explicit {module: device} dict) places the model with accelerate over
    the GPUs, CPU memory and disk instead, within `max_memory` ({GPU index | "cpu" | "disk": size}, or the CLI's
    DEVICE=SIZE strings); the map is computed here on an empty (meta) model first, so a model that cannot be
    placed is refused before any weight is read. Disk-offloaded weights are read from the model's own
    safetensors files where possible; anything accelerate writes goes to `<store>/offload/<pid>-<n>/`, removed
    when the model is released, garbage collected or the process ends (a folder left by a killed process is
    removed by the next load). Inside `kept_models()` the last model loaded is given again to the same call."""
    from ridgefill.models.device import check_device_map

    check_transformers()
    check_architecture(ref.model_type)
    if ref.pending_hashes is not None:  # the store's first write may be this load: remember the file hashes now
        ref.pending_hashes.save()
    if dtype not in DTYPES:
        raise BadInput(f"unknown dtype '{dtype}' (choose one of: {', '.join(DTYPES)})")
    device_map, max_memory = check_device_map(device_map, max_memory, device)
    key = (str(ref.path), ref.fingerprint, str(Path(store_root).resolve()), dtype, device, bool(trust_remote_code))
    if _KEPT is not None and device_map is None:
        if _KEPT and _KEPT[0][0] == key:
            return replace(_KEPT[0][1], seconds=0.0, built_cache=False)
        _KEPT.clear()  # the kept model goes before another is read
    lm = _load(ref, Path(store_root), dtype, device, device_map, max_memory, trust_remote_code)
    if _KEPT is not None and device_map is None:
        _KEPT.append((key, lm))
    return lm


def _load(ref: ModelRef, store_root: Path, dtype: str, device: str, device_map, max_memory,
          trust_remote_code: bool) -> LoadedModel:
    import torch

    from ridgefill.models.adapters import adapter_for

    _quiet_transformers()
    start = time.perf_counter()
    built = False
    if ref.is_gguf:
        source, built = gguf_cache_dir(ref, store_root=Path(store_root), dtype=dtype)
    else:
        source = ref.path
    # Only pass trust_remote_code when asked, so transformers' own default (off) holds otherwise.
    extra = {"trust_remote_code": True} if trust_remote_code else {}
    placement, offload, cleanup = None, None, None
    if device_map is None:
        model, tokenizer = _from_pretrained(source, dtype=getattr(torch, dtype), **extra)
        _check_type(model.config, ref, source)
        try:
            model.to(device)
        except (RuntimeError, AssertionError) as exc:  # e.g. "cuda" on a CPU-only torch
            raise BadInput(f"cannot use device '{device}': {exc}") from exc
    else:
        placement = _device_map(source, ref, getattr(torch, dtype), device, device_map, max_memory, extra)
        if "disk" in placement.values():  # only disk offload needs a folder
            offload, cleanup = _offload_dir(Path(store_root))
        try:
            model, tokenizer = _from_pretrained(source, dtype=getattr(torch, dtype), device_map=placement,
                                                offload_folder=None if offload is None else str(offload), **extra)
        except BaseException:
            if cleanup is not None:
                cleanup()
            raise
        if cleanup is not None:
            weakref.finalize(model, cleanup)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(ref=ref, model=model, tokenizer=tokenizer, adapter=adapter_for(model), source=Path(source),
                       seconds=time.perf_counter() - start, built_cache=built, device=device, dtype=dtype,
                       device_map=placement, offload_dir=offload, _cleanup=cleanup)


def _check_type(config, ref: ModelRef, source) -> None:
    if config.model_type not in (ref.model_type, LOADED_AS.get(ref.model_type)):
        raise RidgefillError(f"{source} loaded as '{config.model_type}', expected '{ref.model_type}'")


def _device_map(source: Path, ref: ModelRef, dtype, device: str, device_map, max_memory: dict | None, extra) -> dict:
    """The explicit {module: device} placement to load with, computed on an empty model; BadInput if none fits."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    # transformers' own copies of accelerate's planners: the same map from_pretrained(device_map="auto") computes.
    from transformers.integrations.accelerate import (compute_module_sizes, get_balanced_memory, get_max_memory,
                                                      infer_auto_device_map)

    from ridgefill.models.device import device_kind

    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True, **extra)
    except ValueError as exc:
        raise BadInput(f"cannot load model from {source}: {_first_line(exc)}") from exc
    _check_type(config, ref, source)
    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    if isinstance(device_map, dict):
        placement = {str(k): (int(v) if isinstance(v, str) and v.isdigit() else v) for k, v in device_map.items()}
        from accelerate.utils import check_device_map as accelerate_check

        try:
            accelerate_check(empty, placement)
        except ValueError as exc:
            raise BadInput(f"device map: {_first_line(exc)}") from exc
    else:
        no_split = sorted(getattr(empty, "_no_split_modules", None) or [])
        if not no_split:
            raise BadInput(f"--device-map auto: {type(empty).__name__} does not name the modules that must stay on "
                           "one device (no _no_split_modules); load it without a device map")
        memory = dict(max_memory or {})
        limit = memory.pop("disk", None)
        if not memory and device_kind(device) != "cuda":  # --device cpu: the CPU's memory and disk, no GPU
            memory = {k: v for k, v in get_max_memory().items() if not isinstance(k, int)}
        try:
            memory = get_balanced_memory(empty, max_memory=memory or None, no_split_module_classes=set(no_split))
            placement = dict(infer_auto_device_map(empty, max_memory=memory, no_split_module_classes=set(no_split),
                                                   no_placement_params=getattr(empty, "_no_placement_params", None)))
        except (ValueError, RuntimeError) as exc:
            raise BadInput(f"--device-map auto: {_first_line(exc)}") from exc
        if limit is not None:
            sizes = compute_module_sizes(empty)[0]
            on_disk = sum(sizes[name] for name, where in placement.items() if where == "disk")
            if on_disk > limit:
                raise BadInput(f"the model does not fit in --max-memory: {_size(on_disk)} of it would go to disk, "
                               f"more than disk={_size(limit)}")
    return placement


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_OFFLOADS = itertools.count()


def _offload_dir(store_root: Path) -> tuple[Path, Any]:
    """A fresh `<store>/offload/<pid>-<n>/` and a function that removes it (idempotent). Folders of processes
    that no longer exist (killed before they could clean up) are removed first."""
    root = store_root / "offload"
    root.mkdir(parents=True, exist_ok=True)
    for old in root.iterdir():
        pid = old.name.partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    path = root / f"{os.getpid()}-{next(_OFFLOADS)}"
    path.mkdir()

    def cleanup(path=path, root=root):
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):
            root.rmdir()  # only when empty

    return path, cleanup


def _quiet_transformers() -> None:
    """ridgefill draws its own progress; transformers' per-tensor bars and notices only add noise."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    # accelerate's "Some parameters are on the meta device because they were offloaded" notice on every
    # dispatched load: the placement is in the artifact's info instead.
    logging.getLogger("accelerate").setLevel(logging.ERROR)


CACHE_DTYPES = {"bfloat16": "bfloat16"}  # load dtype -> the cache's, when not float32 (float16 casts from float32)


def gguf_cache_dir(ref: ModelRef, *, store_root: Path, dtype: str = "float32") -> tuple[Path, bool]:
    """The dequantized transformers directory a GGUF ref loads from in `dtype`, built if missing: the float32 one, or
    for bfloat16 its own. Returns (path, built_now)."""
    cached = CACHE_DTYPES.get(dtype, "float32")
    target = _cache_path(ref, store_root, cached)
    if (target / SOURCE_FILE).is_file():
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _dequantize_gguf(ref, tmp, cached)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same cache first: theirs is as good as ours.
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, True


def _config_dir(ref: ModelRef, store_root: Path) -> Path:
    """A dequantized cache of `ref` to read its configuration from: one already built (any dtype: the same
    config.json but its dtype), else the float32 one, built now."""
    for cached in ("float32", *CACHE_DTYPES.values()):
        path = _cache_path(ref, store_root, cached)
        if (path / SOURCE_FILE).is_file():
            return path
    return gguf_cache_dir(ref, store_root=store_root)[0]


def _cache_path(ref: ModelRef, store_root: Path, cached: str) -> Path:
    return store_root / "models" / (ref.fingerprint[:16] + ("" if cached == "float32" else f"-{cached}"))


def _dequantize_gguf(ref: ModelRef, out: Path, dtype: str = "float32") -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _quiet_transformers()  # the cache may be built before any load (layer_kinds): save_pretrained draws a bar too
    where, name = ref.path.parent, ref.path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
    # dequantize=True asks for a plain dense model even where transformers could keep GGUF blocks packed (with
    # the `kernels` package). Such a model carries no quantization_config and saves like any other.
    # The GGUF loader draws a plain tqdm bar per tensor (not transformers' switchable one): keep it off stderr.
    # In bfloat16 the loader dequantizes to float32 and casts each tensor as a float32 cache's load would.
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(
            where,
            gguf_file=name,
            dtype=getattr(torch, dtype),
            local_files_only=True,
            quantization_config=GgufConfig(dequantize=True),
        )
    model.save_pretrained(out)  # safetensors
    tokenizer.save_pretrained(out)
    source = {
        "fingerprint": ref.fingerprint,
        "gguf_file": name,
        "dtype": dtype,
        "name": ref.name,
        "transformers": transformers.__version__,
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _from_pretrained(source: Path, *, dtype, device_map=None, offload_folder=None, **extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placed = {"device_map": device_map, "offload_folder": offload_folder} if device_map is not None else {}
    # local_files_only: a directory is all we read; never fall back to the network.
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True, **placed, **extra)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **extra)
    except ValueError as exc:  # e.g. custom code without trust_remote_code; transformers' message is multi-line
        raise BadInput(f"cannot load model from {source}: {_first_line(exc)}") from exc
    return model, tokenizer
