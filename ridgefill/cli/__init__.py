"""The `ridgefill` command line: one module per command, registered here; `main()` maps errors to
one line and an exit code (0 ok, 1 failure, 2 bad input, 3 gate failed)."""

from __future__ import annotations

import os
import sys

import typer

from ridgefill.cli import artifacts, capture, eval, export, fold, quantize, release, solve
from ridgefill.cli import hub

app = typer.Typer(
    name="ridgefill",
    help="Make, check and publish RidgeFill map releases: capture -> solve -> quantize -> export -> verify -> eval; compact -> fold.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("capture")(capture.capture)
app.command("solve")(solve.solve)
app.command("quantize")(quantize.quantize)
app.command("export")(export.export)
app.command("verify")(export.verify)
app.command("push")(hub.push)
app.command("pull")(hub.pull)
app.command("eval")(eval.eval_)
app.command("release")(release.release)
app.command("compact")(fold.compact)
app.command("fold")(fold.fold)
app.add_typer(artifacts.app, name="artifacts")


def main() -> None:
    from ridgefill.errors import RidgefillError

    debug = "--debug" in sys.argv[1:] or bool(os.environ.get("RIDGEFILL_DEBUG"))
    try:
        code = app(standalone_mode=False)
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
    sys.exit(code if isinstance(code, int) else 0)
