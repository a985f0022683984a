"""Capture statistics and ridge solve against brute force (numpy float64)."""

import numpy as np
import pytest

from ridgefill.capture.stats import Moments, merge, mix, moments_of
from ridgefill.solve.ridge import decompose, direct_solve, lam, maps_at


def _data(rng, n=300, dx=12, dy=9, k=3):
    x = rng.normal(size=(n, dx)) * rng.uniform(0.1, 5, size=dx) + rng.normal(size=dx)
    ys = np.stack([x @ rng.normal(size=(dx, dy)) + rng.normal(size=dy) + 0.3 * rng.normal(size=(n, dy)) for _ in range(k)])
    return x, ys


def _close(a: Moments, b: Moments, rtol=1e-10):
    assert a.n == b.n
    for f in ("mean_x", "cxx", "mean_y", "cxy", "yy"):
        np.testing.assert_allclose(getattr(a, f), getattr(b, f), rtol=rtol, atol=1e-9)


def test_moments_match_definition():
    rng = np.random.default_rng(0)
    x, ys = _data(rng)
    m = moments_of(x, ys)
    xc = x - x.mean(0)
    np.testing.assert_allclose(m.cxx, xc.T @ xc, rtol=1e-12)
    for l in range(ys.shape[0]):
        yc = ys[l] - ys[l].mean(0)
        np.testing.assert_allclose(m.cxy[l], xc.T @ yc, rtol=1e-12, atol=1e-10)
        np.testing.assert_allclose(m.yy[l], (yc**2).sum(), rtol=1e-12)


@pytest.mark.parametrize("cuts", [[1], [150], [7, 8, 200, 299], list(range(1, 300, 37))])
def test_chan_merge_equals_single_pass(cuts):
    rng = np.random.default_rng(1)
    x, ys = _data(rng)
    edges = [0, *cuts, len(x)]
    acc = Moments.empty(ys.shape[0], x.shape[1], ys.shape[2])
    for a, b in zip(edges, edges[1:]):
        acc = merge(acc, moments_of(x[a:b], ys[:, a:b]))
    _close(acc, moments_of(x, ys))


def test_mix_is_weighted_covariance():
    rng = np.random.default_rng(2)
    x, ys = _data(rng)
    a, b = moments_of(x[:100], ys[:, :100]), moments_of(x[100:] + 3.0, ys[:, 100:] - 1.0)
    # share = natural proportion reproduces the plain merge
    _close(mix(a, b, 200 / 300), merge(a, b))
    # weighted rows: duplicating b's rows 3x (integer weights) is the same as share 3*200/(100+3*200)
    x3 = np.concatenate([x[:100]] + [x[100:] + 3.0] * 3)
    y3 = np.concatenate([ys[:, :100]] + [ys[:, 100:] - 1.0] * 3, axis=1)
    ref = moments_of(x3, y3)
    got = mix(a, b, 600 / 700)
    scale = 300 / 700  # mix keeps n = na + nb rows
    np.testing.assert_allclose(got.cxx, ref.cxx * scale, rtol=1e-10)
    np.testing.assert_allclose(got.cxy, ref.cxy * scale, rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(got.mean_y, ref.mean_y, rtol=1e-12)


@pytest.mark.parametrize("alpha", [1e-5, 1e-3, 0.1, 1.0])
def test_ridge_matches_lstsq(alpha):
    rng = np.random.default_rng(3)
    x, ys = _data(rng)
    m = moments_of(x, ys)
    w, b = maps_at(decompose(m), alpha)
    lam_ = alpha * np.trace(m.cxx) / x.shape[1]
    # Brute force: augmented least squares on centered data, [Xc; sqrt(lam) I] W^T = [Yc; 0]
    xc = x - x.mean(0)
    aug = np.vstack([xc, np.sqrt(lam_) * np.eye(x.shape[1])])
    for l in range(ys.shape[0]):
        yc = ys[l] - ys[l].mean(0)
        wt, *_ = np.linalg.lstsq(aug, np.vstack([yc, np.zeros((x.shape[1], yc.shape[1]))]), rcond=None)
        np.testing.assert_allclose(w[l], wt.T, rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(b[l], ys[l].mean(0) - wt.T @ x.mean(0), rtol=1e-7, atol=1e-9)
    w2, b2 = direct_solve(m, alpha)
    np.testing.assert_allclose(w, w2, rtol=1e-7, atol=1e-10)
    np.testing.assert_allclose(b, b2, rtol=1e-7, atol=1e-10)
    assert lam(alpha, decompose(m)) == pytest.approx(lam_)


def test_tiny_alpha_recovers_exact_linear_map():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(500, 6))
    a, c = rng.normal(size=(4, 6)), rng.normal(size=4)
    ys = (x @ a.T + c)[None]
    w, b = maps_at(decompose(moments_of(x, ys)), 1e-12)
    np.testing.assert_allclose(w[0], a, atol=1e-8)
    np.testing.assert_allclose(b[0], c, atol=1e-8)


def test_quantize_bias_correction_cancels_the_error_at_the_mean():
    from ridgefill.formats import int8
    from ridgefill.quantize.run import quantize_map

    rng = np.random.default_rng(5)
    w = (rng.normal(size=(8, 300)) * 0.05).astype(np.float32)
    w[:, 7] = 1e-4  # a tiny-weight column next to large ones, as massive-activation inputs get
    b = rng.normal(size=8).astype(np.float32)
    mean_x = rng.normal(size=300)
    mean_x[7] = 4.5e4  # a massive, nearly constant input dimension
    codes, scale_bits, bias_bits = quantize_map(w, b, mean_x)
    wq = int8.dequantize(codes, scale_bits)
    bq = int8.bf16_bits_to_f32(bias_bits)
    # at the mean input, the int8 map reproduces the float map up to bf16 rounding of the bias
    exact = w.astype(np.float64) @ mean_x + b
    got = wq.astype(np.float64) @ mean_x + bq
    naive = wq.astype(np.float64) @ mean_x + int8.bf16_bits_to_f32(int8.f32_to_bf16_bits(b))
    tol = np.abs(exact) / 128 + 1e-6  # bf16 keeps 8 significant bits
    assert (np.abs(got - exact) <= tol).all()
    assert np.abs(naive - exact).max() > 10 * np.abs(got - exact).max()
    np.testing.assert_array_equal(codes, int8.quantize(w)[0])  # codes themselves are the plain int8 codes


# ---------------------------------------------------------------- the alpha grid past its edges (ridge.search)

DEFAULT = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


def _searched(alphas, f):
    """search() with a score function of alpha; also returns every alpha it asked for, in order."""
    from ridgefill.solve.ridge import search

    asked = []

    def score_of(a):
        asked.append(a)
        return {"score": f(a)}

    grid, best, ext = search(alphas, score_of)
    return grid, best, ext, asked


def _brute_best(f, lo=1e-9, hi=1e3, per_decade=20):
    """The best alpha on a dense log grid (no search at all)."""
    dense = 10 ** np.linspace(np.log10(lo), np.log10(hi), int(np.log10(hi / lo) * per_decade) + 1)
    return dense[np.argmax([f(a) for a in dense])]


def test_search_extends_below_the_grid_until_the_score_turns():
    peak = 1e-7
    f = lambda a: -0.01 * (np.log10(a) - np.log10(peak)) ** 2  # noqa: E731
    grid, best, ext, asked = _searched(DEFAULT, f)
    # the grid's mean ratio is 10 ** 0.5; each step is rounded to two significant digits
    assert asked == [*DEFAULT, 3.2e-6, 1e-6, 3.2e-7, 1e-7, 3.2e-8]
    assert [g["alpha"] for g in grid] == [3.2e-8, 1e-7, 3.2e-7, 1e-6, 3.2e-6, *DEFAULT]
    assert [g["alpha"] for g in grid if g["extended"]] == [3.2e-8, 1e-7, 3.2e-7, 1e-6, 3.2e-6]
    assert ext == [{"edge": "low", "to": 3.2e-8, "steps": 5, "stopped": "turned"}]
    assert best["alpha"] == 1e-7 and best["score"] == f(1e-7)
    assert abs(np.log10(best["alpha"]) - np.log10(_brute_best(f))) < 0.5  # within one grid step of brute force
    # the given grid alone stops at its edge
    assert max(DEFAULT, key=f) == 1e-5


def test_search_extends_above_the_grid():
    f = lambda a: -((np.log10(a) - 1.0) ** 2)  # noqa: E731  (peak at alpha 10)
    grid, best, ext, asked = _searched(DEFAULT, f)
    assert asked == [*DEFAULT, 3.2, 10.0, 32.0]
    assert ext == [{"edge": "high", "to": 32.0, "steps": 3, "stopped": "turned"}]
    assert best["alpha"] == 10.0 == _brute_best(f)
    assert [g["alpha"] for g in grid][-3:] == [3.2, 10.0, 32.0] and all(g["extended"] for g in grid[-3:])


def test_search_leaves_a_bracketed_optimum_alone():
    f = lambda a: -((np.log10(a) + 3.0) ** 2)  # noqa: E731  (peak at 1e-3, inside the grid)
    grid, best, ext, asked = _searched(DEFAULT, f)
    assert asked == list(DEFAULT) and ext == [] and not any(g["extended"] for g in grid)
    assert best["alpha"] == 1e-3


def test_search_edge_tied_within_tolerance_is_probed_once_and_a_flat_score_stops():
    """The best is the second alpha and the edge ties with it (within TIE): one step past the edge shows whether
    the optimum lies beyond; a flat score there stops the extension and leaves the choice alone."""
    from ridgefill.solve.ridge import TIE

    scores = {1e-5: 0.9 - TIE / 4, 3e-5: 0.9}
    f = lambda a: scores.get(a, 0.9 - TIE / 4 if a < 1e-5 else 0.9 - np.log10(a / 3e-5) / 100)  # noqa: E731
    grid, best, ext, asked = _searched(DEFAULT, f)
    assert asked == [*DEFAULT, 3.2e-6]
    assert ext == [{"edge": "low", "to": 3.2e-6, "steps": 1, "stopped": "flat"}]
    assert best["alpha"] == 3e-5
    # an edge that is worse than the best by more than TIE: the score has turned inside the grid
    scores[1e-5] = 0.9 - 2 * TIE
    assert _searched(DEFAULT, f)[3] == list(DEFAULT)


def test_search_exact_ties_go_to_the_smaller_alpha_and_improvements_within_tie_stop():
    from ridgefill.solve.ridge import TIE

    f = lambda a: 0.5 if a <= 1e-4 else 0.4  # noqa: E731  (flat at the low end: the regularizer does nothing)
    grid, best, ext, asked = _searched(DEFAULT, f)
    assert asked == [*DEFAULT, 3.2e-6] and ext[0]["stopped"] == "flat"
    assert best["alpha"] == 3.2e-6  # an exact tie: the smaller alpha, as inside the grid
    g = lambda a: 0.5 + (TIE / 2 if a < 1e-5 else 0.0) if a <= 1e-4 else 0.4  # noqa: E731
    _, best, ext, asked = _searched(DEFAULT, g)
    assert asked == [*DEFAULT, 3.2e-6] and ext[0]["stopped"] == "flat" and best["alpha"] == 3.2e-6


def test_search_stops_at_the_alpha_limits():
    from ridgefill.solve.ridge import ALPHA_LIMITS

    grid, best, ext, asked = _searched(DEFAULT, lambda a: -0.01 * np.log10(a))  # better with less regularization
    assert asked[len(DEFAULT):] == [3.2e-6, 1e-6, 3.2e-7, 1e-7, 3.2e-8, 1e-8, 3.2e-9, 1e-9]
    assert ext == [{"edge": "low", "to": 1e-9, "steps": 8, "stopped": "limit"}] and best["alpha"] == ALPHA_LIMITS[0]
    grid, best, ext, asked = _searched([0.1, 1.0], lambda a: 0.01 * np.log10(a))
    assert asked == [0.1, 1.0, 10.0, 100.0, 1000.0] and ext[0]["stopped"] == "limit" and best["alpha"] == 1000.0


def test_search_bounded_steps_on_a_dense_grid_and_one_alpha_is_a_fixed_choice():
    from ridgefill.solve.ridge import MAX_EXTEND

    grid, best, ext, asked = _searched([1e-3, 1.1e-3], lambda a: -np.log10(a))
    assert len(asked) == 2 + MAX_EXTEND and ext[0]["stopped"] == "steps"
    assert asked[2:] == sorted(asked[2:], reverse=True) and len(set(asked)) == len(asked)
    grid, best, ext, asked = _searched([1e-3], lambda a: -np.log10(a))
    assert asked == [1e-3] and ext == [] and best["alpha"] == 1e-3


def test_chunk_moments_match_float64_brute_force_with_float32_products():
    """capture's torch path with float32 products: every field within float32 rounding of the float64 definition,
    `yy` included (a float32 norm over n * dy = 1.7M squares was off by 5e-3; the squares are now summed in
    float64)."""
    import torch

    from ridgefill.capture.forward import chunk_moments

    rng = np.random.default_rng(3)
    n, dx, dy, k = 3000, 16, 576, 3
    x = (rng.normal(size=(n, dx)) * 2 + 5).astype(np.float32)
    ys = [(rng.normal(size=(n, dy)) * 3 + 1).astype(np.float32) for _ in range(k)]
    got = chunk_moments(torch.from_numpy(x), [torch.from_numpy(y) for y in ys], "float32")
    want = moments_of(x.astype(np.float64), np.stack(ys).astype(np.float64))
    assert got.n == want.n
    np.testing.assert_allclose(got.yy, want.yy, rtol=1e-6)
    np.testing.assert_allclose(got.mean_y, want.mean_y, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got.cxx, want.cxx, rtol=1e-5, atol=1e-2)
