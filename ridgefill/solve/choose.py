"""Choosing alpha on held-out rows: the shared search over the grid (ridge.search), and with --alpha-per-layer each
late layer's own alpha (ridge.search_per_layer), giving the maps the solve writes.

    fit = choose_maps(late, scorer, alphas, metric, per_layer=False)   # late: kinds.late_maps of the capture's moments
    fit.w, fit.b, fit.best, fit.grid, fit.fitted, fit.timings
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ridgefill.solve.ridge import lam, search, search_per_layer
from ridgefill.solve.score import Scorer, layer_objective, objective


@dataclass(frozen=True)
class Fit:
    """The chosen maps and how they were chosen."""

    w: list[np.ndarray]  # per late layer: [dy, dx] (dy: d for an input map, 2 * kv_heads * head_dim for a kv map)
    b: list[np.ndarray]  # per late layer: [dy]
    grid: list[dict]  # the shared search's rows: {"alpha", "lambda", "score", mean scores...}
    best: dict  # the grid row chosen
    extended: list  # the steps the grid took past an open edge (ridge.search)
    fitted: dict  # the chosen maps' full held-out scores
    per_layer: dict | None  # the report's `per_layer` section, with alpha_per_layer
    timings: dict  # eig_s is the caller's; here maps_all_alphas_s, scoring_s (and per_layer_s)


class GridScores:
    """`score_at(alpha)` for ridge.search: the maps at alpha and their held-out scores. Keeps every alpha's full
    scores (per layer too, which alpha_per_layer reuses) and the seconds spent on maps and on scoring."""

    def __init__(self, e, scorer: Scorer, metric: str):
        self.e, self.scorer, self.metric = e, scorer, metric
        self.scored: dict[float, dict] = {}
        self.maps_s = 0.0
        self.score_s = 0.0

    def __call__(self, a: float) -> dict:
        t = time.perf_counter()
        w, b = self.e.at(a)
        self.maps_s += time.perf_counter() - t
        t = time.perf_counter()
        s = self.scorer.score(w, b)
        self.score_s += time.perf_counter() - t
        self.scored[a] = s
        return {"alpha": a, "lambda": lam(a, self.e), "score": objective(s, self.metric), **s["mean"]}


class LayerScores:
    """`score_layer(i, alpha)` for ridge.search_per_layer: late layer i's own held-out objective at alpha, past the
    shared grid; counts the scorings."""

    def __init__(self, e, scorer: Scorer, metric: str):
        self.e, self.scorer, self.metric = e, scorer, metric
        self.calls = 0

    def __call__(self, i: int, a: float) -> float:
        self.calls += 1
        w, b = self.e.one(i, a)  # [dy, dx], [dy]
        x = self.scorer.x
        return layer_objective(self.scorer.layer_scores(self.scorer.layers[i], x @ w.T + b), self.metric)


def choose_maps(e, scorer: Scorer, alphas: list[float], metric: str, per_layer: bool) -> Fit:
    """The shared search over `alphas` (extended past an open edge), then the maps at its best alpha, or with
    `per_layer` at each late layer's own best (fit_per_layer); their held-out scores."""
    grid_scores = GridScores(e, scorer, metric)
    grid, best, extended = search(alphas, grid_scores)
    timings = {"maps_all_alphas_s": grid_scores.maps_s, "scoring_s": grid_scores.score_s}
    section = None
    if per_layer:
        t = time.perf_counter()
        w, b, section = fit_per_layer(e, scorer, alphas, grid_scores.scored, best, metric)
        fitted = scorer.score(w, b)
        section = {**section, "score": objective(fitted, metric)}
        timings["per_layer_s"] = time.perf_counter() - t  # choosing the alphas, their maps and scoring those
    else:
        w, b = e.at(best["alpha"])
        fitted = scorer.score(w, b)
    return Fit(w=w, b=b, grid=grid, best=best, extended=extended, fitted=fitted, per_layer=section, timings=timings)


def fit_per_layer(e, scorer: Scorer, alphas: list[float], scored: dict, best: dict, metric: str):
    """Maps with each late layer at its own best alpha (ridge.search_per_layer over its own held-out objective,
    reusing every score the shared search made), and the report's `per_layer` section but its "score":
    {"alpha", "lambda": {layer: value}, "shared_score", "shared_fitted" (the shared best's full scores),
    "layers": {layer: {"score", "shared_score", "grid"}}, "extended": [{"layer", "edge", "to", "steps",
    "stopped"}], "layer_scorings" (single-layer scorings past the shared grid)}."""
    layers = scorer.layers
    own = {a: [layer_objective(s["layers"][str(l)], metric) for l in layers] for a, s in scored.items()}
    score_layer = LayerScores(e, scorer, metric)
    chosen = search_per_layer(alphas, own, score_layer)
    w, b = e.per_layer([c["alpha"] for c in chosen])
    section = {
        "alpha": {str(l): c["alpha"] for l, c in zip(layers, chosen)},
        "lambda": {str(l): lam(c["alpha"], e) for l, c in zip(layers, chosen)},
        "shared_score": best["score"], "shared_fitted": scored[best["alpha"]],
        "layers": {str(l): {"score": c["score"], "shared_score": own[best["alpha"]][i], "grid": c["grid"]}
                   for i, (l, c) in enumerate(zip(layers, chosen))},
        "extended": [{"layer": l, **x} for l, c in zip(layers, chosen) for x in c["extended"]],
        "layer_scorings": score_layer.calls,
    }
    return w, b, section
