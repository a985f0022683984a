"""The export artifact (docs/store.md): a release folder's files (ridgefill.json, maps.safetensors, README.md, ...)
beside artifact.json, or, for --format gguf, maps.gguf."""

from __future__ import annotations

from pathlib import Path

from ridgefill.artifacts.store import MANIFEST as ARTIFACT_MANIFEST

GGUF_FILE = "maps.gguf"


def release_files(path: Path) -> list[str]:
    """The files of an export artifact (its folder, or a build's) that make up its release: all but artifact.json."""
    return [p.name for p in Path(path).iterdir() if p.name != ARTIFACT_MANIFEST]
