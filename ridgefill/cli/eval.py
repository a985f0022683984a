"""`ridgefill eval MODEL RELEASE_OR_MAPS`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ridgefill.cli.common import ModelArg, done, output, placed, store
from ridgefill.evaluate.config import DEFAULT_ARMS, EvalConfig

D = EvalConfig()  # each option's default


@placed
def eval_(
    model: ModelArg,
    source: Annotated[str, typer.Argument(help="Release folder, a Hub release hf://OWNER/NAME\\[@REV] (pulled into the release cache once), or a solve / quantize artifact id.")],
    arms: Annotated[Optional[list[str]], typer.Option("--arms", help="exact, ridgefill, identity, nofill, or a fill arm with +corrections (vscale, kscale, kshift, state) and a +selector (rows, protected; its :random and :tail controls are added); repeatable; default: the first four, and the release's configured arm.")] = None,
    tail: Annotated[int, typer.Option("--tail", help="Exact tail in tokens.")] = D.tail,
    lengths: Annotated[Optional[list[int]], typer.Option("--lengths", help="Needle context lengths (repeatable).")] = None,
    depths: Annotated[Optional[list[float]], typer.Option("--depths", help="Needle depths in the context (repeatable).")] = None,
    tasks: Annotated[Optional[list[str]], typer.Option("--tasks", help="single, multikey, multivalue (repeatable).")] = None,
    samples: Annotated[int, typer.Option("--samples", help="Needle samples per (length, depth, task).")] = D.samples,
    documents: Annotated[int, typer.Option("--documents", help="Long documents for the NLL figures.")] = D.documents,
    doc_tokens: Annotated[int, typer.Option("--doc-tokens", help="Length of each long document.")] = D.doc_tokens,
    scored: Annotated[int, typer.Option("--scored", help="Scored stretch: the last tokens of each document.")] = D.scored,
    seed: Annotated[int, typer.Option("--seed")] = D.seed,
    gate: Annotated[Optional[Path], typer.Option("--gate", help="TOML thresholds (on the file's arm, default the release's configured arm); exit 3 when one fails.")] = None,
    place=None,  # --device, --dtype, --device-map, --max-memory: one Where (common.placed)
) -> None:
    """Measure the fill arms against exact (needles, ΔNLL, KL) and gate the release."""
    from ridgefill.errors import GateFailed
    from ridgefill.evaluate import check, evaluate, record
    from ridgefill.evaluate.gate import load_gate
    from ridgefill.evaluate.source import configuration_of, locate_source
    from ridgefill.hub.releases import HUB

    out = output()
    named, source = source, locate_source(source)  # a Hub release pulled once; a missing folder refused, not fetched
    cfg = EvalConfig(arms=tuple(arms or DEFAULT_ARMS), tail=tail, lengths=tuple(lengths or D.lengths),
                     depths=tuple(depths or D.depths), tasks=tuple(tasks or D.tasks), samples=samples,
                     documents=documents, doc_tokens=doc_tokens, scored=scored, seed=seed)
    if gate:  # before any work: a gate it cannot pass (its default arm is the release's configured one)
        configured = configuration_of(source)
        rules = load_gate(gate, [a.name for a in check(cfg, configured)], default_arm=configured)
    else:
        rules = None
    st = store()
    art, cached = evaluate(st, model, source, cfg, out, place=place)
    s = art.manifest["summary"]
    out.table(quality_table(art.id, s))
    out.table(speed_table(s))
    if s.get("pairs"):
        for line in pairs_lines(s):
            out.info(line)
    verdict = record(source, art, rules, out, keep=not named.startswith(HUB))  # into a release folder; the gate
    done(out, "eval", art, cached, {"gate": verdict})
    failed = verdict["failed"] if verdict else []
    if failed:
        raise GateFailed("gate failed: " + "; ".join(failed))


def _fmt(v, f=".3f") -> str:
    return "–" if v is None else format(v, f)


def quality_table(eval_id: str, s: dict):
    """Per arm: needle %, ΔNLL on all / novel / key tokens, KL, top-1 (narrow enough for 80 columns with long arm
    names; the speed is a table of its own)."""
    from rich.table import Table

    t = Table(title=f"eval {eval_id}: {s['samples']} needle samples, {s['documents']} documents; ΔNLL in nats "
                    "against exact (all / novel / key tokens)")
    t.add_column("arm", justify="right", no_wrap=True)
    for c in ("needle %", "ΔNLL", "novel", "key", "KL", "top-1"):
        t.add_column(c, justify="right")
    for arm, a in s["arms"].items():
        t.add_row(arm, _fmt(a.get("needle"), ".1f"), *(_fmt(a.get(k)) for k in ("dnll", "dnll_novel", "dnll_key",
                                                                                 "kl", "top1")))  # fmt: skip
    return t


def speed_table(s: dict):
    from rich.table import Table

    t = Table(title=f"prefill at the longest length; ceiling x{s['ceiling_speedup']:.2f}")
    t.add_column("arm", justify="right", no_wrap=True)
    for c in ("prefill s", "speed-up", "rows exact"):
        t.add_column(c, justify="right")
    for arm, a in s["arms"].items():
        added = a.get("rows_added")
        t.add_row(arm, _fmt(a.get("prefill_s"), ".2f"), _fmt(a.get("speedup"), ".2f"),
                  "–" if added is None else f"{100 * added:.1f} %")
    return t


def pairs_lines(summary: dict) -> list[str]:
    """Each correction, selector and control against what it changes: the difference and its paired interval."""

    def ci(x, f):
        return f"{x['mean']:{f}} [{x['low']:{f}}, {x['high']:{f}}]"

    lines = ["paired differences, mean [95 % interval]:"]
    for name, p in summary["pairs"].items():
        arm, against = name.split(" - ")
        parts = [f"needle {ci(p['needle'], '+.1f')} points"] if p.get("needle") else []
        parts += [f"ΔNLL {k} {ci(p['dnll_' + k], '+.4f')}" for k in ("novel", "key") if p.get("dnll_" + k)]
        added = summary["arms"][arm].get("rows_added")
        if added is not None:
            parts.append(f"{100 * added:.1f} % of the prompt's rows exact")
        lines.append(f"  {arm} vs {against}: " + "; ".join(parts) + f" -> {verdict(p)}")
    return lines


def verdict(pair: dict) -> str:
    """"helps" / "hurts" when an interval excludes zero (more needles, or less added loss, is better), "mixed"
    when they disagree, else "no clear effect"."""
    signs = set()
    for key, better in (("needle", 1), ("dnll_novel", -1), ("dnll_key", -1)):
        x = pair.get(key)
        if x and (x["low"] > 0 or x["high"] < 0):
            signs.add("helps" if (x["low"] > 0) == (better > 0) else "hurts")
    return "mixed" if len(signs) > 1 else signs.pop() if signs else "no clear effect"
