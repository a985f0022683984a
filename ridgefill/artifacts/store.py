"""Content-addressed artifact store.

Layout: `<root>/<stage>/<id>/` holds the stage's files and `artifact.json`. The id is the first 16 hex
digits of the sha256 of the canonical JSON of the stage's recipe (everything that changes the output).
A stage builds into `<root>/<stage>/.tmp-<id>-<pid>/` and renames it into place when `artifact.json` has
been written, so a directory under its final name is always complete. Long stages keep resumable state in
`<root>/<stage>/.work-<id>/` until they finish.

Reading checks the manifest: its recipe must hash to the id it lies under, its stage must be the folder's and
its format known, so an edited `artifact.json` cannot change what an artifact means (`get` refuses it, `cached`
treats it as a miss and builds it again). Files are checked against their sha256 by `problems` / `verify`.

One build per artifact at a time (ridgefill/artifacts/lock.py): a cache miss takes `<root>/<stage>/.lock-<id>`
and holds it until the build is in place or has failed; another process asking for the same artifact meanwhile
waits, says for whom, and then finds the cache hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ridgefill import __version__
from ridgefill.artifacts import lock
from ridgefill.errors import BadInput, RidgefillError

_BUILDING: set[str] = set()  # lock paths of the builds this process is inside (`with store.build(...)`)

MANIFEST = "artifact.json"
FORMAT = "ridgefill-artifact/1"
STAGES = ("capture", "solve", "quantize", "export", "eval", "sweep", "compact", "fold")
UPSTREAM = {"solve": "capture", "quantize": "solve", "fold": "compact", "sweep": "capture"}  # stage -> the recipe key naming its input


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


def _stderr(message: str) -> None:
    print(f"ridgefill: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Artifact:
    stage: str
    id: str  # the directory's name
    path: Path
    manifest: dict  # {} when artifact.json is missing or unreadable (see `error`)
    error: str | None = None  # why artifact.json could not be read

    @property
    def recipe(self) -> dict:
        r = self.manifest.get("recipe")
        return r if isinstance(r, dict) else {}

    @property
    def info(self) -> dict:
        i = self.manifest.get("info", {})
        return i if isinstance(i, dict) else {}

    def file(self, name: str) -> Path:
        return self.path / name


class Build:
    """A stage's artifact under construction: `with store.build(...) as b:` write files into `b.path`, then
    `b.commit()`. Entering takes the artifact's lock (if the cache miss did not already) and removes what killed
    builds of the same id left in `.tmp-<id>-*`; leaving releases it."""

    def __init__(self, store: "Store", stage: str, recipe: dict):
        self.store, self.stage, self.recipe = store, stage, recipe
        self.id = recipe_id(recipe)
        self.final = store.root / stage / self.id
        self.path = store.root / stage / f".tmp-{self.id}-{os.getpid()}"
        self.started = time.time()

    def __enter__(self) -> "Build":
        self.store._lock(self.stage, self.id)
        _BUILDING.add(os.path.abspath(self.store.lock_path(self.stage, self.id)))
        try:
            for old in self.path.parent.glob(f".tmp-{self.id}-*"):  # ours, or a killed run's: no one else's
                shutil.rmtree(old)
            self.path.mkdir(parents=True)
        except BaseException:
            self.store._unlock(self.stage, self.id)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.path.exists():  # not committed: leave nothing behind
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self.store._unlock(self.stage, self.id)

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
        old = None
        if self.final.exists():  # a damaged artifact under this id: out of the way first, then removed
            old = self.final.with_name(f"{self.path.name}-old")
            os.replace(self.final, old)
        os.replace(self.path, self.final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if self.work.exists():
            shutil.rmtree(self.work, ignore_errors=True)
        self.store._unlock(self.stage, self.id)
        return Artifact(self.stage, self.id, self.final, manifest)


class Store:
    """`notice` gets the store's own one-line messages (waiting for another build, rebuilding a damaged
    artifact); stderr by default."""

    def __init__(self, root: Path | str, notice: Callable[[str], None] | None = None):
        self.root = Path(root)
        self.notice = notice or _stderr

    def build(self, stage: str, recipe: dict) -> Build:
        return Build(self, stage, recipe)

    def lock_path(self, stage: str, id: str) -> Path:
        return self.root / stage / f".lock-{id}"

    def _lock(self, stage: str, id: str) -> bool:
        """Take the artifact's lock, waiting (after one notice) while another process holds it; True if it waited."""
        waited = []

        def waiting(info: dict) -> None:
            waited.append(info)
            self.notice(f"{stage}/{id} is being built by {lock.describe(info)}; waiting for it to finish")

        lock.acquire(self.lock_path(stage, id), wait=True, on_wait=waiting)
        return bool(waited)

    def _unlock(self, stage: str, id: str) -> None:
        _BUILDING.discard(os.path.abspath(self.lock_path(stage, id)))
        lock.release(self.lock_path(stage, id))

    def release_locks(self) -> None:
        """Let go of every build lock this process holds in this store. Only needed by a long-lived process
        whose stage failed between its cache miss and its build (the CLI's process ends and the kernel lets go)."""
        for stage in STAGES:
            d = self.root / stage
            if d.is_dir():
                for p in d.glob(".lock-*"):
                    if lock.held_here(p):
                        lock.release(p)

    def cached(self, stage: str, recipe: dict) -> Artifact | None:
        """The artifact for this recipe if it exists and verifies (a cache hit), else None.

        On a miss the caller is about to build, so this takes the artifact's lock (waiting, with one line on
        stderr, while another process builds it, then looking again) and keeps it until the `Build` of the same
        recipe commits or fails, or the process ends. A damaged artifact under this id counts as a miss: it is
        built again from the caller's recipe (which is what its id stands for) and replaced on commit."""
        rid = recipe_id(recipe)
        path = self.root / stage / rid
        seen = _identity(path)
        art, probs = self._look(stage, path)
        if art is not None and not probs:
            return art
        waited = self._lock(stage, rid)
        if waited or _identity(path) != seen:  # someone else built (or rebuilt) it meanwhile: look again
            art, probs = self._look(stage, path)
            if art is not None and not probs:
                self._unlock(stage, rid)
                return art
        if art is not None:
            self.notice(f"{stage}/{rid} is damaged ({'; '.join(probs)}); building it again")
        return None

    def _look(self, stage: str, path: Path) -> tuple[Artifact | None, list[str]]:
        """(artifact, problems) for a directory that may hold one; (None, []) when there is none."""
        if not path.is_dir():
            return None, []
        art = self._read(stage, path)
        return art, self.problems(art)

    def _read(self, stage: str, path: Path) -> Artifact:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError:
            return Artifact(stage, path.name, path, {}, f"{MANIFEST}: missing")
        except (OSError, ValueError) as e:
            return Artifact(stage, path.name, path, {}, f"{MANIFEST}: unreadable ({type(e).__name__})")
        if not isinstance(manifest, dict):
            return Artifact(stage, path.name, path, {}, f"{MANIFEST}: not a JSON object")
        return Artifact(stage, path.name, path, manifest)

    def all(self) -> list[Artifact]:
        """Every artifact directory of the store, damaged ones included (`manifest_problems` tells)."""
        out = []
        for stage in STAGES:
            d = self.root / stage
            if not d.is_dir():
                continue
            for p in sorted(d.iterdir()):
                if p.is_dir() and not p.name.startswith("."):
                    out.append(self._read(stage, p))
        return out

    def get(self, ref: str, stage: str | None = None, check: bool = True) -> Artifact:
        """Find an artifact by id, unique id prefix, `stage/id`, or its directory path.

        With `check` (the default) a manifest that does not hold (`manifest_problems`) is refused with one line
        (RidgefillError, exit 1: the reference is right, the store on disk is not). Files are not hashed here:
        a stage that is about to use them calls `verify`."""
        ref, p = ref.strip(), Path(ref.strip())
        if os.sep in ref and p.is_dir() and ((p / MANIFEST).is_file() or p.parent.name in STAGES):
            art = self._read(p.parent.name, p)
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
        if check:
            probs = self.manifest_problems(art)
            if probs:
                raise RidgefillError(f"artifact {art.stage}/{art.id}: {'; '.join(probs)}; the store was edited or "
                                     f"damaged: `ridgefill artifacts gc` removes it and the next run builds it again")
        if stage is not None and art.stage != stage:
            raise BadInput(f"artifact '{ref}' is a {art.stage} artifact, not {stage}")
        return art

    def manifest_problems(self, art: Artifact) -> list[str]:
        """What is wrong with the artifact's manifest, without reading its other files: it must be readable, in a
        known format, of the stage whose folder it lies in, and its recipe must hash to the id it lies under (so
        an edit to the recipe, or a manifest copied under another id, is caught)."""
        if art.error:
            return [art.error]
        m, out = art.manifest, []
        if m.get("format") != FORMAT:
            out.append(f"{MANIFEST}: format {m.get('format')!r} is not {FORMAT!r}")
        if m.get("stage") != art.stage:
            out.append(f"{MANIFEST}: stage {m.get('stage')!r}, but it lies under {art.stage}/")
        if m.get("id") != art.path.name:
            out.append(f"{MANIFEST}: id {m.get('id')} does not match directory {art.path.name}")
        recipe = m.get("recipe")
        if not isinstance(recipe, dict):
            out.append(f"{MANIFEST}: no recipe")
        else:
            rid = recipe_id(recipe)
            if rid != art.path.name:
                out.append(f"{MANIFEST}'s recipe hashes to {rid}, not its id {art.path.name}")
            if recipe.get("stage", art.stage) != art.stage:
                out.append(f"{MANIFEST}: recipe of stage {recipe.get('stage')!r}, but it lies under {art.stage}/")
        if not isinstance(m.get("files", {}), dict) or not isinstance(m.get("info", {}), dict):
            out.append(f"{MANIFEST}: files / info are not JSON objects")
        return out

    def problems(self, art: Artifact) -> list[str]:
        """The manifest's problems, then every file of the artifact against its recorded size and sha256; extra
        files count too. artifact.json is read again: what is on disk now is checked."""
        art = self._read(art.stage, art.path)
        out = self.manifest_problems(art)
        files = art.manifest.get("files", {})
        files = files if isinstance(files, dict) else {}
        for name, meta in sorted(files.items()):
            p = art.path / name
            if not p.is_file():
                out.append(f"{name}: missing")
            elif (not isinstance(meta, dict) or p.stat().st_size != meta.get("bytes")
                  or sha256_file(p) != meta.get("sha256")):
                out.append(f"{name}: sha256 mismatch")
        for p in sorted(art.path.iterdir()):
            if p.name != MANIFEST and p.name not in files:
                out.append(f"{p.name}: not listed in {MANIFEST}")
        return out

    def upstream(self, art: Artifact, stage: str) -> Artifact:
        """The `stage` artifact that `art` was made from, followed through the hashed recipes (solve -> capture,
        quantize -> solve, fold -> compact), never through the unhashed `info`."""
        cur = art
        while cur.stage != stage:
            key = UPSTREAM.get(cur.stage)
            if key is None or not isinstance(cur.recipe.get(key), str):
                raise BadInput(f"artifact {art.stage}/{art.id} was not made from a {stage} artifact")
            cur = self.get(f"{key}/{cur.recipe[key]}", stage=key)
        return cur

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

    def gc(self, dry_run: bool = False, include_work: bool = False, kept: list | None = None) -> list[Path]:
        """Remove what killed or failed runs left (`.tmp-*` build folders, with include_work also `.work-*`
        resumable state, and `.lock-*` files no process holds) and damaged artifacts. Nothing that belongs to a
        build in progress is touched: each id's leftovers go only while gc itself holds that id's lock, and
        `kept` (if given) receives (path, holder) for what a live process's lock protects. Returns the paths
        removed (or, with dry_run, that would be)."""
        plan: dict[tuple[str, str], list[Path]] = {}
        for p in self.leftovers():
            if include_work or p.name.startswith(".tmp-"):
                plan.setdefault((p.parent.name, _leftover_id(p.name)), []).append(p)
        for a in self.all():
            if self.problems(a):
                plan.setdefault((a.stage, a.id), []).append(a.path)
        for stage in STAGES:
            d = self.root / stage
            if d.is_dir():
                for p in sorted(d.glob(".lock-*")):
                    plan.setdefault((stage, p.name[len(".lock-"):]), [])
        removed = []
        for (stage, id), paths in sorted(plan.items()):
            lp = self.lock_path(stage, id)
            mine = lock.held_here(lp)  # this process's own cache miss (not yet building) holds it: go ahead
            stale_lock = lp.exists() and not mine
            if mine:
                busy = os.path.abspath(lp) in _BUILDING
            elif dry_run:
                busy = lock.is_held(lp)
            else:
                busy = not lock.acquire(lp, wait=False)
            if busy:
                if kept is not None:
                    kept += [(p, lock.holder(lp)) for p in paths]
                continue
            if not dry_run:
                try:
                    for p in paths:
                        shutil.rmtree(p, ignore_errors=True)
                finally:
                    if not mine:
                        lock.release(lp)  # and its file
            removed += paths + ([lp] if stale_lock else [])
        return removed


def _identity(path: Path) -> tuple | None:
    """What tells one directory under a name from the next one renamed into its place."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _leftover_id(name: str) -> str:
    """The id in `.tmp-<id>-<pid>` or `.work-<id>`."""
    return name.split("-")[1]
