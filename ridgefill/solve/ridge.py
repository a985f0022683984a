"""Ridge regression for every late layer of a split, over a grid of alphas (docs/method.md, "Ridge maps").

lambda = alpha * trace(Cxx) / d_in makes alpha scale-free. One eigendecomposition Cxx = V diag(s) V^T
serves the whole grid: W_l^T = V diag(1/(s + lambda)) V^T Cxy_l and b_l = mean_y_l - W_l mean_x, with one lambda
for every layer (maps_at) or one per layer (maps_per_layer, docs/method.md "Per-layer alpha").
Pure numpy, float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

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


def decompose(m: Moments, project: bool = True) -> Eig:
    """The eigendecomposition of Cxx and, with `project`, V^T Cxy for every target (without it `p` is empty: a
    caller that projects other targets' moments onto these eigenvectors, solve/kinds.py)."""
    s, v = np.linalg.eigh(m.cxx)
    s = np.clip(s, 0.0, None)  # round-off can make the smallest eigenvalues slightly negative
    p = v.T @ m.cxy if project else m.cxy[:0]  # [dx, dx] @ [k, dx, dy] -> [k, dx, dy] (batched BLAS)
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


def maps_per_layer(e: Eig, alphas: Sequence[float], index: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Weights [n, dy, dx] and biases [n, dy] with a lambda of its own per layer: layer index[j] (a position in
    0..k-1; default every layer, in order) at alphas[j]. The same eigendecomposition as maps_at; with one alpha
    repeated it gives maps_at's maps."""
    index = list(range(e.p.shape[0])) if index is None else list(index)
    if len(alphas) != len(index):
        raise ValueError(f"{len(alphas)} alphas for {len(index)} layers")
    inv = 1.0 / (e.s[None, :] + np.array([[lam(float(a), e)] for a in alphas]))  # [n, dx]
    wt = e.v @ (inv[:, :, None] * e.p[index])  # W_l^T: [dx, dx] @ [n, dx, dy] -> [n, dx, dy]
    w = np.ascontiguousarray(wt.transpose(0, 2, 1))  # [n, dy, dx]
    b = e.m.mean_y[index] - w @ e.m.mean_x  # [n, dy]
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


def search_per_layer(alphas, scored: dict[float, Sequence[float]], score_layer: Callable[[int, float], float]) -> list[dict]:
    """Each layer's own best alpha. `scored` {alpha: [score of layer i, i = 0..k-1]} holds what the shared search
    already scored (its grid, extensions included); score_layer(i, alpha) scores layer i alone at an alpha it lacks.

    Per layer i, `search` runs over the given `alphas` on layer i's own score, with search's rules for an open
    edge: the scores `scored` has are reused, so a layer only costs new scoring where its own search goes past
    what the shared one scored. The layer's alpha is then the best of every alpha scored for it (the shared grid
    and its own extension), exact ties to the smaller alpha; the shared grid's best alpha is among them, so no
    layer scores below it. Returns per layer {"alpha", "score", "grid": [{"alpha", "score"}] by alpha,
    "extended": search's extensions of that layer}.
    """
    k = len(next(iter(scored.values())))
    out = []
    for i in range(k):
        own = {a: float(s[i]) for a, s in scored.items()}  # alpha -> layer i's score

        def score_of(a: float, i=i, own=own) -> dict:
            if a not in own:
                own[a] = float(score_layer(i, a))
            return {"score": own[a]}

        _, _, extensions = search(alphas, score_of)
        best = max(own, key=lambda a: (own[a], -a))
        out.append({"alpha": best, "score": own[best], "grid": [{"alpha": a, "score": own[a]} for a in sorted(own)],
                    "extended": extensions})
    return out
