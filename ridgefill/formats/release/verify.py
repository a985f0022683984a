"""Verifying a release folder: every file against the manifest's sha256, every entry of the folder accounted for,
and the manifest against the facts maps.safetensors records (names.py says what is protected, and how)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ridgefill.artifacts.store import sha256_file
from ridgefill.errors import BadInput
from ridgefill.formats import safetensors
from ridgefill.formats.release.names import (DOWNLOAD_CACHE, FORMAT, GITATTRIBUTES, HF_DIR, HUB_LEFTOVERS, MANIFEST,
                                             MAPS_FILE, META_FACTS, SHA256_RE, UNHASHED, facts_of, is_bare_name)


def read_manifest(dir: Path) -> dict:
    """ridgefill.json of a folder, parsed (not verified); BadInput when it is missing or not a JSON object."""
    mpath = Path(dir) / MANIFEST
    if not mpath.is_file():
        raise BadInput(f"{MANIFEST}: missing in {dir} (not a ridgefill release folder)")
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise BadInput(f"{MANIFEST}: invalid JSON (not UTF-8: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{MANIFEST}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(manifest, dict):
        raise BadInput(f"{MANIFEST}: invalid manifest (top level is not a JSON object)")
    return manifest


def verify_release(dir: Path) -> dict:
    """Check a release folder against its manifest and return the manifest; BadInput on the first problem.

    Refuses: a missing or unparsable ridgefill.json, a wrong `format`, a `files` entry that is not a bare
    file name inside the folder (or names README.md, ridgefill.json, .gitattributes or .cache), `files` without
    maps.safetensors, a listed file that is missing or whose sha256 differs, a projector tensor file not listed in
    `files`, any entry of the folder that `files` does not list, a maps.safetensors that records no facts, and a
    manifest whose fields (all but `files` and `eval`) differ from the facts maps.safetensors records (the first
    differing field is named). Exempt entries: README.md (documentation, may be rewritten by the Hub),
    ridgefill.json itself, and what `hf download` leaves: a regular file `.gitattributes` and a folder `.cache`
    holding only `huggingface/`. No other dotfile or subfolder is ignored.
    """
    dir = Path(dir)
    if not dir.is_dir():
        raise BadInput(f"{dir}: not a directory")
    manifest = read_manifest(dir)
    if manifest.get("format") != FORMAT:
        raise BadInput(f"{MANIFEST}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
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
    for name in projector_files(manifest):
        if name not in files:
            raise BadInput(f"{MANIFEST}: projector file {name!r} is not listed in 'files'")
    for name in sorted(files):
        if not (dir / name).exists():
            raise BadInput(f"{name}: listed in {MANIFEST} but missing from {dir}")
        if not (dir / name).is_file():
            raise BadInput(f"{name}: listed in {MANIFEST} but not a regular file")
    for name in sorted(os.listdir(dir)):
        if name not in files and name not in UNHASHED and not _hub_leftover(dir / name):
            raise BadInput(f"{name}: in the release folder but not listed in {MANIFEST}")
    for name in sorted(files):
        got = sha256_file(dir / name)
        if got != files[name]:
            raise BadInput(f"{name}: sha256 mismatch (expected {files[name]}, got {got})")
    _check_facts(manifest, safetensors.read_header(dir / MAPS_FILE)[1])
    return manifest


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


def _check_facts(manifest: dict, meta: dict[str, str]) -> None:
    """Refuse a manifest whose facts differ from those maps.safetensors records, naming the first field."""
    raw = meta.get(META_FACTS)
    if raw is None:
        raise BadInput(f"{MAPS_FILE}: records no release facts (no '{META_FACTS}' metadata; written by an older "
                       "ridgefill): export the release again")
    try:
        recorded = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadInput(f"{MAPS_FILE}: '{META_FACTS}' metadata is not JSON ({e.msg})") from None
    if not isinstance(recorded, dict):
        raise BadInput(f"{MAPS_FILE}: '{META_FACTS}' metadata is not a JSON object")
    diff = _difference(facts_of(manifest), recorded, "")
    if diff is not None:
        raise BadInput(f"{MANIFEST}: {diff} (the manifest was edited)")


_ABSENT = object()


def _show(value) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def _difference(given, recorded, path: str) -> str | None:
    """The first field (in sorted order) where the manifest's value differs from the recorded one, as a phrase;
    None if they are the same JSON. Values are compared as JSON text, so 16 and 16.0 or 1 and true differ."""
    if isinstance(given, dict) and isinstance(recorded, dict):
        for key in sorted(set(given) | set(recorded), key=str):
            d = _difference(given.get(key, _ABSENT), recorded.get(key, _ABSENT), f"{path}.{key}" if path else key)
            if d is not None:
                return d
        return None
    if isinstance(given, list) and isinstance(recorded, list) and len(given) == len(recorded):
        for i, (g, r) in enumerate(zip(given, recorded)):
            d = _difference(g, r, f"{path}[{i}]")
            if d is not None:
                return d
        return None
    if given is _ABSENT:
        return f"{path!r} is missing but {MAPS_FILE} records {_show(recorded)}"
    if recorded is _ABSENT:
        return f"{path!r} is {_show(given)} but {MAPS_FILE} records no such field"
    if json.dumps(given, sort_keys=True) == json.dumps(recorded, sort_keys=True):
        return None
    return f"{path!r} is {_show(given)} but {MAPS_FILE} records {_show(recorded)}"


def projector_files(manifest: dict) -> list[str]:
    """The manifest's `projector.files` (the maps' tensor files), checked to be a list of names."""
    proj = manifest.get("projector")
    if proj is None:
        return []
    names = proj.get("files") if isinstance(proj, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadInput(f"{MANIFEST}: 'projector.files' must be a list of file names")
    return names
