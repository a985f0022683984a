"""The sweep's report: which split to ship, where needle retrieval stops, and the figures as a table and a plot.

    from ridgefill.sweep.report import plot, recommend, retrieval_edge, table, write_markdown
    rec = recommend(result)              # {"split": 12, "reason": "...", "qualifying": [12, 16], "checks": [...]}
    out.table(table(result, rec))        # rich, readable at 120 columns
    plot(result, rec, Path("sweep.png")) # two panels: needle % and key-token ΔNLL against measured speed-up
    md = write_markdown(result, rec)     # the same table as GitHub markdown

Everything here is a pure function of the sweep's result dict (see `ridgefill.sweep.run`): one entry per
split S with a fitted arm ("ridgefill": ridge maps) and the identity fill ("identity": x_hat = h_S), each measured
against the exact model. Figures may be None where they were not measured. Importing this module imports neither
rich nor matplotlib; `table` and `plot` import them when called.
"""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path

from ridgefill.errors import BadInput

ARMS = ("ridgefill", "identity")
# A figure that equals its limit up to round-off is within budget: needle % are means of 0/100 scores (10 and 7
# right of 30: 33.333... - 23.333... = 10.000000000000004, a drop of exactly 10 points).
TOLERANCE = 1e-9
# The plot: fixed size and resolution, so that the same result gives the same PNG bytes.
FIGSIZE = (11.0, 4.5)  # inches
DPI = 100  # -> 1100 x 450 pixels
DODGE = 3.0  # points: how far each arm's series is drawn left (ridgefill) / right (identity) of its x
RECOMMENDED = "★"  # the recommended row (table, markdown)
WITHIN = "✓"  # a row within budget
OVER = "✗"  # a row over budget


# ---------------------------------------------------------------------------------------------------------------
# Reading the result


def _splits(result: dict) -> list[dict]:
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


def _arm(entry: dict, arm: str) -> dict:
    return (entry.get("arms") or {}).get(arm) or {}


def _exact_needle(result: dict) -> float | None:
    return (result.get("exact") or {}).get("needle")


def needle_drop(result: dict, entry: dict, arm: str = "ridgefill") -> float | None:
    """Points of needle accuracy the arm loses against exact (negative: it does better); None if not measured."""
    ex, got = _exact_needle(result), _arm(entry, arm).get("needle")
    return None if ex is None or got is None else ex - got


def speedup(entry: dict, arm: str) -> float | None:
    """The arm's measured prefill speed-up, or the split's ceiling when it was not measured."""
    s = _arm(entry, arm).get("speedup")
    return entry.get("ceiling_speedup") if s is None else s


# ---------------------------------------------------------------------------------------------------------------
# The recommendation


def _check(result: dict, entry: dict) -> dict:
    """One split against the budget: its figures and, per figure that fails, one readable phrase."""
    b = result["budget"]
    drop, key = needle_drop(result, entry), _arm(entry, "ridgefill").get("dnll_key")
    failed = {}
    if drop is None:
        failed["needle_drop"] = "needle accuracy not measured"
    elif drop > b["max_needle_drop"] + TOLERANCE:
        failed["needle_drop"] = f"needle {drop:.1f} points below exact > {b['max_needle_drop']:g}"
    if key is None:
        failed["dnll_key"] = "key ΔNLL not measured"
    elif key > b["max_key_dnll"] + TOLERANCE:
        failed["dnll_key"] = f"key ΔNLL {key:.3f} nats > {b['max_key_dnll']:g}"
    return {"split": entry["split"], "needle_drop": drop, "dnll_key": key, "failed": failed}


def _budget_text(result: dict) -> str:
    b = result["budget"]
    return f"needle at most {b['max_needle_drop']:g} points below exact, key ΔNLL at most {b['max_key_dnll']:g} nats"


def recommend(result: dict) -> dict:
    """The shallowest split whose fitted (ridgefill) arm stays within the budget.

    Rule: split S qualifies when, on the point estimates of its ridgefill arm,
      - needle drop = exact needle % - ridgefill needle %  <=  budget.max_needle_drop (points), and
      - ridgefill key-token ΔNLL (nats)                      <=  budget.max_key_dnll,
    each up to TOLERANCE of round-off (a figure equal to its limit qualifies). A figure that was not measured
    (None) fails. The recommendation is the smallest qualifying S: the fewest exact layers, so the fastest
    prefill; a deeper split with better figures does not beat it. The 95 % intervals play no part in the rule;
    the table and plot show them so that a reader can judge how firm a point estimate is.

    -> {"split": S or None, "reason": one line, "qualifying": [S, ...] ascending,
        "checks": [{"split", "needle_drop", "dnll_key", "failed": {figure: phrase}} per split, ascending]}
    where `failed` is keyed by "needle_drop" / "dnll_key" and is empty for a split within budget.
    Raises BadInput on a result without a usable budget or with a split measured twice.
    """
    entries = _splits(result)
    checks = [_check(result, e) for e in entries]
    qualifying = [c["split"] for c in checks if not c["failed"]]
    rec = {"split": qualifying[0] if qualifying else None, "qualifying": qualifying, "checks": checks}
    if not entries:
        rec["reason"] = "no split was measured"
    elif not qualifying:
        deepest = checks[-1]
        rec["reason"] = (f"no split is within budget ({_budget_text(result)}); even the deepest, split "
                         f"{deepest['split']}, fails: {'; '.join(deepest['failed'].values())}")
    else:
        i = [c["split"] for c in checks].index(qualifying[0])
        c, e = checks[i], entries[i]
        drop = c["needle_drop"]
        where = f"{drop:.1f} points below" if drop >= 0 else f"{-drop:.1f} points above"
        measured = _arm(e, "ridgefill").get("speedup")
        speed = ("" if measured is None else f"x{measured:.2f} measured, ") + (
            "ceiling unknown" if e.get("ceiling_speedup") is None else f"ceiling x{e['ceiling_speedup']:.2f}")
        line = (f"split {c['split']} is the shallowest within budget: needle {where} exact (limit "
                f"{result['budget']['max_needle_drop']:g}), key ΔNLL {c['dnll_key']:.3f} nats (limit "
                f"{result['budget']['max_key_dnll']:g}); speed-up {speed}")
        if i > 0:
            above = checks[i - 1]
            line += f"; split {above['split']} fails: {'; '.join(above['failed'].values())}"
        rec["reason"] = line
    return rec


def retrieval_edge(result: dict) -> dict:
    """Where needle retrieval comes back as the split deepens, per arm, and where ridgefill keeps it alone.

    For each arm, the edge is the shallowest split S from which on (S and every deeper split measured) the 95 %
    interval of (arm - exact) needle accuracy reaches 0 (its high >= 0): from there the arm is not significantly
    worse than exact. A split whose interval is missing ends such a run, as a significant loss would. None when
    the deepest split is still significantly worse (or has no interval).
    `ridgefill_keeps` lists the splits where ridgefill is significantly better than identity (the interval of
    ridgefill - identity needle accuracy has low > 0): ridgefill keeps retrieval where identity loses it.

    -> {"ridgefill": S or None, "identity": S or None, "ridgefill_keeps": [S, ...], "line": one readable line}
    """
    entries = _splits(result)
    edge = {}
    for arm in ARMS:
        edge[arm] = None
        for e in reversed(entries):
            ci = _arm(e, arm).get("needle_minus_exact")
            if ci is None or ci.get("high") is None or ci["high"] < 0:
                break
            edge[arm] = e["split"]
    keeps = []
    for e in entries:
        ci = (e.get("ridgefill_minus_identity") or {}).get("needle")
        if ci is not None and ci.get("low") is not None and ci["low"] > 0:
            keeps.append(e["split"])
    edge["ridgefill_keeps"] = keeps
    edge["line"] = _edge_line(entries, edge)
    return edge


def _edge_line(entries: list[dict], edge: dict) -> str:
    if not entries:
        return "no split was measured"
    first, last = entries[0]["split"], entries[-1]["split"]
    parts = []
    for arm in ARMS:
        s = edge[arm]
        if s is None:
            parts.append(f"{arm} stays significantly below exact up to the deepest split ({last})")
        elif s == first:
            parts.append(f"{arm} is not significantly below exact at any split measured (from {first})")
        else:
            parts.append(f"{arm} from split {s} on")
    line = "needle retrieval (not significantly below exact): " + "; ".join(parts)
    keeps = edge["ridgefill_keeps"]
    if keeps:
        line += f"; ridgefill significantly beats identity at split{'s' if len(keeps) > 1 else ''} " + \
                ", ".join(str(s) for s in keeps)
    else:
        line += "; ridgefill never significantly beats identity"
    return line


# ---------------------------------------------------------------------------------------------------------------
# Table and markdown (the same cells)


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _needle_cell(result: dict, entry: dict, arm: str) -> str:
    """'40.0 [-7.5, +0.0]': the arm's needle %, then the 95 % interval of (arm - exact) in points."""
    a = _arm(entry, arm)
    text = _f(a.get("needle"), ".1f")
    ci = a.get("needle_minus_exact") or {}
    if ci.get("low") is not None and ci.get("high") is not None:
        text += f" [{ci['low']:+.1f}, {ci['high']:+.1f}]"
    return text


def _pair(entry: dict, key: str, fmt: str) -> tuple[str, str]:
    """A figure of the fitted arm and of identity, from the held-out fit or the arms' measurements."""
    if key in ("k_cosine", "v_cosine"):
        held = entry.get("heldout") or {}
        return _f((held.get("fitted") or {}).get(key), fmt), _f((held.get("identity") or {}).get(key), fmt)
    return _f(_arm(entry, "ridgefill").get(key), fmt), _f(_arm(entry, "identity").get(key), fmt)


def _speed_cell(entry: dict) -> str:
    return f"{_f(_arm(entry, 'ridgefill').get('speedup'), '.2f')} ({_f(entry.get('ceiling_speedup'), '.2f')})"


def _mark(rec: dict, check: dict) -> str:
    if check["split"] == rec.get("split"):
        return RECOMMENDED
    return OVER if check["failed"] else WITHIN


def _title(result: dict) -> str:
    ex = result.get("exact") or {}
    return (f"sweep {result.get('model', '?')}: exact needle {_f(ex.get('needle'), '.1f')} %, prefill "
            f"{_f(ex.get('prefill_s'), '.2f')} s; length {result.get('length', '?')}, tail {result.get('tail', '?')}, "
            f"{result.get('samples', '?')} needle samples, {result.get('documents', '?')} documents")


def _legend(result: dict) -> str:
    return (f"budget: {_budget_text(result)}. {RECOMMENDED} recommended (shallowest within budget), {WITHIN} within "
            f"budget, {OVER} over. Cells: ridgefill (identity); needle: % [95 % CI of arm - exact, points]")


def _checks_by_split(result: dict, rec: dict) -> list[tuple[dict, dict]]:
    entries = _splits(result)
    checks = {c["split"]: c for c in rec.get("checks", [])}
    return [(e, checks.get(e["split"]) or _check(result, e)) for e in entries]


# Column headers: the table's two-line ones; markdown joins the lines.
COLUMNS = ("split", "speed-up\n(ceiling)", "K cos\nfit (id)", "V cos\nfit (id)",
           "needle % ridgefill\n[- exact, 95 % CI]", "needle % identity\n[- exact, 95 % CI]", "key ΔNLL\nfit (id)")


def _cells(result: dict, rec: dict, e: dict, c: dict, red: bool) -> list[str]:
    """One split's row; with `red`, a figure over budget is wrapped in rich's [red] markup."""
    mark = lambda text, fig: f"[red]{text}[/red]" if red and fig in c["failed"] else text  # noqa: E731
    key_f, key_i = _pair(e, "dnll_key", ".3f")
    return [f"{e['split']} {_mark(rec, c)}", _speed_cell(e), "%s (%s)" % _pair(e, "k_cosine", ".3f"),
            "%s (%s)" % _pair(e, "v_cosine", ".3f"), mark(_needle_cell(result, e, "ridgefill"), "needle_drop"),
            _needle_cell(result, e, "identity"), f"{mark(key_f, 'dnll_key')} ({key_i})"]


def table(result: dict, rec: dict):
    """A rich Table, one row per split (ascending), readable at 120 columns; a figure over budget is red.

    Columns: split (with its mark), speed-up measured (ceiling), held-out K and V cosine fitted (identity),
    needle % of each arm with the 95 % interval of arm - exact, key-token ΔNLL ridgefill (identity).
    """
    from rich.table import Table

    t = Table(title=_title(result), caption=_legend(result), caption_justify="left")
    for name in COLUMNS:
        t.add_column(name, justify="right", no_wrap=True)
    for e, c in _checks_by_split(result, rec):
        t.add_row(*_cells(result, rec, e, c, red=True), style="bold" if c["split"] == rec.get("split") else None)
    return t


def write_markdown(result: dict, rec: dict) -> str:
    """The table as GitHub markdown: a title line, the table plus a `budget` column (recommended, within, or what
    failed), the legend, and the recommendation's reason. Ends with a newline."""
    head = [name.replace("\n", " ") for name in COLUMNS] + ["budget"]
    lines = [f"**{_title(result)}**", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---:"] * (len(head) - 1) + [":---"]) + "|"]
    for e, c in _checks_by_split(result, rec):
        if c["split"] == rec.get("split"):
            status = "recommended"
        else:
            status = "; ".join(c["failed"].values()) if c["failed"] else "within"
        cells = _cells(result, rec, e, c, red=False) + [status]
        lines.append("| " + " | ".join(x.replace("|", "\\|") for x in cells) + " |")
    lines += ["", _legend(result) + ".", "", f"Recommendation: {rec.get('reason', '')}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# The plot


def _series(result: dict, entries: list[dict], arm: str) -> dict:
    """Per arm, the points of both panels: x = speed-up, needle % with its error bar, key ΔNLL with its CI."""
    ex = _exact_needle(result)
    pts = {"needle": [], "dnll": []}  # panel -> [(split, x, y, bar below, bar above)]
    for e in entries:
        a, x = _arm(e, arm), speedup(e, arm)
        if x is None:
            continue
        if a.get("needle") is not None:
            y, ci = a["needle"], a.get("needle_minus_exact") or {}
            # The bar is the interval of (arm - exact) placed on exact's accuracy, so it reaches the exact line
            # exactly when the arm is not significantly worse than exact; clipped to accuracy's 0..100.
            lo = y if ex is None or ci.get("low") is None else min(max(ex + ci["low"], 0.0), 100.0)
            hi = y if ex is None or ci.get("high") is None else min(max(ex + ci["high"], 0.0), 100.0)
            pts["needle"].append((e["split"], x, y, max(y - lo, 0.0), max(hi - y, 0.0)))
        if a.get("dnll_key") is not None:
            y, ci = a["dnll_key"], a.get("dnll_key_ci") or {}
            lo = y if ci.get("low") is None else ci["low"]
            hi = y if ci.get("high") is None else ci["high"]
            pts["dnll"].append((e["split"], x, y, max(y - lo, 0.0), max(hi - y, 0.0)))
    return pts


def plot(result: dict, rec: dict, path: Path) -> Path:
    """Write the sweep's PNG: needle accuracy (left) and key-token ΔNLL (right) against measured speed-up.

    One point per split and arm (ridgefill and identity as two series, each point labelled with its split; the
    split's ceiling speed-up stands in where none was measured), exact as a horizontal line (its needle %, and
    ΔNLL = 0), the budget as a dashed line, the recommended split ringed. Needle error bars: the 95 % interval of
    (arm - exact) placed on exact's accuracy; ΔNLL error bars: its 95 % interval. The figure has a fixed size
    (FIGSIZE at DPI) and the PNG carries no version or date, so the same result gives the same bytes with the
    same matplotlib. Written to a temporary file and renamed; refuses a folder that does not exist.
    """
    path = Path(path)
    if not path.parent.is_dir():
        raise BadInput(f"cannot write the plot to '{path}': folder '{path.parent}' does not exist")
    entries = _splits(result)
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import offset_copy

    b, ex = result["budget"], _exact_needle(result)
    with matplotlib.style.context("default"):  # independent of the user's matplotlibrc
        fig = Figure(figsize=FIGSIZE, dpi=DPI)
        FigureCanvasAgg(fig)
        ax_n, ax_d = fig.subplots(1, 2)
        # The two arms side by side: each series drawn DODGE points left / right of its x, so that the arms of one
        # split never hide each other (they share x when only the ceiling speed-up is known).
        styles = {"ridgefill": dict(color="tab:blue", marker="o", dx=-DODGE, dy=7),
                  "identity": dict(color="tab:orange", marker="s", dx=DODGE, dy=-12)}
        series = {arm: _series(result, entries, arm) for arm in ARMS}
        for ax, panel in ((ax_n, "needle"), (ax_d, "dnll")):
            for arm in ARMS:
                pts, st = series[arm][panel], styles[arm]
                if not pts:
                    continue
                _, xs, ys, lo, hi = zip(*pts)
                ax.errorbar(xs, ys, yerr=[lo, hi], color=st["color"], marker=st["marker"], linestyle="-",
                            linewidth=1, markersize=5, capsize=3, label=arm,
                            transform=offset_copy(ax.transData, fig=fig, x=st["dx"], y=0, units="points"))
                # An offset transform keeps autoscaling from seeing the points: tell the axes their extent.
                ax.update_datalim([(x, y - d) for x, y, d in zip(xs, ys, lo)] +
                                  [(x, y + u) for x, y, u in zip(xs, ys, hi)])
                for s, x, y, *_ in pts:
                    ax.annotate(str(s), (x, y), textcoords="offset points", xytext=(st["dx"] + 4, st["dy"]),
                                fontsize=8, color=st["color"])
            ax.margins(x=0.06, y=0.06)
            ax.autoscale_view()
            ax.set_xlabel("prefill speed-up vs exact (measured; ceiling where not measured)")
            ax.grid(True, linewidth=0.4, alpha=0.5)
        if ex is not None:
            ax_n.axhline(ex, color="black", linewidth=1, label=f"exact ({ex:.1f} %)")
            ax_n.axhline(ex - b["max_needle_drop"], color="tab:red", linestyle="--", linewidth=1,
                         label=f"budget (-{b['max_needle_drop']:g} points)")
        ax_d.axhline(0.0, color="black", linewidth=1, label="exact (0)")
        ax_d.axhline(b["max_key_dnll"], color="tab:red", linestyle="--", linewidth=1,
                     label=f"budget ({b['max_key_dnll']:g} nats)")
        s = rec.get("split")
        for ax, panel in ((ax_n, "needle"), (ax_d, "dnll")):
            hit = [(x, y) for split, x, y, *_ in series["ridgefill"][panel] if split == s]
            if hit:
                ax.plot([hit[0][0]], [hit[0][1]], linestyle="none", marker="o", markersize=14, markerfacecolor="none",
                        markeredgecolor="tab:green", markeredgewidth=2, label=f"recommended: split {s}",
                        transform=offset_copy(ax.transData, fig=fig, x=styles["ridgefill"]["dx"], y=0, units="points"))
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8, loc="best")
        ax_n.set_ylabel("needle accuracy (%)")
        ax_n.set_title("needle retrieval", fontsize=10)
        ax_d.set_ylabel("key-token ΔNLL vs exact (nats)")
        ax_d.set_title("key-token ΔNLL", fontsize=10)
        fig.suptitle(f"{result.get('model', '?')}: length {result.get('length', '?')}, tail {result.get('tail', '?')}, "
                     f"{result.get('samples', '?')} needle samples, {result.get('documents', '?')} documents",
                     fontsize=11)
        fig.subplots_adjust(left=0.06, right=0.99, bottom=0.12, top=0.86, wspace=0.2)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the plot should look like any other file
            with os.fdopen(fd, "wb") as f:
                # No Software (version) chunk; PNG gets no date from matplotlib, and Agg draws deterministically.
                fig.savefig(f, format="png", dpi=DPI, metadata={"Software": None})
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path
