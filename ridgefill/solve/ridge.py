"""Ridge regression for every late layer of a split, over a grid of alphas (docs/method.md, "Ridge maps").

lambda = alpha * trace(Cxx) / d_in makes alpha scale-free. One eigendecomposition Cxx = V diag(s) V^T
serves the whole grid: W_l^T = V diag(1/(s + lambda)) V^T Cxy_l and b_l = mean_y_l - W_l mean_x.
Pure numpy, float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ridgefill.capture.stats import Moments

DEFAULT_ALPHAS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
TIE = 1e-5  # held-out scores (cosines) closer than this are a tie for the grid's edges
ALPHA_LIMITS = (1e-9, 1e3)  # extension never goes past these
MAX_EXTEND = 12  # extension steps per edge at most


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


def search(alphas, score_of: Callable[[float], dict]) -> tuple[list[dict], dict, list[dict]]:
    """Score every alpha of the grid, extend it past an open edge, return (grid, best, extensions).

    score_of(alpha) -> a dict with "score" (higher is better); each grid entry is that dict with "alpha" and
    "extended" (False for the given alphas) added, the grid sorted by alpha. The best entry is the highest score;
    exact ties go to the smaller alpha.

    An edge of a grid of two or more alphas is open when its score is within TIE of the best (the best is the edge
    or ties with it): the optimum may lie beyond it. Past an open edge the grid goes on in steps of its own mean
    ratio r = (max / min) ** (1 / (n - 1)) (alpha / r below, alpha * r above, rounded to two significant digits),
    for as long as each new alpha beats the best score by more than TIE. The first that does not ends it: its
    score "turned" (below the best by more than TIE) or is "flat" (within TIE: the regularizer no longer matters
    there). It also ends at ALPHA_LIMITS ("limit") or after MAX_EXTEND steps ("steps"). The lower edge is
    handled first, then the upper one against the best found so far. A one-alpha grid is a fixed choice: it is
    not extended. Extensions are reported as {"edge": "low" | "high", "to": last alpha scored, "steps", "stopped"}.
    """
    alphas = sorted(set(float(a) for a in alphas))
    grid = [{**score_of(a), "alpha": a, "extended": False} for a in alphas]

    def best_of(entries):
        return max(entries, key=lambda g: (g["score"], -g["alpha"]))

    extensions = []
    if len(alphas) >= 2:
        ratio = (alphas[-1] / alphas[0]) ** (1.0 / (len(alphas) - 1))
        for edge in ("low", "high"):
            best = best_of(grid)
            end = grid[0] if edge == "low" else grid[-1]
            if end["score"] < best["score"] - TIE:
                continue  # the score has turned inside the grid: the optimum is bracketed on this side
            a, steps, stopped = end["alpha"], 0, "steps"
            while steps < MAX_EXTEND:
                nxt = _step(a, ratio, down=edge == "low")
                if not ALPHA_LIMITS[0] <= nxt <= ALPHA_LIMITS[1]:
                    stopped = "limit"
                    break
                g = {**score_of(nxt), "alpha": nxt, "extended": True}
                steps += 1
                a = nxt
                grid = [g, *grid] if edge == "low" else [*grid, g]
                if g["score"] > best["score"] + TIE:
                    best = g
                    continue
                stopped = "turned" if g["score"] < best["score"] - TIE else "flat"
                break
            if steps or stopped == "limit":
                extensions.append({"edge": edge, "to": a, "steps": steps, "stopped": stopped})
    return grid, best_of(grid), extensions


def _step(a: float, ratio: float, down: bool) -> float:
    """The next alpha past `a`: a / ratio or a * ratio, rounded to two significant digits (unrounded if rounding
    would not move past `a`)."""
    exact = a / ratio if down else a * ratio
    rounded = float(f"{exact:.2g}")
    return rounded if (rounded < a if down else rounded > a) else exact
