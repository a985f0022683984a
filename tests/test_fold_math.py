"""ridgefill.fold.math against brute force in numpy float64 (and torch for the bf16 rounding)."""

import itertools

import numpy as np
import pytest
import torch

from ridgefill.fold.math import (
    arms,
    attention_output,
    attention_weights,
    box_nnls,
    fit_log_weights,
    fold_direction,
    fold_keys,
    refit_values,
    relative_error,
    round_to,
    select_keys,
)

HD = 16
S = HD**-0.5


def naive_attention(Q, K, V, s, beta=None):
    """One query at a time, textbook softmax in float64."""
    beta = np.zeros(len(K)) if beta is None else np.asarray(beta, dtype=np.float64)
    out = np.zeros((len(Q), V.shape[1]))
    for i, q in enumerate(np.asarray(Q, dtype=np.float64)):
        e = np.array([np.exp(s * q @ k + b) for k, b in zip(K, beta)])
        out[i] = (e / e.sum()) @ V
    return out


def on_hyperplane(rng, m, u, c):
    """Random queries Q [m, hd] moved along u so that Q u == c (c scalar or [m])."""
    Q = rng.standard_normal((m, len(u))) + 0.5
    return Q + np.outer(c - Q @ u, u) / (u @ u)


def test_attention_output_matches_naive():
    rng = np.random.default_rng(0)
    shapes = [(7, HD), (30, HD), (30, HD)]
    Q, K, V = (rng.standard_normal(shape).astype(np.float32) for shape in shapes)  # float32 in, float64 math
    for beta in (None, rng.uniform(-3, 3, 30)):
        got = attention_output(Q, K, V, S, beta)
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, naive_attention(Q, K, V, S, beta), rtol=1e-12, atol=1e-13)


def test_attention_output_survives_huge_logits():
    rng = np.random.default_rng(1)
    Q, K, V = rng.standard_normal((5, HD)), rng.standard_normal((20, HD)), rng.standard_normal((20, HD))
    with np.errstate(over="ignore", invalid="ignore"):
        assert not np.isfinite(naive_attention(Q * 1e4, K, V, S)).all()  # the naive way overflows
    out = attention_output(Q * 1e4, K, V, S)  # logits ~1e4: one key takes all the mass
    assert np.isfinite(out).all()
    np.testing.assert_array_equal(out, V[np.argmax(Q @ K.T, axis=1)])
    # a constant bias shift of 1e6 changes nothing
    beta = rng.uniform(-3, 3, 20)
    np.testing.assert_allclose(attention_output(Q, K, V, S, beta + 1e6), attention_output(Q, K, V, S, beta),
                               rtol=1e-9, atol=1e-10)
    w = attention_weights(Q * 1e4, K, S, beta - 1e6)
    assert np.isfinite(w).all() and np.allclose(w.sum(axis=1), 1.0)


def test_select_keys_is_top_r_by_rms_attention_sorted():
    rng = np.random.default_rng(2)
    Q, K = rng.standard_normal((12, HD)), rng.standard_normal((40, HD)) * 1.5
    r = 9
    A = naive_attention(Q, K, np.eye(40), S)  # [m, n] attention weights
    rms = [np.sqrt(sum(A[i, j] ** 2 for i in range(12)) / 12) for j in range(40)]
    want = sorted(sorted(range(40), key=lambda j: -rms[j])[:r])
    got = select_keys(Q, K, S, r)
    assert got.tolist() == want
    assert (np.diff(got) > 0).all()
    # ties: 10 distinct keys, each at 20 positions (j, j + 10, ...); equal scores go to the earliest positions
    tied = np.tile(K[:10], (20, 1))  # [200, hd]
    best = int(np.argmax(np.sqrt((naive_attention(Q, K[:10], np.eye(10), S) ** 2).mean(axis=0))))
    assert select_keys(Q, tied, S, 5).tolist() == [best + 10 * i for i in range(5)]
    with pytest.raises(ValueError, match="budget r"):
        select_keys(Q, K, S, 41)


def brute_force_box_ls(M, t, lo, hi):
    """Exact min ||M w - t|| over the box: try every active set (each w_j at lo, at hi, or free)."""
    r = M.shape[1]
    best, best_w = np.inf, None
    for state in itertools.product((0, 1, 2), repeat=r):
        w = np.array([lo if st == 0 else hi for st in state], dtype=np.float64)
        free = [j for j in range(r) if state[j] == 2]
        if free:
            fixed = [j for j in range(r) if state[j] != 2]
            w[free] = np.linalg.lstsq(M[:, free], t - M[:, fixed] @ w[fixed], rcond=None)[0]
            if (w[free] < lo - 1e-12).any() or (w[free] > hi + 1e-12).any():
                continue
        obj = np.linalg.norm(M @ w - t)
        if obj < best:
            best, best_w = obj, w
    return best_w, best


def test_box_nnls_reaches_the_brute_force_optimum():
    rng = np.random.default_rng(3)
    U, _ = np.linalg.qr(rng.standard_normal((40, 5)))
    W, _ = np.linalg.qr(rng.standard_normal((5, 5)))
    M = U @ np.diag(rng.uniform(1, 2, 5)) @ W.T  # [40, 5], condition number <= 2
    t = M @ rng.uniform(0, 3, 5) + 0.1 * rng.standard_normal(40)
    lo, hi = 0.5, 2.0
    want_w, want = brute_force_box_ls(M, t, lo, hi)
    w, start, final, steps = box_nnls(M, t, lo, hi)
    assert ((want_w == lo) | (want_w == hi)).any()  # constraints are active: the clipped start is not optimal
    assert final < start and 1 < steps < 300
    assert ((w >= lo) & (w <= hi)).all()
    np.testing.assert_allclose(w, want_w, atol=1e-6)
    assert final == pytest.approx(want / np.linalg.norm(t), rel=1e-10)
    # no steps: the least-squares solution clipped into the box
    w0, start0, final0, steps0 = box_nnls(M, t, lo, hi, max_iter=0)
    np.testing.assert_array_equal(w0, np.clip(np.linalg.lstsq(M, t, rcond=None)[0], lo, hi))
    assert steps0 == 0 and start0 == final0 == start


def test_fit_log_weights_recovers_duplicate_counts():
    # Dropped keys that duplicate a kept key add exactly one copy of its mass: w_j = 1 + copies.
    rng = np.random.default_rng(4)
    base = rng.standard_normal((8, HD))
    copies = np.array([0, 3, 1, 0, 5, 2, 0, 1])
    K = np.vstack([base] + [np.repeat(base[j:j + 1], c, axis=0) for j, c in enumerate(copies)])
    fit = fit_log_weights(rng.standard_normal((40, HD)), K, np.arange(8), S)
    assert fit.beta.dtype == np.float32
    np.testing.assert_allclose(fit.beta, np.log1p(copies), atol=1e-6)
    assert fit.residual < 1e-12


def test_fit_log_weights_respects_box_and_beats_its_start():
    # Key 0 stands for itself and a cluster of 30 near-copies: it needs w_0 ~ 31 > e^3, so the box binds.
    rng = np.random.default_rng(5)
    Q = rng.standard_normal((30, HD)).astype(np.float32)
    base = rng.standard_normal((5, HD)) * 2
    cluster = base[0] + 0.1 * rng.standard_normal((30, HD))
    K = np.vstack([base, cluster, rng.standard_normal((10, HD)) * 2]).astype(np.float32)  # [45, hd]
    keep = np.arange(5)
    fit = fit_log_weights(Q, K, keep, S, max_iter=20000)
    assert fit.beta[0] == np.float32(3.0)
    assert ((fit.beta >= -3) & (fit.beta <= 3)).all()
    assert fit.residual <= fit.start_residual
    # brute force: M and t built one query at a time, stabilised by each query's max logit
    M, t = np.zeros((30, 5)), np.zeros(30)
    for i, q in enumerate(Q.astype(np.float64)):
        logits = np.array([S * q @ k for k in K.astype(np.float64)])
        e = np.exp(logits - logits.max())
        M[i], t[i] = e[keep], e.sum()
    w = np.exp(fit.beta.astype(np.float64))
    assert np.linalg.norm(M @ w - t) / np.linalg.norm(t) == pytest.approx(fit.residual, rel=1e-5)
    want_w, want = brute_force_box_ls(M, t, np.exp(-3), np.exp(3))
    start = np.clip(np.linalg.lstsq(M, t, rcond=None)[0], np.exp(-3), np.exp(3))
    assert fit.start_residual == pytest.approx(np.linalg.norm(M @ start - t) / np.linalg.norm(t), rel=1e-9)
    assert want < np.linalg.norm(M @ start - t) * (1 - 1e-3)  # the start is clearly not optimal here
    assert fit.residual == pytest.approx(want / np.linalg.norm(t), rel=1e-4)
    # capped at two steps (the paper's AM-style fit, docs/method.md): still never worse than the start
    short = fit_log_weights(Q, K, keep, S, max_iter=2)
    assert short.iterations == 2 and short.residual <= short.start_residual


@pytest.mark.parametrize("ridge", [0.0, 1e-6, 1e-2])
def test_refit_values_is_the_ridge_least_squares_optimum(ridge):
    rng = np.random.default_rng(6)
    Q, K = rng.standard_normal((50, HD)).astype(np.float32), rng.standard_normal((12, HD)).astype(np.float32)
    beta = rng.uniform(-3, 3, 12).astype(np.float32)
    target = rng.standard_normal((50, HD))
    V = refit_values(Q, K, S, target, beta, ridge=ridge)
    A = naive_attention(Q, K, np.eye(12), S, beta)  # [m, r]
    lam = ridge * np.trace(A.T @ A) / 12
    want = np.linalg.solve(A.T @ A + lam * np.eye(12), A.T @ target)  # normal equations
    np.testing.assert_allclose(V, want, rtol=1e-8, atol=1e-8 * np.abs(want).max())

    def objective(X):
        return np.sum((A @ X - target) ** 2) + lam * np.sum(X**2)

    grad = A.T @ (A @ V - target) + lam * V
    assert np.abs(grad).max() < 1e-10 * np.abs(A.T @ target).max()
    for _ in range(20):
        assert objective(V + 1e-4 * rng.standard_normal(V.shape)) > objective(V)


def test_fold_is_exact_when_every_query_has_q_dot_u_one():
    rng = np.random.default_rng(7)
    u = rng.standard_normal(HD) * 0.3
    Q = on_hyperplane(rng, 64, u, 1.0)
    np.testing.assert_allclose(Q @ u, 1.0, atol=1e-13)
    K, V, beta = rng.standard_normal((32, HD)), rng.standard_normal((32, HD)), rng.uniform(-3, 3, 32)
    K_fold = fold_keys(K, beta, u, S)
    np.testing.assert_allclose(K_fold, K + np.outer(beta / S, u), rtol=0, atol=1e-15)
    np.testing.assert_allclose(attention_weights(Q, K_fold, S), attention_weights(Q, K, S, beta), atol=1e-12)
    np.testing.assert_allclose(attention_output(Q, K_fold, V, S), attention_output(Q, K, V, S, beta), atol=1e-12)
    # Q's rows fill the hyperplane {q: q.u = 1}, so Sigma u = 0 and with rho -> 0 the fit returns u itself
    u_hat = fold_direction(Q, rho=1e-12)
    np.testing.assert_allclose(Q @ u_hat, 1.0, atol=1e-9)
    np.testing.assert_allclose(u_hat, u, atol=1e-9)


def test_fold_direction_is_the_constrained_minimiser():
    rng = np.random.default_rng(8)
    Q = rng.standard_normal((200, HD)) * rng.uniform(0.2, 3, HD) + rng.standard_normal(HD)
    rho = 1e-2
    u = fold_direction(Q.astype(np.float32), rho=rho)
    assert np.mean(Q.astype(np.float32).astype(np.float64) @ u) == pytest.approx(1.0, abs=1e-12)
    u = fold_direction(Q, rho=rho)
    mu = Q.mean(axis=0)
    sigma = sum(np.outer(q - mu, q - mu) for q in Q) / len(Q)  # population covariance
    P = sigma + rho * np.trace(sigma) / HD * np.eye(HD)
    # independent route: u = u0 + N y over the constraint plane mu.u = 1, minimise u^T P u in y
    u0 = mu / (mu @ mu)
    N = np.linalg.svd(mu[None, :])[2][1:].T  # [hd, hd-1], orthonormal basis of mu-perp
    y = np.linalg.solve(N.T @ P @ N, -N.T @ P @ u0)
    np.testing.assert_allclose(u, u0 + N @ y, rtol=1e-10, atol=1e-12)
    X = rng.integers(-3, 4, (20, HD)).astype(np.float64)
    with pytest.raises(ValueError, match="zero mean"):
        fold_direction(np.vstack([X, -X]))  # integer sums: the mean is exactly zero


def test_fold_error_is_q_dot_u_minus_one_times_drop_error_to_first_order():
    # Fixed values, logits: AM s q.k + beta, drop s q.k, fold s q.k + (q.u) beta. With beta = eps b,
    # fold - AM = eps (q.u - 1) J b + O(eps^2) and drop - AM = -eps J b + O(eps^2), so the ratio
    # |fold - AM| / (|q.u - 1| |drop - AM|) = 1 + O(eps) per query (docs/method.md, "The fold").
    rng = np.random.default_rng(9)
    n = 48
    K, V, b = rng.standard_normal((n, HD)), rng.standard_normal((n, HD)), rng.uniform(-1, 1, n)
    u = rng.standard_normal(HD) * 0.3
    c = 1 + rng.choice([-1, 1], 40) * rng.uniform(0.05, 0.5, 40)  # q.u per query
    Q = on_hyperplane(rng, 40, u, c)
    deviation = []
    for eps in (1e-1, 1e-2, 1e-3):
        beta = eps * b
        am = attention_output(Q, K, V, S, beta)
        fold_err = np.linalg.norm(attention_output(Q, fold_keys(K, beta, u, S), V, S) - am, axis=1)
        drop_err = np.linalg.norm(attention_output(Q, K, V, S) - am, axis=1)
        deviation.append(np.abs(fold_err / (np.abs(c - 1) * drop_err) - 1).max())
    assert deviation[0] > 1e-3  # the second-order term is really there at eps = 0.1 ...
    assert deviation[1] < 0.2 * deviation[0] and deviation[2] < 0.2 * deviation[1]  # ... and shrinks like eps
    assert deviation[2] < 1e-3


def bf16_torch(x):
    return torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()


def test_round_to_matches_torch_bit_for_bit():
    rng = np.random.default_rng(10)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    ties = (bits & np.uint32(0xFFFF0000)) | np.uint32(0x8000)  # exactly halfway, both parities of bit 16
    special = np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 3.3961776e38,
                        1.4e-45, -1.4e-45, 1.1754942e-38, 1.1754944e-38, 65504.0, 65520.0, 6e-8, 1.0], np.float32)
    x = np.concatenate([bits.view(np.float32), ties.view(np.float32), special])
    x = x[~np.isnan(x)]
    x64 = rng.standard_normal(100_000) * np.exp(rng.uniform(-30, 30, 100_000))
    with np.errstate(over="ignore"):
        for arr in (x, x64, (rng.standard_normal((3, 4, 5)) * 10).astype(np.float32)):
            got = round_to(arr, "bfloat16")
            assert got.dtype == np.float32 and got.shape == arr.shape
            np.testing.assert_array_equal(got.view(np.uint32), bf16_torch(arr).view(np.uint32))
            f16 = torch.from_numpy(arr).to(torch.float16).to(torch.float32).numpy()
            np.testing.assert_array_equal(round_to(arr, "float16").view(np.uint32), f16.view(np.uint32))
            np.testing.assert_array_equal(round_to(arr, "float32"), arr.astype(np.float32))
    with pytest.raises(ValueError, match="bfloat16, float16, float32"):
        round_to(x, "int8")


def test_relative_error():
    ref = np.array([[3.0, 4.0]])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(np.array([[3.0, 5.0]]), ref) == pytest.approx(0.2)


def test_arms_fold_equals_am_when_queries_fix_q_dot_u():
    rng = np.random.default_rng(11)
    u = rng.standard_normal(HD) * 0.3
    Q = on_hyperplane(rng, 96, u, 1.0)
    K, V = rng.standard_normal((64, HD)) * 1.5, rng.standard_normal((64, HD))
    err = arms(Q, Q, K, V, S, 16, dtype="float32", rho=1e-12)
    assert err["fold"] == pytest.approx(err["am"], rel=1e-6)
    assert err["drop"] < err["keep"]  # refit values are least-squares optimal for the same weights
    bf16 = arms(Q[:64], Q[64:], K, V, S, 16, dtype="bfloat16")
    assert set(bf16) == {"keep", "drop", "am", "fold"} and all(0 < e < 2 for e in bf16.values())


# -- values are refit on the keys as stored (rounded), not on the keys before rounding ---------------------------


def torch_round(x, dtype: str) -> np.ndarray:
    """x rounded to the cache dtype by torch (independent of `round_to`), as float32."""
    return torch.from_numpy(np.asarray(x, np.float32)).to(getattr(torch, dtype)).to(torch.float32).numpy()


def shifted_attention(Q, K, V, s, beta=None):
    """`naive_attention` with each query's largest logit subtracted first (the logits here reach ~1e3)."""
    beta = np.zeros(len(K)) if beta is None else np.asarray(beta, dtype=np.float64)
    out = np.zeros((len(Q), V.shape[1]))
    for i, q in enumerate(np.asarray(Q, dtype=np.float64)):
        logits = np.array([s * q @ k + b for k, b in zip(np.asarray(K, np.float64), beta)])
        e = np.exp(logits - logits.max())
        out[i] = (e / e.sum()) @ V
    return out


def brute_refit(Q, K_kept, s, target, beta=None, ridge=1e-6):
    """Ridge least squares by the normal equations on a textbook softmax, in float64."""
    r = len(K_kept)
    A = shifted_attention(Q, K_kept, np.eye(r), s, beta)  # [m, r]
    lam = ridge * np.trace(A.T @ A) / r
    return np.linalg.solve(A.T @ A + lam * np.eye(r), A.T @ np.asarray(target, np.float64))


def offset_cache(rng, dtype, heads=2, n=40, m=64):
    """Keys with a large common offset in dimension 0 (it cancels in the softmax) plus a small per-key part:
    rounding a key to the cache dtype moves its logit by up to s * q_0 * ulp(offset) / 2, so refitting on the
    rounded or on the unrounded keys gives clearly different values. Queries have q_0 ~ 1."""
    offset = {"bfloat16": 1000.0, "float16": 5000.0}[dtype]  # ulp 4 in both
    K = rng.standard_normal((heads, n, HD)).astype(np.float32)
    K[:, :, 0] = offset + 2 * rng.standard_normal((heads, n))
    V = rng.standard_normal((heads, n, HD)).astype(np.float32)
    Q = (rng.standard_normal((heads, m, HD)) + 0.5).astype(np.float32)
    Q[:, :, 0] = 1 + 0.3 * rng.standard_normal((heads, m))
    Qh = (rng.standard_normal((heads, 16, HD)) + 0.5).astype(np.float32)
    return K, V, Q, Qh


def close_and_apart(got, rounded, unrounded, dtype):
    """got (stored values) equals the refit on rounded keys up to the dtype's own rounding, and the refit on
    unrounded keys is at least 10 times further away than that."""
    tol = {"bfloat16": 2.0**-8, "float16": 2.0**-11}[dtype] * np.abs(rounded).max()
    assert np.abs(got - rounded).max() <= tol
    assert np.abs(got - unrounded).max() > 10 * tol


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_fold_refits_values_on_the_rounded_folded_keys(dtype):
    """`fold_layer` (what `ridgefill fold` runs per layer) stores keys k' = round(k + (beta / s) u) and values
    refit against the full cache's output on those rounded keys, not on k + (beta / s) u."""
    from types import SimpleNamespace

    from ridgefill.fold.run import FoldConfig, fold_layer

    rng = np.random.default_rng(12)
    K, V, Q, Qh = offset_cache(rng, dtype)
    heads, r = len(K), 8
    pos = np.stack([np.sort(rng.choice(K.shape[1], r, replace=False)) for _ in range(heads)]).astype(np.int32)
    layer = {"keys": np.stack([torch_round(K[h][pos[h]], dtype) for h in range(heads)]),  # as `compact` stores
             "values": np.stack([torch_round(V[h][pos[h]], dtype) for h in range(heads)]),
             "beta": rng.uniform(-2, 2, (heads, r)).astype(np.float32), "positions": pos}  # fmt: skip
    cc = SimpleNamespace(keys={0: torch.from_numpy(K)}, values={0: torch.from_numpy(V)})
    rq = SimpleNamespace(layers={0: (torch.from_numpy(Q), torch.from_numpy(Qh))})
    cfg = FoldConfig(bootstrap=10)
    folded, _, _ = fold_layer(0, layer, cc, rq, S, dtype, cfg)
    for h in range(heads):
        target = shifted_attention(Q[h], K[h], V[h], S)
        u = fold_direction(Q[h], cfg.rho)
        k_fold = layer["keys"][h].astype(np.float64) + np.outer(layer["beta"][h].astype(np.float64) / S, u)
        k_stored = torch_round(k_fold, dtype)
        np.testing.assert_array_equal(folded["keys"][h], k_stored)
        assert np.abs(k_stored - k_fold).max() > 0.5  # the rounding is large here: up to half of ulp 4
        close_and_apart(folded["values"][h], brute_refit(Q[h], k_stored, S, target, ridge=cfg.ridge),
                        brute_refit(Q[h], k_fold, S, target, ridge=cfg.ridge), dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compact_refits_values_on_the_rounded_kept_keys(dtype):
    """`compact_layer` (what `ridgefill compact` runs per layer): values refit with beta on round(K[keep])."""
    from types import SimpleNamespace

    from ridgefill.fold.compaction import CompactConfig, compact_layer

    rng = np.random.default_rng(13)
    K, V, Q, Qh = offset_cache(rng, dtype)
    cfg = CompactConfig(dtype=dtype)
    cc = SimpleNamespace(keys={0: torch.from_numpy(K)}, values={0: torch.from_numpy(V)})
    rq = SimpleNamespace(layers={0: (torch.from_numpy(Q), torch.from_numpy(Qh))})
    layer, _ = compact_layer(0, cc, rq, S, 8, cfg)
    for h in range(len(K)):
        keep, beta = layer["positions"][h], layer["beta"][h]
        target = shifted_attention(Q[h], K[h], V[h], S)
        np.testing.assert_array_equal(layer["keys"][h], torch_round(K[h][keep], dtype))
        close_and_apart(layer["values"][h], brute_refit(Q[h], torch_round(K[h][keep], dtype), S, target, beta),
                        brute_refit(Q[h], K[h][keep], S, target, beta), dtype)
