"""The late layers' maps of one solve, each of its kind (docs/method.md#keyvalue-maps): an input map predicts a late
layer's input from the split state (`[d, d]`); a key/value map predicts an attention layer's keys, before RoPE and
QK-norm, and its values (`[2 * kv_heads * head_dim, d]`). Gated DeltaNet layers need their input and keep input maps.

Both kinds are fitted from one capture's moments of the same rows, so they share `Cxx` and its one
eigendecomposition (ridge.decompose); only `V^T Cxy` differs. `LateMaps` holds each kind's projection and gives the
maps of every late layer, in layer order, as lists (the two kinds' widths differ):

    late = late_maps(e, layers, kinds, kv_moments, kv_layers)
    w, b = late.at(alpha)              # one alpha for every layer
    w, b = late.per_layer(alphas)      # one per layer
    w, b = late.one(i, alpha)          # late layer i alone
Pure numpy, float64.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ridgefill.capture.stats import INPUT, KV, Moments
from ridgefill.solve.ridge import Eig, maps_at, maps_per_layer



@dataclass(frozen=True)
class LateMaps:
    layers: list[int]  # the late layers, ascending
    kinds: list[str]  # per late layer: INPUT or KV
    eigs: dict[str, Eig]  # per kind present: the decomposition with that kind's V^T Cxy
    index: list[int]  # per late layer: its position in its kind's moments

    @property
    def s(self) -> np.ndarray:  # the eigenvalues of Cxx, which every kind shares (ridge.lam reads them)
        return self.eigs[self.kinds[0]].s

    @property
    def trace(self) -> float:
        return self.eigs[self.kinds[0]].trace

    def at(self, alpha: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every late layer's map at one alpha: ([W_l [dy_l, dx]], [b_l [dy_l]]) in layer order."""
        if self.kinds == [INPUT] * len(self.layers) and self.index == list(range(len(self.layers))):
            w, b = maps_at(self.eigs[INPUT], alpha)  # all input maps: ridge.maps_at's own arithmetic, as always
            return list(w), list(b)
        return self.per_layer([alpha] * len(self.layers))

    def per_layer(self, alphas: Sequence[float]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Every late layer's map at its own alpha (alphas in layer order)."""
        w: list = [None] * len(self.layers)
        b: list = [None] * len(self.layers)
        for kind, e in self.eigs.items():
            at = [i for i, k in enumerate(self.kinds) if k == kind]
            wk, bk = maps_per_layer(e, [alphas[i] for i in at], [self.index[i] for i in at])
            for j, i in enumerate(at):
                w[i], b[i] = wk[j], bk[j]
        return w, b

    def one(self, i: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
        """Late layer i's map alone at alpha: (W [dy, dx], b [dy])."""
        w, b = maps_per_layer(self.eigs[self.kinds[i]], [alpha], [self.index[i]])
        return w[0], b[0]


def late_maps(e: Eig, layers: list[int], kinds: list[str], kv: Moments | None = None,
              kv_layers: list[int] | None = None) -> LateMaps:
    """The late layers' maps from the inputs' decomposition `e` (moments of every late layer, in order) and, where
    `kinds` asks for key/value maps, the key/value moments `kv` of `kv_layers` (the same rows: same n, mean and Cxx,
    so e's eigenvectors serve them)."""
    eigs = {INPUT: e}
    index = []
    for i, (l, kind) in enumerate(zip(layers, kinds)):
        if kind == KV:
            if kv is None or l not in (kv_layers or []):
                raise ValueError(f"layer {l}: a key/value map needs its key/value moments")
            index.append(kv_layers.index(l))
        else:
            index.append(i)
    if KV in kinds:
        if kv.n != e.m.n or not np.array_equal(kv.mean_x, e.m.mean_x):
            raise ValueError("the key/value moments are not of the inputs' rows")
        eigs[KV] = replace(e, p=e.v.T @ kv.cxy, m=kv)  # [dx, dx] @ [k, dx, 2kv] -> [k, dx, 2kv]
    if INPUT not in kinds:
        del eigs[INPUT]
    return LateMaps(list(layers), list(kinds), eigs, index)
