"""`ridgefill export ARTIFACT --out DIR` and `ridgefill verify DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import DEFAULT_STORE, DebugOpt, JsonOpt, StoreOpt, done, output, store


def export(
    artifact: Annotated[str, typer.Argument(help="Quantize or solve artifact id (or unique prefix).")],
    out_dir: Annotated[Optional[Path], typer.Option("--out", help="Release folder to write.")] = None,
    tail: Annotated[int, typer.Option("--tail", help="Default exact tail recorded in the manifest.")] = 512,
    force: Annotated[bool, typer.Option("--force", help="Replace a different release in --out.")] = False,
    store_root: StoreOpt = DEFAULT_STORE,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Write a release folder: ridgefill.json, maps.safetensors and a model card."""
    from ridgefill.export.build import export as run

    out = output(json)
    art, cached, copied = run(store(store_root), artifact, out_dir, out, tail=tail, force=force)
    if copied is not None:
        out.info(f"release folder: {copied}")
    done(out, "export", art, cached, {"out": str(copied) if copied else None})


def verify(
    folder: Annotated[Path, typer.Argument(help="Release folder.")],
    store_root: StoreOpt = DEFAULT_STORE,  # accepted like every command's; verify reads only the folder
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Check every file of a release folder against its manifest (exit 2 naming the bad file)."""
    from ridgefill.export.release import verify_release

    out = output(json)
    manifest = verify_release(folder)
    files = sorted(manifest["files"])
    out.info(f"[green]ok[/green] {folder}: {len(files)} file(s) match ridgefill.json ({', '.join(files)})")
    out.result({"ok": True, "folder": str(folder), "files": manifest["files"]}, primary=None)
