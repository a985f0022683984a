"""Content-addressed artifact store (DESIGN §3).

Layout: `<root>/<stage>/<id>/` holds the stage's files and `artifact.json`. The id is the first 16 hex
digits of the sha256 of the canonical JSON of the stage's recipe (everything that changes the output).
A stage builds into `<root>/<stage>/.tmp-<id>-<pid>/` and renames it into place when `artifact.json` has
been written, so a directory under its final name is always complete. Long stages keep resumable state in
`<root>/<stage>/.work-<id>/` until they finish.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ridgefill import __version__
from ridgefill.errors import BadInput, RidgefillError

MANIFEST = "artifact.json"
FORMAT = "ridgefill-artifact/1"
STAGES = ("capture", "solve", "quantize", "export", "eval", "compact", "fold")


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def recipe_id(recipe: dict) -> str:
    return hashlib.sha256(canonical_json(recipe).encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj: Any) -> None:
    """Deterministic JSON (sorted keys, indent 2, trailing newline), via a temp file and rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True, indent=2) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class Artifact:
    stage: str
    id: str
    path: Path
    manifest: dict

    @property
    def recipe(self) -> dict:
        return self.manifest["recipe"]

    @property
    def info(self) -> dict:
        return self.manifest.get("info", {})

    def file(self, name: str) -> Path:
        return self.path / name


class Build:
    """A stage's artifact under construction: write files into `path`, then `commit()`."""

    def __init__(self, store: "Store", stage: str, recipe: dict):
        self.store, self.stage, self.recipe = store, stage, recipe
        self.id = recipe_id(recipe)
        self.final = store.root / stage / self.id
        self.path = store.root / stage / f".tmp-{self.id}-{os.getpid()}"
        self.started = time.time()

    def __enter__(self) -> "Build":
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.path.exists():  # not committed: leave nothing behind
            shutil.rmtree(self.path, ignore_errors=True)

    @property
    def work(self) -> Path:
        """Resumable state for this id; survives a crash, removed on commit."""
        return self.store.root / self.stage / f".work-{self.id}"

    def commit(self, info: dict | None = None, summary: dict | None = None, timings: dict | None = None) -> Artifact:
        files = {}
        for p in sorted(self.path.iterdir()):
            if p.name == MANIFEST or not p.is_file():
                continue
            files[p.name] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        manifest = {
            "format": FORMAT,
            "stage": self.stage,
            "id": self.id,
            "recipe": self.recipe,
            "files": files,
            "info": info or {},
            "summary": summary or {},
            "timings": {"total_s": round(time.time() - self.started, 3), **(timings or {})},
            "tool_version": __version__,
        }
        write_json(self.path / MANIFEST, manifest)
        if self.final.exists():  # a concurrent run finished first, or a broken leftover
            shutil.rmtree(self.final)
        os.replace(self.path, self.final)
        if self.work.exists():
            shutil.rmtree(self.work, ignore_errors=True)
        return Artifact(self.stage, self.id, self.final, manifest)


class Store:
    def __init__(self, root: Path | str):
        self.root = Path(root)

    def build(self, stage: str, recipe: dict) -> Build:
        return Build(self, stage, recipe)

    def cached(self, stage: str, recipe: dict) -> Artifact | None:
        """The artifact for this recipe if it exists and verifies (a cache hit), else None."""
        path = self.root / stage / recipe_id(recipe)
        if not (path / MANIFEST).is_file():
            return None
        art = self._read(stage, path)
        return art if art is not None and not self.problems(art) else None

    def _read(self, stage: str, path: Path) -> Artifact | None:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        return Artifact(stage, path.name, path, manifest)

    def all(self) -> list[Artifact]:
        out = []
        for stage in STAGES:
            d = self.root / stage
            if not d.is_dir():
                continue
            for p in sorted(d.iterdir()):
                if p.is_dir() and not p.name.startswith("."):
                    art = self._read(stage, p)
                    if art is not None:
                        out.append(art)
        return out

    def get(self, ref: str, stage: str | None = None) -> Artifact:
        """Find an artifact by id, unique id prefix, `stage/id`, or its directory path."""
        ref = ref.strip()
        if os.sep in ref and Path(ref, MANIFEST).is_file():
            p = Path(ref)
            art = self._read(p.parent.name, p)
            if art is None:
                raise BadInput(f"artifact '{ref}' has an unreadable {MANIFEST}")
            stage_ok = stage is None or art.stage == stage
        else:
            want_stage, _, prefix = ref.rpartition("/")
            hits = [a for a in self.all() if a.id.startswith(prefix) and (not want_stage or a.stage == want_stage)]
            if stage is not None:
                hits_stage = [a for a in hits if a.stage == stage]
                hits = hits_stage or hits
            if not prefix or not hits:
                raise BadInput(f"no artifact '{ref}' in store {self.root}")
            if len(hits) > 1:
                raise BadInput(f"artifact id '{ref}' is ambiguous: " + ", ".join(f"{a.stage}/{a.id}" for a in hits))
            art = hits[0]
            stage_ok = stage is None or art.stage == stage
        if not stage_ok:
            raise BadInput(f"artifact '{ref}' is a {art.stage} artifact, not {stage}")
        return art

    def problems(self, art: Artifact) -> list[str]:
        """Every file of the artifact against its recorded size and sha256; extra files count too."""
        out = []
        files = art.manifest.get("files", {})
        if art.manifest.get("id") != art.path.name:
            out.append(f"{MANIFEST}: id {art.manifest.get('id')} does not match directory {art.path.name}")
        for name, meta in sorted(files.items()):
            p = art.path / name
            if not p.is_file():
                out.append(f"{name}: missing")
            elif p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
                out.append(f"{name}: sha256 mismatch")
        for p in sorted(art.path.iterdir()):
            if p.name != MANIFEST and p.name not in files:
                out.append(f"{p.name}: not listed in {MANIFEST}")
        return out

    def verify(self, art: Artifact) -> None:
        probs = self.problems(art)
        if probs:
            raise RidgefillError(f"artifact {art.stage}/{art.id} is damaged: " + "; ".join(probs))

    def leftovers(self) -> list[Path]:
        """Temporary build directories and abandoned work directories."""
        out = []
        for stage in STAGES:
            d = self.root / stage
            if d.is_dir():
                out += [p for p in sorted(d.iterdir()) if p.name.startswith((".tmp-", ".work-"))]
        return out

    def gc(self, dry_run: bool = False, include_work: bool = False) -> list[Path]:
        """Remove temp build dirs, damaged artifacts and (with include_work) resumable work dirs."""
        doomed = [p for p in self.leftovers() if include_work or p.name.startswith(".tmp-")]
        doomed += [a.path for a in self.all() if self.problems(a)]
        if not dry_run:
            for p in doomed:
                shutil.rmtree(p, ignore_errors=True)
        return doomed
