"""The `ridgefill` command line: one module per command, registered here; `main()` maps errors to
one line and an exit code (0 ok, 1 failure, 2 bad input, 3 gate failed).

Here too: `ridgefill --version`, shell completion (`--install-completion`, `--show-completion`), and `-q/--quiet`,
which `RidgefillGroup` adds to every command (declared once, as `common.QuietOpt`).
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Annotated

import typer
from typer.core import TyperGroup

from ridgefill.cli import artifacts, capture, eval, export, fold, quantize, release, solve, sweep
from ridgefill.cli import hub
from ridgefill.cli.common import QuietOpt

PROG = "ridgefill"


def _quiet_option():
    """The click option typer makes from `QuietOpt` (so it is parsed, completed and shown like any other)."""
    probe = typer.Typer(add_completion=False)

    @probe.command()
    def _probe(quiet: QuietOpt = False) -> None:  # pragma: no cover - never run
        pass

    return typer.main.get_command(probe).params[0]


def _add_quiet(group) -> None:
    for command in group.commands.values():
        if hasattr(command, "commands"):
            _add_quiet(command)
        elif not any("--quiet" in getattr(p, "opts", ()) for p in command.params):
            command.params.append(copy.copy(_QUIET))


class RidgefillGroup(TyperGroup):
    """The root group: every command (also `artifacts ls` and the like) gets -q/--quiet."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _add_quiet(self)


_QUIET = _quiet_option()

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


app.command("capture")(capture.capture)
app.command("solve")(solve.solve)
app.command("quantize")(quantize.quantize)
app.command("export")(export.export)
app.command("verify")(export.verify)
app.command("push")(hub.push)
app.command("pull")(hub.pull)
app.command("eval")(eval.eval_)
app.command("sweep")(sweep.sweep)
app.command("release")(release.release)
app.command("compact")(fold.compact)
app.command("fold")(fold.fold)
app.add_typer(artifacts.app, name="artifacts")


def main() -> None:
    from ridgefill.errors import RidgefillError

    from ridgefill.output import set_quiet

    debug = "--debug" in sys.argv[1:] or bool(os.environ.get("RIDGEFILL_DEBUG"))
    set_quiet(False)
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
        if debug:
            raise
        print(f"Error: {e}", file=sys.stderr)
        code = e.exit_code
    except Exception as e:
        if debug:
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
