"""Putting a finished folder in place: a release (`export`, `pull`) is built in a temporary sibling and swapped in.

`staging_dir(out)` makes the sibling `.<out>.tmp-<pid>-*`; `move_into_place(tmp, out)` renames it to `out`, moving
an old folder there aside first (`.<out>.old-<pid>-*`) and deleting it only once the new one is in place (restored
if the rename fails). A process killed between the two renames (even by `kill -9`) leaves no `out` and the old
folder aside: `recover(out)`, which every staging runs first, puts the old folder back, and removes what killed
runs left. So after any kill either the old or the new folder is at `out`, or the next run restores the old one.
`check_out_dir` refuses an `--out` that a release may not go to, before any work. `out_lock(out)` holds the lock
`.<out>.lock` beside it (ridgefill/artifacts/lock.py) while a writer checks what `out` holds and swaps its folder in,
so that of two processes writing one new `--out` at once the second finds the first's release there (and refuses a
different one without --force) instead of replacing it unseen.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from ridgefill.artifacts import lock
from ridgefill.artifacts.lock import pid_alive
from ridgefill.errors import BadInput
from ridgefill.formats.release.names import MANIFEST

KINDS = ("tmp", "old", "pull")  # a staging folder, an old folder moved aside, a pull's download folder


def check_out_dir(out_dir: Path, marker: str = MANIFEST, what: str = "a release folder") -> None:
    """Refuse an --out that a release (or another folder this module puts in place, told by its `marker` file) may
    not go to: a file, or a non-empty folder without the marker (even --force only ever replaces such a folder, so
    a mistyped --out never deletes other files)."""
    recover(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / marker).is_file():
        raise BadInput(f"--out {out_dir} exists, is not empty and is not {what}")


@contextmanager
def out_lock(out_dir: Path, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold `.<name>.lock` beside out_dir (waiting, after one `on_wait` line, while another process holds it): one
    writer at a time looks at out_dir and puts its folder there. The lock file goes when it is let go; a process
    killed holding it leaves a file the next writer takes over (the kernel drops the lock itself)."""
    path = out_dir.parent / f".{out_dir.name}.lock"
    told = None if on_wait is None else lambda info: on_wait(
        f"--out {out_dir} is being written by {lock.describe(info)}; waiting for it to finish")
    lock.acquire(path, wait=True, on_wait=told)
    try:
        yield
    finally:
        lock.release(path)


def sibling(out_dir: Path, kind: str) -> Path:
    """A new empty sibling folder of out_dir, `.<name>.<kind>-<pid>-*`, with a plain folder's mode."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.{kind}-{os.getpid()}-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a release folder should look like any other
    return path


def staging_dir(out_dir: Path) -> Path:
    """A new empty sibling folder of out_dir to fill and then `move_into_place` (after `recover`)."""
    recover(out_dir)
    return sibling(out_dir, "tmp")


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder tmp to out_dir, swapping out an old one (restored if the rename fails)."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    old = sibling(out_dir, "old")
    old.rmdir()
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def recover(out_dir: Path) -> None:
    """Undo what a process killed mid-swap left beside out_dir: with no out_dir, its old folder goes back there
    (the newest, if there are several); every other `.<name>.(tmp|old|pull)-<pid>-*` of a process that no longer
    runs is removed, and `.<name>.lock` when no process holds it. Another live process's folders are left alone."""
    parent = out_dir.parent
    if not parent.is_dir():
        return
    pattern = re.compile(rf"^\.{re.escape(out_dir.name)}\.({'|'.join(KINDS)})-(\d+)-")
    dead = []
    for p in parent.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not p.is_symlink() and (int(m[2]) == os.getpid() or not pid_alive(int(m[2]))):
            dead.append((m[1], p))
    olds = sorted((p for kind, p in dead if kind == "old"), key=lambda p: p.stat().st_mtime)
    if olds and not out_dir.exists() and not out_dir.is_symlink():
        os.rename(olds.pop(), out_dir)
    for kind, p in dead:
        if p.exists() and p != out_dir:
            shutil.rmtree(p, ignore_errors=True)
    held = parent / f".{out_dir.name}.lock"  # `out_lock`'s file, left by a writer that was killed holding it
    if held.is_file() and not held.is_symlink() and not lock.is_held(held):
        held.unlink(missing_ok=True)  # safe: a process that opened it meanwhile sees it gone and takes a new one


def same_files(a: Path, b: Path, names: list[str]) -> bool:
    """Whether folder `a` holds exactly the files `names`, each with the same bytes as in `b`."""
    return sorted(p.name for p in a.iterdir()) == sorted(names) and all(
        (a / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes() for n in names)
