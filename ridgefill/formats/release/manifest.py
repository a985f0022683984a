"""The manifest and the folder of a release (docs/format.md, "Verifying", rules 1-9): ridgefill.json parsed as the
format allows JSON (`parse_json`, `read_manifest`), its `files` and the folder's entries, every file's sha256, and
the facts maps.safetensors records compared with the manifest by value (`verified_manifest`). read.py goes on from a
verified manifest to the tensors and the facts a runtime applies. numpy only (none needed here).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.formats import safetensors
from ridgefill.formats.release.write import is_writer_leftover
from ridgefill.formats.release.names import (CORRECTIONS_FILE, DOWNLOAD_CACHE, FORMATS, GITATTRIBUTES, HF_DIR,
                                             HUB_LEFTOVERS, MANIFEST, MAPS_FILE, META_FACTS, META_FORMAT,
                                             PROTECTED_FILE, SHA256_RE, UNHASHED, facts_of, is_bare_name)


# ------------------------------------------------------------------------------------------------ the manifest


def _no_constant(name):  # NaN, Infinity, -Infinity: Python's json reads them, JSON does not have them
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:  # 1e999 is a JSON number, but not one a float can hold
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} overflows to infinity")
    return value


def parse_json(text: str, what: str):
    """JSON as the format allows it: no duplicate keys, no NaN or infinity; BadInput naming `what`."""
    try:
        return json.loads(text, object_pairs_hook=safetensors.no_duplicates, parse_constant=_no_constant,
                          parse_float=_finite)
    except safetensors.DuplicateKey as e:
        raise BadInput(f"{what}: invalid JSON (the key {e.args[0]!r} appears twice in one object)") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{what}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except ValueError as e:
        raise BadInput(f"{what}: invalid JSON ({e})") from None


def read_manifest(dir: Path) -> dict:
    """ridgefill.json of a folder, parsed (not verified); BadInput when it is missing or not a JSON object."""
    mpath = Path(dir) / MANIFEST
    if mpath.is_symlink():
        raise BadInput(f"{MANIFEST}: a symbolic link (a release holds regular files only)")
    if not mpath.is_file():
        raise BadInput(f"{MANIFEST}: missing in {dir} (not a ridgefill release folder)")
    try:
        text = mpath.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{MANIFEST}: invalid JSON (not UTF-8: {e.reason})") from None
    manifest = parse_json(text, MANIFEST)
    if not isinstance(manifest, dict):
        raise BadInput(f"{MANIFEST}: invalid manifest (top level is not a JSON object)")
    return manifest


def _named_files(manifest: dict) -> list[str]:
    """The tensor files the facts name: `projector.files`, `protected_tokens.file`, `corrections.state.file`."""
    proj = manifest.get("projector")
    names = proj.get("files") if isinstance(proj, dict) else None
    if names != [MAPS_FILE]:
        raise BadInput(f"{MANIFEST}: 'projector.files' is {_show(names)}, expected [{MAPS_FILE!r}] (the maps are in "
                       "one file, whose hash covers the facts)")
    for key, field, name in (("protected_tokens", ("protected_tokens",), PROTECTED_FILE),
                             ("corrections.state", ("corrections", "state"), CORRECTIONS_FILE)):
        info = _get(manifest, field)
        if info is not None:
            if not isinstance(info, dict) or info.get("file") != name:
                raise BadInput(f"{MANIFEST}: '{key}.file' must be {name!r}")
            names = [*names, name]
    return names


def _get(manifest: dict, path: tuple[str, ...]):
    node = manifest
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def verified_manifest(dir: Path) -> dict:
    if not dir.is_dir():
        raise BadInput(f"{dir}: not a directory")
    manifest = read_manifest(dir)
    if manifest.get("format") not in FORMATS:
        raise BadInput(f"{MANIFEST}: format is {manifest.get('format')!r}, expected "
                       f"{' or '.join(map(repr, FORMATS))}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise BadInput(f"{MANIFEST}: 'files' must be a non-empty object of file name -> sha256")
    for name in sorted(files):
        if not is_bare_name(name):
            raise BadInput(f"{MANIFEST}: files entry {name!r} is not a bare file name inside the release folder")
        if name in UNHASHED or name in HUB_LEFTOVERS:
            raise BadInput(f"{MANIFEST}: files entry {name!r} must not be listed (it is never hashed)")
        if not isinstance(files[name], str) or not SHA256_RE.match(files[name]):
            raise BadInput(f"{MANIFEST}: files entry {name!r} has no valid sha256 (64 lowercase hex digits)")
    if MAPS_FILE not in files:
        raise BadInput(f"{MANIFEST}: 'files' does not list {MAPS_FILE} (the file that records the release facts)")
    named = _named_files(manifest)
    for name in named:
        if name not in files:
            raise BadInput(f"{MANIFEST}: {name!r} is named by the manifest but not listed in 'files'")
    for name in sorted(set(files) - set(named)):
        raise BadInput(f"{MANIFEST}: 'files' lists {name!r}, which no field of the manifest names (a release holds "
                       "only its tensor files)")
    for name in sorted(files):
        path = dir / name
        if path.is_symlink():
            raise BadInput(f"{name}: a symbolic link (a release holds regular files only)")
        if not path.exists():
            raise BadInput(f"{name}: listed in {MANIFEST} but missing from {dir}")
        if not path.is_file():
            raise BadInput(f"{name}: listed in {MANIFEST} but not a regular file")
    for name in sorted(os.listdir(dir)):
        if name in files or name == MANIFEST:
            continue
        if name in UNHASHED and (dir / name).is_symlink():
            raise BadInput(f"{name}: a symbolic link (a release holds regular files only)")
        if name in UNHASHED and not (dir / name).is_file():
            raise BadInput(f"{name}: not a regular file (a release holds regular files only)")
        if name not in UNHASHED and not _hub_leftover(dir / name) and not is_writer_leftover(dir / name):
            raise BadInput(f"{name}: in the release folder but not listed in {MANIFEST}")
    for name in sorted(files):
        got = sha256_file(dir / name)
        if got != files[name]:
            raise BadInput(f"{name}: sha256 mismatch (expected {files[name]}, got {got})")
    meta = safetensors.read_header(dir / MAPS_FILE)[1]
    check_format(MAPS_FILE, meta, manifest["format"])
    _check_facts(manifest, meta)
    for key, field in (("protected_tokens", ("protected_tokens",)), ("corrections.state", ("corrections", "state"))):
        info = _get(manifest, field)
        if info is not None and info.get("sha256") != files[info["file"]]:
            raise BadInput(f"{info['file']}: its sha256 is not the one the facts record ('{key}.sha256' is "
                           f"{info.get('sha256')!r}): the file does not belong to this release")
    return manifest


def check_format(name: str, meta: dict[str, str], format: str | None) -> None:
    """A tensor file's `format` metadata must be the manifest's `format` (None: either release format)."""
    if format is None and meta.get(META_FORMAT) not in FORMATS:
        raise BadInput(f"{name}: metadata '{META_FORMAT}' is {meta.get(META_FORMAT)!r}, expected "
                       f"{' or '.join(map(repr, FORMATS))}")
    if format is not None and meta.get(META_FORMAT) != format:
        raise BadInput(f"{name}: metadata '{META_FORMAT}' is {meta.get(META_FORMAT)!r}, expected {format!r} (the "
                       "manifest's format)")


def _hub_leftover(path: Path) -> bool:
    """True for what `hf download --local-dir` adds to a folder: the regular file `.gitattributes`, and a
    folder `.cache` whose only entry is the folder `huggingface` (symbolic links are never accepted)."""
    if path.is_symlink():
        return False
    if path.name == GITATTRIBUTES:
        return path.is_file()
    if path.name == DOWNLOAD_CACHE and path.is_dir():
        hf = path / HF_DIR
        return os.listdir(path) == [HF_DIR] and hf.is_dir() and not hf.is_symlink()
    return False


# --------------------------------------------------------------------------------------------------- the facts


def _check_facts(manifest: dict, meta: dict[str, str]) -> None:
    """Refuse a manifest whose facts differ from those maps.safetensors records, naming the first field."""
    raw = meta.get(META_FACTS)
    if raw is None:
        raise BadInput(f"{MAPS_FILE}: records no release facts (no '{META_FACTS}' metadata; written by an older "
                       "ridgefill): export the release again")
    recorded = parse_json(raw, f"{MAPS_FILE}: '{META_FACTS}' metadata")
    if not isinstance(recorded, dict):
        raise BadInput(f"{MAPS_FILE}: '{META_FACTS}' metadata is not a JSON object")
    diff = _difference(facts_of(manifest), recorded, "")
    if diff is not None:
        raise BadInput(f"{MANIFEST}: {diff} (the manifest was edited)")


ABSENT = object()


def _show(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _same_value(a, b) -> bool:
    """JSON values equal by value: numbers by their value (20 and 20.0 are one number, as in JavaScript), booleans
    only to booleans, strings and null to themselves."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def _difference(given, recorded, path: str) -> str | None:
    """The first field (in sorted order) where the manifest's value differs from the recorded one, as a phrase;
    None if they are the same JSON value."""
    if isinstance(given, dict) and isinstance(recorded, dict):
        for key in sorted(set(given) | set(recorded), key=str):
            d = _difference(given.get(key, ABSENT), recorded.get(key, ABSENT), f"{path}.{key}" if path else key)
            if d is not None:
                return d
        return None
    if isinstance(given, list) and isinstance(recorded, list) and len(given) == len(recorded):
        for i, (g, r) in enumerate(zip(given, recorded)):
            d = _difference(g, r, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    if given is ABSENT:
        return f"{path!r} is missing but {MAPS_FILE} records {_show(recorded)}"
    if recorded is ABSENT:
        return f"{path!r} is {_show(given)} but {MAPS_FILE} records no such field"
    if _same_value(given, recorded):
        return None
    return f"{path!r} is {_show(given)} but {MAPS_FILE} records {_show(recorded)}"
