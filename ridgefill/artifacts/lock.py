"""One build at a time per artifact: an exclusive `flock` on `<root>/<stage>/.lock-<id>`.

The process building an artifact holds the lock from its cache miss until the artifact is in place (or the build
failed); a second process asking for the same artifact waits for it and then finds a cache hit. The lock file
holds the holder's pid, host and start time (JSON), for the waiting message. The kernel drops the lock of a
process that dies, even by `kill -9`, so a lock is never stale: a `.lock-*` file that can be locked is a
leftover, and whoever locks it may remove it. Whoever holds a lock unlinks its file before letting go, and
whoever takes one checks that the file it locked is still the one under that name (else it tries again), so
removing a lock file never lets two processes in.

Within one process a lock is held once, by path (`_HELD`), so the stage that took it on a cache miss can take
it again to build without waiting for itself. A stage that fails after its cache miss (bad input found late)
keeps its lock until the command ends (`ridgefill.cli.main` calls `release_all`) or the process exits (atexit);
letting go removes the lock file, and the folders that taking the lock created if they are still empty, so that
a refused command leaves nothing behind. Where `fcntl`
does not exist (not POSIX) nothing is locked.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path
from typing import Callable

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system: builds are not serialised
    fcntl = None

_HELD: dict[str, int] = {}  # absolute lock path -> the open descriptor this process holds it through
_CREATED: dict[str, list[str]] = {}  # absolute lock path -> folders that taking it created (deepest first)


def _key(path: Path) -> str:
    return os.path.abspath(path)


def held_here(path: Path) -> bool:
    """Whether this process holds the lock."""
    return _key(path) in _HELD


def holder(path: Path) -> dict:
    """What the lock file says about its holder ({} when it says nothing readable)."""
    try:
        doc = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def describe(info: dict) -> str:
    """`pid 1234 on host (since 2025-01-02 10:11:12)`, from what `holder` returned."""
    if not info.get("pid"):
        return "another process"
    since = info.get("started")
    when = ""
    if isinstance(since, (int, float)):
        when = f" (since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))})"
    return f"pid {info['pid']} on {info.get('host', '?')}{when}"


def acquire(path: Path, wait: bool = True, on_wait: Callable[[dict], None] | None = None) -> bool:
    """Take the lock (creating its file). Without `wait`, False when another process holds it; with `wait`,
    `on_wait(holder)` is called once before blocking. Already held by this process: True at once."""
    key = _key(path)
    if key in _HELD:
        return True
    created = _make_parents(key)
    if fcntl is None:  # pragma: no cover
        _HELD[key], _CREATED[key] = -1, created
        return True
    told = False
    while True:
        try:
            fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # its folder, empty, was just removed by a process letting go of its lock
            created += _make_parents(key)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    os.close(fd)
                    return False
                if not told and on_wait is not None:
                    info = holder(Path(key))
                    for _ in range(50):  # the holder writes who it is just after it takes the lock
                        if info.get("pid"):
                            break
                        time.sleep(0.01)
                        info = holder(Path(key))
                    on_wait(info)
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:  # the file may have been unlinked (by its last holder, or gc) while we waited for it
                same = os.path.samestat(os.fstat(fd), os.stat(key))
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            os.write(fd, (json.dumps(me) + "\n").encode())
        except BaseException:
            os.close(fd)
            raise
        _HELD[key], _CREATED[key] = fd, created
        return True


def _make_parents(key: str) -> list[str]:
    """Create the lock file's folder; the folders created, deepest first."""
    missing, d = [], os.path.dirname(key)
    while not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    os.makedirs(os.path.dirname(key), exist_ok=True)
    return missing


def release(path: Path) -> None:
    """Let go of the lock if this process holds it; its file goes first."""
    key = _key(path)
    fd = _HELD.pop(key, None)
    if fd is None:
        return
    try:
        os.unlink(key)
    except FileNotFoundError:
        pass
    if fd >= 0:
        os.close(fd)  # closing the descriptor drops the flock
    for d in _CREATED.pop(key, []):  # deepest first; stops at the first one something else now lives in
        try:
            os.rmdir(d)
        except OSError:
            break


@atexit.register
def release_all() -> None:
    """Let go of every lock this process holds (at exit; the kernel would drop the locks, not the files)."""
    for key in list(_HELD):
        release(Path(key))


def is_held(path: Path) -> bool:
    """Whether some live process (this one included) holds the lock; creates and removes nothing."""
    if held_here(path):
        return True
    if fcntl is None:  # pragma: no cover
        return False
    try:
        fd = os.open(_key(path), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (for leftovers named by their maker's pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
