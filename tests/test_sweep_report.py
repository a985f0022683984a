"""The sweep's report (ridgefill/sweep/report.py, plot.py): the (split, configuration) recommendation against a plain loop,
what the maps earn, the table, the markdown and the PNG."""

import os
import random
import re
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ridgefill.errors import BadInput
from ridgefill.sweep.plot import DPI, FIGSIZE, plot
from ridgefill.sweep.report import advantage, candidates, recommend, table, write_markdown

REPO = Path(__file__).resolve().parents[1]
L, N, T = 30, 4096, 512


def ceiling(split, tail=T):
    return L * N / (split * (N - tail) + L * tail)


def by_task(n):
    """Right answers / prompts per task of n prompts in rounds of the three tasks (all right)."""
    k = n // 3
    return {"single": [n - 2 * k, n - 2 * k], "multikey": [k, k], "multivalue": [k, k]}


def arm(verdict, needle=40.0, key=0.3, n=40):
    return {"verdict": verdict, "decided": "needles, 40 prompts", "needle": needle, "needle_exact": 100.0,
            "needle_n": n, "needle_by_suite": by_task(n),
            "needle_minus_exact": {"mean": needle - 100.0, "low": needle - 110.0, "high": min(needle - 90.0, 0.0)},
            "dnll_key": key, "dnll_key_ci": {"mean": key, "low": key * 0.8, "high": key * 1.2}}


def config(verdict, beats, control_verdict, extra=410.0):
    tail = T + round(extra)
    return {"figures": arm(verdict), "verdict": verdict, "decided": "needles, 40 prompts", "extra_rows": extra,
            "ceiling_speedup": ceiling(config.split, tail), "beats_control": beats, "why": "reason",
            "control": {"arm": "ridgefill+rows:tail", "tail": tail, "figures": arm(control_verdict),
                        "verdict": control_verdict}}


def entry(split, rf, ident, configurations=None, speed=None):
    return {"split": split, "ceiling_speedup": ceiling(split), "alpha": 0.01, "solve": "s", "quantize": "q",
            "heldout": {"fitted": {"k_cosine": 0.96, "v_cosine": 0.81}, "identity": {"k_cosine": 0.85, "v_cosine": 0.57}},
            "macs": {"exact": 725.0, "arm": 544.0}, "arms": {"ridgefill": arm(rf), "identity": arm(ident)},
            "configurations": configurations or {}, "speed": speed}


def result(splits, edges=(None, None)):
    return {"model": "builtin:smollm2-135m", "num_layers": L, "length": N, "tail": T, "samples": 40, "documents": 4,
            "mode": "adaptive", "budget": {"max_needle_drop": 10.0, "max_key_dnll": 0.5},
            "exact": {"needle": 100.0, "needle_by_suite": by_task(40)},
            "search": {"ridgefill": {"edge": edges[0]}, "identity": {"edge": edges[1]}}, "splits": splits}


def sweep():
    """SmolLM2-like: the maps within budget from 20, identity from 22; +rows at 18 beats its control."""
    config.split = 18
    rows18 = {"ridgefill+rows": config("within", True, "over")}
    config.split = 16
    rows16 = {"ridgefill+rows": config("over", False, "over")}
    sp = lambda m: {"median": m, "low": m - 0.1, "high": m + 0.1, "runs": [m - 0.1, m, m + 0.1], "noise": m > 1.5}  # noqa: E731
    return result([entry(14, "over", "over", speed=sp(1.5)), entry(16, "over", "over", rows16, sp(1.6)),
                   entry(18, "over", "over", rows18, sp(1.4)), entry(20, "within", "over", speed=sp(1.3)),
                   entry(22, "within", "within", speed=sp(1.2))], edges=(20, 22))


# --- recommend -------------------------------------------------------------------------------------------------


def test_a_configuration_with_a_higher_ceiling_that_beats_its_control_wins():
    r = sweep()
    rec = recommend(r)
    assert ceiling(18, T + 410) > ceiling(20)
    assert (rec["split"], rec["configuration"], rec["tail"], rec["kind"]) == (18, "ridgefill+rows", T, "configuration")
    assert rec["ceiling_speedup"] == pytest.approx(ceiling(18, T + 410))
    assert rec["reason"].startswith("split 18, ridgefill+rows: the highest compute ceiling within budget, x")
    assert [(c["split"], c["kind"]) for c in rec["candidates"]] == [(18, "configuration"), (20, "plain"), (22, "plain")]


def test_a_longer_tail_as_good_as_the_configuration_is_the_recommendation():
    r = sweep()
    c = r["splits"][2]["configurations"]["ridgefill+rows"]
    c.update(beats_control=False)
    c["control"]["verdict"] = "within"
    rec = recommend(r)
    assert (rec["split"], rec["configuration"], rec["tail"], rec["kind"]) == (18, "ridgefill", T + 410, "longer tail")
    # A configuration over budget whose control is within: the longer tail too.
    c.update(verdict="over")
    assert recommend(r)["kind"] == "longer tail"


def test_without_configurations_the_plain_edge_and_nothing_within():
    r = sweep()
    for e in r["splits"]:
        e["configurations"] = {}
    rec = recommend(r)
    assert (rec["split"], rec["configuration"], rec["tail"], rec["kind"]) == (20, "ridgefill", T, "plain")
    for e in r["splits"]:
        e["arms"]["ridgefill"]["verdict"] = "over"
    rec = recommend(r)
    assert rec["split"] is None and rec["candidates"] == []
    assert rec["reason"].startswith("no split or configuration is within budget (needle at most 10 points below exact")


def test_equal_ceilings_prefer_the_simpler_candidate():
    r = result([entry(20, "within", "over", {"ridgefill+kscale": {
        "figures": arm("within"), "verdict": "within", "beats_control": True, "why": "w", "extra_rows": 0.0,
        "ceiling_speedup": ceiling(20), "control": {"arm": "ridgefill", "verdict": "within", "figures": None}}})])
    assert recommend(r)["kind"] == "plain"


def test_recommend_against_a_plain_loop_on_random_sweeps():
    rng = random.Random(0)
    for _ in range(200):
        entries = []
        for s in sorted(rng.sample(range(4, 28), 5)):
            confs = {}
            if rng.random() < 0.5:
                config.split = s
                confs["ridgefill+rows"] = config(rng.choice(["within", "over"]), rng.random() < 0.5,
                                                 rng.choice(["within", "over"]), extra=rng.choice([100.0, 410.0]))
                confs["ridgefill+rows"]["beats_control"] &= confs["ridgefill+rows"]["verdict"] == "within"
            entries.append(entry(s, rng.choice(["within", "over"]), "over", confs))
        r = result(entries)
        best = None  # the rule written out: highest ceiling; plain, then longer tail, then configuration
        for e in entries:
            opts = []
            if e["arms"]["ridgefill"]["verdict"] == "within":
                opts.append((e["ceiling_speedup"], 0, e["split"], "ridgefill", T))
            for c in e["configurations"].values():
                wins = c["verdict"] == "within" and c["beats_control"]
                if wins:
                    opts.append((c["ceiling_speedup"], -2, e["split"], "ridgefill+rows", T))
                elif c["control"]["verdict"] == "within":
                    opts.append((c["ceiling_speedup"], -1, e["split"], "ridgefill", c["control"]["tail"]))
            for o in opts:
                if best is None or (round(o[0], 9), o[1], o[2]) > (round(best[0], 9), best[1], best[2]):
                    best = o
        rec = recommend(r)
        assert (rec["split"], rec["configuration"], rec["tail"]) == ((best[2], best[3], best[4]) if best else (None,) * 3)
        assert len(candidates(r)) == len(rec["candidates"])


def test_bad_results_are_refused_in_one_line():
    with pytest.raises(BadInput, match=r"^sweep result measures split 8 more than once$"):
        recommend(result([entry(8, "over", "over")] * 2))
    with pytest.raises(BadInput, match=r"^sweep result's budget.max_key_dnll must be a number >= 0, got None$"):
        recommend({**sweep(), "budget": {"max_needle_drop": 10}})
    with pytest.raises(BadInput, match=r"^sweep result has no 'splits' list$"):
        recommend({"budget": {"max_needle_drop": 10, "max_key_dnll": 0.5}})
    with pytest.raises(BadInput, match=r"^sweep result has a split entry without an integer 'split'"):
        recommend(result([{"split": "8"}]))


# --- what the maps earn ----------------------------------------------------------------------------------------


def test_advantage_in_layers_and_ceiling_including_zero():
    a = advantage(sweep())
    assert (a["ridgefill"], a["identity"], a["layers"]) == (20, 22, 2)
    assert a["ceiling"] == pytest.approx(ceiling(20) - ceiling(22))
    assert a["line"] == (f"the fitted maps are within budget from split 20 (x{ceiling(20):.2f}), the identity fill from "
                         f"22 (x{ceiling(22):.2f}): 2 layers shallower, +{ceiling(20) - ceiling(22):.2f} in ceiling")
    same = advantage(result([entry(20, "within", "within")], edges=(20, 20)))
    assert same["layers"] == 0 and same["ceiling"] == 0
    assert same["line"].startswith("the fitted maps earn nothing over the identity fill: both are within budget from split 20")
    assert advantage(result([], edges=(20, None)))["line"].endswith("the identity fill at no split measured")
    assert advantage(result([], edges=(None, None)))["layers"] is None


# --- table and markdown ----------------------------------------------------------------------------------------


def render(r):
    import io

    from rich.console import Console

    con = Console(record=True, width=200, color_system=None, file=io.StringIO())
    con.print(table(r))
    return con.export_text()


def test_table_has_a_row_per_split_and_per_configuration():
    r = sweep()
    r["recommended"] = recommend(r)
    text = render(r)
    assert "…" not in text
    rows = [line for line in text.splitlines() if line.startswith("│") and line.strip("│ ")[:2].isdigit()]
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    assert [c[0] for c in cells] == ["14", "16", "16 +rows", "18", "18 +rows ★", "20", "22"]
    assert cells[5] == ["20", f"{ceiling(20):.2f}", "1.30 [1.20, 1.40]", "0.750", "0.960/0.810 (0.850/0.570)",
                        "40.0 [-70.0, -50.0] (40) 14/14|13/13|13/13", "40.0 (40)", "0.300 (0.300)", "✓ (✗)"]
    assert cells[1][2] == "1.60 [1.50, 1.70] noise"  # above its ceiling? 1.6 > 1.5 flagged by the sweep
    assert cells[4][6] == f"tail {T + 410}: 40.0 (40)" and cells[4][8] == "✓ (✗) beats"


def test_markdown_rows_and_the_lines_after():
    r = sweep()
    r["recommended"] = recommend(r)
    md = write_markdown(r)
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 7 and all(row.count(" | ") == 8 for row in rows)
    # every line of the table, the header and the rule included, has exactly the 10 pipes of 9 cells: a "|" inside a
    # cell (the header's "single|multi-key|multi-value", the per-task counts) is escaped
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 7 and all(len(re.findall(r"(?<!\\)\|", line)) == 10 for line in table)
    assert rows[1].startswith("| 14 | ") and "\\|" in rows[1]
    assert md.endswith(f"Recommendation: {r['recommended']['reason']}\n\nWhat the maps earn: {advantage(r)['line']}\n")


# --- plot ------------------------------------------------------------------------------------------------------


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, i = [], 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        kind, body, crc = data[i + 4:i + 8], data[i + 8:i + 8 + n], data[i + 8 + n:i + 12 + n]
        assert struct.unpack(">I", crc)[0] == zlib.crc32(kind + body)
        chunks.append((kind, body))
        i += 12 + n
    assert chunks[-1][0] == b"IEND"
    return chunks


PLOT_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_sweep_report import sweep
from ridgefill.sweep.plot import plot
plot(sweep(), {path!r})
"""


def test_plot_is_a_png_of_fixed_size_and_the_same_bytes_every_time(tmp_path):
    r = sweep()
    a, b = plot(r, tmp_path / "a.png"), plot(r, tmp_path / "b.png")
    data = a.read_bytes()
    chunks = png_chunks(data)
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert (width, height) == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI)) == (1500, 450)
    assert not {k for k, _ in chunks} & {b"tEXt", b"iTXt", b"zTXt", b"tIME"}  # no version, no date
    assert b.read_bytes() == data
    script = PLOT_SCRIPT.format(tests=str(Path(__file__).parent), path=str(tmp_path / "c.png"))
    env = {"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin", "MPLCONFIGDIR": str(tmp_path / "mpl")}
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, env=env)
    assert (tmp_path / "c.png").read_bytes() == data
    umask = os.umask(0)
    os.umask(umask)
    assert a.stat().st_mode & 0o777 == 0o666 & ~umask and not list(tmp_path.glob(".*.tmp"))


def test_plot_draws_the_figures_and_the_noise(tmp_path):
    r = sweep()
    base = plot(r, tmp_path / "base.png").read_bytes()
    r2 = sweep()
    r2["splits"][3]["arms"]["ridgefill"]["dnll_key"] = 0.45
    assert plot(r2, tmp_path / "moved.png").read_bytes() != base
    r3 = sweep()
    r3["splits"][1]["speed"]["noise"] = False  # the same median drawn as a result, not as noise
    assert plot(r3, tmp_path / "noise.png").read_bytes() != base
    for e in r3["splits"]:  # missing figures are skipped, not drawn at 0
        e["speed"] = None
        for a in e["arms"].values():
            a.update(needle=None, dnll_key=None)
    png_chunks(plot(r3, tmp_path / "empty.png").read_bytes())


def test_plot_draws_a_recommended_configuration_or_longer_tail_at_its_ceiling(tmp_path):
    from ridgefill.sweep.plot import _recommended_figure

    r = sweep()  # +rows at 18 is the recommendation
    rec = recommend(r)
    assert rec["kind"] == "configuration" and _recommended_figure(r, rec, "needle") == 40.0
    base = plot(r, tmp_path / "base.png").read_bytes()
    r["splits"][2]["configurations"]["ridgefill+rows"]["figures"]["needle"] = 55.0
    assert plot(r, tmp_path / "moved.png").read_bytes() != base
    # its control as good: the longer tail is recommended, drawn with the control's figures
    r = sweep()
    c = r["splits"][2]["configurations"]["ridgefill+rows"]
    c["beats_control"], c["control"]["verdict"] = False, "within"
    c["control"]["figures"]["dnll_key"] = 0.123
    rec = recommend(r)
    assert rec["kind"] == "longer tail" and _recommended_figure(r, rec, "dnll_key") == 0.123
    assert _recommended_figure(r, {**rec, "kind": "plain"}, "needle") is None
    png_chunks(plot(r, tmp_path / "tail.png").read_bytes())


def test_plot_refuses_a_missing_folder_and_writes_nothing(tmp_path):
    with pytest.raises(BadInput, match=r"^cannot write the plot to '.*/nope/p.png': folder '.*/nope' does not exist$"):
        plot(sweep(), tmp_path / "nope" / "p.png")
    assert list(tmp_path.iterdir()) == []


def test_importing_ridgefill_and_the_report_does_not_import_matplotlib():
    code = ("import sys, ridgefill, ridgefill.sweep.report as rep, ridgefill.sweep.plot\n"
            "sys.path.insert(0, 'tests')\n"
            "from test_sweep_report import sweep\n"
            "r = sweep(); rep.recommend(r); rep.advantage(r); rep.write_markdown(r)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
