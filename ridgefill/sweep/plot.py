"""The sweep's plot (`sweep.png`): needle accuracy, key-token ΔNLL and the measured speed-up, each against the
compute ceiling, from the sweep's result dict alone. Deterministic: a fixed size and no date or version in the
file, so the same result gives the same bytes.

    from ridgefill.sweep.plot import plot
    plot(result, Path("sweep.png"))

Importing this module does not import matplotlib; `plot` does.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ridgefill.errors import BadInput
from ridgefill.sweep.artifact import ARMS
from ridgefill.sweep.report import arm_figures, recommend, sorted_splits

FIGSIZE = (15.0, 4.5)  # inches; fixed, so that the same result gives the same PNG bytes
DPI = 100
DODGE = 3.0  # points: how far each series is drawn left / right of its x
STYLES = {"ridgefill": dict(color="tab:blue", marker="o", dx=-DODGE),
          "identity": dict(color="tab:orange", marker="s", dx=DODGE)}


def plot(result: dict, path: Path) -> Path:
    """Write the sweep's PNG, three panels against the compute ceiling (the horizontal axis): needle accuracy with
    the interval of (arm - exact) placed on exact's accuracy, key-token ΔNLL with its interval, each for the fitted
    maps and the identity fill, the budget dashed and the recommendation ringed; and the measured speed-up, its
    median with the [min, max] of the timing rounds, beside the line y = x that no prefill can beat: a median above
    it is drawn hollow and grey, as noise. A recommended configuration or longer tail is a green star at its own
    ceiling. Fixed size, no date or version in the file, written by rename."""
    path = Path(path)
    if not path.parent.is_dir():
        raise BadInput(f"cannot write the plot to '{path}': folder '{path.parent}' does not exist")
    entries = sorted_splits(result)
    rec = result.get("recommended") or recommend(result)
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with matplotlib.style.context("default"):
        fig = Figure(figsize=FIGSIZE, dpi=DPI)
        FigureCanvasAgg(fig)
        ax_n, ax_d, ax_s = fig.subplots(1, 3)
        for ax, panel in ((ax_n, "needle"), (ax_d, "dnll")):
            for arm in ARMS:
                _arm_points(fig, ax, _points(result, arm, panel), STYLES[arm], arm)
            if rec.get("split") is not None:
                _recommendation(fig, ax, result, rec, panel)
        _budgets(ax_n, ax_d, result)
        _speeds(ax_s, entries)
        _labels(fig, (ax_n, ax_d, ax_s), result)
        _save(fig, path)
    return path


def _points(result: dict, arm: str, panel: str) -> list[tuple]:
    """(split, ceiling, y, below, above) per split where the arm has the panel's figure."""
    ex = (result.get("exact") or {}).get("needle")
    pts = []
    for e in sorted_splits(result):
        a, x = arm_figures(e, arm), e.get("ceiling_speedup")
        if x is None:
            continue
        if panel == "needle" and a.get("needle") is not None:
            y, ci = a["needle"], a.get("needle_minus_exact") or {}
            base = a.get("needle_exact", ex)
            lo = y if base is None or ci.get("low") is None else min(max(base + ci["low"], 0.0), 100.0)
            hi = y if base is None or ci.get("high") is None else min(max(base + ci["high"], 0.0), 100.0)
            pts.append((e["split"], x, y, max(y - lo, 0.0), max(hi - y, 0.0)))
        elif panel == "dnll" and a.get("dnll_key") is not None:
            y, ci = a["dnll_key"], a.get("dnll_key_ci") or {}
            lo, hi = ci.get("low", y), ci.get("high", y)
            pts.append((e["split"], x, y, max(y - lo, 0.0), max(hi - y, 0.0)))
    return pts


def _arm_points(fig, ax, pts: list[tuple], st: dict, label: str) -> None:
    """One arm's points on a panel, with their intervals, each labelled by its split, dodged sideways by `st["dx"]`."""
    from matplotlib.transforms import offset_copy

    if not pts:
        return
    splits, xs, ys, lo, hi = zip(*pts)
    ax.errorbar(xs, ys, yerr=[lo, hi], color=st["color"], marker=st["marker"], linestyle="none", markersize=5,
                capsize=3, label=label, transform=offset_copy(ax.transData, fig=fig, x=st["dx"], y=0, units="points"))
    ax.update_datalim([(x, y - d) for x, y, d in zip(xs, ys, lo)] + [(x, y + u) for x, y, u in zip(xs, ys, hi)])
    for s, x, y in zip(splits, xs, ys):
        ax.annotate(str(s), (x, y), textcoords="offset points", xytext=(st["dx"] + 4, 6), fontsize=8,
                    color=st["color"])


def _recommendation(fig, ax, result: dict, rec: dict, panel: str) -> None:
    """The recommendation on a panel: the fitted maps' point ringed (a plain fill), or a green star at its own
    ceiling (a configuration or a longer tail)."""
    from matplotlib.transforms import offset_copy

    hit = [p for p in _points(result, "ridgefill", panel) if p[0] == rec["split"]]
    if hit and rec.get("kind") == "plain":
        ax.plot([hit[0][1]], [hit[0][2]], linestyle="none", marker="o", markersize=14, markerfacecolor="none",
                markeredgecolor="tab:green", markeredgewidth=2, label=f"recommended: split {rec['split']}",
                transform=offset_copy(ax.transData, fig=fig, x=-DODGE, y=0, units="points"))
    y = _recommended_figure(result, rec, "needle" if panel == "needle" else "dnll_key")
    if rec.get("kind") != "plain" and y is not None:
        what = f"tail {rec['tail']}" if rec["kind"] == "longer tail" else rec["configuration"].removeprefix("ridgefill")
        ax.plot([rec["ceiling_speedup"]], [y], linestyle="none", marker="*", markersize=12, color="tab:green",
                label=f"recommended: split {rec['split']}, {what}")
        ax.update_datalim([(rec["ceiling_speedup"], y)])


def _recommended_figure(result: dict, rec: dict, key: str):
    """A figure ("needle", "dnll_key") of the recommended configuration or longer tail: the configuration's own, or
    that of the control whose tail was recommended; None for a plain recommendation or a figure not measured."""
    e = next((e for e in sorted_splits(result) if e["split"] == rec.get("split")), None)
    if e is None or rec.get("kind") not in ("configuration", "longer tail"):
        return None
    for name, c in sorted((e.get("configurations") or {}).items()):
        if rec["kind"] == "configuration" and name == rec["configuration"]:
            return (c.get("figures") or {}).get(key)
        ctl = c.get("control") or {}
        if rec["kind"] == "longer tail" and ctl.get("tail") == rec["tail"] and ctl.get("verdict") == "within":
            return (ctl.get("figures") or {}).get(key)
    return None


def _budgets(ax_n, ax_d, result: dict) -> None:
    """Exact's level and the budget, dashed, on the needle and the key ΔNLL panels."""
    b, ex = result["budget"], (result.get("exact") or {}).get("needle")
    if ex is not None:
        ax_n.axhline(ex, color="black", linewidth=1, label=f"exact ({ex:.1f} %)")
        ax_n.axhline(ex - b["max_needle_drop"], color="tab:red", linestyle="--", linewidth=1,
                     label=f"budget (-{b['max_needle_drop']:g} points)")
    ax_d.axhline(0.0, color="black", linewidth=1, label="exact (0)")
    ax_d.axhline(b["max_key_dnll"], color="tab:red", linestyle="--", linewidth=1,
                 label=f"budget ({b['max_key_dnll']:g} nats)")


def _speeds(ax, entries: list[dict]) -> None:
    """The measured speed-ups (median, [min, max]) beside the line y = x; a median above it hollow and grey."""
    xs = [e["ceiling_speedup"] for e in entries if e.get("ceiling_speedup") is not None]
    if xs:
        ax.plot([min(xs), max(xs)], [min(xs), max(xs)], color="black", linewidth=1, label="ceiling (y = x)")
    for noise in (False, True):
        pts = [(e["split"], e["ceiling_speedup"], e["speed"]) for e in entries
               if e.get("speed") and bool(e["speed"].get("noise")) == noise]
        if not pts:
            continue
        splits, x, sp = zip(*pts)
        med = [p["median"] for p in sp]
        ax.errorbar(x, med, yerr=[[m - p["low"] for m, p in zip(med, sp)], [p["high"] - m for m, p in zip(med, sp)]],
                    linestyle="none", marker="o", markersize=5, capsize=3,
                    color="tab:gray" if noise else "tab:blue", markerfacecolor="none" if noise else "tab:blue",
                    label="above the ceiling: noise" if noise else "measured (median, [min, max])")
        for s, xx, m in zip(splits, x, med):
            ax.annotate(str(s), (xx, m), textcoords="offset points", xytext=(4, 6), fontsize=8)


def _labels(fig, axes, result: dict) -> None:
    """Margins, axes, grids, legends and titles."""
    ax_n, ax_d, ax_s = axes
    for ax in axes:
        ax.margins(x=0.06, y=0.08)
        ax.autoscale_view()
        ax.set_xlabel("compute ceiling 1/r")
        ax.grid(True, linewidth=0.4, alpha=0.5)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="best")
    ax_n.set_ylabel("needle accuracy (%)")
    ax_n.set_title("needle retrieval", fontsize=10)
    ax_d.set_ylabel("key-token ΔNLL vs exact (nats)")
    ax_d.set_title("key-token ΔNLL", fontsize=10)
    ax_s.set_ylabel("measured prefill speed-up")
    ax_s.set_title("measured speed-up, fitted maps", fontsize=10)
    fig.suptitle(f"{result.get('model', '?')} ({result.get('mode', '?')}): length {result.get('length', '?')}, "
                 f"tail {result.get('tail', '?')}, {result.get('samples', '?')} needle prompts at most, "
                 f"{result.get('documents', '?')} documents", fontsize=11)
    fig.text(0.5, 0.01, "compute ceiling 1/r: the speed-up if only the skipped layer-rows counted",
             ha="center", va="bottom", fontsize=9)
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.17, top=0.86, wspace=0.22)


def _save(fig, path: Path) -> None:
    """The PNG, through a temporary file beside `path` and a rename, with the umask's permissions and no software
    tag (so that no version lands in the file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png", dpi=DPI, metadata={"Software": None})
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
