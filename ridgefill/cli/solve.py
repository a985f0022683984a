"""`ridgefill solve CAPTURE`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ridgefill.cli.common import done, offsets, output, placed, store
from ridgefill.solve.config import SolveConfig

D = SolveConfig()


@placed
def solve(
    capture: Annotated[str, typer.Argument(help="Capture artifact id (or unique prefix).")],
    model: Annotated[Optional[str], typer.Option("--model", help="Model to score with (default: the captured one; must match it).")] = None,
    split: Annotated[Optional[int], typer.Option("--split", help="Which captured split to solve.")] = D.split,
    alpha: Annotated[Optional[list[float]], typer.Option("--alpha", help="Alpha grid (repeatable). Default 1e-5 ... 1.")] = None,
    metric: Annotated[str, typer.Option("--metric", help="Held-out selection metric: kv (K/V cosine) or input (input cosine).")] = D.metric,
    maps: Annotated[str, typer.Option("--maps", help="What the late attention layers' maps predict: input (the layer input) or kv (its keys and values: cheaper to apply; Gated DeltaNet layers keep input maps).")] = D.maps,
    chat_share: Annotated[Optional[float], typer.Option("--chat-share", help="Weight of chat-template rows when the capture has them.")] = D.chat_share,
    alpha_per_layer: Annotated[bool, typer.Option("--alpha-per-layer", help="Give every late layer the alpha best for its own held-out score (default: one alpha shared by all).")] = D.alpha_per_layer,
    state_data: Annotated[Optional[list[str]], typer.Option("--state-data", help="Hybrids: text kept apart from the capture's (file, directory or .jsonl; repeatable) on which to measure the terminal-state correction of the filled Gated DeltaNet layers.")] = None,
    state_chunk: Annotated[int, typer.Option("--state-chunk", help="Measure the states every this many tokens.")] = D.state_chunk,
    earlier: Annotated[Optional[str], typer.Option("--earlier", help="Offsets k, like 2,7,13, of the earlier states h_(S-k) the maps read besides h_S (some of the capture's --earlier), or none. Default: every one the capture has.")] = D.earlier,
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
) -> None:
    """Fit ridge maps for every late layer over the alpha grid; choose alpha on held-out rows."""
    from ridgefill.solve import solve as run
    from ridgefill.solve.artifact import load_report

    out = output()
    cfg = SolveConfig(split=split, alphas=tuple(alpha) if alpha else D.alphas, metric=metric, maps=maps,
                      chat_share=chat_share, alpha_per_layer=alpha_per_layer,
                      state_data=tuple(state_data or D.state_data), state_chunk=state_chunk,
                      earlier=offsets(earlier, "--earlier"))
    art, cached = run(store(), capture, cfg, out, model=model, place=place)
    report = load_report(art)
    out.table(grid_table(report))
    for line in extension_lines(report) + per_layer_lines(report):
        out.info(line)
    out.table(layer_table(report))
    if "state_correction" in report:
        sc = report["state_correction"]
        norms = ", ".join(f"{l}: {v:.3g} (state {sc['exact_state_norm'][l]:.3g})" for l, v in sc["offset_norm"].items())
        out.info(f"terminal-state offsets from {len(sc['documents'])} documents, {sc['states_per_layer']} states per "
                 f"layer; norm per layer {norms}")
    done(out, "solve", art, cached)


def grid_table(report: dict):
    from rich.table import Table

    shared = "; * the best shared alpha" if report.get("per_layer") else ""
    t = Table(title=f"held-out score per alpha ({report['metric']}){shared}")
    for c in ("alpha", "score", "K cos", "V cos", "input cos"):
        t.add_column(c, justify="right")
    for g in report["grid"]:
        mark = (" (extended)" if g.get("extended") else "") + (" *" if g["alpha"] == report["alpha"] else "")
        t.add_row(f"{g['alpha']:g}{mark}", f"{g['score']:.4f}", f"{g['k_cosine']:.4f}", f"{g['v_cosine']:.4f}",
                  f"{g['input_cosine']:.4f}")
    return t


def layer_table(report: dict):
    from rich.table import Table

    per = (report.get("per_layer") or {}).get("alpha")  # {layer: alpha} when the alphas are per layer
    setting = "per-layer alpha" if per else f"alpha {report['alpha']:g}"
    t = Table(title=f"split {report['split']}, {setting}: fitted (identity) per late layer")
    for c in ("layer", *(("alpha",) if per else ()), "K cos", "V cos", "input cos", "rel. sq. err", "expl. var"):
        t.add_column(c, justify="right")
    keys = ("k_cosine", "v_cosine", "input_cosine", "rel_se", "explained_var")
    fit, ident = report["fitted"], report["identity"]
    rows = [(l, fit["layers"][l], ident["layers"][l]) for l in sorted(fit["layers"], key=int)] + [("mean", fit["mean"], ident["mean"])]
    for name, f, i in rows:
        alpha = (f"{per[name]:g}" if name in per else "",) if per else ()
        t.add_row(str(name), *alpha, *(f"{f[k]:.4f} ({i[k]:.4f})" for k in keys))
    return t


def per_layer_lines(report: dict) -> list[str]:
    """For people, when the alphas are per layer: their range and the held-out score against the shared alpha's
    (one line), and one line per layer whose own search went past the grid's edge."""
    p = report.get("per_layer")
    if not p:
        return []
    lo, hi = min(p["alpha"].values()), max(p["alpha"].values())
    d = p["score"] - p["shared_score"]
    lines = [f"per-layer alphas {lo:g} .. {hi:g} over {len(p['alpha'])} layers: held-out score {p['score']:.4f} "
             f"vs {p['shared_score']:.4f} with the shared alpha {report['alpha']:g} ({d:+.4f})"]
    past = sorted({x["layer"] for x in p["extended"]})
    if p["layer_scorings"]:
        lines.append(f"layer{'s' * (len(past) != 1)} {', '.join(map(str, past))}: alpha at the grid's edge, "
                     f"searched on alone ({p['layer_scorings']} single-layer scoring"
                     f"{'s' * (p['layer_scorings'] != 1)}; report.json per_layer.extended)")
    return lines


def extension_lines(report: dict) -> list[str]:
    """One line per grid edge that solve extended, for people: how far, and why it stopped."""
    from ridgefill.solve.ridge import ALPHA_LIMITS

    why = {"turned": "the score turned", "flat": "the score stopped improving",
           "limit": f"reached the limit {ALPHA_LIMITS[0]:g} .. {ALPHA_LIMITS[1]:g}", "steps": "reached the step limit"}
    return [f"alpha at the grid's edge: extended to {x['to']:g} ({x['steps']} step{'s' * (x['steps'] != 1)}; "
            f"{why[x['stopped']]})" for x in report.get("extended", [])]
