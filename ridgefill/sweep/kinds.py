"""Map kinds side by side: one sweep per kind (`sweep --maps input,kv`), on one capture and the same prompts, put
together split by split, and the kind to ship chosen by a stated rule (docs/sweep.md, "Map kinds side by side").

Each kind's sweep is an ordinary sweep artifact (cached, resumable, its own recommendation). Both draw the same
needle prompts in the same order (the suite is a function of the model, the length, the tail and the seed), so at a
split where both kinds' maps were measured on a prompt their answers are paired: `compare` gives the paired
difference of the second kind's needle accuracy from the first's, with a bootstrap interval.

The rule (`choose`): the kind whose recommendation has the highest compute ceiling; on equal ceilings the one whose
fill does the fewer multiply-accumulates (a key/value map skips the late layer's d x d map, norm and key/value
projections); then the kind named first. A kind with no split within budget is never chosen.

    from ridgefill.sweep.kinds import compare, table
    both = compare({"input": result_a, "kv": result_b})   # results: sweep.json of each kind's sweep
    both["choice"]    # {"maps": "kv", "split": 20, "configuration": "ridgefill", "tail": 512, "reason": ...}
    out.table(table(both))
"""

from __future__ import annotations

from ridgefill.errors import BadInput
from ridgefill.sweep.report import (arm_figures, budget_text, fmt_cell, needle_cell, recommend, sorted_splits,
                                     speed_cell, verdict_mark)

SAME = ("model", "num_layers", "length", "tail", "samples", "budget")  # what two sweeps compared must share


def parse_kinds(text: str) -> tuple[str, ...]:
    """'input', 'kv' or 'input,kv' (either order) -> the kinds, in order; BadInput for anything else."""
    from ridgefill.solve.config import MAP_CHOICES

    kinds = tuple(k.strip() for k in str(text).split(","))
    bad = [k for k in kinds if k not in MAP_CHOICES]
    if bad:
        raise BadInput(f"--maps: '{bad[0]}' is not a map kind; use {', '.join(MAP_CHOICES)}, or both separated by a "
                       "comma (input,kv) to compare them")
    if len(set(kinds)) != len(kinds):
        raise BadInput(f"--maps: '{text}' names a kind twice")
    return kinds


def compare(results: dict, bootstrap: int = 10000, seed: int = 0) -> dict:
    """Sweep results by kind ({kind: sweep.json}, in the order to report) -> {"kinds", "splits": [per split each
    kind's figures and the paired needle difference], "recommended": {kind: its recommendation}, "choice"}.
    BadInput when the sweeps do not measure the same thing (model, length, tail, needles, budget) or share no
    split."""
    kinds = list(results)
    if len(kinds) < 2:
        raise BadInput("comparing map kinds needs two sweeps")
    first = results[kinds[0]]
    for k in kinds[1:]:
        for key in SAME:
            if results[k].get(key) != first.get(key):
                raise BadInput(f"the {kinds[0]} and {k} sweeps differ in {key} ({first.get(key)!r} vs "
                               f"{results[k].get(key)!r}): compare sweeps of one model with the same settings")
    entries = {k: {e["split"]: e for e in sorted_splits(r)} for k, r in results.items()}
    splits = sorted(set.intersection(*(set(e) for e in entries.values())))
    if not splits:
        raise BadInput("the sweeps share no split")
    rows = []
    for s in splits:
        row = {"split": s, "ceiling_speedup": entries[kinds[0]][s].get("ceiling_speedup")}
        for k in kinds:
            row[k] = _figures(entries[k][s])
        row["paired"] = {k: paired_needles(first, results[k], s, bootstrap, seed) for k in kinds[1:]}
        rows.append(row)
    recs = {k: {**(r.get("recommended") or recommend(r)), "macs_ratio": None} for k, r in results.items()}
    for k, rec in recs.items():
        if rec.get("split") in entries[k]:
            rec["macs_ratio"] = _ratio(entries[k][rec["split"]].get("macs"))
    return {"kinds": kinds, "model": first.get("model"), "length": first.get("length"), "tail": first.get("tail"),
            "budget": first.get("budget"), "splits": rows,
            "recommended": {k: {x: rec.get(x) for x in ("split", "configuration", "tail", "ceiling_speedup", "kind",
                                                        "macs_ratio", "reason")} for k, rec in recs.items()},
            "choice": choose(recs, kinds)}


def choose(recs: dict, kinds: list[str]) -> dict:
    """The rule (module docstring) over each kind's recommendation -> {"maps", "split", "configuration", "tail",
    "reason"} ("maps" None when no kind has a split within budget)."""
    within = [k for k in kinds if recs[k].get("split") is not None]
    if not within:
        return {"maps": None, "split": None, "configuration": None, "tail": None,
                "reason": "no map kind is within budget at any split measured"}
    order = {k: i for i, k in enumerate(kinds)}
    best = min(within, key=lambda k: (-round(recs[k]["ceiling_speedup"], 9),
                                      recs[k]["macs_ratio"] if recs[k]["macs_ratio"] is not None else float("inf"),
                                      order[k]))
    b = recs[best]
    others = [k for k in within if k != best]
    line = f"{best} maps at split {b['split']}: ceiling x{b['ceiling_speedup']:.2f}"
    if b.get("macs_ratio") is not None:
        line += f", {b['macs_ratio']:.3f} of exact's multiply-accumulates"
    for k in others:
        o = recs[k]
        if round(o["ceiling_speedup"], 9) < round(b["ceiling_speedup"], 9):
            line += f"; {k} maps reach only split {o['split']} (x{o['ceiling_speedup']:.2f})"
        else:
            line += (f"; {k} maps reach the same ceiling (split {o['split']}) at "
                     f"{fmt_cell(o.get('macs_ratio'), '.3f')} of exact's multiply-accumulates")
    for k in kinds:
        if k not in within:
            line += f"; {k} maps are within budget at no split measured"
    return {"maps": best, **{x: b[x] for x in ("split", "configuration", "tail")}, "reason": line}


def paired_needles(a: dict, b: dict, split: int, bootstrap: int, seed: int) -> dict:
    """Needle accuracy of sweep `b`'s fitted maps minus sweep `a`'s at `split`, in points, on the prompts both
    measured there (the same prompt: same index, kind and depth), with a paired bootstrap interval. -> {"n",
    "mean", "low", "high"} (n 0 and no figures when they share no prompt)."""
    from ridgefill.numerics import paired_bootstrap

    def answers(result):
        return {n["index"]: (tuple(n.get(k) for k in ("task", "haystack", "form", "length", "depth")),
                             n["arms"][f"{split}/ridgefill"])
                for n in result.get("needles") or [] if f"{split}/ridgefill" in (n.get("arms") or {})}

    x, y = answers(a), answers(b)
    both = sorted(i for i in set(x) & set(y) if x[i][0] == y[i][0])
    if not both:
        return {"n": 0, "mean": None, "low": None, "high": None}
    got = paired_bootstrap([100.0 * y[i][1] for i in both], [100.0 * x[i][1] for i in both], samples=bootstrap,
                           seed=seed)
    return {k: got[k] for k in ("n", "mean", "low", "high")}


def _figures(entry: dict) -> dict:
    """One kind's figures at one split (the fitted maps' arm of that sweep's split entry)."""
    r = arm_figures(entry, "ridgefill")
    held = (entry.get("heldout") or {}).get("fitted") or {}
    return {"k_cosine": held.get("k_cosine"), "v_cosine": held.get("v_cosine"), "dnll_key": r.get("dnll_key"),
            "dnll": r.get("dnll"), "needle": r.get("needle"), "needle_n": r.get("needle_n"),
            "needle_by_suite": r.get("needle_by_suite"),
            "needle_minus_exact": r.get("needle_minus_exact"), "verdict": r.get("verdict"),
            "decided": r.get("decided"), "macs_ratio": _ratio(entry.get("macs")), "speed": entry.get("speed")}


def _ratio(m: dict | None) -> float | None:
    return m["arm"] / m["exact"] if m and m.get("exact") else None


def _paired(p: dict) -> str:
    if not p.get("n"):
        return "–"
    return f"{p['mean']:+.1f} [{p['low']:+.1f}, {p['high']:+.1f}] ({p['n']})"


def rows(both: dict) -> tuple[list[str], list[tuple[list[str], bool]]]:
    """The table's header and (cells, chosen?) rows: one row per (split, kind)."""
    kinds, choice = both["kinds"], both["choice"]
    head = ["split", "maps", "ceiling", "measured\n[min, max]", "MACs\n/ exact", "K / V cos",
            "needle % [- exact CI]\n(prompts) single|multi-key|multi-value",
            f"needle - {kinds[0]}\npaired CI (prompts)", "key ΔNLL", "budget"]
    out = []
    for r in both["splits"]:
        for k in kinds:
            f = r[k]
            chosen = choice.get("maps") == k and choice.get("split") == r["split"]
            out.append(([f"{r['split']}{' ★' if chosen else ''}", k, fmt_cell(r.get("ceiling_speedup"), ".2f"),
                         speed_cell(f.get("speed")), fmt_cell(f.get("macs_ratio"), ".3f"),
                         f"{fmt_cell(f.get('k_cosine'), '.3f')}/{fmt_cell(f.get('v_cosine'), '.3f')}",
                         needle_cell(f),
                         _paired(r["paired"][k]) if k in r["paired"] else "", fmt_cell(f.get("dnll_key"), ".3f"),
                         verdict_mark(f.get("verdict"))], chosen))
    return head, out


def table(both: dict):
    """A rich Table of `compare`'s result: one row per (split, kind), the chosen one in bold."""
    from rich.table import Table

    head, body = rows(both)
    b = both.get("budget") or {}
    t = Table(title=f"map kinds, {both.get('model')}: length {both.get('length')}, tail {both.get('tail')}",
              caption=(f"budget: {budget_text(b)}. ★ chosen, ✓ within, ✗ over, – not measured (the "
                       "bisection did not need it). Paired: the same prompts, this kind's answers minus the first "
                       "kind's."),
              caption_justify="left")
    for name in head:
        t.add_column(name, justify="right", no_wrap=True)
    for cells, chosen in body:
        t.add_row(*cells, style="bold" if chosen else None)
    return t
