"""`ridgefill quantize MAPS`."""

from __future__ import annotations

from typing import Annotated

import typer

from ridgefill.cli.common import done, output, placed, store


@placed
def quantize(
    maps: Annotated[str, typer.Argument(help="Solve artifact id (or unique prefix).")],
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
) -> None:
    """Quantize maps to int8 (one bf16 scale per 128 weights of a row) and re-score them held out."""
    import json as jsonlib

    from rich.table import Table

    from ridgefill.quantize import quantize as run
    from ridgefill.quantize.artifact import REPORT

    out = output()
    art, cached = run(store(), maps, out, place=place)
    report = jsonlib.loads(art.file(REPORT).read_text())
    t = Table(title="int8 error / max|w|")
    t.add_column("layer", justify="right")
    t.add_column("error", justify="right")
    for layer, err in sorted(report["max_rel_error"].items(), key=lambda kv: int(kv[0])):
        t.add_row(layer, f"{err:.5f}")
    out.table(t)
    s = art.manifest["summary"]
    out.info(f"largest error / max|w|: {s['max_rel_error_worst']:.5f}; held-out score float "
             f"{s['score_float']:.5f} -> int8 {s['score_int8']:.5f}")
    done(out, "quantize", art, cached)
