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
    from ridgefill.export import int8
    from ridgefill.export.quantize import quantize_map

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
