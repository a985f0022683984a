"""Putting a finished folder in place: a release (`export`, `pull`) is built in a temporary sibling and swapped in.

`staging_dir(out)` makes the sibling; `move_into_place(tmp, out)` renames it to `out`, moving an old folder there
aside first and deleting it only once the new one is in place (restored if the rename fails). `check_out_dir`
refuses an `--out` that a release may not go to, before any work.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ridgefill.errors import BadInput
from ridgefill.formats.release.names import MANIFEST


def check_out_dir(out_dir: Path) -> None:
    """Refuse an --out that a release may not go to: a file, or a non-empty folder that is not a release (even
    --force only ever replaces a release folder, so a mistyped --out never deletes other files)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise BadInput(f"--out {out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST).is_file():
        raise BadInput(f"--out {out_dir} exists, is not empty and is not a release folder")


def staging_dir(out_dir: Path) -> Path:
    """A new empty sibling folder of out_dir to fill and then `move_into_place`, with a plain folder's mode."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes 0700; a release folder should look like any other
    return tmp


def move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished folder tmp to out_dir, swapping out an old one (restored if the rename fails)."""
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        os.rename(tmp, out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    shutil.rmtree(old, ignore_errors=True)


def same_files(a: Path, b: Path, names: list[str]) -> bool:
    """Whether folder `a` holds exactly the files `names`, each with the same bytes as in `b`."""
    return sorted(p.name for p in a.iterdir()) == sorted(names) and all(
        (a / n).is_file() and (a / n).read_bytes() == (b / n).read_bytes() for n in names)
