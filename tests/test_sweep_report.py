"""The sweep's report (ridgefill/sweep/report.py): recommendation rule, retrieval edge, table, markdown, PNG."""

import json
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from ridgefill.errors import BadInput
from ridgefill.sweep.report import DPI, FIGSIZE, plot, recommend, retrieval_edge, table, write_markdown

REPO = Path(__file__).resolve().parents[1]
EXACT = 42.5


def ci(mean, half, n=40):
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def arm(needle, key, speed=2.0, half=12.0, exact=EXACT):
    return {"needle": needle, "needle_minus_exact": None if needle is None else ci(needle - exact, half),
            "dnll": 0.03, "dnll_novel": 0.01, "dnll_key": key,
            "dnll_key_ci": None if key is None else {"mean": key, "low": key * 0.8, "high": key * 1.2, "n": 4},
            "kl": 0.07, "top1": 0.91, "prefill_s": None if speed is None else 13.2 / speed, "speedup": speed}


def entry(split, rf, ident, ceiling=None, rmi=None):
    """rf / ident: (needle, key dnll, measured speed-up); rmi: the ridgefill - identity needle interval."""
    fit, idn = arm(*rf), arm(*ident)
    if rmi is None and rf[0] is not None and ident[0] is not None:
        rmi = ci(rf[0] - ident[0], 10.0)
    return {"split": split, "alpha": 0.01, "solve": "s", "quantize": "q",
            "ceiling_speedup": ceiling if ceiling is not None else 3.6 - split / 10,
            "heldout": {"fitted": {"k_cosine": 0.96, "v_cosine": 0.81},
                        "identity": {"k_cosine": 0.85, "v_cosine": 0.57}},
            "arms": {"ridgefill": fit, "identity": idn}, "ridgefill_minus_identity": {"needle": rmi, "dnll_key": None}}


def result(splits, drop=10.0, key=0.5, exact=EXACT):
    return {"model": "builtin:smollm2-135m", "num_layers": 30, "length": 4096, "tail": 512, "samples": 40,
            "documents": 4, "budget": {"max_needle_drop": drop, "max_key_dnll": key},
            "exact": {"needle": exact, "prefill_s": 13.2}, "splits": splits}


def sweep():
    """Five splits; ridgefill first within budget at 16 (12 fails both figures), identity never."""
    rows = [(8, 0.0, 0.0, 2.6, 3.1, 2.6), (12, 20.0, 5.0, 0.9, 1.5, 2.1), (16, 37.5, 22.5, 0.31, 0.8, 1.7),
            (20, 42.5, 32.5, 0.12, 0.4, 1.4), (24, 45.0, 40.0, 0.05, 0.1, 1.2)]
    return result([entry(s, (rn, rk, sp), (idn, ik, sp * 1.02)) for s, rn, idn, rk, ik, sp in rows])


# --- recommend -------------------------------------------------------------------------------------------------


def test_recommends_the_shallowest_split_within_budget():
    rec = recommend(sweep())
    assert rec["split"] == 16 and rec["qualifying"] == [16, 20, 24]
    failed = {c["split"]: c["failed"] for c in rec["checks"]}
    assert set(failed[8]) == set(failed[12]) == {"needle_drop", "dnll_key"} and not failed[16] and not failed[24]
    assert failed[12]["needle_drop"] == "needle 22.5 points below exact > 10"
    assert failed[12]["dnll_key"] == "key ΔNLL 0.900 nats > 0.5"
    c16 = rec["checks"][2]
    assert (c16["split"], c16["needle_drop"], c16["dnll_key"]) == (16, 5.0, 0.31)
    assert rec["reason"].startswith("split 16 is the shallowest within budget: needle 5.0 points below exact (limit "
                                    "10), key ΔNLL 0.310 nats (limit 0.5); speed-up x1.70 measured, ceiling x2.00")
    assert rec["reason"].endswith("; split 12 fails: needle 22.5 points below exact > 10; key ΔNLL 0.900 nats > 0.5")
    assert "\n" not in rec["reason"]


def test_shallowest_wins_over_better_deeper_splits_and_input_order():
    # 12 and 20 qualify with the same figures (a tie), 16 is better still: the shallowest qualifying one wins.
    splits = [entry(20, (40.0, 0.2, 1.4), (30.0, 0.5, 1.4)), entry(8, (0.0, 3.0, 2.6), (0.0, 3.0, 2.6)),
              entry(16, (45.0, 0.01, 1.7), (30.0, 0.5, 1.7)), entry(12, (40.0, 0.2, 2.1), (30.0, 0.5, 2.1))]
    rec = recommend(result(splits))
    assert rec["split"] == 12 and rec["qualifying"] == [12, 16, 20]
    assert [c["split"] for c in rec["checks"]] == [8, 12, 16, 20]
    assert "split 8 fails" in rec["reason"]
    # Improvement over exact reads as such.
    rec = recommend(result([entry(4, (50.0, 0.1, 3.0), (40.0, 0.4, 3.0))]))
    assert rec["split"] == 4 and "needle 7.5 points above exact" in rec["reason"] and "fails" not in rec["reason"]


def test_a_figure_at_its_limit_qualifies_up_to_round_off():
    # Needle % are means of 0/100 scores (evaluate.run.summarize): 10 and 7 right of 30 are 10 points apart, which
    # is 10.000000000000004 in floating point.
    import numpy as np

    exact, got = (float(np.mean([100.0] * k + [0.0] * (30 - k))) for k in (10, 7))
    assert exact - got > 10.0
    at = result([entry(8, (got, 0.5, 2.0), (0.0, 1.0, 2.0))], exact=exact)
    assert recommend(at)["split"] == 8
    over = result([entry(8, (got - 0.01, 0.5, 2.0), (0.0, 1.0, 2.0)),
                   entry(12, (got, 0.5 + 1e-6, 1.8), (0.0, 1.0, 1.8))], exact=exact)
    rec = recommend(over)
    assert rec["split"] is None and rec["qualifying"] == []
    assert set(rec["checks"][0]["failed"]) == {"needle_drop"} and set(rec["checks"][1]["failed"]) == {"dnll_key"}


def test_no_split_qualifies_names_the_deepest_splits_failing_figure():
    splits = [entry(8, (0.0, 2.6, 2.6), (0.0, 3.1, 2.6)), entry(24, (40.0, 0.71, 1.2), (35.0, 0.9, 1.2))]
    rec = recommend(result(splits))
    assert rec["split"] is None and rec["qualifying"] == []
    assert rec["reason"] == ("no split is within budget (needle at most 10 points below exact, key ΔNLL at most 0.5 "
                             "nats); even the deepest, split 24, fails: key ΔNLL 0.710 nats > 0.5")
    assert recommend(result([]))["reason"] == "no split was measured"


def test_a_figure_not_measured_does_not_qualify():
    splits = [entry(8, (None, 0.1, 2.6), (0.0, 0.2, 2.6)), entry(12, (42.5, None, 2.1), (0.0, 0.2, 2.1)),
              entry(16, (42.5, 0.1, None), (40.0, 0.2, None))]
    rec = recommend(result(splits))
    assert rec["split"] == 16  # no measured speed-up does not matter to the rule
    assert rec["checks"][0]["failed"] == {"needle_drop": "needle accuracy not measured"}
    assert rec["checks"][1]["failed"] == {"dnll_key": "key ΔNLL not measured"}
    assert "speed-up ceiling x2.00" in rec["reason"]
    no_exact = result(splits, exact=None)
    assert recommend(no_exact)["split"] is None
    assert "needle accuracy not measured" in recommend(no_exact)["reason"]


def test_rule_against_a_plain_loop_on_random_sweeps():
    rng = random.Random(0)
    for _ in range(300):
        drop, key = rng.choice([0.0, 5.0, 10.0]), rng.choice([0.1, 0.5])
        splits, expect = [], []
        for s in rng.sample(range(2, 30), rng.randint(1, 6)):
            needle = rng.choice([None, 0.0, 32.5, 35.0, 37.5, 42.5, 45.0])
            k = rng.choice([None, 0.05, 0.1, 0.3, 0.5, 0.7])
            splits.append(entry(s, (needle, k, 2.0), (0.0, 1.0, 2.0)))
            if needle is not None and k is not None and EXACT - needle <= drop and k <= key:
                expect.append(s)
        rec = recommend(result(splits, drop, key))
        assert rec["qualifying"] == sorted(expect)
        assert rec["split"] == (min(expect) if expect else None)


def test_bad_results_are_refused_in_one_line():
    with pytest.raises(BadInput, match=r"^sweep result measures split 8 more than once$"):
        recommend(result([entry(8, (0.0, 1.0, 2.0), (0.0, 1.0, 2.0))] * 2))
    with pytest.raises(BadInput, match=r"^sweep result's budget.max_key_dnll must be a number >= 0, got None$"):
        recommend({**sweep(), "budget": {"max_needle_drop": 10}})
    with pytest.raises(BadInput, match=r"^sweep result's budget.max_needle_drop must be a number >= 0, got -1$"):
        recommend({**sweep(), "budget": {"max_needle_drop": -1, "max_key_dnll": 0.5}})
    with pytest.raises(BadInput, match=r"^sweep result has no 'splits' list$"):
        recommend({"budget": {"max_needle_drop": 10, "max_key_dnll": 0.5}})
    with pytest.raises(BadInput, match=r"^sweep result has a split entry without an integer 'split'"):
        recommend(result([{"split": "8"}]))


# --- retrieval_edge --------------------------------------------------------------------------------------------


def test_retrieval_edge_per_arm_and_where_ridgefill_alone_keeps_it():
    edge = retrieval_edge(sweep())
    # ridgefill - exact highs: 8: -30.5, 12: -10.5, 16: +7, 20: +12, 24: +14.5; identity: 20: +2, 16: -8.
    assert (edge["ridgefill"], edge["identity"]) == (16, 20)
    # ridgefill - identity lows (half width 10): 12: 5, 16: 5, 20: 0, 24: -5.
    assert edge["ridgefill_keeps"] == [12, 16]
    assert edge["line"] == ("needle retrieval (not significantly below exact): ridgefill from split 16 on; identity "
                            "from split 20 on; ridgefill significantly beats identity at splits 12, 16")


def test_retrieval_edge_needs_every_deeper_split():
    r = sweep()
    r["splits"][3]["arms"]["ridgefill"]["needle_minus_exact"] = ci(-20.0, 5.0)  # split 20 significant again
    r["splits"][4]["arms"]["identity"]["needle_minus_exact"] = None  # identity's deepest interval missing
    r["splits"][2]["ridgefill_minus_identity"]["needle"] = None
    edge = retrieval_edge(r)
    assert (edge["ridgefill"], edge["identity"], edge["ridgefill_keeps"]) == (24, None, [12])
    assert "identity stays significantly below exact up to the deepest split (24)" in edge["line"]
    assert edge["line"].endswith("at split 12")
    ok = result([entry(s, (40.0, 0.1, 2.0), (40.0, 0.1, 2.0)) for s in (4, 8)])
    edge = retrieval_edge(ok)
    assert (edge["ridgefill"], edge["identity"], edge["ridgefill_keeps"]) == (4, 4, [])
    assert edge["line"] == ("needle retrieval (not significantly below exact): ridgefill is not significantly below "
                            "exact at any split measured (from 4); identity is not significantly below exact at any "
                            "split measured (from 4); ridgefill never significantly beats identity")


# --- table and markdown ----------------------------------------------------------------------------------------


def render(r, rec):
    import io

    from rich.console import Console

    con = Console(record=True, width=120, color_system=None, file=io.StringIO())
    con.print(table(r, rec))
    return con.export_text()


def test_table_renders_every_split_with_its_mark_at_120_columns():
    r = sweep()
    text = render(r, recommend(r))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120 and "…" not in text  # nothing truncated
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 5
    cells = [[c.strip() for c in row.strip("│").split("│")] for row in rows]
    assert [c[0] for c in cells] == ["8 ✗", "12 ✗", "16 ★", "20 ✓", "24 ✓"]
    assert cells[2] == ["16 ★", "1.70 (2.00)", "0.960 (0.850)", "0.810 (0.570)", "37.5 [-17.0, +7.0]",
                        "22.5 [-32.0, -8.0]", "0.310 (0.800)"]
    words = " ".join(text.split())  # title and caption wrap
    assert "exact needle 42.5 %" in words and "length 4096, tail 512, 40 needle samples, 4 documents" in words
    assert "budget: needle at most 10 points below exact, key ΔNLL at most 0.5 nats" in words
    # The widest cells still fit: 100 % with a -100 point interval and missing figures.
    r["splits"][0]["arms"]["ridgefill"].update(needle=100.0,
                                               needle_minus_exact={"mean": -100.0, "low": -100.0, "high": -100.0})
    r["splits"][1]["arms"]["identity"] = {}
    r["splits"][1]["heldout"] = None
    text = render(r, recommend(r))
    assert max(len(line) for line in text.splitlines()) <= 120 and "…" not in text
    assert "100.0 [-100.0, -100.0]" in text and "– (–)" in text


def test_table_marks_over_budget_figures_red():
    r = sweep()
    t = table(r, recommend(r))
    cells = {col.header.split("\n")[0]: list(col.cells) for col in t.columns}
    assert cells["needle % ridgefill"][1] == "[red]20.0 [-34.5, -10.5][/red]"
    assert cells["needle % ridgefill"][2] == "37.5 [-17.0, +7.0]"
    assert cells["key ΔNLL"][1] == "[red]0.900[/red] (1.500)" and cells["key ΔNLL"][2] == "0.310 (0.800)"
    assert cells["needle % identity"][1] == "5.0 [-49.5, -25.5]"  # the budget is on ridgefill only


def test_markdown_has_one_row_per_split():
    r = sweep()
    md = write_markdown(r, recommend(r))
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 5  # header + one per split
    assert md.splitlines()[3] == "|---:|---:|---:|---:|---:|---:|---:|:---|"
    assert all(row.count(" | ") == 7 for row in rows)
    assert rows[1] == ("| 8 ✗ | 2.60 (2.80) | 0.960 (0.850) | 0.810 (0.570) | 0.0 [-54.5, -30.5] | "
                       "0.0 [-54.5, -30.5] | 2.600 (3.100) | needle 42.5 points below exact > 10; "
                       "key ΔNLL 2.600 nats > 0.5 |")
    assert rows[3].startswith("| 16 ★ |") and rows[3].endswith("| recommended |") and rows[4].endswith("| within |")
    assert md.endswith(f"Recommendation: {recommend(r)['reason']}\n")
    rec = recommend(r)  # a recommendation read back from JSON gives the same report
    assert write_markdown(r, json.loads(json.dumps(rec))) == md


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
from ridgefill.sweep.report import plot, recommend
r = sweep()
plot(r, recommend(r), {path!r})
"""


def test_plot_is_a_png_of_fixed_size_and_the_same_bytes_every_time(tmp_path):
    r = sweep()
    rec = recommend(r)
    a, b = plot(r, rec, tmp_path / "a.png"), plot(r, rec, tmp_path / "b.png")
    data = a.read_bytes()
    chunks = png_chunks(data)
    assert chunks[0][0] == b"IHDR"
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert (width, height) == (round(FIGSIZE[0] * DPI), round(FIGSIZE[1] * DPI)) == (1100, 450)
    kinds = {k for k, _ in chunks}
    assert not kinds & {b"tEXt", b"iTXt", b"zTXt", b"tIME"}, kinds  # no version, no date
    assert b"matplotlib" not in data
    assert b.read_bytes() == data
    # Another process, another hash seed: the same bytes.
    script = PLOT_SCRIPT.format(tests=str(Path(__file__).parent), path=str(tmp_path / "c.png"))
    env = {"PYTHONHASHSEED": "123", "PATH": "/usr/bin:/bin", "MPLCONFIGDIR": str(tmp_path / "mpl")}
    subprocess.run([sys.executable, "-c", script], check=True, cwd=REPO, env=env)
    assert (tmp_path / "c.png").read_bytes() == data
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["a.png", "b.png", "c.png"]
    assert not list(tmp_path.glob(".*.tmp"))
    umask = os.umask(0)
    os.umask(umask)
    assert a.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_plot_draws_the_recommendation_and_the_figures(tmp_path):
    r = sweep()
    rec = recommend(r)
    base = plot(r, rec, tmp_path / "base.png").read_bytes()
    assert plot(r, {**rec, "split": None}, tmp_path / "norec.png").read_bytes() != base
    r2 = sweep()
    r2["splits"][2]["arms"]["ridgefill"]["dnll_key"] = 0.45
    assert plot(r2, rec, tmp_path / "moved.png").read_bytes() != base
    # Ceiling speed-ups stand in for measured ones; missing figures are skipped, not drawn at 0.
    for e in r2["splits"]:
        for a in e["arms"].values():
            a.update(speedup=None, needle=None, dnll_key=None)
    empty = plot(r2, recommend(r2), tmp_path / "empty.png").read_bytes()
    png_chunks(empty)
    assert empty != base


def test_plot_refuses_a_missing_folder_and_writes_nothing(tmp_path):
    r = sweep()
    with pytest.raises(BadInput, match=r"^cannot write the plot to '.*/nope/p.png': folder '.*/nope' does not exist$"):
        plot(r, recommend(r), tmp_path / "nope" / "p.png")
    assert list(tmp_path.iterdir()) == []


def test_importing_ridgefill_and_the_report_does_not_import_matplotlib():
    code = ("import sys, ridgefill, ridgefill.sweep.report as rep\n"
            "sys.path.insert(0, 'tests')\n"
            "from test_sweep_report import sweep\n"
            "r = sweep(); rec = rep.recommend(r); rep.retrieval_edge(r); rep.write_markdown(r, rec)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
