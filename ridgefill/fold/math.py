"""Per-head math of AM-style compaction and the fold (docs/method.md#compaction-and-the-fold;
the fold paper's §2, §3, §A.1, §A.5, cited in docs/method.md#references).

Pure numpy for ONE (layer, KV head): arrays in, arrays out, no I/O, no torch. Inputs may be float32; all
arithmetic is float64. Shapes: `m` reference queries, `n` full-cache keys, `r` kept keys, `hd` head dim.
A logit is `s * q.k + beta` with `s` the layer's own attention scaling.

The four r-key caches compared by `arms` (all use the keys chosen by `select_keys`):

    keep   original values, no bias
    am     bias beta = fit_log_weights(...), values refit with beta
    drop   beta removed, values refit without it
    fold   keys fold_keys(K, beta, fold_direction(Q), s) rounded to the cache dtype, values refit without beta

Why the fold works: its logit is `s q.k + beta (q.u)`, i.e. AM's with beta scaled by `q.u`. It is exact when
`q.u = 1`; to first order in beta its output error is `|q.u - 1|` times that of drop (fold paper §3.3, §A.5).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ridgefill.numerics import round_to


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def attention_weights(Q, K, s: float, beta=None) -> np.ndarray:
    """softmax(s Q K^T + beta) by rows: Q [m, hd], K [n, hd], beta [n] or None -> [m, n] float64.

    Each row's max logit is subtracted before exp, so huge logits neither overflow nor give nan.
    """
    logits = s * (_f64(Q) @ _f64(K).T)  # [m, n]
    if beta is not None:
        logits = logits + _f64(beta)[None, :]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def attention_output(Q, K, V, s: float, beta=None) -> np.ndarray:
    """softmax(s Q K^T + beta) V: Q [m, hd], K [n, hd], V [n, hd], beta [n] or None -> [m, hd] float64."""
    return attention_weights(Q, K, s, beta) @ _f64(V)


def select_keys(Q, K, s: float, r: int) -> np.ndarray:
    """Indices [r] (int64, ascending) of the r keys K [n, hd] with the highest RMS attention over Q [m, hd].

    Attention is the full-cache softmax; among equal scores the earlier position wins.
    """
    n = len(K)
    if not 1 <= r <= n:
        raise ValueError(f"budget r must be in 1..{n} (the number of keys), got {r}")
    rms = np.sqrt(np.mean(attention_weights(Q, K, s) ** 2, axis=0))  # [n]
    return np.sort(np.argsort(-rms, kind="stable")[:r])


def box_nnls(M, t, lo: float, hi: float, max_iter: int = 300, tol: float = 1e-9):
    """min ||M w - t|| subject to lo <= w <= hi, by projected gradient: M [m, r], t [m].

    Starts from the least-squares solution clipped into the box; step 1/||M||_2^2 (the gradient's Lipschitz
    constant); projects onto the box after each step. Stops after `max_iter` steps or once a step moves w by at
    most `tol * ||w||`. Returns (w [r] float64, start residual, final residual, steps), residuals being
    ||M w - t|| / ||t||; the best iterate is returned, so final <= start.
    """
    M, t = _f64(M), _f64(t)
    lip = np.linalg.eigvalsh(M.T @ M)[-1] if M.size else 0.0  # ||M||_2^2
    step = 1.0 / lip if lip > 0 else 0.0
    w = np.clip(np.linalg.lstsq(M, t, rcond=None)[0], lo, hi)
    res = M @ w - t  # [m]
    start = best = np.linalg.norm(res)
    best_w, steps = w, 0
    while steps < max_iter:
        w_next = np.clip(w - step * (M.T @ res), lo, hi)
        steps += 1
        moved = np.linalg.norm(w_next - w)
        w = w_next
        res = M @ w - t
        norm = np.linalg.norm(res)
        if norm < best:
            best, best_w = norm, w
        if moved <= tol * np.linalg.norm(w):
            break
    scale = np.linalg.norm(t) or 1.0
    return best_w, start / scale, best / scale, steps


class LogWeightFit(NamedTuple):
    beta: np.ndarray  # [r] float32, log w, inside [-box, box]
    start_residual: float  # ||M w - t|| / ||t|| at the clamped least-squares start
    residual: float  # the same for the returned w; never above start_residual
    iterations: int  # projected-gradient steps taken


def fit_log_weights(Q, K, keep, s: float, box: float = 3.0, max_iter: int = 300, tol: float = 1e-9) -> LogWeightFit:
    """AM-style bias fit: beta [r] so that the kept keys carry each query's full attention mass (fold paper §2, §A.1).

    Q [m, hd] reference queries, K [n, hd] the full cache, keep [r] indices into K. With L = s Q K^T [m, n]
    and m_q = max_i L_qi (stabilisation), solve box_nnls for w in [e^-box, e^box]:
        M = exp(L[:, keep] - m_q) [m, r],   t = sum_i exp(L_qi - m_q) [m],   beta = log w.
    The seed's AM-style fit stopped after two steps (§A.1); the default here runs to convergence, capped at
    300 steps (the number its authors' own fit takes).
    """
    logits = s * (_f64(Q) @ _f64(K).T)  # [m, n]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))  # [m, n]
    w, start, res, steps = box_nnls(e[:, keep], e.sum(axis=1), np.exp(-box), np.exp(box), max_iter, tol)
    beta = np.clip(np.log(w), -box, box).astype(np.float32)
    return LogWeightFit(beta, float(start), float(res), steps)


def refit_values(Q, K_kept, s: float, target, beta=None, ridge: float = 1e-6) -> np.ndarray:
    """Values V' [r, hd] minimising ||A V' - target||_F^2 + lam ||V'||_F^2, in float64.

    A = softmax(s Q K_kept^T + beta) [m, r] for Q [m, hd], K_kept [r, hd]; target [m, hd] is the full-cache
    output on Q. lam = ridge * trace(A^T A) / r, i.e. `ridge` times the mean eigenvalue of A^T A. Solved by
    lstsq on the stacked system [A; sqrt(lam) I] V' = [target; 0], which does not square A's condition number.
    """
    A = attention_weights(Q, K_kept, s, beta)  # [m, r]
    r = A.shape[1]
    lam = ridge * np.sum(A * A) / r  # trace(A^T A) = ||A||_F^2
    target = _f64(target)
    stacked = np.vstack([A, np.sqrt(lam) * np.eye(r)])  # [m + r, r]
    rhs = np.vstack([target, np.zeros((r, target.shape[1]))])  # [m + r, hd]
    return np.linalg.lstsq(stacked, rhs, rcond=None)[0]


def fold_direction(Q, rho: float = 1e-3) -> np.ndarray:
    """u [hd] = (Sigma + rho' I)^-1 mu / (mu^T (Sigma + rho' I)^-1 mu) for pooled queries Q [m, hd] (fold paper §3.2).

    mu [hd] is the mean of Q's rows, Sigma [hd, hd] their population covariance (1/m), rho' = rho * trace(Sigma)
    / hd. u minimises u^T (Sigma + rho' I) u subject to mu.u = 1: mean(Q u) = 1 with the spread of q.u (plus
    a small ridge for conditioning) minimal.
    """
    Q = _f64(Q)
    m, hd = Q.shape
    mu = Q.mean(axis=0)
    Qc = Q - mu  # [m, hd]
    sigma = Qc.T @ Qc / m  # [hd, hd]
    z = np.linalg.solve(sigma + rho * np.trace(sigma) / hd * np.eye(hd), mu)
    norm = mu @ z
    if not norm > 0:
        raise ValueError("reference queries have zero mean: no fold direction exists")
    return z / norm


def fold_keys(K, beta, u, s: float) -> np.ndarray:
    """Folded keys K' = K + (beta / s) u^T: K [r, hd], beta [r], u [hd] -> [r, hd] float64."""
    return _f64(K) + (_f64(beta) / s)[:, None] * _f64(u)[None, :]


def relative_error(out, ref) -> float:
    """||out - ref||_F / ||ref||_F for two arrays of the same shape."""
    out, ref = _f64(out), _f64(ref)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def arms(Q_fit, Q_test, K, V, s: float, r: int, dtype: str = "bfloat16", rho: float = 1e-3,
         ridge: float = 1e-6, box: float = 3.0) -> dict[str, float]:
    """Relative output error on Q_test [m', hd] of the keep/drop/am/fold caches built on Q_fit [m, hd].

    K, V [n, hd] is the full cache; r keys are kept. Errors are against the full cache's output on Q_test.
    Keys and values are rounded to `dtype` (values refit against the rounded keys, §3.4); beta stays float32.
    """
    keep = select_keys(Q_fit, K, s, r)
    beta = fit_log_weights(Q_fit, K, keep, s, box=box).beta
    target = attention_output(Q_fit, K, V, s)  # [m, hd]
    k_kept = round_to(K[keep], dtype)
    k_fold = round_to(fold_keys(K[keep], beta, fold_direction(Q_fit, rho), s), dtype)
    caches = {  # name: (keys, values, beta)
        "keep": (k_kept, V[keep], None),
        "drop": (k_kept, refit_values(Q_fit, k_kept, s, target, None, ridge), None),
        "am": (k_kept, refit_values(Q_fit, k_kept, s, target, beta, ridge), beta),
        "fold": (k_fold, refit_values(Q_fit, k_fold, s, target, None, ridge), None),
    }
    ref = attention_output(Q_test, K, V, s)  # [m', hd]
    return {name: relative_error(attention_output(Q_test, k, round_to(v, dtype), s, b), ref)
            for name, (k, v, b) in caches.items()}
