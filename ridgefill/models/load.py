"""Load a resolved model with transformers: eval mode, no gradients, plus its tokenizer and layer adapter.

Directories and hub snapshots load directly (local files only). A GGUF file is dequantized by transformers
(`from_pretrained(dir, gguf_file=name)`), which is slow -- about 20 s for SmolLM2 and a minute for Gemma 3 270M
on two cores, mostly rebuilding the tokenizer from the GGUF vocabulary -- so the dense float32 result is saved
once as a plain transformers directory (safetensors) under `<store>/models/<fingerprint[:16]>/` and later
loads read that. The cache directory is written to a temporary sibling and renamed, so it is complete whenever
it exists under its final name.

torch and transformers are imported inside the functions: `import ridgefill.models` stays cheap.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ridgefill.errors import BadInput, RidgefillError
from ridgefill.models.spec import ModelRef

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


def load_model(
    ref: ModelRef,
    *,
    store_root: Path,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load `ref` in `dtype` on `device`. GGUF refs go through (and fill) the dequantized cache in the store."""
    import torch

    from ridgefill.models.adapters import adapter_for

    if dtype not in DTYPES:
        raise BadInput(f"unknown dtype '{dtype}' (choose one of: {', '.join(DTYPES)})")
    _quiet_transformers()
    start = time.perf_counter()
    built = False
    if ref.is_gguf:
        source, built = gguf_cache_dir(ref, store_root=Path(store_root))
    else:
        source = ref.path
    # Only pass trust_remote_code when asked, so transformers' own default (off) holds otherwise.
    extra = {"trust_remote_code": True} if trust_remote_code else {}
    model, tokenizer = _from_pretrained(source, dtype=getattr(torch, dtype), **extra)
    if model.config.model_type != ref.model_type:
        raise RidgefillError(f"{source} loaded as '{model.config.model_type}', expected '{ref.model_type}'")
    try:
        model.to(device)
    except (RuntimeError, AssertionError) as exc:  # e.g. "cuda" on a CPU-only torch
        raise BadInput(f"cannot use device '{device}': {exc}") from exc
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(
        ref=ref,
        model=model,
        tokenizer=tokenizer,
        adapter=adapter_for(model),
        source=Path(source),
        seconds=time.perf_counter() - start,
        built_cache=built,
    )


def _quiet_transformers() -> None:
    """ridgefill draws its own progress; transformers' per-tensor bars and notices only add noise."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def gguf_cache_dir(ref: ModelRef, *, store_root: Path) -> tuple[Path, bool]:
    """The dequantized transformers directory for a GGUF ref, built if missing. Returns (path, built_now)."""
    target = store_root / "models" / ref.fingerprint[:16]
    if (target / SOURCE_FILE).is_file():
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _dequantize_gguf(ref, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same cache first: theirs is as good as ours.
            if not (target / SOURCE_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, True


def _dequantize_gguf(ref: ModelRef, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    where, name = ref.path.parent, ref.path.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
    # dequantize=True asks for a plain dense model even where transformers could keep GGUF blocks packed (with
    # the `kernels` package). Such a model carries no quantization_config and saves like any other.
    # The GGUF loader draws a plain tqdm bar per tensor (not transformers' switchable one): keep it off stderr.
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(
            where,
            gguf_file=name,
            dtype=torch.float32,
            local_files_only=True,
            quantization_config=GgufConfig(dequantize=True),
        )
    model.save_pretrained(out)  # safetensors
    tokenizer.save_pretrained(out)
    source = {
        "fingerprint": ref.fingerprint,
        "gguf_file": name,
        "name": ref.name,
        "transformers": transformers.__version__,
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _from_pretrained(source: Path, *, dtype, **extra):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # local_files_only: a directory is all we read; never fall back to the network.
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=True, **extra)
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True, **extra)
    except ValueError as exc:  # e.g. custom code without trust_remote_code; transformers' message is multi-line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadInput(f"cannot load model from {source}: {first}") from exc
    return model, tokenizer
