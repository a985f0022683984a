"""Ridge regression for every late layer of a split, over a grid of alphas (DESIGN §4, "Ridge").

lambda = alpha * trace(Cxx) / d_in makes alpha scale-free. One eigendecomposition Cxx = V diag(s) V^T
serves the whole grid: W_l^T = V diag(1/(s + lambda)) V^T Cxy_l and b_l = mean_y_l - W_l mean_x.
Pure numpy, float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ridgefill.capture.stats import Moments

DEFAULT_ALPHAS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


@dataclass(frozen=True)
class Eig:
    s: np.ndarray  # [dx] eigenvalues of Cxx (clipped at 0)
    v: np.ndarray  # [dx, dx] eigenvectors in columns
    p: np.ndarray  # [k, dx, dy] V^T Cxy_l, shared by every alpha
    trace: float
    m: Moments


def decompose(m: Moments) -> Eig:
    s, v = np.linalg.eigh(m.cxx)
    s = np.clip(s, 0.0, None)  # round-off can make the smallest eigenvalues slightly negative
    p = v.T @ m.cxy  # [dx, dx] @ [k, dx, dy] -> [k, dx, dy] (batched BLAS)
    return Eig(s, v, p, float(np.trace(m.cxx)), m)


def lam(alpha: float, e: Eig) -> float:
    return alpha * e.trace / e.s.shape[0]


def maps_at(e: Eig, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Weights [k, dy, dx] (W_l, so y = W_l x + b_l) and biases [k, dy] for one alpha."""
    inv = 1.0 / (e.s + lam(alpha, e))  # [dx]
    wt = e.v @ (inv[:, None] * e.p)  # W_l^T: [dx, dx] @ [k, dx, dy] -> [k, dx, dy]
    w = np.ascontiguousarray(wt.transpose(0, 2, 1))  # [k, dy, dx]
    b = e.m.mean_y - w @ e.m.mean_x  # [k, dy]
    return w, b


def direct_solve(m: Moments, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """The same maps by a plain linear solve per alpha (the reference the tests and bench compare with)."""
    d = m.cxx.shape[0]
    a = m.cxx + alpha * np.trace(m.cxx) / d * np.eye(d)
    k, dx, dy = m.cxy.shape
    wt = np.linalg.solve(a, m.cxy.transpose(1, 0, 2).reshape(dx, k * dy)).reshape(dx, k, dy)  # [dx, k, dy]
    w = np.ascontiguousarray(wt.transpose(1, 2, 0))  # [k, dy, dx]
    return w, m.mean_y - w @ m.mean_x
