"""`ridgefill export ARTIFACT --out DIR` (or `--format gguf --out FILE.gguf`) and `ridgefill verify DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import done, output, store
from ridgefill.export.config import ExportConfig

FORMATS = ("release", "gguf")
D = ExportConfig()


def export(
    artifact: Annotated[str, typer.Argument(
        help="Quantize or solve artifact id (or unique prefix); with --format gguf also a release folder.")],
    out_dir: Annotated[Optional[Path], typer.Option(
        "--out", help="Release folder to write; with --format gguf, the .gguf file to write.")] = None,
    fmt: Annotated[str, typer.Option(
        "--format", help="release (folder: manifest, maps, model card) or gguf (one file: Q8_0 maps, manifest "
        "facts as metadata).")] = "release",
    tail: Annotated[int, typer.Option("--tail", help="Default exact tail recorded in the manifest.")] = D.tail,
    force: Annotated[bool, typer.Option("--force", help="Replace a different release or GGUF file in --out.")] = False,
    model: Annotated[Optional[str], typer.Option(
        "--model", help="The captured model, where it now is (default: where it was captured; must match it).")] = None,
    configuration: Annotated[Optional[str], typer.Option(
        "--configuration", help="How the release is applied, recorded in its manifest: ridgefill (the plain fill, "
        "the default), ridgefill+rows (the most-attended prompt rows run exactly), ridgefill+kscale (a per-request "
        "key rescale), ridgefill+protected (prompt rows whose token is in the protected-token table run "
        "exactly).")] = D.configuration,
    row_share: Annotated[Optional[float], typer.Option(
        "--row-share", help="With --configuration ridgefill+rows: the share of the prompt's rows run exactly "
        "(default 0.1).")] = D.row_share,
    sweep: Annotated[Optional[str], typer.Option(
        "--sweep", help="The sweep artifact that recommended the split and configuration, recorded with "
        "it.")] = D.sweep,
) -> None:
    """Write a release folder (ridgefill.json, maps.safetensors, model card) or, with --format gguf, one .gguf file."""
    from ridgefill.errors import BadInput

    if fmt not in FORMATS:
        raise BadInput(f"--format {fmt!r} is not one of: {', '.join(FORMATS)}")
    out = output()
    cfg = ExportConfig(tail=tail, configuration=configuration, row_share=row_share, sweep=sweep)
    if fmt == "gguf":
        from ridgefill.export import export_gguf

        art, cached, copied = export_gguf(store(), artifact, cfg, out, out_path=out_dir, force=force, model=model)
    else:
        from ridgefill.export import export as run

        art, cached, copied = run(store(), artifact, cfg, out, out_dir=out_dir, force=force, model=model)
    if copied is not None:
        out.info(f"{'GGUF file' if fmt == 'gguf' else 'release folder'}: {copied}")
    done(out, "export", art, cached, {"out": str(copied) if copied else None, "format": fmt})


def verify(
    release: Annotated[str, typer.Argument(help="Release folder, or a Hub release hf://owner/name\\[@rev].")],
) -> None:
    """Check every file of a release folder against its manifest, and the manifest against the facts
    maps.safetensors records (exit 2 naming the bad file or field). A Hub release is pulled into the release cache
    first (or found there), and its cached copy checked."""
    from ridgefill.formats.release import MAPS_FILE, verify_release
    from ridgefill.hub.releases import locate_release

    out = output()
    folder = locate_release(release)
    manifest = verify_release(folder)
    files = sorted(manifest["files"])
    out.info(f"[green]ok[/green] {folder}: {len(files)} file(s) match ridgefill.json ({', '.join(files)}), and its "
             f"facts match those {MAPS_FILE} records")
    out.result({"ok": True, "folder": str(folder), "files": manifest["files"]}, primary=None)
