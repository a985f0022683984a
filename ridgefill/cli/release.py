"""`ridgefill release RECIPE.toml [--push]`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import output, store, warn_token_flag


def release(
    recipe: Annotated[Path, typer.Argument(help="Recipe file (TOML): model, out, and one table per stage.")],
    push: Annotated[bool, typer.Option("--push", help="Push the release to the recipe's [push] repo after the gate passes.")] = False,
    token: Annotated[Optional[str], typer.Option("--token", help="Hub token (default: HF_TOKEN or the saved login).")] = None,
) -> None:
    """Run the whole chain from a recipe: capture -> solve -> quantize -> export -> eval (gate) -> push."""
    from ridgefill.errors import GateFailed
    from ridgefill.recipe import load_recipe, run_recipe

    out = output()
    warn_token_flag(out, token)
    summary = run_recipe(load_recipe(recipe), store(), out, push=push, token=token)
    cached = [k for k, v in summary["stages"].items() if v.get("cached")]
    out.info(f"release {summary['release']} in {summary['seconds']:.1f} s (cached: {', '.join(cached) or 'none'})")
    out.result(summary, primary=summary["release"])
    gate = summary.get("gate")
    if gate and not gate["passed"]:
        raise GateFailed("gate failed: " + "; ".join(gate["failed"]))
