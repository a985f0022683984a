"""`ridgefill sweep MODEL [--splits 8-24]`: which split to ship, measured."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ridgefill.cli.common import ModelArg, done, output, placed, store
from ridgefill.runtime.rows import DEFAULT_TAIL


@placed
def sweep(
    model: ModelArg,
    splits: Annotated[Optional[str], typer.Option("--splits", help="Splits to measure: 8-24, 8-24:2, 8,12,16 (default: 8 evenly spaced over the middle half of the layers).")] = None,
    data: Annotated[Optional[list[str]], typer.Option("--data", help="Calibration text for the capture (as in `capture`; default builtin:default). Repeatable.")] = None,
    capture_ref: Annotated[Optional[str], typer.Option("--capture", help="Reuse this capture artifact (it must have every split).")] = None,
    length: Annotated[int, typer.Option("--length", help="Prompt length in tokens (needles, documents, speed).")] = 4096,
    tail: Annotated[int, typer.Option("--tail", help="Exact tail in tokens.")] = DEFAULT_TAIL,
    samples: Annotated[int, typer.Option("--samples", help="Single-needle prompts at most, half in noise filler, half in prose, drawn in the same order at every split (the sequential rule may stop sooner).")] = 40,
    documents: Annotated[int, typer.Option("--documents", help="Long documents for the ΔNLL figures.")] = 4,
    scored: Annotated[int, typer.Option("--scored", help="Scored stretch: the last tokens of each document.")] = 256,
    max_needle_drop: Annotated[float, typer.Option("--max-needle-drop", help="Budget: needle accuracy points below exact.")] = 10.0,
    max_key_dnll: Annotated[float, typer.Option("--max-key-dnll", help="Budget: key-token ΔNLL in nats.")] = 0.5,
    quantize: Annotated[bool, typer.Option("--quantize/--float", help="Measure the int8 maps a release ships, or the float maps.")] = True,
    alpha_per_layer: Annotated[bool, typer.Option("--alpha-per-layer", help="Solve each layer at its own best alpha.")] = False,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="Measure every split and arm on every needle prompt (no bisection, no early stop); for checking the adaptive search.")] = False,
    configurations: Annotated[bool, typer.Option("--configurations/--no-configurations", help="Also measure +rows, +kscale and +protected, each beside its equal-cost control, at the splits just shallower than the maps' edge.")] = True,
    repeats: Annotated[int, typer.Option("--repeats", help="Timing rounds (at least 3): the measured speed-up is their median, with [min, max].")] = 3,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
) -> None:
    """Measure splits and quality configurations (needles, key-token ΔNLL, speed-up) and recommend the (split,
    configuration) with the highest compute ceiling within budget."""
    from ridgefill.sweep import SweepConfig
    from ridgefill.sweep import sweep as run
    from ridgefill.sweep.artifact import PLOT, load_result
    from ridgefill.sweep.report import table

    out = output()
    cfg = SweepConfig(splits=splits if splits is not None else (), length=length, tail=tail,
                      samples=samples, documents=documents, scored=scored, max_needle_drop=max_needle_drop,
                      max_key_dnll=max_key_dnll, quantize=quantize, alpha_per_layer=alpha_per_layer, seed=seed,
                      exhaustive=exhaustive, configurations=configurations, repeats=repeats)
    art, cached = run(store(), model, cfg, out, data=data, capture_ref=capture_ref, place=place)
    result = load_result(art)
    out.table(table(result))
    out.info(f"what the maps earn: {result['advantage']['line']}")
    cost = result["cost"]
    back = cost.get("early_layers_read_back")  # (a sweep made before early layers were kept lacks the count)
    out.info(f"needle prompts measured: {sum(cost['needle_prompts'].values())} over {len(cost['needle_prompts'])} "
             f"(split, arm) pairs; {cost['exact_forwards']} exact forwards"
             + (f", {back} early layers read back" if back else ""))
    out.info(f"[bold]recommended:[/bold] {result['recommended']['reason']}")
    out.info(f"plot: {art.path / PLOT}")
    done(out, "sweep", art, cached)
