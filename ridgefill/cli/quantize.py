"""`ridgefill quantize MAPS`."""

from __future__ import annotations

from typing import Annotated

import typer

from ridgefill.cli.common import DEFAULT_STORE, DebugOpt, JsonOpt, StoreOpt, done, output, store


def quantize(
    maps: Annotated[str, typer.Argument(help="Solve artifact id (or unique prefix).")],
    store_root: StoreOpt = DEFAULT_STORE,
    json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Quantize maps to int8 (one bf16 scale per 128 weights of a row) and re-score them held out."""
    from ridgefill.export.quantize import quantize as run

    out = output(json)
    art, cached = run(store(store_root), maps, out)
    s = art.manifest["summary"]
    out.info(f"largest error / max|w|: {s['max_rel_error_worst']:.5f}; held-out score float "
             f"{s['score_float']:.5f} -> int8 {s['score_int8']:.5f}")
    done(out, "quantize", art, cached)
