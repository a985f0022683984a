"""Whether a served model folder is a release's model: what the vLLM plugin checks before it applies a release.

A release records its model's fingerprint (docs/format.md "Model fingerprint"). A model an engine serves is a
Hugging Face folder; for a model that is one already (a local folder, a Hub snapshot) that folder's own fingerprint
is the release's. A GGUF model (the built-ins included) is not: `ridgefill engine model` writes a folder from it
(ridgefill/engines/model_dir.py), whose own fingerprint differs from the GGUF's, and leaves in it a marker,
`ridgefill-model.json`, that ties the two together:

    {"format": "ridgefill-engine-model/1",
     "fingerprint": <the written folder's own fingerprint, as dir_fingerprint computes it>,
     "source": {"spec": <the model spec given>, "name": <the model's name>, "fingerprint": <the source's>},
     "dtype": "float32" | "bfloat16" | "float16"}

(keys sorted, indent 2, trailing newline). The marker's name matches none of the tokenizer, config or weight file
names, so it is not part of the folder's fingerprint. A marker is trusted only while the folder still has the
fingerprint it records: an edited weight, config or tokenizer file makes it void. It is a record against mistakes
(serving the wrong model, or a folder changed since), not a signature: whoever can edit the folder can write a
marker that claims any source.

- `served_fingerprint_problem(folder, manifest)`: None when `folder` is the release's model (its own fingerprint
  is the manifest's `model.fingerprint`, or it holds a valid marker whose source is), else one line naming the
  problem. It hashes the folder's weight files, unless they are a Hub snapshot's (then the blob names, the sha256
  the Hub keeps, stand for them), or a `FileHashCache` given as `hashes` remembers them.
- `served_config_problem(config, manifest)`: the cheap check beside it: architecture, layer count and width.

This module runs inside the engine's environment: it imports only the standard library and ridgefill's numpy-only
modules (fingerprints, the store's hashing, errors) -- no torch, transformers, typer or rich.
"""

from __future__ import annotations

import json
from pathlib import Path

from ridgefill.errors import RidgefillError
from ridgefill.models.fingerprint import SHA256_NAME, FileHashCache, dir_fingerprint, hub_fingerprint

MARKER = "ridgefill-model.json"
MARKER_FORMAT = "ridgefill-engine-model/1"
MARKER_DTYPES = ("float32", "bfloat16", "float16")


def marker_bytes(fingerprint: str, source: dict, dtype: str) -> bytes:
    """The marker of a folder whose own fingerprint is `fingerprint`, written from `source` ({spec, name,
    fingerprint}) with weights in `dtype`: JSON, keys sorted, indent 2, trailing newline."""
    doc = {"format": MARKER_FORMAT, "fingerprint": fingerprint, "dtype": dtype,
           "source": {"spec": source["spec"], "name": source["name"], "fingerprint": source["fingerprint"]}}
    return (json.dumps(doc, sort_keys=True, indent=2) + "\n").encode("utf-8")


def read_marker(folder: Path) -> dict | None:
    """The marker of `folder` (checked field by field), or None when it has none. ValueError (one line) for a
    marker that is not one."""
    path = Path(folder) / MARKER
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
        raise ValueError(f"{path}: 'format' is not {MARKER_FORMAT!r}")
    src = doc.get("source")
    if not isinstance(src, dict):
        raise ValueError(f"{path}: 'source' is not an object")
    for where, key in ((doc, "fingerprint"), (src, "fingerprint")):
        if not isinstance(where.get(key), str) or not SHA256_NAME.match(where[key]):
            raise ValueError(f"{path}: '{'source.' if where is src else ''}{key}' is not 64 lowercase hex digits")
    if not all(isinstance(src.get(k), str) for k in ("spec", "name")):
        raise ValueError(f"{path}: 'source.spec' and 'source.name' must be strings")
    if doc.get("dtype") not in MARKER_DTYPES:
        raise ValueError(f"{path}: 'dtype' is not one of {', '.join(MARKER_DTYPES)}")
    return doc


def is_hub_snapshot(folder: Path) -> bool:
    """A Hugging Face cache snapshot: `<repo>/snapshots/<commit>/` beside `<repo>/blobs/`."""
    folder = Path(folder)
    return folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir()


def folder_fingerprint(folder: Path, hashes: FileHashCache | None = None) -> str:
    """The fingerprint of a served folder, as `resolve_model` computes it for it: from the blob names for a Hub
    snapshot's weights, by hashing the files (through `hashes`, when given) otherwise."""
    folder = Path(folder)
    return (hub_fingerprint if is_hub_snapshot(folder) else dir_fingerprint)(folder, hashes)


def served_fingerprint_problem(folder: Path, release_manifest: dict, *,
                               hashes: FileHashCache | None = None) -> str | None:
    """None when the model folder an engine serves is the one `release_manifest` (a release's ridgefill.json,
    parsed) was made for: its own fingerprint is the manifest's `model.fingerprint`, or it holds a marker
    (`ridgefill engine model`) that records the folder's present fingerprint and the manifest's model as its
    source. Otherwise one line that names the problem. `hashes` may remember weight hashes between starts (a
    `FileHashCache` whose file is not in the model folder); without it every local weight file is read."""
    folder = Path(folder)
    model = release_manifest.get("model") if isinstance(release_manifest, dict) else None
    wanted = model.get("fingerprint") if isinstance(model, dict) else None
    if not isinstance(wanted, str) or not SHA256_NAME.match(wanted):
        return "the release manifest has no model.fingerprint (64 hex digits): not a ridgefill release"
    try:
        have = folder_fingerprint(folder, hashes)
    except (OSError, RidgefillError) as exc:
        return f"cannot fingerprint the served model {folder}: {str(exc).splitlines()[0] if str(exc) else exc!r}"
    if have == wanted:
        return None
    made_for = f"the release was made for {_label(model)} (fingerprint {wanted[:12]})"
    try:
        marker = read_marker(folder)
    except ValueError as exc:
        return f"{made_for}; the served model {folder} has fingerprint {have[:12]} and a damaged marker: {exc}"
    if marker is None:
        return f"{made_for}, the served model {folder} has fingerprint {have[:12]}; {_hint(model)}"
    if marker["fingerprint"] != have:
        return (f"the served model {folder} does not match its {MARKER} (which records fingerprint "
                f"{marker['fingerprint'][:12]}; the folder has {have[:12]}): edited since `ridgefill engine model` "
                f"wrote it; write it again: `ridgefill engine model {marker['source']['spec']} --out {folder} --force`")
    src = marker["source"]
    if src["fingerprint"] != wanted:
        return (f"{made_for}, the served model {folder} was written from {src['spec']} (fingerprint "
                f"{src['fingerprint'][:12]}); {_hint(model)}")
    return None


def served_config_problem(config: dict, release_manifest: dict) -> str | None:
    """None when a served model's config.json (`config`, parsed) has the release's architecture (`model_type`),
    layer count, hidden size and (a ridgefill-maps/2 release) KV heads and head size (a vision-language config's from
    its `text_config`); else one line naming the
    first that differs. Cheap (no file is read), but it cannot tell two models of one shape apart:
    `served_fingerprint_problem` does."""
    model = release_manifest.get("model") if isinstance(release_manifest, dict) else None
    if not isinstance(model, dict):
        return "the release manifest has no 'model' object: not a ridgefill release"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    checks = [("architecture", config.get("model_type"), model.get("architecture")),
              ("layer count", text.get("num_hidden_layers"), model.get("num_layers")),
              ("hidden size", text.get("hidden_size"), model.get("hidden_size"))]
    heads = text.get("num_attention_heads")
    if heads and "num_kv_heads" in model:  # a /2 release records the KV shape its key/value maps are for
        head_dim = text.get("head_dim") or (text.get("hidden_size") or 0) // heads
        checks += [("KV head count", text.get("num_key_value_heads") or heads, model.get("num_kv_heads")),
                   ("head size", head_dim, model.get("head_dim"))]
    for what, have, want in checks:
        if have != want:
            return f"the release was made for {_label(model)}, whose {what} is {want!r}; the served model's is {have!r}"
    return None


def _label(model: dict) -> str:
    return str(model.get("spec") or model.get("name") or "an unnamed model")


def _hint(model: dict) -> str:
    spec = model.get("spec")
    if isinstance(spec, str) and spec.startswith("builtin:"):  # a GGUF: only a written folder can serve it
        return f"serve the folder `ridgefill engine model {spec} --out DIR` writes from that model"
    return ("serve that model's own folder, or for a GGUF model the folder `ridgefill engine model MODEL --out DIR` "
            "writes from it")
