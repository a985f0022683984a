"""Run the `ridgefill` entry point as a user or CI job would: in a subprocess (`cli`), or in this process
(`cli_here`, the same `main()` with its own argv, stdout and stderr) where start-up time would dominate."""

import contextlib
import io
import os
import subprocess
import sys


def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "ridgefill", *map(str, args)], capture_output=True, text=True, **kw)


def cli_here(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    """`ridgefill ARGS` through `ridgefill.cli.main` in this process (no interpreter start-up): exit code, stdout,
    stderr. `env` adds environment variables for the call."""
    from ridgefill.cli import main

    out, err, argv, saved = io.StringIO(), io.StringIO(), sys.argv, dict(os.environ)
    sys.argv = ["ridgefill", *map(str, args)]
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
