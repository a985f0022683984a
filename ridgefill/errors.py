"""Error classes that carry their process exit code.

0 ok, 1 failure, 2 bad input, 3 quality gate failed. `ridgefill.cli.main` prints `Error: <message>` on one
line and exits with `exit_code`; `--debug` shows the traceback instead.
"""


class RidgefillError(Exception):
    """A failure the user should read about in one line (exit 1)."""

    exit_code = 1


class BadInput(RidgefillError):
    """The user's input is wrong: a path, a parameter, a file. Nothing has been written (exit 2)."""

    exit_code = 2


class GateFailed(RidgefillError):
    """A release-gate threshold failed (exit 3)."""

    exit_code = 3
