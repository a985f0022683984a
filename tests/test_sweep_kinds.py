"""Map kinds side by side (ridgefill/sweep/kinds.py): the rule that picks the kind to ship, the paired needle
difference against a by-hand bootstrap, the table, and the refusals. The sweeps themselves run in test_sweep.py."""

import copy

import numpy as np
import pytest

from ridgefill.errors import BadInput
from ridgefill.sweep.kinds import choose, compare, paired_needles, parse_kinds, rows
from test_sweep_report import arm, entry, result


def two(input_edge=20, kv_edge=20, kv_macs=300.0):
    """An input sweep and a kv sweep of splits 18, 20, 22: each kind within budget from its edge; kv's fill does
    `kv_macs` multiply-accumulates where input's does 544 (exact 725). Needle answers: 8 prompts at every split."""
    out = {}
    for kind, edge, macs in (("input", input_edge, 544.0), ("kv", kv_edge, kv_macs)):
        es = []
        for s in (18, 20, 22):
            e = entry(s, "within" if edge is not None and s >= edge else "over", "over")
            e["macs"] = {"exact": 725.0, "arm": macs}
            es.append(e)
        r = result(es, edges=(edge, None))
        r["needles"] = [{"index": i, "haystack": ("noise", "prose")[i % 2], "depth": 0.1 * (i % 4), "exact": True,
                         "arms": {f"{s}/ridgefill": bool((i * 7 + s + len(kind)) % 3) for s in (18, 20, 22)}}
                        for i in range(8)]
        out[kind] = r
    return out


def test_parse_kinds():
    assert parse_kinds("input") == ("input",) and parse_kinds("kv, input") == ("kv", "input")
    for bad, msg in (("keys", "--maps: 'keys' is not a map kind; use input, kv, or both separated by a comma "
                               "(input,kv) to compare them"),
                     ("kv,kv", "--maps: 'kv,kv' names a kind twice"), ("", "--maps: '' is not a map kind")):
        with pytest.raises(BadInput) as e:
            parse_kinds(bad)
        assert str(e.value).startswith(msg)


def test_the_higher_ceiling_wins_then_the_fewer_macs_then_the_first_named():
    # kv reaches a shallower split: a higher ceiling, whatever its MACs
    got = compare(two(input_edge=20, kv_edge=18, kv_macs=600.0))["choice"]
    assert (got["maps"], got["split"]) == ("kv", 18) and "input maps reach only split 20" in got["reason"]
    got = compare(two(input_edge=18, kv_edge=20))["choice"]
    assert (got["maps"], got["split"]) == ("input", 18) and "kv maps reach only split 20" in got["reason"]
    # equal ceilings: the fill with fewer multiply-accumulates
    got = compare(two(kv_macs=300.0))["choice"]
    assert got["maps"] == "kv" and f"{300 / 725:.3f} of exact's" in got["reason"]
    assert f"input maps reach the same ceiling (split 20) at {544 / 725:.3f}" in got["reason"]
    assert compare(two(kv_macs=600.0))["choice"]["maps"] == "input"
    # equal in both: the kind named first
    r = two(kv_macs=544.0)
    assert compare(r)["choice"]["maps"] == "input"
    assert compare({"kv": r["kv"], "input": r["input"]})["choice"]["maps"] == "kv"
    # a kind within budget nowhere is never chosen; neither: no choice
    got = compare(two(input_edge=None, kv_edge=22))["choice"]
    assert got["maps"] == "kv" and "input maps are within budget at no split measured" in got["reason"]
    assert compare(two(None, None))["choice"] == {"maps": None, "split": None, "configuration": None, "tail": None,
                                                   "reason": "no map kind is within budget at any split measured"}


def test_the_rule_against_a_plain_loop_on_random_recommendations():
    rng = np.random.default_rng(1)
    for _ in range(300):
        kinds = ["input", "kv"] if rng.random() < 0.5 else ["kv", "input"]
        recs = {}
        for k in kinds:
            within = rng.random() < 0.8
            recs[k] = {"split": int(rng.integers(10, 25)) if within else None, "configuration": "ridgefill",
                       "tail": 512, "ceiling_speedup": float(rng.choice([1.3, 1.4, 1.5])) if within else None,
                       "macs_ratio": float(rng.choice([0.5, 0.6])) if rng.random() < 0.9 else None}
        want = None
        for k in kinds:  # the first best by ceiling, then MACs (an unknown count loses), then order
            if recs[k]["split"] is None:
                continue
            if want is None:
                want = k
                continue
            a, b = recs[k], recs[want]
            ma = a["macs_ratio"] if a["macs_ratio"] is not None else 9.0
            mb = b["macs_ratio"] if b["macs_ratio"] is not None else 9.0
            ca, cb = a["ceiling_speedup"], b["ceiling_speedup"]
            if ca > cb or (ca == cb and ma < mb):
                want = k
        assert choose(recs, kinds)["maps"] == want


def test_paired_needles_against_a_by_hand_bootstrap():
    """The second kind's answers minus the first's on the prompts both measured at the split (a prompt only one
    kind measured, or a different prompt under the same index, is left out), resampled as numpy would."""
    r = two()
    a, b = r["input"], r["kv"]
    del b["needles"][3]["arms"]["20/ridgefill"]  # kv never measured prompt 3 at split 20
    b["needles"][5]["depth"] = 0.99  # not the same prompt
    got = paired_needles(a, b, 20, bootstrap=2000, seed=4)
    keep = [i for i in range(8) if i not in (3, 5)]
    d = np.array([100.0 * (b["needles"][i]["arms"]["20/ridgefill"] - a["needles"][i]["arms"]["20/ridgefill"])
                  for i in keep])
    idx = np.random.default_rng(4).integers(0, len(d), size=(2000, len(d)))
    boots = d[idx].mean(axis=1)
    assert got["n"] == 6 and got["mean"] == pytest.approx(d.mean())
    assert (got["low"], got["high"]) == pytest.approx((np.quantile(boots, 0.025), np.quantile(boots, 0.975)))
    assert paired_needles(a, b, 21, 100, 0) == {"n": 0, "mean": None, "low": None, "high": None}


def test_each_row_is_that_kinds_own_figures():
    r = two(input_edge=20, kv_edge=18)
    r["kv"]["splits"][1]["arms"]["ridgefill"] = arm("within", needle=70.0, key=0.21)
    r["kv"]["splits"][1]["heldout"]["fitted"] = {"k_cosine": 0.93, "v_cosine": 0.77}
    both = compare(r)
    row = next(x for x in both["splits"] if x["split"] == 20)
    assert (row["kv"]["needle"], row["kv"]["dnll_key"], row["kv"]["k_cosine"], row["kv"]["v_cosine"]) == (
        70.0, 0.21, 0.93, 0.77)
    assert (row["input"]["needle"], row["input"]["k_cosine"]) == (40.0, 0.96)
    assert row["kv"]["macs_ratio"] == pytest.approx(300 / 725)
    assert row["input"]["macs_ratio"] == pytest.approx(544 / 725)
    assert set(row["paired"]) == {"kv"}
    head, body = rows(both)
    assert len(body) == 6 and [(c[:2], chosen) for c, chosen in body[:2]] == [(["18", "input"], False),
                                                                              (["18 ★", "kv"], True)]
    assert head[7] == "needle - input\npaired CI (prompts)" and body[0][0][7] == ""


def test_sweeps_that_measure_different_things_are_refused():
    r = two()
    other = copy.deepcopy(r)
    other["kv"]["length"] = 8192
    with pytest.raises(BadInput, match=r"^the input and kv sweeps differ in length \(4096 vs 8192\): compare sweeps"):
        compare(other)
    other = copy.deepcopy(r)
    other["kv"]["splits"] = [e for e in other["kv"]["splits"] if e["split"] == 22]
    other["input"]["splits"] = [e for e in other["input"]["splits"] if e["split"] != 22]
    with pytest.raises(BadInput, match="^the sweeps share no split$"):
        compare(other)
    with pytest.raises(BadInput, match="needs two sweeps"):
        compare({"kv": r["kv"]})
