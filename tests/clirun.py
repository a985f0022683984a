"""Run the `ridgefill` entry point as a user or CI job would: in a subprocess (`cli`), or in this process
(`cli_here`, the same `main()` with its own argv, stdout and stderr) where start-up time would dominate."""

import contextlib
import io
import subprocess
import sys


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "ridgefill", *map(str, args)], capture_output=True, text=True, **kw)


def cli_here(*args) -> subprocess.CompletedProcess:
    """`ridgefill ARGS` through `ridgefill.cli.main` in this process; what it printed and its exit code."""
    from ridgefill.cli import main

    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["ridgefill", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(sys.argv, code, out.getvalue(), err.getvalue())
