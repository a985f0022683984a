"""Held-out scores of a fill (docs/method.md, "Choosing alpha").

For each late layer, compare what it would write to its cache from the predicted input with what it
writes from the true input: the cosine of keys (input norm, k_proj, k_norm; per KV head; RoPE is a
rotation and does not change it) and of values, averaged over rows and heads. Also the plain cosine of
predicted vs true layer input, relative squared error and explained variance.

The model computes the keys and values on its own device in its own dtype (bfloat16 on a GPU by default); they
come back to the host and every score is computed there in float64.
"""

from __future__ import annotations

import numpy as np

from ridgefill.capture.stats import INPUT, KV

METRICS = ("k_cosine", "v_cosine", "input_cosine", "rel_se", "explained_var")


def _cos(a, b):
    """Row-wise cosine over the last axis, float64."""
    num = (a * b).sum(-1)
    den = np.sqrt((a * a).sum(-1) * (b * b).sum(-1))
    return num / np.maximum(den, 1e-30)


class Scorer:
    """Caches the true keys/values of the held-out rows so that many fills can be scored cheaply.

    `kinds` {layer: INPUT | KV} says what each late layer's map predicts (default: its input, for every layer). A
    key/value map's prediction [R, 2 * kv_heads * head_dim] is split into keys and values, the keys go through the
    layer's key norm (QK-norm models), and both are scored as an input map's are; its `input_cosine`, `rel_se` and
    `explained_var` are measured on what it predicts, the keys before the norm and the values. What the maps read
    for the held-out rows: `x` [R, dx], or the held-out states of the layers `states` side by side (maps from
    earlier states), or by default their split state alone."""

    def __init__(self, adapter, held: dict[str, np.ndarray], split: int, num_layers: int,
                 kinds: dict[int, str] | None = None, x: np.ndarray | None = None, states=None):
        self.adapter = adapter
        self.split = split
        self.layers = list(range(split, num_layers))
        self.kinds = {l: (kinds or {}).get(l, INPUT) for l in self.layers}
        self.h = held[f"hidden.{split}"].astype(np.float64)  # [R, d]: the split state (the identity fill's)
        if x is None and states is not None and len(states) > 1:  # maps from earlier states: [h_S; h_l1; ...]
            x = np.concatenate([held[f"hidden.{l}"] for l in states], axis=1)
        self.x = self.h if x is None else np.asarray(x, dtype=np.float64)  # [R, dx]: what the maps read
        self.y = {l: held[f"hidden.{l}"].astype(np.float64) for l in self.layers}  # [R, d] each
        self.true_kv = {l: self._kv(l, self.y[l]) for l in self.layers}
        # what a key/value map predicts, from the true input: keys before the key norm, then values [R, 2kv]
        self.target = {l: self._kv_target(l, self.y[l]) for l in self.layers if self.kinds[l] == KV}

    def _kv(self, l: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import torch

        k, v = self.adapter.kv(l, torch.from_numpy(x.astype(np.float32)))  # on the layer's device, model dtype
        return k.cpu().double().numpy(), v.cpu().double().numpy()  # [R, kv_heads, head_dim], float64 on the host

    def _kv_target(self, l: int, x: np.ndarray) -> np.ndarray:
        import torch

        return self.adapter.kv_target(l, torch.from_numpy(x.astype(np.float32))).cpu().double().numpy()  # [R, 2kv]

    def _kv_of_prediction(self, l: int, kv_hat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A key/value map's prediction [R, 2kv] -> what the layer writes: keys through its key norm, and values,
        each [R, kv_heads, head_dim] float64; computed in the model's dtype as a runtime does."""
        import torch

        k, v = self.adapter.from_kv_target(l, torch.from_numpy(kv_hat.astype(np.float32)))
        return k.cpu().double().numpy(), v.cpu().double().numpy()

    def layer_scores(self, l: int, y_hat: np.ndarray, kind: str | None = None) -> dict[str, float]:
        """Layer l's figures for a prediction y_hat of its map's kind (or of `kind`: the identity fill predicts
        inputs whatever the maps are)."""
        if (kind or self.kinds[l]) == KV:
            y = self.target[l]
            k, v = self._kv_of_prediction(l, y_hat)
        else:
            y = self.y[l]
            k, v = self._kv(l, y_hat)
        kt, vt = self.true_kv[l]
        err = ((y_hat - y) ** 2).sum()
        return {
            "k_cosine": float(_cos(k, kt).mean()),
            "v_cosine": float(_cos(v, vt).mean()),
            "input_cosine": float(_cos(y_hat, y).mean()),
            "rel_se": float(err / (y**2).sum()),
            "explained_var": float(1.0 - err / ((y - y.mean(0)) ** 2).sum()),
        }

    def score(self, w, b) -> dict:
        """w [k, dy, dx] or a list of k maps [dy_l, dx] (key/value maps are narrower), b likewise; None for the
        identity fill (x_hat = h_S, into every layer's input)."""
        per = {}
        for i, l in enumerate(self.layers):
            per[l] = self.layer_scores(l, self.h, INPUT) if w is None else self.layer_scores(l, self.x @ w[i].T + b[i])
        mean = {m: float(np.mean([p[m] for p in per.values()])) for m in METRICS}
        return {"mean": mean, "layers": {str(l): p for l, p in per.items()}}


def objective(scores: dict, metric: str) -> float:
    """The selection score of a Scorer.score result: of its mean over the late layers."""
    return layer_objective(scores["mean"], metric)


def layer_objective(m: dict[str, float], metric: str) -> float:
    """The selection score of one set of figures (one layer's, or their mean): kv or input."""
    return (m["k_cosine"] + m["v_cosine"]) / 2 if metric == "kv" else m["input_cosine"]
