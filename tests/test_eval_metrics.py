"""Release-gate metrics (ridgefill.evaluate.metrics) against brute-force references and hand-made cases."""

import itertools
import math

import numpy as np
import pytest

from ridgefill.evaluate.metrics import (
    doc_summary,
    exact_match,
    key_mask,
    kl_exact_arm,
    log_softmax,
    novel_mask,
    paired_bootstrap,
    token_nll,
    top1_agree,
)


# ---------------------------------------------------------------- brute-force references (plain Python)


def _softmax_ref(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    s = sum(e)
    return [v / s for v in e]


def _nll_ref(logits, targets):
    return [-math.log(_softmax_ref(list(map(float, row)))[t]) for row, t in zip(logits, targets)]


def _kl_ref(le, la):
    out = []
    for re_, ra in zip(le, la):
        p, q = _softmax_ref(list(map(float, re_))), _softmax_ref(list(map(float, ra)))
        out.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q) if pi > 0))
    return out


def _novel_ref(tokens, start, run):
    tokens = [int(v) for v in tokens]
    n = len(tokens)
    covered = [False] * n
    for j in range(0, n - run + 1):
        w = tokens[j : j + run]
        if any(tokens[jp : jp + run] == w for jp in range(j)):
            for i in range(j, j + run):
                covered[i] = True
    return [not covered[i] for i in range(start, n)]


# ---------------------------------------------------------------- token_nll, KL, top-1


def test_token_nll_matches_loops():
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=3.0, size=(7, 11)).astype(np.float32)
    targets = rng.integers(0, 11, size=7)
    got = token_nll(logits, targets)
    assert got.dtype == np.float64 and got.shape == (7,)
    np.testing.assert_allclose(got, _nll_ref(logits, targets), rtol=1e-12, atol=1e-12)


def test_token_nll_known_values_and_stability():
    # Uniform over 4 tokens: log 4 each. Huge offsets must not overflow.
    np.testing.assert_allclose(token_nll(np.zeros((2, 4)), [0, 3]), [math.log(4)] * 2, rtol=1e-15)
    big = np.array([[1000.0, 1000.0], [-1e4, -1e4 + math.log(3)]])
    np.testing.assert_allclose(token_nll(big, [1, 1]), [math.log(2), -math.log(3 / 4)], rtol=1e-12)
    # A float16 input is promoted before any arithmetic.
    assert np.isfinite(token_nll(np.array([[60000.0, -60000.0]], dtype=np.float16), [1])).all()
    np.testing.assert_allclose(np.exp(log_softmax(np.zeros((1, 5)))).sum(), 1.0)


def test_token_nll_rejects_bad_input():
    with pytest.raises(ValueError):
        token_nll(np.zeros((3, 4)), [0, 1])
    with pytest.raises(ValueError):
        token_nll(np.zeros((2, 4)), [0, 4])
    with pytest.raises(ValueError):
        token_nll(np.zeros((2, 4)), [0.0, 1.0])
    with pytest.raises(ValueError):
        token_nll(np.zeros(4), [0])


def test_kl_matches_definition():
    rng = np.random.default_rng(2)
    le = rng.normal(scale=2.0, size=(6, 9))
    la = le + rng.normal(scale=0.7, size=(6, 9))
    got = kl_exact_arm(le, la)
    assert got.shape == (6,)
    np.testing.assert_allclose(got, _kl_ref(le, la), rtol=1e-10, atol=1e-14)
    assert np.all(kl_exact_arm(le, le) == 0.0)
    # Adding a constant per row leaves the distributions, hence the KL, unchanged.
    np.testing.assert_allclose(kl_exact_arm(le, le + 5.0), 0.0, atol=1e-12)
    # Hand case: p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3).
    q = np.log([[0.25, 0.75]])
    np.testing.assert_allclose(kl_exact_arm(np.zeros((1, 2)), q), [0.5 * math.log(2) + 0.5 * math.log(2 / 3)])
    # Exact puts zero mass on a token: that term counts 0.
    np.testing.assert_allclose(kl_exact_arm([[0.0, -np.inf]], [[0.0, 0.0]]), [math.log(2)])
    with pytest.raises(ValueError):
        kl_exact_arm(le, la[:, :5])


def test_top1_agree():
    le = np.array([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    la = np.array([[0.0, 5.0, 1.0], [0.0, 3.0, 0.0], [1.0, 1.0, 9.0]])
    np.testing.assert_array_equal(top1_agree(le, la), [True, False, True])
    assert top1_agree(le, la).dtype == bool


# ---------------------------------------------------------------- novel tokens


def test_novel_mask_hand_cases():
    # "a b c a b c" with run 3: window at j=3 repeats j=0, so tokens 3..5 are not novel.
    np.testing.assert_array_equal(novel_mask([1, 2, 3, 1, 2, 3], 0, run=3), [1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(novel_mask([1, 2, 3, 1, 2, 3], 4, run=3), [0, 0])
    # A constant run: the earlier occurrence overlaps (j' = j - 1); every token from 1 on is covered.
    np.testing.assert_array_equal(novel_mask([7] * 5, 0, run=3), [1, 0, 0, 0, 0])
    # Shorter than run: no windows, all novel; start == N gives an empty mask.
    np.testing.assert_array_equal(novel_mask([4, 4, 4], 1, run=8), [True, True])
    assert novel_mask([4, 4, 4], 3).shape == (0,)
    assert novel_mask([], 0).shape == (0,)
    # A repeat window that starts before the scored start still covers scored tokens.
    toks = [5, 6, 9, 5, 6, 1, 2]
    np.testing.assert_array_equal(novel_mask(toks, 4, run=2), [False, True, True])
    # run = 1: a token is novel iff it did not occur before.
    np.testing.assert_array_equal(novel_mask([1, 2, 1, 3, 2], 0, run=1), [1, 1, 0, 1, 0])


def test_novel_mask_matches_brute_force():
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(400):
        n = int(rng.integers(0, 40))
        alphabet = int(rng.integers(1, 4))
        run = int(rng.integers(1, 7))
        toks = rng.integers(0, alphabet, size=n)
        if rng.random() < 0.3 and n > 6:  # plant a copy so long runs repeat too
            k = int(rng.integers(1, n // 2 + 1))
            s = int(rng.integers(0, n - k + 1))
            d = int(rng.integers(0, n - k + 1))
            toks[d : d + k] = toks[s : s + k].copy()
        start = int(rng.integers(0, n + 1))
        got = novel_mask(toks, start, run=run)
        assert got.dtype == bool and got.shape == (n - start,)
        np.testing.assert_array_equal(got, _novel_ref(toks, start, run))
        checked += 1
    # Default run 8 with a binary alphabet (many repeats) and large token ids.
    for _ in range(30):
        n = int(rng.integers(0, 60))
        toks = rng.integers(0, 2, size=n) * 150_000 + 7
        start = int(rng.integers(0, n + 1))
        np.testing.assert_array_equal(novel_mask(toks, start), _novel_ref(toks, start, 8))
    assert checked == 400


def test_novel_mask_rejects_bad_input():
    for args in (([1, 2, 3], -1), ([1, 2, 3], 4)):
        with pytest.raises(ValueError):
            novel_mask(*args)
    with pytest.raises(ValueError):
        novel_mask([1, 2, 3], 0, run=0)
    with pytest.raises(ValueError):
        novel_mask(np.zeros((2, 2), dtype=int), 0)


def test_novel_mask_is_fast_on_long_documents():
    toks = np.random.default_rng(4).integers(0, 50_000, size=200_000)
    toks[150_000:160_000] = toks[10_000:20_000]
    m = novel_mask(toks, 100_000)
    assert m.shape == (100_000,)
    assert not m[50_000:60_000].any() and m[:40_000].all()


# ---------------------------------------------------------------- key tokens, summary


def test_key_mask():
    full = np.array([1.0, 1.0, 1.0, 0.5, np.nan])
    tail = np.array([3.0, 3.5, 0.0, 2.5001, 9.0])
    np.testing.assert_array_equal(key_mask(full, tail), [False, True, False, True, False])
    np.testing.assert_array_equal(key_mask(full, tail, threshold=0.0), [True, True, False, True, False])
    with pytest.raises(ValueError):
        key_mask(full, tail[:3])


def test_doc_summary_hand_case():
    e = np.array([1.0, 2.0, 3.0, 4.0])
    a = np.array([1.5, 2.0, 4.0, 3.0])  # deltas 0.5, 0, 1, -1
    kl = np.array([0.1, 0.0, 0.3, 0.2])
    top1 = np.array([True, True, False, True])
    novel = np.array([False, True, True, False])
    key = np.array([True, False, False, False])
    s = doc_summary(e, a, kl, top1, novel, key)
    assert s["tokens"] == 4 and s["novel_tokens"] == 2 and s["key_tokens"] == 1
    assert s["nll_exact"] == pytest.approx(2.5) and s["nll_arm"] == pytest.approx(2.625)
    assert s["dnll"] == pytest.approx(0.125)
    assert s["dnll_novel"] == pytest.approx(0.5)
    assert s["dnll_key"] == pytest.approx(0.5)
    assert s["kl"] == pytest.approx(0.15)
    assert s["top1"] == pytest.approx(0.75)
    assert all(isinstance(v, (int, float)) for v in s.values())


def test_doc_summary_empty_masks_give_none():
    e = np.array([1.0, 2.0])
    s = doc_summary(e, e + 1, np.zeros(2), np.ones(2, bool), np.zeros(2, bool), np.zeros(2, bool))
    assert s["dnll"] == pytest.approx(1.0)
    assert s["dnll_novel"] is None and s["dnll_key"] is None
    assert s["novel_tokens"] == 0 and s["key_tokens"] == 0
    z = np.zeros(0)
    s0 = doc_summary(z, z, z, z.astype(bool), z.astype(bool), z.astype(bool))
    assert s0["tokens"] == 0 and s0["dnll"] is None and s0["kl"] is None and s0["top1"] is None
    with pytest.raises(ValueError):
        doc_summary(e, e, np.zeros(3), np.ones(2, bool), np.ones(2, bool), np.ones(2, bool))
    with pytest.raises(ValueError):
        doc_summary(e, e, np.zeros(2), np.ones(2), np.ones(2, bool), np.ones(2, bool))


def test_metrics_compose_on_a_document():
    rng = np.random.default_rng(5)
    T, V = 12, 6
    le = rng.normal(size=(T, V))
    la = le + rng.normal(scale=0.5, size=(T, V))
    tgt = rng.integers(0, V, size=T)
    ne, na = token_nll(le, tgt), token_nll(la, tgt)
    s = doc_summary(ne, na, kl_exact_arm(le, la), top1_agree(le, la), np.ones(T, bool), np.ones(T, bool))
    assert s["dnll"] == pytest.approx(float(np.mean(_nll_ref(la, tgt)) - np.mean(_nll_ref(le, tgt))))
    assert s["dnll_novel"] == pytest.approx(s["dnll"]) and s["dnll_key"] == pytest.approx(s["dnll"])
    assert s["kl"] == pytest.approx(float(np.mean(_kl_ref(le, la))))


# ---------------------------------------------------------------- paired bootstrap


def _exact_bootstrap(d, w=None):
    """All n^n equally likely resamples -> sorted statistic values."""
    n = len(d)
    vals = []
    for idx in itertools.product(range(n), repeat=n):
        if w is None:
            vals.append(sum(d[i] for i in idx) / n)
        else:
            vals.append(sum(w[i] * d[i] for i in idx) / sum(w[i] for i in idx))
    return np.sort(np.array(vals))


def _quantile_exact(sorted_vals, p):
    """Smallest x with P(X <= x) >= p for the discrete uniform distribution over sorted_vals."""
    k = int(math.ceil(p * len(sorted_vals) - 1e-12))
    return sorted_vals[max(k, 1) - 1]


@pytest.mark.parametrize(
    "a,b,w",
    [
        ([1.0, 2.5, 4.0, 7.5], [0.5, 0.5, 1.0, 1.0], None),
        ([0.3, -1.2, 2.2], [0.0, 0.1, -0.4], None),
        ([1.0, 2.5, 4.0, 7.5], [0.5, 0.5, 1.0, 1.0], [10.0, 1.0, 3.0, 6.0]),
        ([0.3, -1.2, 2.2], [0.0, 0.1, -0.4], [1.0, 5.0, 2.0]),
    ],
)
def test_bootstrap_matches_exact_enumeration(a, b, w):
    d = [x - y for x, y in zip(a, b)]
    exact = _exact_bootstrap(d, w)
    r = paired_bootstrap(a, b, samples=200_000, seed=7, weights=w)
    n = len(d)
    assert r["n"] == n
    point = float(np.mean(d)) if w is None else sum(wi * di for wi, di in zip(w, d)) / sum(w)
    assert r["mean"] == pytest.approx(point, rel=1e-12)
    # Monte-Carlo quantiles land between the exact quantiles at p -/+ 0.005 (MC error here is ~3.5e-4 in p).
    for key, p in (("low", 0.025), ("high", 0.975)):
        lo, hi = _quantile_exact(exact, p - 0.005), _quantile_exact(exact, p + 0.005)
        assert lo - 1e-12 <= r[key] <= hi + 1e-12, (key, r[key], lo, hi)
    # And the mean of the exact bootstrap distribution matches the plain mean (unweighted case).
    if w is None:
        assert exact.mean() == pytest.approx(point)


def test_bootstrap_deterministic_by_seed():
    rng = np.random.default_rng(8)
    a, b = rng.normal(size=30), rng.normal(size=30)
    r1 = paired_bootstrap(a, b, samples=2000, seed=3)
    r2 = paired_bootstrap(a, b, samples=2000, seed=3)
    r3 = paired_bootstrap(a, b, samples=2000, seed=4)
    assert r1 == r2
    assert (r1["low"], r1["high"]) != (r3["low"], r3["high"])
    assert r1["mean"] == r3["mean"]
    assert r1["low"] < r1["mean"] < r1["high"]
    # Lists and arrays give the same answer.
    assert paired_bootstrap(list(a), list(b), samples=2000, seed=3) == r1


def test_bootstrap_constant_difference_zero_width():
    a = np.array([0.1, 0.7, 1.3, 2.9, 5.0])
    for w in (None, [1, 2, 3, 4, 5]):
        r = paired_bootstrap(a + 0.3, a, samples=500, seed=0, weights=w)
        assert r["low"] == r["high"] == r["mean"]
        assert r["mean"] == pytest.approx(0.3)
    r = paired_bootstrap([2.0], [1.0], samples=100)
    assert r == {"mean": 1.0, "low": 1.0, "high": 1.0, "n": 1}


def test_bootstrap_weights():
    # Equal weights reproduce the unweighted interval (same seed, same draws).
    rng = np.random.default_rng(9)
    a, b = rng.normal(size=12), rng.normal(size=12)
    r0 = paired_bootstrap(a, b, samples=3000, seed=1)
    r1 = paired_bootstrap(a, b, samples=3000, seed=1, weights=np.full(12, 4.0))
    for k in ("mean", "low", "high"):
        assert r1[k] == pytest.approx(r0[k], rel=1e-12, abs=1e-12)
    # Integer weights equal token-level pooling of the point estimate.
    w = np.array([1, 3, 0, 2])
    av, bv = np.array([1.0, 2.0, np.nan, 0.0]), np.array([0.0, 0.0, 0.0, 1.0])
    r = paired_bootstrap(av, bv, samples=1000, weights=w)
    assert r["n"] == 3  # the zero-weight unit (NaN allowed there) is dropped
    assert r["mean"] == pytest.approx((1 * 1 + 3 * 2 + 2 * -1) / 6)
    # A unit with a huge weight dominates: the interval shrinks toward its difference.
    r = paired_bootstrap([5.0, 0.0, 1.0], [0.0, 0.0, 0.0], samples=2000, weights=[1e6, 1, 1])
    assert r["mean"] == pytest.approx(5.0, rel=1e-5) and r["high"] == pytest.approx(5.0, rel=1e-5)


def test_bootstrap_refuses_bad_input():
    bad = [
        (([], []), {}),
        (([1.0, 2.0], [1.0]), {}),
        (([[1.0]], [[1.0]]), {}),
        (([1.0, np.nan], [0.0, 0.0]), {}),
        (([1.0, 2.0], [0.0, 0.0]), {"weights": [1.0]}),
        (([1.0, 2.0], [0.0, 0.0]), {"weights": [1.0, -1.0]}),
        (([1.0, 2.0], [0.0, 0.0]), {"weights": [0.0, 0.0]}),
        (([1.0, 2.0], [0.0, 0.0]), {"level": 1.0}),
        (([1.0, 2.0], [0.0, 0.0]), {"samples": 0}),
    ]
    for args, kw in bad:
        with pytest.raises(ValueError):
            paired_bootstrap(*args, **kw)


# ---------------------------------------------------------------- string match


def test_exact_match():
    assert exact_match("The special  magic number is 12345.", "12345")
    assert exact_match("Answer:\n  PARIS\tFrance", "paris france")
    assert exact_match("the numbers are 1, 22 and 333", ["22", "333", "1"])
    assert not exact_match("the numbers are 1, 22", ["22", "333"])
    assert not exact_match("1234", "12345")
    assert exact_match("abc", ("ABC",))
    with pytest.raises(ValueError):
        exact_match("abc", [])
    with pytest.raises(ValueError):
        exact_match("abc", ["  "])
