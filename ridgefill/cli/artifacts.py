"""`ridgefill artifacts ls | show ID | verify [ID] | gc`."""

from __future__ import annotations

import json as jsonlib
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import output, store

app = typer.Typer(help="Inspect and clean the artifact store.", no_args_is_help=True)


def figure(v) -> str:
    """A summary value for people: floats to 4 significant digits (`--json` keeps them exact)."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


@app.command("ls")
def ls() -> None:
    """List artifacts (figures rounded; --json: exact)."""
    from rich.table import Table

    out = output()
    st = store()
    arts = st.all()
    t = Table()
    for c in ("stage", "id", "from", "summary"):
        t.add_column(c)
    for a in arts:
        up = ", ".join(f"{k} {v}" for k, v in a.recipe.items() if k in ("capture", "solve", "source"))
        s = a.manifest.get("summary", {})
        s = s if isinstance(s, dict) else {}
        brief = ", ".join(f"{k} {figure(v)}" for k, v in s.items() if isinstance(v, (int, float, str)))[:80]
        bad = st.manifest_problems(a)
        t.add_row(a.stage, a.id, up, f"[red]damaged[/red]: {bad[0]}" if bad else brief)
    out.table(t)
    out.result({"artifacts": [{"stage": a.stage, "id": a.id, "path": str(a.path), "damaged": st.manifest_problems(a),
                               "summary": a.manifest.get("summary", {})} for a in arts]})


@app.command("show")
def show(artifact: str) -> None:
    """Print an artifact's manifest."""
    out = output()
    st = store()
    art = st.get(artifact, check=False)  # a damaged manifest is still shown, after a warning
    for p in st.manifest_problems(art):
        out.warn(f"artifact {art.stage}/{art.id} is damaged: {p}")
    if out.json_mode:
        out.result(art.manifest)
    else:
        print(jsonlib.dumps(art.manifest, indent=2, sort_keys=True))


@app.command("verify")
def verify(
    artifact: Annotated[Optional[str], typer.Argument(help="Artifact id; all artifacts when omitted.")] = None,
) -> None:
    """Check each artifact's manifest (its recipe must hash to its id) and files (their sha256); exit 1 if any is
    damaged."""
    from ridgefill.errors import RidgefillError

    out = output()
    st = store()
    arts = [st.get(artifact, check=False)] if artifact else st.all()
    bad = {f"{a.stage}/{a.id}": st.problems(a) for a in arts}
    bad = {k: v for k, v in bad.items() if v}
    for a in arts:
        key = f"{a.stage}/{a.id}"
        out.info(f"{'[red]damaged[/red]' if key in bad else '[green]ok[/green]'} {key}" + (f": {'; '.join(bad[key])}" if key in bad else ""))
    out.result({"checked": len(arts), "damaged": bad})
    if bad:
        raise RidgefillError(f"{len(bad)} damaged artifact(s): {', '.join(bad)}")


@app.command("gc")
def gc(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
    work: Annotated[bool, typer.Option("--work", help="Also remove resumable work of unfinished runs.")] = False,
) -> None:
    """Remove what killed runs left (.tmp-*, stale .lock-*), damaged artifacts and (with --work) unfinished
    work; never what a running build holds."""
    from ridgefill.artifacts import lock

    out = output()
    kept: list = []
    removed = store().gc(dry_run=dry_run, include_work=work, kept=kept)
    for p in removed:
        out.info(f"{'would remove' if dry_run else 'removed'} {p}")
    for p, holder in kept:
        out.info(f"kept {p}: {lock.describe(holder)} is building it")
    out.result({"removed": [str(p) for p in removed], "dry_run": dry_run,
                "kept": [{"path": str(p), "holder": h} for p, h in kept]})
