"""`ridgefill sweep MODEL [--splits 8-24]`: which split to ship, measured. The defaults are SweepConfig's."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import ModelArg, done, offsets, output, placed, store
from ridgefill.solve.config import SolveConfig, check_config as check_solve
from ridgefill.sweep.config import DEFAULT_SPLITS, FLAGS, LONG_LENGTH, SweepConfig, renamed

D = SweepConfig()


@placed
def sweep(
    ctx: typer.Context,
    model: ModelArg,
    splits: Annotated[Optional[str], typer.Option("--splits", help=f"Splits to measure: 8-24, 8-24:2, 8,12,16 (default: {DEFAULT_SPLITS} evenly spaced over the middle half of the layers).")] = None,
    data: Annotated[Optional[list[str]], typer.Option("--data", help="Calibration text for the capture (as in `capture`; default builtin:default). Repeatable.")] = None,
    capture_ref: Annotated[Optional[str], typer.Option("--capture", help="Reuse this capture artifact (it must have every split).")] = None,
    length: Annotated[int, typer.Option("--length", help="Prompt length in tokens (needles, documents, speed).")] = D.length,
    long_length: Annotated[Optional[int], typer.Option("--long-length", help=f"Length of the long needle prompts, in every round of the mix beside --length ones; 0 for none (default: {LONG_LENGTH} where the model's context holds it).")] = D.long_length,
    tail: Annotated[int, typer.Option("--tail", help="Exact tail in tokens.")] = D.tail,
    needles: Annotated[int, typer.Option("--needles", help="Needle prompts in all, at most, rounded up to whole rounds of the mix (eval's single, multi-key and multi-value needles, through the chat template and as plain text, at each length): drawn in the same order at every split (the sequential rule may stop sooner).")] = D.needles,
    samples: Annotated[Optional[int], typer.Option("--samples", hidden=True, help="Deprecated name of --needles.")] = None,
    documents: Annotated[int, typer.Option("--documents", help="Long documents for the ΔNLL figures.")] = D.documents,
    scored: Annotated[int, typer.Option("--scored", help="Scored stretch: the last tokens of each document.")] = D.scored,
    max_needle_drop: Annotated[float, typer.Option("--max-needle-drop", help="Budget: needle accuracy points below exact.")] = D.max_needle_drop,
    max_key_dnll: Annotated[float, typer.Option("--max-key-dnll", help="Budget: key-token ΔNLL in nats.")] = D.max_key_dnll,
    gate: Annotated[Optional[Path], typer.Option("--gate", help="A release gate file (as eval's): its thresholds join the budget, so that nothing recommended fails them on the sweep's own measurements.")] = None,
    quantize: Annotated[bool, typer.Option("--quantize/--float", help="Measure the int8 maps a release ships, or the float maps.")] = D.quantize,
    alpha_per_layer: Annotated[bool, typer.Option("--alpha-per-layer", help="Solve each layer at its own best alpha.")] = D.alpha_per_layer,
    maps: Annotated[str, typer.Option("--maps", help="What the maps measured predict: input, kv (keys and values; Gated DeltaNet layers keep input maps), or input,kv: a sweep of each on one capture and the same prompts, side by side, and the kind to ship.")] = SolveConfig().maps,
    earlier: Annotated[Optional[str], typer.Option("--earlier", help="Offsets k, like 2,7,13: the maps read the earlier states h_(S-k) besides h_S (the sweep's capture keeps them; with --capture, some of its --earlier), or none. Default: none captured, and every one a given --capture has.")] = None,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="Measure every split and arm on every needle prompt (no bisection, no early stop); for checking the adaptive search.")] = D.exhaustive,
    configurations: Annotated[bool, typer.Option("--configurations/--no-configurations", help="Also measure +rows, +kscale and +protected, each beside its equal-cost control, at the splits just shallower than the maps' edge.")] = D.configurations,
    repeats: Annotated[int, typer.Option("--repeats", help="Timing rounds (at least 3): the measured speed-up is their median, with \\[min, max].")] = D.repeats,
    seed: Annotated[int, typer.Option("--seed")] = D.seed,
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
) -> None:
    """Measure splits and quality configurations (needles, key-token ΔNLL, speed-up) and recommend the (split,
    configuration) with the highest compute ceiling within budget."""
    from ridgefill.evaluate.gate import load_gate
    from ridgefill.sweep import sweep as run
    from ridgefill.sweep.artifact import PLOT, load_result
    from ridgefill.sweep.kinds import parse_kinds
    from ridgefill.sweep.report import table

    out = output()
    kinds = parse_kinds(maps)
    states = offsets(earlier, "--earlier")
    check_solve(SolveConfig(earlier=states))  # before any work, as the capture's own check
    named = {"samples": samples} if samples is not None else {}  # the old name, with a warning
    if ctx.get_parameter_source("needles").name != "DEFAULT":  # typed too: both at once are refused
        named["needles"] = needles
    needles = renamed(named, FLAGS, out).get("needles", needles)
    thresholds = tuple(sorted(load_gate(gate)["thresholds"].items())) if gate is not None else ()
    cfg = SweepConfig(splits=splits if splits is not None else (), length=length, long_length=long_length, tail=tail,
                      needles=needles, gate=thresholds,
                      documents=documents, scored=scored, max_needle_drop=max_needle_drop, max_key_dnll=max_key_dnll,
                      quantize=quantize, alpha_per_layer=alpha_per_layer, seed=seed, exhaustive=exhaustive,
                      configurations=configurations, repeats=repeats)
    # the states the sweep's capture keeps, and those its solves read (None: every one the capture has)
    args = {"capture_args": {"earlier": states} if states else None,
            "solve_args": {} if states is None else {"earlier": states}}
    if len(kinds) > 1:
        return _kinds(out, model, cfg, kinds, data, capture_ref, place, args)
    art, cached = run(store(), model, cfg, out, data=data, capture_ref=capture_ref, place=place,
                      capture_args=args["capture_args"], solve_args={"maps": kinds[0], **args["solve_args"]})
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


def _kinds(out, model, cfg: SweepConfig, kinds, data, capture_ref, place, args: dict) -> None:
    """One sweep per map kind, the later ones on the first one's capture, then the kinds side by side
    (sweep/kinds.py). JSON: each kind's sweep and the comparison."""
    from ridgefill.sweep import sweep as run
    from ridgefill.sweep.artifact import load_result
    from ridgefill.sweep.kinds import compare, table

    st, arts, results = store(), {}, {}
    for k in kinds:
        out.info(f"[bold]sweep of {k} maps[/bold]")
        art, cached = run(st, model, cfg, out, data=data, capture_ref=capture_ref, place=place,
                          capture_args=args["capture_args"], solve_args={"maps": k, **args["solve_args"]})
        capture_ref = art.recipe["capture"]
        arts[k] = (art, cached)
        results[k] = load_result(art)
        out.info(f"sweep {art.id} ({'cached' if cached else 'written'}, {k} maps) -> {art.path}; recommended: "
                 f"{results[k]['recommended']['reason']}")
    both = compare(results, bootstrap=cfg.bootstrap, seed=cfg.seed)
    out.table(table(both))
    out.info(f"[bold]map kind to ship:[/bold] {both['choice']['reason']}")
    out.result({"stage": "sweep", "capture": capture_ref, "comparison": both,
                "sweeps": {k: {"id": a.id, "cached": c, "path": str(a.path), "summary": a.manifest.get("summary", {})}
                           for k, (a, c) in arts.items()}},
               primary=" ".join(a.id for a, _ in arts.values()))
