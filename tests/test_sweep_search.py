"""The needle search (`sweep.search`): bisection finds the edge an exhaustive measurement finds, visiting fewer
splits, and measures the last few open splits side by side."""

import itertools
import random

import pytest

from ridgefill.sweep.search import TOGETHER, Bisection, exhaustive_edge


def search(candidates, truth, known=None):
    """Run a Bisection against true verdicts; -> (edge, passes: the splits measured in each pass)."""
    b = Bisection(candidates, known=dict(known or {}))
    passes = []
    while splits := b.next_splits():
        assert not set(splits) & set(b.verdicts), "a split measured twice"
        passes.append(splits)
        for s in splits:
            b.record(s, truth[s])
    return b, passes


def test_monotone_verdicts_give_the_exhaustive_edge_in_few_passes():
    """Every monotone truth on 1..10 candidates, with or without splits known over on key ΔNLL below the edge."""
    for n in range(1, 11):
        cands = list(range(2, 2 * n + 2, 2))
        for k in range(n + 1):  # the first k are over, the rest within
            truth = {s: "over" if i < k else "within" for i, s in enumerate(cands)}
            for known_n in range(k + 1):
                known = {s: "over" for s in cands[:known_n]}
                b, passes = search(cands, truth, known)
                assert b.edge == exhaustive_edge([s for s in cands if truth[s] == "within"], cands)
                measured = [s for p in passes for s in p]
                assert not set(measured) & set(known)
                assert len(passes) <= max(1, (n - known_n).bit_length())
                assert b.inferred() == truth


def test_the_last_open_splits_are_measured_together():
    cands = [8, 10, 12, 14, 16, 18, 20, 22]
    truth = {s: "over" if s < 20 else "within" for s in cands}
    # 8..18 over on key ΔNLL: 20 and 22 remain, measured in one pass
    _, passes = search(cands, truth, {s: "over" for s in cands[:6]})
    assert passes == [[20, 22]]
    # nothing known: the middle (16) first, then the TOGETHER (3) still open above it in one pass
    assert TOGETHER == 3
    _, passes = search(cands, truth)
    assert passes == [[16], [18, 20, 22]]


def test_a_deeper_split_over_moves_the_edge_past_it():
    """Splits measured side by side that break monotonicity: the edge lies above the deepest split over, as the
    exhaustive edge does."""
    cands = [10, 12, 14]
    truth = {10: "within", 12: "over", 14: "within"}
    b, passes = search(cands, truth)
    assert passes == [[10, 12, 14]] and b.edge == 14 == exhaustive_edge([10, 14], cands)
    b, _ = search(cands, {10: "within", 12: "within", 14: "over"})
    assert b.edge is None and b.inferred() == {10: "within", 12: "within", 14: "over"}
    # a split known over on key ΔNLL deeper than one within counts as well
    b, _ = search([10, 12], {10: "within", 12: "over"}, known={12: "over"})
    assert b.edge is None


def test_random_truths_against_the_exhaustive_edge():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 12)
        cands = sorted(rng.sample(range(1, 40), n))
        k = rng.randint(0, n)
        truth = {s: "over" if i < k else "within" for i, s in enumerate(cands)}
        b, passes = search(cands, truth)
        assert b.edge == exhaustive_edge([s for s in cands if truth[s] == "within"], cands)
        assert sum(len(p) for p in passes) <= n


@pytest.mark.parametrize("bad", ["maybe", None])
def test_a_verdict_is_within_or_over(bad):
    b = Bisection([1, 2])
    with pytest.raises(ValueError, match="a verdict is 'within' or 'over'"):
        b.record(b.next_splits()[0], bad)


def test_exhaustive_and_bisection_agree_on_every_monotone_truth_of_8():
    cands = [8, 10, 12, 14, 16, 18, 20, 22]
    for bits in itertools.product(("over", "within"), repeat=len(cands)):
        truth = dict(zip(cands, bits))
        if list(bits) != sorted(bits, key=lambda v: v == "within"):
            continue  # not monotone
        b, _ = search(cands, truth)
        assert b.edge == exhaustive_edge([s for s in cands if truth[s] == "within"], cands)
