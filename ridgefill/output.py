"""One output object for every command.

People get rich tables and progress on stderr; `--json` puts exactly one JSON document on stdout. In human
mode stdout carries only the command's primary result (an artifact id or a path), so shell scripts can
write `ID=$(ridgefill capture ...)`.

`-q/--quiet` (every command) keeps stderr to warnings and errors: no info lines, tables or progress, and no
colours or live bars (the stderr console is then never treated as a terminal, so huggingface_hub's transfer bars
stay off too). The option sets a process-wide default through `set_quiet`; an `Output` made with an explicit
`quiet` ignores it.
"""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator


_QUIET = False  # what -q/--quiet asked for in this process (set_quiet)


def set_quiet(quiet: bool) -> None:
    """Make `Output()` quiet by default (the CLI's -q/--quiet; reset by every command that runs)."""
    global _QUIET
    _QUIET = bool(quiet)


def is_quiet() -> bool:
    return _QUIET


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool | None = None):
        from rich.console import Console

        self.json_mode = json_mode
        self.quiet = _QUIET if quiet is None else bool(quiet)
        # Quiet: plain text, never a terminal (no live bars anywhere, including huggingface_hub's).
        self.err = Console(stderr=True, highlight=False, force_terminal=False if self.quiet else None)

    def info(self, message: str) -> None:
        if not self.quiet:
            self.err.print(message, soft_wrap=True)

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]Warning:[/yellow] {message}", soft_wrap=True)  # one line, also in CI logs

    def table(self, table: Any) -> None:
        if not self.quiet:
            self.err.print(table)

    def result(self, data: dict, primary: str | None = None) -> None:
        """The command's result: JSON on stdout, or the primary value alone on stdout."""
        if self.json_mode:
            sys.stdout.write(json.dumps(data, sort_keys=True, default=str) + "\n")
        elif primary is not None:
            sys.stdout.write(f"{primary}\n")
        sys.stdout.flush()

    @contextmanager
    def progress(self, label: str, total: int, unit: str = "tok") -> Iterator["Progress"]:
        bar = Progress(self, label, total, unit)
        try:
            yield bar
        finally:
            bar.close()


LOG_EVERY = 15.0


class Progress:
    """A rich bar labelled by position: `doc 12/300 · 41.2k tok/s · ETA 3:10`."""

    def __init__(self, out: Output, label: str, total: int, unit: str):
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn

        self.unit = unit
        self.start = time.perf_counter()
        self.label = label
        self.out = out
        # Not a terminal (CI logs): no live bar, a plain status line every LOG_EVERY seconds instead.
        self.plain = not out.err.is_terminal and not out.quiet
        self.last_log = self.start
        self._bar = RichProgress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            console=out.err,
            transient=False,
            disable=out.quiet or self.plain,
        )
        self._task = self._bar.add_task(label, total=total, status="")
        self._bar.start()

    def update(self, completed: int, done_units: int | None, status: str = "") -> None:
        """`completed` counts towards the total; `done_units` (e.g. tokens) sets the rate (None: no rate)."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        total = self._bar.tasks[0].total or 0
        frac = completed / total if total else 1.0
        eta = elapsed * (1 - frac) / frac if frac > 0 else 0.0
        rate = "" if done_units is None else f" · {_human(done_units / elapsed)} {self.unit}/s"
        text = f"{status}{rate} · ETA {int(eta // 60)}:{int(eta % 60):02d}"
        self._bar.update(self._task, completed=completed, status=text)
        now = time.perf_counter()
        if self.plain and (now - self.last_log >= LOG_EVERY or completed == total):
            self.out.err.print(f"{self.label} {completed}/{total} {text}")
            self.last_log = now

    def close(self) -> None:
        self._bar.stop()


def _human(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"
