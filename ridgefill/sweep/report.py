"""The sweep's report: which (split, configuration) to ship, what the fitted maps earn over the identity fill, and
the figures as a table (plot.py draws them).

    from ridgefill.sweep.report import advantage, recommend, table, write_markdown
    rec = recommend(result)           # {"split": 20, "configuration": "ridgefill", "tail": 512, "reason": ..., ...}
    out.table(table(result))          # rich, one row per split and one per configuration measured
    md = write_markdown(result)       # the same table as GitHub markdown

Everything here is a pure function of the sweep's result dict (result.py builds it; docs/sweep.md describes it):
per split the fitted maps ("ridgefill") and the identity fill ("identity"), each with its budget verdict, and, at
the splits just shallower than the maps' edge, the quality configurations beside their controls. Importing this
module does not import rich; `table` imports it when called.
"""

from __future__ import annotations

import math

from ridgefill.errors import BadInput
from ridgefill.evaluate.needles import TASKS
from ridgefill.sweep.artifact import ARMS
from ridgefill.sweep.config import FIGURES

RECOMMENDED, WITHIN, OVER = "★", "✓", "✗"
# Equal ceilings: the simpler recommendation first.
PREFERENCE = {"plain": 0, "longer tail": 1, "configuration": 2}


# ---------------------------------------------------------------------------------------------------------------
# Reading the result


def sorted_splits(result: dict) -> list[dict]:
    """The split entries sorted by split; refuses a result without a budget, or with a split measured twice."""
    if not isinstance(result, dict) or not isinstance(result.get("splits"), list):
        raise BadInput("sweep result has no 'splits' list")
    budget = result.get("budget") or {}
    for key in ("max_needle_drop", "max_key_dnll"):
        v = budget.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise BadInput(f"sweep result's budget.{key} must be a number >= 0, got {v!r}")
    for e in result["splits"]:
        if not isinstance(e, dict) or not isinstance(e.get("split"), int) or isinstance(e.get("split"), bool):
            raise BadInput(f"sweep result has a split entry without an integer 'split': {str(e)[:60]}")
    entries = sorted(result["splits"], key=lambda e: e["split"])
    seen = [e["split"] for e in entries]
    dup = sorted({s for s in seen if seen.count(s) > 1})
    if dup:
        raise BadInput(f"sweep result measures split {dup[0]} more than once")
    return entries


def arm_figures(entry: dict, arm: str) -> dict:
    return (entry.get("arms") or {}).get(arm) or {}


def fmt_cell(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


# ---------------------------------------------------------------------------------------------------------------
# The recommendation


def candidates(result: dict) -> list[dict]:
    """Every (split, configuration, tail) the sweep found within budget and worth shipping:
    - the fitted maps at a split where they are within budget ("plain");
    - a configuration within budget that beats its equal-cost control ("configuration");
    - a configuration's longer-tail control within budget where the configuration does not beat it: the same
      cost with nothing new to ship ("longer tail").
    Each with its compute ceiling."""
    tail = result.get("tail")
    out = []
    for e in sorted_splits(result):
        s = e["split"]
        if arm_figures(e, "ridgefill").get("verdict") == "within":
            out.append({"split": s, "configuration": "ridgefill", "tail": tail, "kind": "plain",
                        "ceiling_speedup": e.get("ceiling_speedup")})
        for name, c in sorted((e.get("configurations") or {}).items()):
            wins = c.get("verdict") == "within" and c.get("beats_control")
            if wins:
                out.append({"split": s, "configuration": name, "tail": tail, "kind": "configuration",
                            "ceiling_speedup": c.get("ceiling_speedup"), "why": c.get("why")})
            ctl = c.get("control") or {}
            if ctl.get("arm", "ridgefill") != "ridgefill" and ctl.get("verdict") == "within" and not wins:
                out.append({"split": s, "configuration": "ridgefill", "tail": ctl.get("tail"), "kind": "longer tail",
                            "ceiling_speedup": c.get("ceiling_speedup"), "instead_of": name})
    return [c for c in out if c["ceiling_speedup"] is not None]


def recommend(result: dict) -> dict:
    """The candidate (`candidates`) with the highest compute ceiling; on equal ceilings the simpler one (the plain
    fill, then a longer tail, then a configuration), then the deeper split.

    -> {"split": S or None, "configuration": arm name or None, "tail": T or None, "ceiling_speedup",
        "kind", "reason": one line, "candidates": [...]}
    """
    cands = candidates(result)
    if not cands:
        over = [e for e in sorted_splits(result) if arm_figures(e, "ridgefill")]
        why = ""
        if over:
            deepest = arm_figures(over[-1], "ridgefill")
            why = f"; even the deepest, split {over[-1]['split']}, is over ({deepest.get('decided', '?')})"
        return {"split": None, "configuration": None, "tail": None, "ceiling_speedup": None, "kind": None,
                "reason": f"no split or configuration is within budget ({budget_text(result['budget'])}){why}",
                "candidates": []}
    best = max(cands, key=lambda c: (round(c["ceiling_speedup"], 9), -PREFERENCE[c["kind"]], c["split"]))
    what = {"plain": "the fitted maps", "configuration": best["configuration"],
            "longer tail": f"the fitted maps with a {best['tail']}-token tail (as good as {best.get('instead_of')})"}
    line = (f"split {best['split']}, {what[best['kind']]}: the highest compute ceiling within budget, "
            f"x{best['ceiling_speedup']:.2f} ({budget_text(result['budget'])})")
    if best["kind"] == "configuration":
        line += f"; beats its equal-cost control: {best.get('why')}"
    return {**{k: best[k] for k in ("split", "configuration", "tail", "ceiling_speedup", "kind")}, "reason": line,
            "candidates": cands}


def budget_text(b: dict) -> str:
    """A sweep's budget (sweep.json's "budget") in words."""
    if "limits" not in b:  # a sweep made before gates joined the budget
        drop, key = (format(b[k], "g") if k in b else "?" for k in ("max_needle_drop", "max_key_dnll"))
        return f"needle at most {drop} points below exact, key ΔNLL at most {key} nats"
    return ", ".join(f"{FIGURES[k]} {'≤' if kind == 'max' else '≥'} {v:g}{' points' if k == 'needle_drop' else ''}"
                     for k, (kind, v) in b["limits"].items())


def advantage(result: dict) -> dict:
    """What the fitted maps earn over the free identity fill: each arm's shallowest split within budget (its edge)
    and the difference, in layers and in compute ceiling. -> {"ridgefill", "identity", "layers", "ceiling", "line"}
    (layers / ceiling None when either arm has no edge)."""
    search = result.get("search") or {}
    edges = {a: (search.get(a) or {}).get("edge") for a in ARMS}
    ceil = {e["split"]: e.get("ceiling_speedup") for e in sorted_splits(result)}
    out = {"ridgefill": edges["ridgefill"], "identity": edges["identity"], "layers": None, "ceiling": None}
    r, i = edges["ridgefill"], edges["identity"]
    if r is not None and i is not None:
        out["layers"] = i - r
        out["ceiling"] = ceil[r] - ceil[i]
        if i == r:
            out["line"] = (f"the fitted maps earn nothing over the identity fill: both are within budget from split "
                           f"{r} (ceiling x{ceil[r]:.2f})")
        elif i > r:
            out["line"] = (f"the fitted maps are within budget from split {r} (x{ceil[r]:.2f}), the identity fill from "
                           f"{i} (x{ceil[i]:.2f}): {i - r} layers shallower, +{ceil[r] - ceil[i]:.2f} in ceiling")
        else:
            out["line"] = (f"the identity fill is within budget from split {i}, shallower than the fitted maps ({r}): "
                           "the maps cost retrieval here")
    elif r is not None:
        out["line"] = f"the fitted maps are within budget from split {r}; the identity fill at no split measured"
    elif i is not None:
        out["line"] = f"the identity fill is within budget from split {i}; the fitted maps at no split measured"
    else:
        out["line"] = "neither the fitted maps nor the identity fill is within budget at any split measured"
    return out


# ---------------------------------------------------------------------------------------------------------------
# Table and markdown (the same cells)

COLUMNS = ("split", "ceiling", "measured\n[min, max]", "MACs\n/ exact", "K / V cos\nfit (id)",
           "needle % fit [- exact CI]\n(prompts) single|multi-key|multi-value", "needle %\nidentity (prompts)",
           "key ΔNLL\nfit (id)",
           "budget\nfit (id)")


def needle_cell(a: dict) -> str:
    if a.get("needle") is None:
        return "–"
    text = f"{a['needle']:.1f}"
    ci = a.get("needle_minus_exact") or {}
    if ci.get("low") is not None:
        text += f" [{ci['low']:+.1f}, {ci['high']:+.1f}]"
    text += f" ({a.get('needle_n', '?')})"
    suites = a.get("needle_by_suite") or {}
    if suites:
        text += " " + "|".join(f"{r}/{n}" for r, n in (suites.get(k, [0, 0]) for k in TASKS))
    return text


def _short(a: dict) -> str:
    return "–" if a.get("needle") is None else f"{a['needle']:.1f} ({a.get('needle_n', '?')})"


def speed_cell(sp: dict | None) -> str:
    if not sp:
        return "–"
    text = f"{sp['median']:.2f} [{sp['low']:.2f}, {sp['high']:.2f}]"
    return text + " noise" if sp.get("noise") else text


def _macs(m: dict | None) -> str:
    return "–" if not m or not m.get("exact") else f"{m['arm'] / m['exact']:.3f}"


def verdict_mark(v: str | None) -> str:
    return {"within": WITHIN, "over": OVER}.get(v or "", "–")  # "–": not measured (it could not change the choice)


def _rows(result: dict, rec: dict) -> list[tuple[list[str], bool]]:
    """(cells, recommended?) per split and per configuration measured, split by split."""
    rows = []
    for e in sorted_splits(result):
        r, i = arm_figures(e, "ridgefill"), arm_figures(e, "identity")
        held = e.get("heldout") or {}
        fit, ident = held.get("fitted") or {}, held.get("identity") or {}
        plain = rec.get("split") == e["split"] and rec.get("kind") == "plain"
        rows.append(([f"{e['split']}{' ' + RECOMMENDED if plain else ''}", fmt_cell(e.get("ceiling_speedup"), ".2f"),
                      speed_cell(e.get("speed")), _macs(e.get("macs")),
                      f"{fmt_cell(fit.get('k_cosine'), '.3f')}/{fmt_cell(fit.get('v_cosine'), '.3f')} "
                      f"({fmt_cell(ident.get('k_cosine'), '.3f')}/{fmt_cell(ident.get('v_cosine'), '.3f')})",
                      needle_cell(r), _short(i),
                      f"{fmt_cell(r.get('dnll_key'), '.3f')} ({fmt_cell(i.get('dnll_key'), '.3f')})",
                      f"{verdict_mark(r.get('verdict'))} ({verdict_mark(i.get('verdict'))})"], plain))
        for name, c in sorted((e.get("configurations") or {}).items()):
            f, ctl = c.get("figures") or {}, c.get("control") or {}
            cf = ctl.get("figures") or {}
            chosen = rec.get("split") == e["split"] and (
                (rec.get("kind") == "configuration" and rec.get("configuration") == name)
                or (rec.get("kind") == "longer tail" and rec.get("tail") == ctl.get("tail")))
            label = f"{e['split']} {name.removeprefix('ridgefill')}"
            ctl_name = ctl.get("arm", "ridgefill")
            ctl_text = (f"tail {ctl.get('tail')}: " if ctl_name != "ridgefill" else "plain: ") + _short(cf)
            rows.append(([label + (f" {RECOMMENDED}" if chosen else ""),
                          fmt_cell(c.get("ceiling_speedup"), ".2f"), "–", _macs(c.get("macs")), "", needle_cell(f),
                          ctl_text,
                          f"{fmt_cell(f.get('dnll_key'), '.3f')} ({fmt_cell(cf.get('dnll_key'), '.3f')})",
                          f"{verdict_mark(c.get('verdict'))} ({verdict_mark(ctl.get('verdict'))})"
                          + (" beats" if c.get("beats_control") else "")], chosen))
    return rows


def _title(result: dict) -> str:
    ex = result.get("exact") or {}
    suites = ex.get("needle_by_suite") or {}
    per = ", ".join(f"{k} {r}/{n}" for k, (r, n) in sorted(suites.items()))
    return (f"sweep {result.get('model', '?')} ({result.get('mode', '?')}): length {result.get('length', '?')}, tail "
            f"{result.get('tail', '?')}; exact needle {fmt_cell(ex.get('needle'), '.1f')} % ({per})")


def _legend(result: dict) -> str:
    return (f"budget: {budget_text(result['budget'])}. {RECOMMENDED} recommended, {WITHIN} within, {OVER} over. "
            "Ceiling: the "
            "compute ceiling 1/r; measured: median speed-up of the timing rounds [min, max], 'noise' above the "
            "ceiling; MACs: the arm's multiply-accumulates / exact's. Configuration rows: the configuration "
            "(its equal-cost control)")


def table(result: dict):
    """A rich Table: one row per split, then one per configuration measured there."""
    from rich.table import Table

    rec = result.get("recommended") or recommend(result)
    t = Table(title=_title(result), caption=_legend(result), caption_justify="left")
    for name in COLUMNS:
        t.add_column(name, justify="right", no_wrap=True)
    for cells, chosen in _rows(result, rec):
        t.add_row(*cells, style="bold" if chosen else None)
    return t


def write_markdown(result: dict) -> str:
    """The table as GitHub markdown, with the legend, the recommendation and what the maps earn. Ends with a
    newline."""
    rec = result.get("recommended") or recommend(result)

    def line(cells) -> str:  # a "|" inside a cell (single|multi-key|...) is escaped, in the header as in the rows
        return "| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |"

    head = [c.replace("\n", " ") for c in COLUMNS]
    lines = [f"**{_title(result)}**", "", line(head), "|" + "|".join(["---:"] * len(head)) + "|"]
    lines += [line(cells) for cells, _ in _rows(result, rec)]
    adv = result.get("advantage") or advantage(result)
    lines += ["", _legend(result) + ".", "", f"Recommendation: {rec.get('reason', '')}", "",
              f"What the maps earn: {adv['line']}", ""]
    return "\n".join(lines)
