"""The sweep's sequential rule (ridgefill/sweep/sequential.py): its p-values against brute-force enumeration, its
looks, the point rule at the last look, and its error rate by simulation."""

import itertools
import math

import numpy as np
import pytest

from ridgefill.sweep.sequential import GRID, WITHIN_FACTOR, Rule, p_over, p_within


def _enumerate_tail(n, diff, b, c):
    """P(sum of (exact - arm) >= diff) for n independent pairs: +1 with prob b, -1 with c, 0 otherwise, by listing
    every sequence."""
    probs = {1: b, -1: c, 0: 1 - b - c}
    total = 0.0
    for seq in itertools.product((1, -1, 0), repeat=n):
        if sum(seq) >= diff:
            total += math.prod(probs[x] for x in seq)
    return total


@pytest.mark.parametrize("n,diff,budget", [(4, 3, 0.1), (5, 2, 0.0), (6, 4, 0.25), (6, -1, 0.1), (3, 3, 0.5)])
def test_p_over_is_the_largest_tail_over_the_null_boundary(n, diff, budget):
    cs = np.linspace(0.0, (1 - budget) / 2, GRID)
    brute = max(_enumerate_tail(n, diff, c + budget, c) for c in cs[:: max(1, GRID // 64)].tolist() + [cs[-1]])
    got = p_over(n, diff, budget)
    assert got >= brute - 1e-12  # the grid includes every point tried here
    assert got == pytest.approx(max(_enumerate_tail(n, diff, c + budget, c) for c in cs), rel=1e-9, abs=1e-12)


def test_p_over_dominates_every_null_distribution_inside_the_boundary():
    # A null with drop below the budget has a smaller tail than the boundary's maximum.
    n, diff, budget = 6, 3, 0.2
    worst = p_over(n, diff, budget)
    for b, c in [(0.1, 0.0), (0.2, 0.05), (0.3, 0.3), (0.0, 0.5), (0.5, 0.4)]:
        assert b - c <= budget
        assert _enumerate_tail(n, diff, b, c) <= worst + 1e-12


def test_p_within_is_a_binomial_tail():
    n, missed, d = 24, 2, 0.2
    brute = sum(math.comb(n, k) * d**k * (1 - d) ** (n - k) for k in range(missed + 1))
    assert p_within(n, missed, d) == pytest.approx(brute, rel=1e-12)
    assert p_within(10, 3, 1.0) == 0.0 and p_within(10, 10, 1.0) == 1.0


def test_looks_and_levels():
    r = Rule(budget=0.1, samples=40)
    assert r.looks == (8, 16, 24, 32, 40) and r.level == pytest.approx(0.0125)
    assert Rule(0.1, 20, group=8).looks == (8, 16, 20)
    assert Rule(0.1, 5).looks == (5,)  # fewer prompts than a group: only the point rule


def test_decisions_early_and_at_the_last_look():
    r = Rule(budget=0.1, samples=40)
    all_missed = [(True, False)] * 8
    d = r.decide(all_missed)
    assert (d.verdict, d.n, d.early) == ("over", 8, True)  # 0.55 ** 8 = 0.0084 <= 0.0125
    assert d.p_over == pytest.approx(0.55**8, rel=1e-9)
    assert r.decide(all_missed[:7]).verdict is None  # between looks
    agree = [(True, True)] * 24
    assert r.decide(agree[:16]).verdict is None  # 0.8 ** 16 = 0.028: not yet
    d = r.decide(agree)
    assert (d.verdict, d.early) == ("within", True) and d.p_within == pytest.approx(0.8**24)
    # The last look is the exhaustive sweep's point rule: 4 misses of 40 is a drop of exactly 10 points.
    mixed = [(True, False)] * 4 + [(True, True)] * 36
    assert r.decide(mixed) == r.decide(mixed + [(True, False)] * 3)  # pairs past `samples` do not count
    d = r.decide(mixed)
    assert (d.verdict, d.early, d.n) == ("within", False, 40)
    assert r.decide([(True, False)] * 5 + [(True, True)] * 35).verdict == "over"


def test_bounds_table():
    rows = Rule(0.1, 40).bounds()
    assert [r["n"] for r in rows] == [8, 16, 24, 32]
    assert rows[0]["within_at_most"] is None and rows[2]["within_at_most"] == 0 and rows[3]["within_at_most"] == 1
    for row in rows:  # the bound is the first sum that stops
        n, s = row["n"], row["over_at_least"]
        assert p_over(n, s, 0.1) <= 0.0125 < p_over(n, s - 1, 0.1)


def _simulate(rule, b, c, runs, rng):
    """Early decisions of `rule` on `runs` simulated prompt streams with P(+1) = b, P(-1) = c."""
    tie = max(1 - b - c, 0.0) / 2
    cat = rng.choice(4, size=(runs, rule.samples), p=[b, c, tie, tie])  # +1, -1, both right, both wrong
    e, a = (cat == 0) | (cat == 2), (cat == 1) | (cat == 2)
    out = {"over": 0, "within": 0}
    for i in range(runs):
        pairs = list(zip(e[i].tolist(), a[i].tolist()))
        for n in rule.looks[:-1]:
            d = rule.decide(pairs[:n])
            if d.verdict:
                out[d.verdict] += 1
                break
    return out


def test_error_rate_by_simulation():
    rng = np.random.default_rng(0)
    rule = Rule(budget=0.1, samples=40)
    runs = 3000
    # At the null boundary (drop = budget) the rule rarely stops "over" early, whatever the nuisance.
    for c in (0.0, 0.2, 0.45):
        stats = _simulate(rule, 0.1 + c, c, runs, rng)
        assert stats["over"] / runs <= rule.alpha
    # At a drop of WITHIN_FACTOR budgets it rarely stops "within" early.
    d = WITHIN_FACTOR * 0.1
    for c in (0.0, 0.3):
        stats = _simulate(rule, d + c, c, runs, rng)
        assert stats["within"] / runs <= rule.alpha
    # And it does stop where the answer is plain: a drop of 100 points at the first look, none by the third.
    assert _simulate(rule, 1.0, 0.0, 50, rng)["over"] == 50
    assert _simulate(rule, 0.0, 0.0, 50, rng)["within"] == 50


def test_bad_rules_are_refused():
    for kw in ({"budget": -0.1, "samples": 40}, {"budget": 0.1, "samples": 0}, {"budget": float("nan"), "samples": 4},
               {"budget": 0.1, "samples": 4, "alpha": 0}):
        with pytest.raises(ValueError):
            Rule(**kw)
