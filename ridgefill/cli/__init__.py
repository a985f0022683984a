"""The `ridgefill` command line: one module per command, registered here; `main()` maps errors to
one line and an exit code (0 ok, 1 failure, 2 bad input, 3 gate failed).

Here too: `ridgefill --version`, shell completion (`--install-completion`, `--show-completion`), and the options
of every command (`--store`, `--json`, `--debug`, `-q/--quiet`), which `RidgefillGroup` adds to each one (declared
once, in common.py).
"""

from __future__ import annotations

import copy
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from ridgefill import environment
from ridgefill.cli import (
    artifacts,
    capture,
    engine,
    eval,
    export,
    fold,
    hub,
    quantize,
    release,
    solve,
    sweep,
)
from ridgefill.cli.common import shared_options

PROG = "ridgefill"


def _add_shared(group, shared) -> None:
    for command in group.commands.values():
        if hasattr(command, "commands"):
            _add_shared(command, shared)
        else:
            have = {opt for p in command.params for opt in getattr(p, "opts", ())}
            command.params += [copy.copy(o) for o in shared if not set(o.opts) & have]


class RidgefillGroup(TyperGroup):
    """The root group: every command (also `artifacts ls` and the like) gets the shared options."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _add_shared(self, _SHARED)


_SHARED = shared_options()

app = typer.Typer(
    name=PROG,
    help="Make, check and publish RidgeFill map releases: capture -> solve -> quantize -> export -> verify -> eval; compact -> fold.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    cls=RidgefillGroup,
)


def _version(value: bool) -> None:
    if value:
        from ridgefill import __version__

        print(f"{PROG} {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print the version and exit.")] = False,
) -> None:
    pass


COMMANDS = {  # in pipeline order, as `ridgefill --help` lists them
    "capture": capture.capture, "solve": solve.solve, "quantize": quantize.quantize, "export": export.export,
    "verify": export.verify, "push": hub.push, "pull": hub.pull, "eval": eval.eval_, "sweep": sweep.sweep,
    "release": release.release, "compact": fold.compact, "fold": fold.fold,
}
for _name, _command in COMMANDS.items():
    app.command(_name)(_command)
app.add_typer(artifacts.app, name="artifacts")
app.add_typer(engine.app, name="engine")


def main() -> None:
    from ridgefill.cli import common
    from ridgefill.errors import RidgefillError
    from ridgefill.memory import keep_freed_memory

    keep_freed_memory()  # this process runs models: freed activations are reused, not faulted in again
    common.reset()
    try:
        code = app(standalone_mode=False, prog_name=PROG)
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        code = 130
    except KeyboardInterrupt:
        print("Interrupted.", file=sys.stderr)
        code = 130
    except RidgefillError as e:
        if _debug():
            raise
        print(f"Error: {e}", file=sys.stderr)
        code = e.exit_code
    except Exception as e:
        if _debug():
            raise
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # click's usage errors (typer vendors click)
            e.show()
            code = e.exit_code
        else:  # a bug or an environment problem: one line, the traceback on request
            print(f"Error: {type(e).__name__}: {e} (run with --debug for the traceback)", file=sys.stderr)
            code = 1
    finally:  # the command is over: a stage that failed after its cache miss stops holding that artifact's lock
        from ridgefill.artifacts.lock import release_all

        release_all()
    sys.exit(code if isinstance(code, int) else 0)


def _debug() -> bool:
    """--debug (or RIDGEFILL_DEBUG): show the traceback of an error instead of its one line."""
    from ridgefill.cli import common

    return common.SESSION.debug or bool(environment.get(environment.RIDGEFILL_DEBUG))
